"""Multi-head self-attention with a choice of what the attention core keeps for backward."""

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .. import ops

BACKENDS = ("tempo", "sdpa", "eager", "fused", "auto")


def _causal_keep(rows, cols, device):
    return torch.ones(rows, cols, dtype=torch.bool, device=device).tril()


def eager_attention(q, k, v, mask=None, dropout_p=0.0, causal=False):
    """The plain PyTorch baseline: keeps P, a byte mask and the dropped P."""
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if causal:
        s = s.masked_fill(~_causal_keep(q.size(2), k.size(2), q.device), float("-inf"))
    p = torch.softmax(s, -1)
    if dropout_p > 0:
        # A byte mask, as PyTorch's CUDA dropout keeps it; the mask tempo.attention would draw
        # from the same generator state.
        _, bits = torch.ops.tempo.dropout_forward(p.detach(), dropout_p, "bits")
        shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
        keep = ((bits.unsqueeze(1) >> shifts) & 1).flatten()[: p.numel()].view(p.shape).bool()
        p = p.masked_fill(~keep, 0.0) * (1.0 / (1.0 - dropout_p))
    return p @ v


def sdpa_attention(q, k, v, mask=None, dropout_p=0.0, causal=False):
    """torch's scaled_dot_product_attention (a mask and causal merged into one mask)."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    if causal and mask is not None:
        keep = _causal_keep(q.size(2), k.size(2), q.device)
        mask = mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, float("-inf"))
        causal = False
    return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, causal)


class SelfAttention(torch.nn.Module):
    """Self-attention: one GEMM projects q, k, v (``qkv``, weight [3 hidden, hidden]), then
    ``out``. ``backend``: "tempo" (tempo.attention: keeps P and 1 bit per probability),
    "sdpa" (torch's fused kernels: no S^2 tensor), "eager" (the plain baseline: P, a byte
    mask and the dropped P), "fused" (no S^2 tensor: torch's fused sdpa kernel where torch has
    one for the inputs, else tempo.fused_attention), "auto" (sdpa where torch picks a fused
    kernel, else tempo).

    forward(x [batch, seq, hidden], attention_mask=None): a [batch, seq] padding mask (nonzero:
    attend to that key), or a bool (True: attend) / additive mask broadcastable to
    [batch, heads, seq, seq]."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        causal: bool = False,
        backend: str = "auto",
        mode: str = "bits",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        name = "tempo.nn.SelfAttention"
        if hidden <= 0 or heads <= 0:
            raise ValueError("%s: hidden and heads must be positive, got %d and %d" % (name, hidden, heads))
        if hidden % heads:
            raise ValueError("%s: hidden (%d) must be divisible by heads (%d)" % (name, hidden, heads))
        if not 0.0 <= dropout <= 1.0:
            raise ValueError("%s: dropout must be a probability in [0, 1], got %r" % (name, dropout))
        if backend not in BACKENDS:
            raise ValueError("%s: backend must be one of %s, got %r" % (name, BACKENDS, backend))
        if mode not in ("bits", "philox"):
            raise ValueError("%s: mode must be 'bits' or 'philox', got %r" % (name, mode))
        self.hidden, self.heads, self.dropout, self.causal = hidden, heads, dropout, causal
        self.backend, self.mode = backend, mode
        self.last_backend = None
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=bias, device=device, dtype=dtype)
        self.out = torch.nn.Linear(hidden, hidden, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dim() != 3 or x.size(2) != self.hidden:
            raise ValueError(
                "tempo.nn.SelfAttention: x must be [batch, seq, %d], got %s" % (self.hidden, tuple(x.shape))
            )
        B, S, _ = x.shape
        A, d = self.heads, self.hidden // self.heads
        q, k, v = self.qkv(x).view(B, S, 3, A, d).permute(2, 0, 3, 1, 4).unbind(0)
        mask = attention_mask
        if mask is not None and mask.dim() == 2:
            if tuple(mask.shape) != (B, S):
                raise ValueError(
                    "tempo.nn.SelfAttention: a 2-D attention_mask must be [batch, seq] = [%d, %d], "
                    "got %s" % (B, S, tuple(mask.shape))
                )
            mask = (mask != 0).view(B, 1, 1, S)
        p = self.dropout if self.training else 0.0
        backend = self.backend
        if backend in ("auto", "fused"):
            m = mask if mask is None or mask.dtype == torch.bool else mask.to(q.dtype)
            torch_fused = torch._fused_sdp_choice(q, k, v, m, p, self.causal) != 0
            backend = "sdpa" if torch_fused else ("tempo" if backend == "auto" else "tempo-fused")
        self.last_backend = backend
        if backend == "tempo":
            o = ops.attention(q, k, v, mask, p, self.causal, None, self.mode)
        elif backend == "tempo-fused":
            o = ops.fused_attention(q, k, v, mask, p, self.causal)
        elif backend == "sdpa":
            o = sdpa_attention(q, k, v, mask, p, self.causal)
        else:
            o = eager_attention(q, k, v, mask, p, self.causal)
        return self.out(o.transpose(1, 2).reshape(B, S, self.hidden))

    def extra_repr(self) -> str:
        return "hidden=%d, heads=%d, dropout=%r, causal=%r, backend=%r" % (
            self.hidden,
            self.heads,
            self.dropout,
            self.causal,
            self.backend,
        )
