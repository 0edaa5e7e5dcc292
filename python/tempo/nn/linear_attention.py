"""Causal linear attention (Performer-style) over chunks with a carried state, on
tempo.causal_linear_attention, and its feature maps."""

import math

import torch

from ..ops import causal_linear_attention

FEATURE_MAPS = ("relu", "elu", "sqr", "favor")


class FeatureMap(torch.nn.Module):
    """x [..., d] -> non-negative features [..., M]: relu (M = d), elu + 1 (M = d), sqr (x^2,
    M = d) or FAVOR+ (positive orthogonal random features, M = `features`):
    exp(w_i . x' - |x'|^2 / 2) / sqrt(M) with x' = x / d^(1/4), the softmax kernel's unbiased
    estimator. Queries may subtract their row's maximum exponent (it cancels in the
    attention's ratio); keys may not (it would tie positions to their chunk). `redraw()`
    draws new orthogonal features."""

    def __init__(self, kind: str, head_dim: int, features: int = 0, generator=None) -> None:
        super().__init__()
        if kind not in FEATURE_MAPS:
            raise ValueError("tempo.nn.FeatureMap: unknown feature map %r; known: %s" % (kind, ", ".join(FEATURE_MAPS)))
        self.kind, self.head_dim = kind, head_dim
        self.features = (features or head_dim) if kind == "favor" else head_dim
        if kind == "favor":
            self.register_buffer("projection", self._orthogonal(generator), persistent=True)

    def _orthogonal(self, generator=None):
        d, m = self.head_dim, self.features
        blocks = []
        for _ in range(math.ceil(m / d)):
            g = torch.randn(d, d, generator=generator, dtype=torch.float64)
            qm, rm = torch.linalg.qr(g)
            qm = qm * torch.sign(torch.diagonal(rm)).unsqueeze(0)  # Haar-distributed (QR alone is biased)
            blocks.append(qm.T)
        w = torch.cat(blocks)[:m]
        norms = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
        return (w * norms).float()  # rows of chi(d)-distributed length, orthogonal within blocks

    def redraw(self, generator=None) -> None:
        if self.kind == "favor":
            self.projection.copy_(self._orthogonal(generator).to(self.projection))

    def forward(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        if self.kind == "relu":
            return torch.relu(x)
        if self.kind == "elu":
            return torch.nn.functional.elu(x) + 1
        if self.kind == "sqr":
            return x * x
        x = x * self.head_dim**-0.25
        logits = x @ self.projection.to(x.dtype).T - (x * x).sum(-1, keepdim=True) / 2
        if is_query:
            logits = logits - logits.amax(-1, keepdim=True).detach()
        return torch.exp(logits) / math.sqrt(self.features)


class CausalLinearAttention(torch.nn.Module):
    """Multi-head causal linear attention: x [B, L, d_model] and a state (or None) ->
    (y [B, L, d_model], state after x). Calls over consecutive chunks with the state carried
    give the output of one call over the whole sequence. `kv_sums(x)` is the state increment
    that x contributes (what SLiM's backward subtracts to recover the state before a chunk)."""

    def __init__(
        self,
        d_model: int,
        heads: int,
        feature_map: str = "sqr",
        features: int = 0,
        eps: float = 1e-6,
        mode: str = "iterative",
    ) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(
                "tempo.nn.CausalLinearAttention: d_model %d is not a multiple of heads %d" % (d_model, heads)
            )
        self.heads, self.head_dim, self.eps, self.mode = heads, d_model // heads, eps, mode
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.out = torch.nn.Linear(d_model, d_model)
        self.feature_map = FeatureMap(feature_map, self.head_dim, features)

    def _features(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return self.feature_map(q, True), self.feature_map(k, False), v

    @staticmethod
    def _sums(kf, v):
        st = torch.float64 if v.dtype == torch.float64 else torch.float32
        return kf.to(st).transpose(-1, -2) @ v.to(st), kf.to(st).sum(-2)

    def _merge(self, y):
        B, _, L, _ = y.shape
        return self.out(y.transpose(1, 2).reshape(B, L, -1))

    def kv_sums(self, x: torch.Tensor):
        _, kf, v = self._features(x)
        return self._sums(kf, v)

    def forward(self, x: torch.Tensor, state=None):
        qf, kf, v = self._features(x)
        y, state = causal_linear_attention(qf, kf, v, state, eps=self.eps, mode=self.mode)
        return self._merge(y), state

    def forward_rebuilding(self, x: torch.Tensor, state_after):
        """SLiM's backward step: the state before x rebuilt from the state after it (minus x's
        own sums, from the same features the forward uses), as a leaf that requires grad;
        returns (y, state after, that leaf)."""
        qf, kf, v = self._features(x)
        with torch.no_grad():
            num_inc, den_inc = self._sums(kf, v)
            before = (
                (state_after[0] - num_inc.to(state_after[0].dtype)).requires_grad_(),
                (state_after[1] - den_inc.to(state_after[1].dtype)).requires_grad_(),
            )
        y, state = causal_linear_attention(qf, kf, v, before, eps=self.eps, mode=self.mode)
        return self._merge(y), state, before
