"""Functional forms of the tempo ops (same names as torch.ops.tempo.* and tempo:: in C++)."""

from typing import Optional

import torch

# The public ops (tempo.<name>), exactly csrc/ops.json's (tests/python/suites/test_registry.py).
__all__ = [
    "gelu",
    "silu",
    "attention",
    "fused_attention",
    "causal_linear_attention",
    "gated_mlp",
    "linear_cross_entropy",
    "linear_cross_entropy_stats",
    "qkv_split",
    "rope",
    "dropout",
    "layer_norm",
    "rms_norm",
    "bias_dropout_add_layer_norm",
]


def gelu(x: torch.Tensor, approximate: str = "none", bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GELU(x + bias), as torch.nn.functional.gelu; backward keeps the output and 1 bit per element."""
    return torch.ops.tempo.gelu(x, approximate, bias)


def silu(x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SiLU(x + bias), as torch.nn.functional.silu; backward keeps the output and 1 bit per element."""
    return torch.ops.tempo.silu(x, bias)


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, mode: str = "bits") -> torch.Tensor:
    """As torch.nn.functional.dropout; the backward keeps 1 bit per element ("bits") or only the
    16-byte Philox state ("philox"). Identity (x itself) when not training or p == 0."""
    if not 0.0 <= p <= 1.0:
        raise ValueError("tempo.dropout: argument 'p' must be a probability in [0, 1], got %r" % (p,))
    if mode not in ("bits", "philox"):
        raise ValueError("tempo.dropout: argument 'mode' must be 'bits' or 'philox', got %r" % (mode,))
    if not training or p == 0.0:
        return x
    return torch.ops.tempo.dropout(x, p, mode)


def layer_norm(
    x: torch.Tensor,
    normalized_shape,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """As torch.nn.functional.layer_norm; the backward keeps y and one rstd per row, not x
    (and xhat of the rare columns whose gamma and beta make recovery from y inexact).
    weight and bias: of x's dtype, or float32 for a bfloat16/float16 x (as torch's CPU
    layer_norm takes them)."""
    return torch.ops.tempo.layer_norm(x, _shape(normalized_shape), weight, bias, eps)


def rms_norm(
    x: torch.Tensor, normalized_shape, weight: Optional[torch.Tensor] = None, eps: Optional[float] = None
) -> torch.Tensor:
    """As torch.nn.functional.rms_norm; the backward keeps y and one rstd per row, not x
    (and xhat of the rare columns whose gamma makes recovery from y inexact)."""
    return torch.ops.tempo.rms_norm(x, _shape(normalized_shape), weight, eps)


def bias_dropout_add_layer_norm(
    x: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: torch.Tensor,
    p: float,
    weight: Optional[torch.Tensor],
    beta: Optional[torch.Tensor],
    eps: float = 1e-5,
    mode: str = "bits",
    training: bool = True,
) -> torch.Tensor:
    """layer_norm(residual + dropout(x + bias)) over the last dimension in one pass; keeps y,
    rstd and the dropout bits (or Philox state)."""
    return torch.ops.tempo.bias_dropout_add_layer_norm(
        x, bias, residual, p if training else 0.0, weight, beta, eps, mode
    )


def _shape(normalized_shape):
    # an int, a torch.Size or list, or a size that torch.jit.trace hands over as a 0-d tensor
    if isinstance(normalized_shape, int) or (
        isinstance(normalized_shape, torch.Tensor) and normalized_shape.dim() == 0
    ):
        return [normalized_shape]
    return list(normalized_shape)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    causal: bool = False,
    scale: Optional[float] = None,
    mode: str = "bits",
) -> torch.Tensor:
    """softmax(scale q k^T + mask) v for [B, A, S, d] inputs, as
    torch.nn.functional.scaled_dot_product_attention (bool mask: True attends; additive mask
    added). The backward keeps q, k, v, P and 1 bit per probability (mode="philox": a 16-byte
    seed), never the logits or the dropped probabilities. Fully masked rows give zeros."""
    return torch.ops.tempo.attention(q, k, v, attn_mask, dropout_p, causal, scale, mode)


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    causal: bool = False,
    scale: Optional[float] = None,
    block_rows: int = 0,
) -> torch.Tensor:
    """The result of tempo.attention (the same dropout mask from the same generator state),
    computed over blocks of query rows, keeping only q, k, v, the mask and a 16-byte seed for
    backward: no S^2 tensor. The backward recomputes each block's probabilities."""
    return torch.ops.tempo.fused_attention(q, k, v, attn_mask, dropout_p, causal, scale, block_rows)


def fused_attention_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    causal: bool = False,
    block_rows: int = 0,
) -> str:
    """Which kernel tempo.fused_attention runs for these arguments: "torch-sdpa" (torch's
    flash or memory-efficient kernels, on CUDA without a mask or dropout, where the semantics
    are the same) or "tempo" (its own blocked kernel; TEMPO_FUSED_ATTENTION=tempo forces it)."""
    return torch.ops.tempo.fused_attention_backend(q, k, attn_mask, dropout_p, causal, block_rows)


def qkv_split(z: torch.Tensor, bias: Optional[torch.Tensor], heads: int):
    """q, k, v ([B, heads, S, head_dim] each, contiguous) from z, the q/k/v projection without its
    bias ([B, S, 3 hidden], q's columns first), plus the bias ([3 hidden] or None), in one pass:
    the Data Movement paper's attention input bias. Equal to
    (z + bias).view(B, S, 3, heads, -1).permute(2, 0, 3, 1, 4) made contiguous; the backward
    gathers dz and sums the bias gradient in one pass. Keeps nothing for backward."""
    return torch.ops.tempo.qkv_split(z, bias, heads)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary position embedding in one pass: x cos + rotate_half(x) sin over the first r
    columns of x ([B, heads, S, head_dim], any strides with a contiguous last dimension), the rest
    passed through; cos, sin [S, r], [B or 1, S, r] or [B or 1, 1, S, r] (r even, at most
    head_dim), in x's dtype or float32 for 16-bit x. rotate_half(x) = cat(-x[..., r/2:r],
    x[..., :r/2]): transformers' apply_rotary_pos_emb for q and for k. Computed in float32
    (float64 for float64) and rounded once; keeps only cos and sin for backward (the caller's,
    shared by every layer). The output has x's layout where x's last dimension is the innermost
    (a transposed q stays one), else is contiguous."""
    return torch.ops.tempo.rope(x, cos, sin)


def causal_linear_attention(
    qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor, state=None, eps: float = 1e-6, mode: str = "iterative"
):
    """Causal linear attention over one chunk with a carried state (SLiM). qf, kf: feature-mapped
    queries and keys [..., C, M] (non-negative); v [..., C, D]; state: (num [..., M, D],
    den [..., M]), the sums of k v^T and of k before the chunk, or None (zeros). Returns
    (y [..., C, D], (num, den) after the chunk), y_l = S_l^T q_l / (z_l . q_l + eps). mode
    "iterative" keeps only the inputs for backward; "prefix" uses torch ops over the C x M x D
    prefix sum. States are float32 (float64 for float64 data)."""
    num, den = state if state is not None else (None, None)
    if mode == "iterative":
        y, num, den = torch.ops.tempo.causal_linear_attention(qf, kf, v, num, den, eps)
    elif mode == "prefix":
        y, num, den = torch.ops.tempo.causal_linear_attention_prefix(qf, kf, v, num, den, eps)
    else:
        raise ValueError("tempo.causal_linear_attention: mode must be 'iterative' or 'prefix', got %r" % (mode,))
    return y, (num, den)


def gated_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: Optional[torch.Tensor],
    down_weight: torch.Tensor,
    gate_bias: Optional[torch.Tensor] = None,
    up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    activation: str = "silu",
    chunk: int = 0,
    recompute: str = "product",
) -> torch.Tensor:
    """F.linear(act(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight, up_bias), down_weight,
    down_bias): the gated MLP of LLaMA, Mistral, Qwen (SwiGLU, activation "silu") and Gemma (GeGLU,
    "gelu_tanh"; "gelu" is the erf form). up_weight None: gate_weight is one fused gate_up
    projection [2 I, H], the gate's rows first (Phi-3). The backward keeps x, gate(x) and up(x), not
    act(gate) or their product: it recomputes the product in blocks of `chunk` intermediate columns
    (0: automatic, H rounded up to 64) by 2^20 / chunk rows (at least 1024), so its transients stay bounded
    whatever the sequence length, recomputing no matmul. recompute: what the backward recomputes,
    "product" (the product only), "up" (also up(x), one of the forward's three GEMMs, block by
    block: gate(x) alone kept) or "gate_up" (also gate(x), two GEMMs: nothing of the intermediate
    width kept)."""
    return torch.ops.tempo.gated_mlp(
        x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, chunk, recompute
    )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    labels: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk: int = 0,
    dtype: Optional[torch.dtype] = None,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """F.cross_entropy(F.linear(hidden, weight, bias), labels) over chunks of rows, keeping no
    logits for backward (it keeps one float32 log-sum-exp per row and recomputes each chunk's
    logits). hidden [..., H], weight [V, H], labels [...] (int64, ignore_index skipped).
    reduction "mean" returns 0, not NaN, when every label is ignored. chunk: rows per chunk
    (0: about 32 MiB of logits). dtype: the loss's (default hidden's; torch.float32 from 16-bit
    data returns the fp32 reduction unrounded). Under torch.autocast the head's matmul runs in
    the autocast dtype and the loss is float32, as autocast's linear and cross_entropy.
    logit_scale, softcap: what the model does to its logits before the loss,
    softcap * tanh(logit_scale * z / softcap) (Gemma 2/3's final_logit_softcapping; Cohere's
    logit_scale; Granite's 1 / logits_scaling), differentiated through. z_loss: z_loss * lse**2
    added to each row's loss that is not ignored (PaLM's auxiliary loss), lse that of the
    transformed logits."""
    if labels is None:
        raise TypeError("tempo.linear_cross_entropy: labels are required")
    return torch.ops.tempo.linear_cross_entropy(
        hidden,
        weight,
        bias,
        labels,
        ignore_index,
        label_smoothing,
        reduction,
        chunk,
        dtype,
        logit_scale,
        softcap,
        z_loss,
    )


def linear_cross_entropy_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    labels: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    chunk: int = 0,
):
    """Per-token statistics of the head tempo.linear_cross_entropy computes, from the same chunks
    and logit transforms, no logits kept and no gradient: a dict of "logprob" (the label's
    log-probability, 0 where ignored; with gradient it is -linear_cross_entropy(reduction="none")),
    "entropy" (of softmax(logits / temperature), every row) and "accuracy" (whether the label is
    the arg max, False where ignored), each of the labels' shape."""
    if labels is None:
        raise TypeError("tempo.linear_cross_entropy_stats: labels are required")
    logprob, entropy, correct = torch.ops.tempo.linear_cross_entropy_stats(
        hidden, weight, bias, labels, ignore_index, temperature, logit_scale, softcap, chunk
    )
    return {"logprob": logprob, "entropy": entropy, "accuracy": correct}
