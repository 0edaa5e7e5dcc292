"""The op table every op-wide suite loops over: one entry per op of the registry (csrc/ops.json)
and per variant of one (name_variant), each a sample call built by an Inputs factory at a size
the suite picks, and what the op's second derivative is. Its readers: the sanitizer's script
(scripts/sanitize_ops.py, compute-sanitizer on the GPU), CUDA synchronisation
(test_cuda_sync.py), determinism across thread counts (test_determinism.py), second derivatives
(test_second_derivatives.py), autocast (test_autocast.py) and the registry's dtype check
(test_registry.py, which also fails while an op has no entry). An op's own behaviour against its
reference stays in tests/python/ops/test_<unit>.py; its random cases in test_properties.py.

Sizes: "tiny" (a Hessian over x stays small), "small" (odd widths: the vector tails, a kept norm
column, one masked label), "large" (past the CPU kernels' parallel threshold of 32768 elements).
"""

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import tempo
from draws import DTYPES, Case, draw_layouts, values


@dataclass(frozen=True)
class Sizes:
    rows: int  # rows of a [rows, cols] activation or norm input
    cols: int
    B: int  # [B, H, S, D] attention-shaped inputs
    H: int
    S: int
    D: int
    hidden: int  # the LM head's and the gated MLP's input width
    inter: int  # the gated MLP's intermediate width
    vocab: int


SIZES = {
    "tiny": Sizes(rows=4, cols=6, B=1, H=2, S=2, D=4, hidden=6, inter=8, vocab=10),
    "small": Sizes(rows=37, cols=203, B=2, H=3, S=33, D=16, hidden=24, inter=45, vocab=101),
    "large": Sizes(rows=512, cols=256, B=2, H=4, S=128, D=64, hidden=96, inter=160, vocab=1000),
}


class Inputs:
    """The tensors of one sample call: drawn in float64 from a generator seeded by `seed` on the
    CPU, then cast to `dtype` on `device`, so every device and run sees the same values. x(...)
    is the input the second-derivative suite differentiates (`x`, when given, stands in for it);
    leaf(...) other inputs with a gradient; the rest take none. `leaves` lists those with one."""

    def __init__(self, dtype, device, size, seed=0, x=None, reuse=None):
        self.dtype, self.device, self.s = dtype, torch.device(device), SIZES[size]
        self._g = torch.Generator().manual_seed(seed)
        self._x = x
        # reuse: an earlier Inputs of the same call, whose tensors this one hands out again in
        # the order they were made (no host-to-device copy: what test_cuda_sync needs)
        self._reuse = list(reuse.made) if reuse is not None else None
        self.made, self.leaves = [], []

    def _make(self, draw, grad=False):
        """The next tensor: drawn (draw() on the CPU, then cast and moved) or reused."""
        if self._reuse is not None:
            t = self._reuse.pop(0)
            t.grad = None
        else:
            t = draw().to(self.device, self.dtype if grad else None)
            if grad:
                t.requires_grad_()
        self.made.append(t)
        if grad:
            self.leaves.append(t)
        return t

    def _randn(self, shape, scale=1.0):
        return lambda: torch.randn(*shape, generator=self._g, dtype=torch.float64) * scale

    def x(self, *shape, positive=False):
        """The differentiated input (positive: softplus(x) + 0.1 of it, as linear attention's
        features must be)."""
        if self._x is not None:
            assert tuple(self._x.shape) == shape, (tuple(self._x.shape), shape)
            x, self._x = self._x, None
            self.leaves.append(x)
        else:
            x = self._make(self._randn(shape), grad=True)
        return F.softplus(x) + 0.1 if positive else x

    def leaf(self, *shape, scale=1.0):
        return self._make(self._randn(shape, scale), grad=True)

    def norm_weight(self, n):
        """A norm's gamma: in [0.5, 1.5), with column 5 zero (a kept column) where there is one."""

        def draw():
            w = torch.rand(n, generator=self._g, dtype=torch.float64) + 0.5
            if n > 5:
                w[5] = 0.0
            return w

        return self._make(draw, grad=True)

    def mask(self, S):
        return self._make(lambda: torch.rand(S, S, generator=self._g) > 0.2)

    def labels(self, n, vocab):
        def draw():
            y = torch.randint(0, vocab, (n,), generator=self._g)
            y[min(3, n - 1)] = -100
            return y

        return self._make(draw)

    def tables(self, S, r, dtype=None):
        """Rotary cos and sin [S, r] (LLaMA's form) in `dtype`, by default x's, float32 beside
        16-bit x (as transformers under autocast gives them)."""
        if dtype is None:
            dtype = torch.float32 if self.dtype in (torch.bfloat16, torch.float16) else self.dtype
        inv = 10000.0 ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
        emb = torch.arange(S, dtype=torch.float64)[:, None] * torch.cat([inv, inv])
        return self._make(lambda: emb.cos().to(dtype)), self._make(lambda: emb.sin().to(dtype))


def _attention(op):
    def f(i):
        s = i.s
        q = i.x(s.B, s.H, s.S, s.D)
        k, v = i.leaf(s.B, s.H, s.S, s.D), i.leaf(s.B, s.H, s.S, s.D)
        return op(q, k, v, i.mask(s.S), dropout_p=0.1)

    return f


def _rope(own_dtype):
    def f(i):
        s = i.s
        r = s.D * 3 // 4 // 2 * 2  # a partial rotation: the rest of each row passes through
        x = i.x(s.B, s.S, s.H, s.D).transpose(1, 2)  # q as the projection's transposed view
        cos, sin = i.tables(s.S, r, x.dtype if own_dtype else None)
        return tempo.rope(x, cos, sin)

    return f


def _linear_attention(mode):
    def f(i):
        s = i.s
        qf = i.x(s.B, s.H, s.S, s.D, positive=True)
        v = i.leaf(s.B, s.H, s.S, s.D)
        y, (num, den) = tempo.causal_linear_attention(qf, qf, v, mode=mode)
        return y, num, den

    return f


def _lce_stats(i):
    s = i.s
    stats = tempo.linear_cross_entropy_stats(
        i.x(s.rows, s.hidden), i.leaf(s.vocab, s.hidden), None, i.labels(s.rows, s.vocab), temperature=0.7
    )
    return stats["entropy"], stats["logprob"], stats["accuracy"].float()


def _gated_mlp(fused):
    def f(i):
        s = i.s
        h = i.x(s.rows, s.hidden)
        wg, wd = i.leaf(2 * s.inter, s.hidden, scale=0.2), i.leaf(s.hidden, s.inter, scale=0.2)
        if fused:  # one [2 inter, hidden] gate_up weight
            return tempo.gated_mlp(h, wg, None, wd, activation="gelu_tanh")
        return tempo.gated_mlp(h, wg[: s.inter], wg[s.inter :], wd, chunk=16)

    return f


def _rope_property(rng):
    """test_properties' random case: sizes, a partial or odd rotary_dim, tables per row or shared."""
    B, H, S = rng.choice([1, 2, 3]), rng.choice([1, 2, 4]), rng.choice([1, 5, 13, 64])
    D = rng.choice([2, 8, 10, 64, 130])
    r = rng.choice([D, D, D - D % 4, 2 * rng.randint(0, D // 2)])
    tb = rng.choice([1, B])
    dtype = rng.choice(DTYPES)
    x = values(rng, [B, H, S, D], "wide")
    cos, sin = values(rng, [tb, S, r]), values(rng, [tb, S, r])
    valid = True
    if rng.random() < 0.1:
        cos, sin, valid = values(rng, [tb, S, r + 1]), values(rng, [tb, S, r + 1]), False  # odd or past head_dim

    def ref(t):
        xx, c, sn = t[0], t[1].unsqueeze(1), t[2].unsqueeze(1)
        h = r // 2
        xr = xx[..., :r]
        return torch.cat([xr * c + torch.cat([-xr[..., h:], xr[..., :h]], -1) * sn, xx[..., r:]], -1)

    lay = draw_layouts(rng, 1) + ["contiguous", "contiguous"]
    return Case(
        [x, cos, sin],
        dtype,
        lambda t: tempo.rope(t[0], t[1], t[2]),
        ref,
        valid,
        [True, False, False],
        lay,
        describe=f"rope B{B} H{H} S{S} D{D} r{r} tables {tb} {dtype} {lay[0]}",
    )


@dataclass(frozen=True)
class Op:
    call: Callable  # call(Inputs) -> a tensor, or a tuple whose first is the op's main output
    # the second derivative: "refuses" (tempo::<op>: double backward ... is not supported),
    # "linear" (linear in x: differentiable to any order), "torch" (computed by torch's ops, so
    # differentiable as they are), "none" (no gradient at all)
    second: str = "refuses"
    random: bool = False  # draws a dropout mask: each call (and each CUDA graph replay) a new one
    # test_validation_audit's checks of the op's schemas (torch.ops.tempo.<schema>, its backward's
    # too): schema -> {tensor argument: the dimension a wrong shape narrows ("shape": the last)},
    # on the arguments the tiny sample passes; an op absent here has its own row in the audit
    audit: dict = field(default_factory=dict)
    # test_properties' generator of random cases (rng -> draws.Case); an op absent here has one
    # in the harness's own table
    property: Optional[Callable] = None


OPS = {
    "gelu": Op(lambda i: tempo.gelu(i.x(i.s.rows, i.s.cols), bias=i.leaf(i.s.cols, scale=0.1))),
    "gelu_tanh": Op(lambda i: tempo.gelu(i.x(i.s.rows, i.s.cols), "tanh")),
    "silu": Op(lambda i: tempo.silu(i.x(i.s.rows, i.s.cols), bias=i.leaf(i.s.cols, scale=0.1))),
    "dropout_bits": Op(lambda i: tempo.dropout(i.x(i.s.rows, i.s.cols), 0.3), "linear", random=True),
    "dropout_philox": Op(lambda i: tempo.dropout(i.x(i.s.rows, i.s.cols), 0.3, mode="philox"), "linear", random=True),
    "layer_norm": Op(
        lambda i: tempo.layer_norm(
            i.x(i.s.rows, i.s.cols), (i.s.cols,), i.norm_weight(i.s.cols), i.leaf(i.s.cols, scale=0.1)
        )
    ),
    "rms_norm": Op(lambda i: tempo.rms_norm(i.x(i.s.rows, i.s.cols), (i.s.cols,), i.norm_weight(i.s.cols), 1e-6)),
    "bias_dropout_add_layer_norm": Op(
        lambda i: tempo.bias_dropout_add_layer_norm(
            i.x(i.s.rows, i.s.cols),
            i.leaf(i.s.cols, scale=0.1),
            i.leaf(i.s.rows, i.s.cols),
            0.2,
            i.norm_weight(i.s.cols),
            i.leaf(i.s.cols, scale=0.1),
        ),
        random=True,
    ),
    "attention": Op(_attention(tempo.attention), random=True),
    "fused_attention": Op(_attention(tempo.fused_attention), random=True),
    "qkv_split": Op(
        lambda i: tempo.qkv_split(i.x(i.s.B, i.s.S, 3 * i.s.H * i.s.D), i.leaf(3 * i.s.H * i.s.D, scale=0.1), i.s.H)
    ),
    "rope": Op(
        _rope(False),
        "linear",
        property=_rope_property,
        audit={
            "rope": {"x": 2, "cos": "shape", "sin": "shape"},
            "rope_backward": {"grad": 2, "cos": "shape", "sin": "shape"},
        },
    ),
    "rope_own_dtype": Op(_rope(True), "linear"),
    "causal_linear_attention": Op(_linear_attention("iterative")),
    "causal_linear_attention_prefix": Op(_linear_attention("prefix"), "torch"),
    "linear_cross_entropy": Op(
        lambda i: tempo.linear_cross_entropy(
            i.x(i.s.rows, i.s.hidden), i.leaf(i.s.vocab, i.s.hidden), None, i.labels(i.s.rows, i.s.vocab)
        )
    ),
    "linear_cross_entropy_stats": Op(_lce_stats, "none"),
    "gated_mlp": Op(_gated_mlp(False)),
    "gated_mlp_fused": Op(_gated_mlp(True)),
}


def outputs(out):
    """A sample's outputs as a tuple."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def run(name, dtype, device, size, seed=0, x=None, reuse=None, reseed=True):
    """Op `name`'s sample call (with `reseed` the global RNG seeded first: dropout draws the same
    mask each time; not while a CUDA graph records): its outputs (a tuple) and its Inputs."""
    i = Inputs(dtype, device, size, seed, x, reuse)
    if reseed:
        torch.manual_seed(seed)
    return outputs(OPS[name].call(i)), i


def step(name, dtype, device, size, seed=0, reuse=None, reseed=True):
    """run(), then where the op has a gradient the backward of the sum of its outputs' squares
    (each input's gradient in its .grad): the outputs and the Inputs."""
    outs, i = run(name, dtype, device, size, seed, reuse=reuse, reseed=reseed)
    if outs[0].requires_grad:
        sum(o.float().square().sum() for o in outs if o.requires_grad).backward()
    return outs, i


def cases(dtype, device, size="small"):
    """name -> a function running the op's sample and returning its main output: the form the
    sanitizer's script and the dtype and autocast checks take."""
    return {name: (lambda n=name: run(n, dtype, device, size)[0][0]) for name in OPS}
