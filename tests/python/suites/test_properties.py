"""A property-based harness over every public tempo op (the functions of `tempo`, each on its
torch op and autograd kernel, which run the C++ core's CPU kernels).

Each case is drawn from a seeded generator: shapes with 0, 1, primes and long last dims (numel
not a multiple of 8 or 64), every dtype the op takes, inputs laid out contiguous, transposed,
strided or expanded (stride 0), broadcast attention masks, fully masked rows, dropout p in
{0, tiny, 0.5, 1}, and some arguments that must be refused. A case passes when either

  - the op raises a clear error (RuntimeError/ValueError naming the op) and the case was
    drawn to be invalid; or
  - it runs, the case is valid, and the output and every input gradient match an independent
    float64 reference (PyTorch's own ops in float64, the same dropout bits) within the
    tolerance below, and nothing is NaN or infinite where the reference is finite.

The float64 reference runs on the inputs rounded to the case's dtype (the values tempo sees).
Tolerance, per output tensor: max |tempo - ref| at most the largest of 4 x PyTorch's own error
computing the same formula in the case's dtype (the bound docs/accuracy.md states for the
norms), 4 x the change of the float64 result when every input moves by one rounding unit of the
dtype (the problem's conditioning: what any method in that dtype may err by, where the result
cancels), and FLOOR[dtype] x max(max |ref|, 1). Inputs and output gradients are O(1) draws, so a
result far below 1 comes from cancellation (a one-column LayerNorm's dx is 0 up to the
reference's own rounding), and 1 is its scale. The activations are held per element: the
forward to its stated ulps (half an ulp on the CPU), the gradients to the recovery bound.
The activations' gradients, recovered from the output (docs/accuracy.md), are held per
element to their stated recovery bound instead.

TEMPO_PROPERTY_CASES (default 300) cases per op, seeds base + i with TEMPO_PROPERTY_SEED as base
(default 0). A failure prints the op, the seed and the one-line command that reruns it.
"""

import contextlib
import math
import os
import random
import re

import pytest
import torch
import torch.nn.functional as F

import tempo
import opinfo  # tests/python/opinfo.py: the op table (the generators of the ops it names)
import registry  # tests/python/registry.py: the op registry
from draws import DTYPES, Case, draw_layouts, shape, size, values  # noqa: F401
from reference import VARIANTS, exact, forward_ulps, half_ulp, recovery_bound

CASES = int(os.environ.get("TEMPO_PROPERTY_CASES", "300"))
BASE = int(os.environ.get("TEMPO_PROPERTY_SEED", "0"))
FLOOR = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 4 * 2.0**-8, torch.float16: 4 * 2.0**-11}
SCALE_FLOOR = 1.0


def layout(t, how):
    """A view of t (a leaf) with the same values in another memory layout."""
    if t is None or t.dim() == 0 or how == "contiguous":
        return t
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "strided":
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    return t


def to_leaf(master, dtype, how, grad):
    """The input as the op sees it (layout `how`), and the leaf whose .grad is compared."""
    if master is None:
        return None, None
    if how == "expanded" and master.dim() >= 2 and master.shape[0] > 1:
        leaf = master[:1].to(dtype).detach().requires_grad_(grad)
        return leaf.expand(master.shape), leaf
    leaf = master.to(dtype).detach().requires_grad_(grad)
    if how in ("transposed", "strided"):
        return layout(leaf, how), leaf  # differentiable view of the leaf
    return leaf, leaf


def max_abs(t):
    t = t.double()
    t = t[torch.isfinite(t)]
    return t.abs().max().item() if t.numel() else 0.0


def abs_err(a, ref):
    """Largest |a - ref| where both are finite (PyTorch's own low-precision formula may
    overflow where tempo's does not: its error there gives no tolerance)."""
    a, ref = a.double(), ref.double()
    d = torch.where(torch.isfinite(ref) & torch.isfinite(a), (a - ref).abs(), torch.zeros_like(ref))
    return d.max().item() if d.numel() else 0.0


UNIT = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def run_side(case, dtype, which, grad_out_seed, perturb=None):
    """Run tempo or the reference in `dtype` on the case's inputs rounded to the case's dtype
    (so the float64 reference sees exactly the values tempo sees); `perturb` (a seed) first
    moves each input by a relative rounding unit of the case's dtype, at random."""
    views, leaves = [], []
    for m, how, g in zip(case.inputs, case.layouts, case.grad):
        if m is not None:
            m = m.to(case.dtype)
            if perturb is not None:
                gen = torch.Generator().manual_seed(perturb)
                m = m.double() * (
                    1 + UNIT[case.dtype] * (2 * torch.rand(m.shape, generator=gen, dtype=torch.float64) - 1)
                )
        v, leaf = to_leaf(m, dtype if m is not None else None, how, g and m is not None)
        views.append(v)
        leaves.append(leaf)
    fn = {"tempo": case.run, "reference": case.reference, "torch": case.torch_ref or case.reference}[which]
    out = fn(views)
    grads = [None] * len(leaves)
    if any(l is not None and l.requires_grad for l in leaves) and out.requires_grad:
        gen = torch.Generator().manual_seed(grad_out_seed)
        # rounded to the case's dtype, so that every side sees the same output gradient
        go = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(case.dtype).to(out.dtype)
        if case.activation:
            go = torch.ones_like(out)
        ws = [l for l in leaves if l is not None and l.requires_grad]
        gs = torch.autograd.grad(out, ws, go, allow_unused=True)
        it = iter(gs)
        grads = [next(it) if l is not None and l.requires_grad else None for l in leaves]
        return out.detach(), grads, views, go
    return out.detach(), grads, views, None


def check(name, case, seed):
    repro = (
        f"TEMPO_PROPERTY_SEED={seed} TEMPO_PROPERTY_CASES=1 python -m pytest "
        f"'tests/python/suites/test_properties.py::test_property[{name}]'"
    )
    where = f"{name}, seed {seed} ({case.describe}); rerun: {repro}"
    try:
        out, grads, _, _ = run_side(case, case.dtype, "tempo", seed)
    except (RuntimeError, ValueError, TypeError) as e:
        if case.valid:
            raise AssertionError(f"{where}: a valid case raised {type(e).__name__}: {e}") from e
        op = name.replace("gelu_tanh", "gelu")
        assert f"tempo::{op}" in str(e) or f"tempo.{op}" in str(e), f"{where}: the refusal does not name the op: {e}"
        return "refused"
    assert case.valid, f"{where}: an invalid case was not refused"
    ref, ref_grads, views64, go64 = run_side(case, torch.float64, "reference", seed)
    low, low_grads = run_side(case, case.dtype, "torch", seed)[:2] if case.dtype != torch.float64 else (ref, ref_grads)
    # The problem's conditioning: how far the float64 result moves when the inputs move by a
    # rounding unit of the dtype (what any method computing in that dtype may err by).
    moved, moved_grads = run_side(case, torch.float64, "reference", seed, perturb=seed + 1)[:2]
    # Scale floors: 1 (O(1) draws), times the broadcast factor of an expanded input (its
    # gradient sums that many rows), or the op's own scale of the gradient.
    floors = {
        "output": max(
            SCALE_FLOOR,
            case.output_scale([v.detach() if v is not None else None for v in views64]) if case.output_scale else 0.0,
        )
    }
    extra = (
        case.grad_scale([v.detach() if v is not None else None for v in views64], go64)
        if case.grad_scale and go64 is not None
        else [None] * len(case.inputs)
    )
    for i, (m, how) in enumerate(zip(case.inputs, case.layouts)):
        factor = m.shape[0] if m is not None and how == "expanded" and m.dim() >= 2 and m.shape[0] > 1 else 1
        floors[f"grad of input {i}"] = max(SCALE_FLOOR, extra[i] or 0.0) * factor
    finite_in = all(m is None or not m.is_floating_point() or bool(torch.isfinite(m).all()) for m in case.inputs)
    pairs = [("output", out, ref, low, moved)] + [
        (f"grad of input {i}", g, r, lo, mv)
        for i, (g, r, lo, mv) in enumerate(zip(grads, ref_grads, low_grads, moved_grads))
        if r is not None
    ]
    for what, got, want, torch_low, perturbed in pairs:
        assert got is not None, f"{where}: no {what}"
        assert got.shape == want.shape, f"{where}: {what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        if finite_in:
            # finite wherever the reference is and fits the dtype (1% short of its largest value:
            # past it, torch's own result overflows too, as an fp16 gradient of 1e6 does)
            fits = want.abs() <= 0.99 * torch.finfo(got.dtype).max if got.is_floating_point() else torch.isfinite(want)
            bad = torch.isfinite(want) & fits & ~torch.isfinite(got.double())
            assert not bad.any(), f"{where}: {what} is not finite where the reference is"
        if case.activation and what == "output":
            # test_activation's forward rule: within 2x PyTorch's own error against the exact
            # value, plus the forward's stated rounding, plus f's conditioning for x << 0.
            # With a bias, the op evaluates f at x + bias summed in its math type (float32, or
            # float64 for float64 data): the exact value is taken there.
            math_t = torch.float64 if case.dtype == torch.float64 else torch.float32
            s_math = case.inputs[0].to(case.dtype).to(math_t)
            if case.inputs[1] is not None:
                s_math = s_math + case.inputs[1].to(case.dtype).to(math_t)
            s64 = s_math.double()
            exact_y = exact(case.activation, s64)[0]
            theirs = VARIANTS[case.activation][0](s_math.to(case.dtype)).double()
            slack = max(2, 2 * forward_ulps(case.activation, got)) * half_ulp(exact_y, case.dtype) + 1e-300
            cond = exact_y.abs() * (1 + s64**2 + s64.abs() ** 3) * 4e-16
            err = (got.double() - exact_y).abs()
            allowed = 2 * (theirs - exact_y).abs() + slack + cond
            assert bool((err <= allowed).all()), (
                f"{where}: output beyond its bound ({(err / allowed).max().item():.3g} x)"
            )
            continue
        if case.activation and what.startswith("grad"):
            if got.numel() == 0 or case.inputs[0].numel() == 0:
                assert bool((got == 0).all()), f"{where}: {what} of an empty input is not zero"
                continue
            x = case.inputs[0].to(case.dtype)
            if case.inputs[1] is not None:
                x = (x.double() + case.inputs[1].to(case.dtype).double()).to(case.dtype)
            bound, _ = recovery_bound(case.activation, x)
            if what == "grad of input 1":  # the bias: the column sums of the recovered derivatives
                bound = bound.reshape(-1, bound.shape[-1]).sum(0) + 2 * half_ulp(want, case.dtype)
            err = (got.double() - want).abs()
            worst = (err / bound).max().item() if err.numel() else 0.0
            assert worst <= 1.0, f"{where}: {what} exceeds the recovery bound ({worst:.3g} x)"
            continue
        err = abs_err(got, want)
        tol = max(
            4 * abs_err(torch_low, want),
            4 * abs_err(perturbed, want),
            FLOOR[case.dtype] * max(max_abs(want), floors[what]),
        )
        assert err <= tol, f"{where}: {what} error {err:.3g} > {tol:.3g} (largest |reference| {max_abs(want):.3g})"
    return "matched"


# ---- the ops: each draws a case from rng ------------------------------------------------------


def unpack_bits(bits, numel):
    b = bits.reshape(-1).to(torch.int64)
    return ((b.unsqueeze(-1) >> torch.arange(8)) & 1).reshape(-1)[:numel].bool()


def pick_p(rng):
    return rng.choice([0.0, 0.0, 1e-7, 0.1, 0.5, 1.0])


def gen_activation(rng, act):
    s = shape(rng, rng.randint(1, 3))
    dtype = rng.choice(DTYPES)
    with_bias = rng.random() < 0.4 and s[-1] > 0
    x = values(rng, s, "wide")
    b = values(rng, [s[-1]]) if with_bias else None
    valid = True
    if with_bias and rng.random() < 0.1:
        b, valid = values(rng, [s[-1] + 1]), False  # wrong size: must be refused
    approx = {"gelu": "none", "gelu_tanh": "tanh"}.get(act)
    if act == "silu":
        run = lambda t: tempo.silu(t[0], t[1])
        ref = lambda t: F.silu(t[0] + t[1] if t[1] is not None else t[0])
    else:
        run = lambda t: tempo.gelu(t[0], approx, t[1])
        ref = lambda t: F.gelu(t[0] + t[1] if t[1] is not None else t[0], approximate=approx)
    # Not expanded: the elementwise bound holds per element, not for a sum over a broadcast dim.
    lay = [rng.choice(["contiguous", "transposed", "strided"]), "contiguous"]
    return Case(
        [x, b],
        dtype,
        run,
        ref,
        valid,
        [True, True],
        lay,
        activation=act,
        describe=f"{act} x{s} {dtype} bias={b is not None} {lay[0]}",
    )


def layer_norm_ref(x, shape_, w, b, eps):
    """LayerNorm in two passes (mean, then the mean square of x - mean): exact for one column,
    where F.layer_norm's float64 variance leaves rounding that 1/sqrt(eps) amplifies."""
    h = x - x.mean(-1, keepdim=True)
    y = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps)
    y = y * w if w is not None else y
    return y + b if b is not None else y


def norm_grad_scales(h, w, go, eps, centred):
    """The size of the terms an in-place norm's backward adds, per input: dx (and the
    residual's, the bias's) rstd |w dy|, dgamma sum_rows |dy xhat|, dbeta sum_rows |dy|. A
    result far below them cancels; recovering xhat from the rounded y errs by about u at
    that scale (docs/accuracy.md). Returns [dx, dgamma, dbeta]; dgamma's is at least dbeta's,
    since the xhat it sums is recovered from y - beta."""
    if h.numel() == 0:
        return [None, None, None]
    hc = h - h.mean(-1, keepdim=True) if centred else h
    rstd = torch.rsqrt((hc * hc).mean(-1, keepdim=True) + eps)
    wa = w.abs().max().item() if w is not None and w.numel() else 1.0
    g = go.double().abs()
    dx = (rstd * g).max().item() * wa
    rows = g.numel() // max(g.shape[-1], 1)
    dw = (g * (hc * rstd).abs()).reshape(rows, -1).sum(0).max().item()
    db = g.reshape(rows, -1).sum(0).max().item()
    return [dx, max(dw, db), db]


def gen_norm(rng, kind):
    s = shape(rng, rng.randint(2, 3))
    dtype = rng.choice(DTYPES)
    cols = s[-1]
    x = values(rng, s, "wide")
    w = values(rng, [cols]) if rng.random() < 0.8 else None
    if w is not None and rng.random() < 0.3 and cols > 0:
        # trained-model gammas: tiny, zero and subnormal columns
        for _ in range(rng.randint(1, 3)):
            w[rng.randrange(cols)] = rng.choice([0.0, -4.8e-33, 1e-41, 1e-8])
    b = values(rng, [cols]) if kind == "layer" and rng.random() < 0.8 else None
    eps = rng.choice([1e-5, 1e-6, 1e-12])
    valid = True
    if rng.random() < 0.06:
        eps, valid = rng.choice([-1e-5, float("nan")]), False
    if kind == "layer":
        run = lambda t: tempo.layer_norm(t[0], [cols], t[1], t[2], eps)
        ref = lambda t: layer_norm_ref(t[0], [cols], t[1], t[2], eps)
        torch_ref = lambda t: F.layer_norm(t[0], [cols], t[1], t[2], eps)
    else:
        run = lambda t: tempo.rms_norm(t[0], [cols], t[1], eps)
        ref = torch_ref = lambda t: F.rms_norm(t[0], [cols], t[1], eps)
    lay = draw_layouts(rng, 1) + ["contiguous", "contiguous"]
    scales = lambda t, go: norm_grad_scales(t[0], t[1], go, eps, kind == "layer")
    return Case(
        [x, w, b],
        dtype,
        run,
        ref,
        valid,
        [True, True, True],
        lay,
        torch_ref=torch_ref,
        grad_scale=scales,
        describe=f"{kind}_norm x{s} {dtype} weight={w is not None} bias={b is not None} eps={eps} {lay[0]}",
    )


def gen_dropout(rng):
    s = shape(rng, rng.randint(1, 3))
    dtype = rng.choice(DTYPES)
    p = pick_p(rng)
    mode = rng.choice(["bits", "philox"])
    valid = True
    if rng.random() < 0.06:
        p, valid = rng.choice([-0.1, 1.5, float("nan")]), False
    seed = rng.randrange(2**31)
    x = values(rng, s)
    numel = math.prod(s)

    def run(t):
        torch.manual_seed(seed)
        return tempo.dropout(t[0], p, True, mode)

    def ref(t):
        torch.manual_seed(seed)
        _, bits = torch.ops.tempo.dropout_forward(t[0].detach().float().contiguous(), p, "bits")
        keep = unpack_bits(bits, numel).reshape(s) if p not in (0.0, 1.0) else torch.full(s, p < 1.0)
        scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
        return t[0] * keep.to(t[0].dtype) * scale

    lay = draw_layouts(rng, 1)
    return Case([x], dtype, run, ref, valid, [True], lay, describe=f"dropout x{s} {dtype} p={p} {mode} {lay[0]}")


def attention_ref(q, k, v, mask, p, causal, scale, keep):
    sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    s = (q @ k.transpose(-1, -2)) * sc
    if mask is not None:
        s = s + mask
    if causal:
        i = torch.arange(s.shape[-2]).unsqueeze(-1)
        j = torch.arange(s.shape[-1])
        s = s.masked_fill(j > i, float("-inf"))
    dead = torch.isneginf(s).all(-1, keepdim=True)
    pr = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)  # fully masked rows: P = 0
    if p > 0:
        pr = pr * keep.to(pr.dtype) * (1.0 / (1.0 - p) if p < 1 else 0.0)
    return pr @ v


def gen_attention(rng, fused):
    B, A = rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
    S, T = rng.choice([1, 2, 5, 8, 13, 17, 33]), rng.choice([1, 3, 8, 13, 31, 64])
    d, dv = rng.choice([1, 4, 8, 16, 17]), rng.choice([4, 8, 5])
    causal = rng.random() < 0.3
    if causal:
        T = S
    dtype = rng.choice(DTYPES)
    p = pick_p(rng) if rng.random() < 0.5 else 0.0
    scale = rng.choice([None, None, 0.3])
    mode = rng.choice(["bits", "philox"])
    q, k, v = values(rng, [B, A, S, d]), values(rng, [B, A, T, d]), values(rng, [B, A, T, dv])
    mask = None
    if rng.random() < 0.5:
        ms = [rng.choice([1, B]), rng.choice([1, A]), rng.choice([1, S]), T]
        mask = torch.where(
            torch.rand(ms, generator=torch.Generator().manual_seed(rng.randrange(2**31))) < 0.2, float("-inf"), 0.0
        ).double()
        if rng.random() < 0.3:
            mask[..., 0, :] = float("-inf")  # a fully masked row
    valid = True
    if rng.random() < 0.06:
        k, valid = values(rng, [B, A, T, d + 1]), False  # q and k head dims differ
    seed = rng.randrange(2**31)
    block = rng.choice([0, 1, 4]) if fused else 0

    def run(t):
        torch.manual_seed(seed)
        if fused:
            return tempo.fused_attention(t[0], t[1], t[2], t[3], p, causal, scale, block)
        return tempo.attention(t[0], t[1], t[2], t[3], p, causal, scale, mode)

    def ref(t):
        keep = None
        if p > 0:
            torch.manual_seed(seed)
            if fused:
                keep = fused_keep(t, p, causal, scale, block)
            else:
                qq, kk, vv = (u.detach().float().contiguous() for u in t[:3])
                mm = t[3].detach().float() if t[3] is not None else None
                _, _, bits = torch.ops.tempo.attention_forward(qq, kk, vv, mm, p, causal, scale, "bits")
                keep = unpack_bits(bits, B * A * S * T).reshape(B, A, S, T) if p < 1 else torch.zeros(B, A, S, T)
        return attention_ref(t[0], t[1], t[2], t[3], p, causal, scale, keep)

    lay = draw_layouts(rng, 3) + ["contiguous"]
    name = "fused_attention" if fused else "attention"
    return Case(
        [q, k, v, mask],
        dtype,
        run,
        ref,
        valid,
        [True, True, True, False],
        lay,
        describe=f"{name} B{B} A{A} S{S} T{T} d{d} dv{dv} {dtype} p={p} causal={causal} "
        f"mask={None if mask is None else list(mask.shape)} {mode if not fused else block} {lay[:3]}",
    )


def fused_keep(t, p, causal, scale, block):
    """The keep bits the fused kernel drew: its probabilities with dropout, against without."""
    qq, kk, vv = (u.detach().double() for u in t[:3])
    eye = torch.eye(kk.shape[-2], dtype=torch.float64).expand(*kk.shape[:-2], kk.shape[-2], kk.shape[-2])
    mm = t[3].detach().double() if t[3] is not None else None
    # P_d = fused_attention with v = I (one column per key): P * keep / (1 - p)
    pd = tempo.fused_attention(qq, kk, eye.contiguous(), mm, p, causal, scale, block)
    return pd != 0


def gen_bias_dropout_add_layer_norm(rng):
    s = shape(rng, rng.randint(2, 3))
    cols = s[-1]
    dtype = rng.choice(DTYPES)
    p = pick_p(rng)
    mode = rng.choice(["bits", "philox"])
    x, res = values(rng, s), values(rng, s)
    bias = values(rng, [cols]) if rng.random() < 0.7 else None
    w = values(rng, [cols]) if rng.random() < 0.8 else None
    beta = values(rng, [cols]) if rng.random() < 0.8 else None
    eps = 1e-5
    seed = rng.randrange(2**31)
    numel = math.prod(s)

    def run(t):
        torch.manual_seed(seed)
        return tempo.bias_dropout_add_layer_norm(t[0], t[1], t[2], p, t[3], t[4], eps, mode)

    def h_of(t):  # residual + dropout(x + bias), under the op's mask
        h = t[0] + t[1] if t[1] is not None else t[0]
        if p > 0:
            torch.manual_seed(seed)
            f32 = [u.detach().float().contiguous() if u is not None else None for u in t]
            _, _, bits, _ = torch.ops.tempo.bias_dropout_add_layer_norm_forward(
                f32[0], f32[1], f32[2], p, f32[3], f32[4], eps, "bits"
            )
            keep = unpack_bits(bits, numel).reshape(s) if p < 1 else torch.zeros(s, dtype=torch.bool)
            h = h * keep.to(h.dtype) * (1.0 / (1.0 - p) if p < 1 else 0.0)
        return h + t[2]

    def ref(t):
        return F.layer_norm(h_of(t), [cols], t[3], t[4], eps)

    def scales(t, go):  # as the plain norms': the size of the terms the backward adds
        dh, dw, db = norm_grad_scales(h_of(t).detach(), t[3], go, eps, True)
        if dh is None:
            return [None] * 5
        dx = dh * (1.0 / (1.0 - p) if p < 1 else 0.0)
        return [dx, dx * (numel // max(cols, 1)), dh, dw, db]  # x, bias (summed over rows), residual, w, beta

    lay = draw_layouts(rng, 3) + ["contiguous", "contiguous"]
    lay[1] = "contiguous"
    return Case(
        [x, bias, res, w, beta],
        dtype,
        run,
        ref,
        True,
        [True] * 5,
        lay,
        grad_scale=scales,
        describe=f"bias_dropout_add_layer_norm x{s} {dtype} p={p} {mode} bias={bias is not None} {lay}",
    )


def gen_linear_attention(rng):
    B, A = rng.choice([1, 2]), rng.choice([1, 3])
    C, M, D = rng.choice([1, 2, 7, 16, 33]), rng.choice([1, 3, 8]), rng.choice([1, 4, 5])
    dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.bfloat16])
    mode = rng.choice(["iterative", "prefix"])
    qf, kf, v = values(rng, [B, A, C, M]).abs(), values(rng, [B, A, C, M]).abs(), values(rng, [B, A, C, D])
    with_state = rng.random() < 0.5
    num = values(rng, [B, A, M, D]) if with_state else None
    den = values(rng, [B, A, M]).abs() + 1.0 if with_state else None
    eps = 1e-6

    def state(t):  # the state's own dtype: float64 for float64 data, float32 otherwise
        sd = torch.float64 if t[0].dtype == torch.float64 else torch.float32
        return (t[3].to(sd), t[4].to(sd)) if t[3] is not None else None

    def run(t):
        y, _ = tempo.causal_linear_attention(t[0], t[1], t[2], state(t), eps, mode)
        return y

    def ref(t):
        q, k, vv = t[0], t[1], t[2]
        kv = torch.cumsum(k.unsqueeze(-1) * vv.unsqueeze(-2), -3)  # [.., C, M, D]
        z = torch.cumsum(k, -2)
        if t[3] is not None:
            kv = kv + t[3].unsqueeze(-3).to(kv.dtype)
            z = z + t[4].unsqueeze(-2).to(z.dtype)
        numr = (q.unsqueeze(-1) * kv).sum(-2)
        return numr / ((q * z).sum(-1, keepdim=True) + eps)

    def scales(t, go):
        """The terms of dq (and, summed over the positions after, of dk, dv): per position
        sum_d |dy| (|S| + |y| |z|) / (q . z + eps); with one feature they cancel to a result
        far below them."""
        q, k, vv = t[0], t[1], t[2]
        S = torch.cumsum(k.unsqueeze(-1) * vv.unsqueeze(-2), -3)
        z = torch.cumsum(k, -2)
        if t[3] is not None:
            S, z = S + t[3].unsqueeze(-3), z + t[4].unsqueeze(-2)
        den = (q * z).sum(-1, keepdim=True) + eps
        y = (q.unsqueeze(-1) * S).sum(-2) / den
        terms = (go.abs() * (S.abs().amax(-2) + y.abs() * z.abs().amax(-1, keepdim=True))).sum(-1) / den.squeeze(-1)
        c = terms.max().item() * q.shape[-2] if terms.numel() else 0.0
        return [c, c, c, None, None]

    lay = draw_layouts(rng, 3) + ["contiguous", "contiguous"]
    # the state stays in fp32 (fp64 for fp64 data): give it in that dtype
    return Case(
        [qf, kf, v, num, den],
        dtype,
        run,
        ref,
        True,
        [True, True, True, False, False],
        lay,
        grad_scale=scales,
        describe=f"causal_linear_attention B{B} A{A} C{C} M{M} D{D} {dtype} {mode} state={with_state} {lay[:3]}",
    )


def gen_lce(rng):
    N, H, V = rng.choice([1, 2, 7, 33, 64]), rng.choice([1, 8, 17, 64]), rng.choice([2, 5, 31, 100, 257])
    dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.bfloat16])
    hidden, weight = values(rng, [N, H]), values(rng, [V, H]) * 0.3
    bias = values(rng, [V]) if rng.random() < 0.5 else None
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    labels = torch.randint(0, V, (N,), generator=g)
    if rng.random() < 0.3:
        labels[torch.rand(N, generator=g) < 0.4] = -100
    if rng.random() < 0.05:
        labels[:] = -100
    valid = True
    if rng.random() < 0.06:
        labels[0], valid = V + rng.randrange(3), False  # out of range: refused
    reduction = rng.choice(["mean", "sum", "none"])
    smoothing = rng.choice([0.0, 0.0, 0.1])
    chunk = rng.choice([0, 1, 5, 37])
    # the logit transforms (Cohere's scale, Gemma 2's soft-capping) and the z-loss, now and then
    scale = rng.choice([1.0, 1.0, 1.0, 0.25, 3.0])
    cap = rng.choice([None, None, None, 2.0, 30.0])
    z_loss = rng.choice([0.0, 0.0, 0.0, 1e-2])
    if reduction == "mean" and bool((labels == -100).all()):
        reduction = "sum"  # F.cross_entropy gives 0/0 there; tempo 0 (documented)

    def run(t):
        return tempo.linear_cross_entropy(
            t[0], t[1], t[2], labels, -100, smoothing, reduction, chunk, None, scale, cap, z_loss
        )

    def ref(t):
        z = F.linear(t[0], t[1], t[2]) * scale  # the transforms in the data's dtype, as the models apply them
        if cap is not None:
            z = cap * torch.tanh(z / cap)
        logits = z.float() if t[0].dtype != torch.float64 else z
        loss = F.cross_entropy(logits, labels, ignore_index=-100, label_smoothing=smoothing, reduction="none")
        loss = loss + z_loss * torch.logsumexp(logits, -1) ** 2 * (labels != -100)
        if reduction == "mean":
            return loss.sum() / (labels != -100).sum().clamp_min(1)
        return loss.sum() if reduction == "sum" else loss

    def scales(t, go):
        """The size of the terms the gradients sum (|p - y| <= 1 per logit): dh_n adds V terms
        of |w_v| per row, dW_v and db add one term per row, of |h_n| and 1, each row weighted
        by its share of the output gradient. Classes whose weights agree (an expanded weight)
        cancel in dW to that size times fp32's rounding."""
        if go is None or t[0].numel() == 0 or t[1].numel() == 0:
            return [None, None, None]
        kept = (labels != -100).to(torch.float64)
        rw = go.abs().double() * kept
        if reduction == "mean":
            rw = rw / max(kept.sum().item(), 1.0)
        # the z-loss's 2 z_loss lse p adds to each logit's |p - y| <= 1; the transforms scale it by <= scale
        lse = torch.logsumexp(F.linear(t[0], t[1], t[2]).double() * scale, -1).abs().max().item() if N else 0.0
        rw = rw * abs(scale) * (1 + 2 * z_loss * lse)
        dh = 2 * rw.max().item() * t[1].abs().max().item()
        dw = (rw[:, None] * t[0].abs().double()).sum(0).max().item()
        return [dh, dw, rw.sum().item()]

    lay = draw_layouts(rng, 2) + ["contiguous"]
    return Case(
        [hidden, weight, bias],
        dtype,
        run,
        ref,
        valid,
        [True, True, True],
        lay,
        grad_scale=scales,
        describe=f"linear_cross_entropy N{N} H{H} V{V} {dtype} {reduction} ls={smoothing} chunk={chunk} "
        f"scale={scale} cap={cap} z={z_loss} {lay[:2]}",
    )


def gen_lce_stats(rng):
    """linear_cross_entropy_stats: the labels' log-probabilities and the entropies at a temperature
    (stacked: one output), against float64; no gradient (the op has none)."""
    N, H, V = rng.choice([1, 2, 7, 33]), rng.choice([1, 8, 17]), rng.choice([2, 5, 31, 100])
    dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.bfloat16])
    hidden, weight = values(rng, [N, H]), values(rng, [V, H]) * 0.3
    bias = values(rng, [V]) if rng.random() < 0.5 else None
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) < 0.2] = -100
    temperature, scale = rng.choice([1.0, 0.5, 2.0]), rng.choice([1.0, 0.25])
    cap, chunk = rng.choice([None, 2.0]), rng.choice([0, 1, 5])

    def run(t):
        s = tempo.linear_cross_entropy_stats(t[0], t[1], t[2], labels, -100, temperature, scale, cap, chunk)
        return torch.stack([s["logprob"], s["entropy"]])

    def ref(t):
        z = F.linear(t[0], t[1], t[2]) * scale
        if cap is not None:
            z = cap * torch.tanh(z / cap)
        z = z.float() if t[0].dtype != torch.float64 else z
        lp = torch.log_softmax(z, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0] * (labels != -100)
        entropy = -(torch.softmax(z / temperature, -1) * torch.log_softmax(z / temperature, -1)).sum(-1)
        return torch.stack([lp, entropy])

    return Case(
        [hidden, weight, bias],
        dtype,
        run,
        ref,
        True,
        [False, False, False],
        ["contiguous"] * 3,
        describe=f"linear_cross_entropy_stats N{N} H{H} V{V} {dtype} T={temperature} scale={scale} cap={cap} "
        f"chunk={chunk}",
    )


def gen_qkv_split(rng):
    B, S, A, d = rng.choice([1, 2, 3]), rng.choice([1, 5, 13, 64]), rng.choice([1, 2, 3, 4]), rng.choice([1, 8, 17])
    dtype = rng.choice(DTYPES)
    z = values(rng, [B, S, 3 * A * d])
    bias = values(rng, [3 * A * d]) if rng.random() < 0.7 else None
    which = rng.randrange(3)

    def run(t):
        return tempo.qkv_split(t[0], t[1], A)[which]

    def ref(t):
        zz = t[0] + t[1] if t[1] is not None else t[0]
        return zz.reshape(B, S, 3, A, d)[:, :, which].transpose(1, 2)

    lay = draw_layouts(rng, 1) + ["contiguous"]
    return Case(
        [z, bias],
        dtype,
        run,
        ref,
        True,
        [True, True],
        lay,
        describe=f"qkv_split B{B} S{S} A{A} d{d} {dtype} bias={bias is not None} part {which} {lay[0]}",
    )


def gen_gated_mlp(rng):
    lead = [rng.choice([1, 2, 3])] + ([rng.choice([1, 5, 13])] if rng.random() < 0.5 else [])
    H, I, O = rng.choice([1, 8, 17, 64]), rng.choice([1, 8, 33, 100]), rng.choice([1, 8, 17, 64])
    dtype = rng.choice(DTYPES)
    act = rng.choice(["silu", "gelu", "gelu_tanh"])
    fused = rng.random() < 0.3
    chunk = rng.choice([0, 0, 1, 7, 64])
    # wide inputs but in fp16, where act(gate) * up of wide ones overflows in PyTorch's own op as in tempo's
    x = values(rng, lead + [H], "normal" if dtype == torch.float16 else "wide")
    wg, wu, wd = values(rng, [2 * I if fused else I, H]) * 0.5, values(rng, [I, H]) * 0.5, values(rng, [O, I]) * 0.3
    bg = values(rng, [2 * I if fused else I]) if rng.random() < 0.4 else None
    bu = values(rng, [I]) if rng.random() < 0.4 and not fused else None
    bd = values(rng, [O]) if rng.random() < 0.4 else None
    f = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]

    def run(t):
        return tempo.gated_mlp(t[0], t[1], None if fused else t[2], t[3], t[4], t[5], t[6], act, chunk)

    def ref(t):
        if fused:
            g, u = F.linear(t[0], t[1], t[4]).chunk(2, dim=-1)
        else:
            g, u = F.linear(t[0], t[1], t[4]), F.linear(t[0], t[2], t[5])
        return F.linear(f(g) * u, t[3], t[6])

    def parts(t):
        if fused:
            g, u = F.linear(t[0], t[1], t[4]).chunk(2, dim=-1)
        else:
            g, u = F.linear(t[0], t[1], t[4]), F.linear(t[0], t[2], t[5])
        return g, u, f(g) * u

    def out_scale(t):
        """The size of the terms y sums: |h| |W_down| (+ |b|), h rounded in the dtype as PyTorch's own op rounds it."""
        h = parts(t)[2]
        y = F.linear(h.abs(), t[3].abs(), t[6].abs() if t[6] is not None else None)
        return y.abs().max().item() if y.numel() else 0.0

    def scales(t, go):
        """The size of the terms each gradient sums (dh = dy W_down, dgate = dh up f', dup = dh f(gate); f' <= 1.2)."""
        if go is None or t[0].numel() == 0:
            return [None] * 7
        g, u, h = parts(t)
        dh = go.abs().reshape(-1, go.shape[-1]) @ t[3].abs()
        dg, du = dh * u.abs().reshape(dh.shape) * 1.2, dh * f(g).abs().reshape(dh.shape)
        x2 = t[0].abs().reshape(-1, t[0].shape[-1])
        wg = t[1].abs()[:I] if fused else t[1].abs()
        wu = t[1].abs()[I:] if fused else t[2].abs()
        dx = dg @ wg + du @ wu
        big = lambda m: m.max().item() if m.numel() else 0.0  # noqa: E731
        gate_w = max(big(dg.t() @ x2), big(du.t() @ x2)) if fused else big(dg.t() @ x2)
        gate_b = max(big(dg.sum(0)), big(du.sum(0))) if fused else big(dg.sum(0))
        return [
            big(dx),
            gate_w,
            big(du.t() @ x2),
            big(go.abs().reshape(dh.shape[0], -1).t() @ h.abs().reshape(dh.shape)),
            gate_b,
            big(du.sum(0)),
            big(go.abs().reshape(dh.shape[0], -1).sum(0)),
        ]

    lay = draw_layouts(rng, 1) + ["contiguous"] * 6
    return Case(
        [x, wg, None if fused else wu, wd, bg, bu, bd],
        dtype,
        run,
        ref,
        True,
        [True] * 7,
        lay,
        grad_scale=scales,
        output_scale=out_scale,
        describe=f"gated_mlp {lead}x{H} I{I} O{O} {dtype} {act} fused={fused} chunk={chunk} "
        f"biases={[b is not None for b in (bg, bu, bd)]} {lay[0]}",
    )


OPS = {
    "gelu": lambda rng: gen_activation(rng, "gelu"),
    "gelu_tanh": lambda rng: gen_activation(rng, "gelu_tanh"),
    "silu": lambda rng: gen_activation(rng, "silu"),
    "layer_norm": lambda rng: gen_norm(rng, "layer"),
    "rms_norm": lambda rng: gen_norm(rng, "rms"),
    "dropout": gen_dropout,
    "attention": lambda rng: gen_attention(rng, False),
    "fused_attention": lambda rng: gen_attention(rng, True),
    "bias_dropout_add_layer_norm": gen_bias_dropout_add_layer_norm,
    "causal_linear_attention": gen_linear_attention,
    "linear_cross_entropy": gen_lce,
    "linear_cross_entropy_stats": gen_lce_stats,
    "qkv_split": gen_qkv_split,
    "gated_mlp": gen_gated_mlp,
}
# and the generators the op table holds (an op's entry in tests/python/opinfo.py)
OPS.update({key: op.property for key, op in opinfo.OPS.items() if op.property is not None})


def test_every_op_of_the_registry_has_a_property():
    """Every op of csrc/ops.json (tests/python/registry.py) is drawn here."""
    assert not registry.missing(OPS), f"ops without a property: {registry.missing(OPS)}"


@pytest.mark.parametrize("name", sorted(OPS))
def test_property(name):
    counts = {"matched": 0, "refused": 0}
    for i in range(CASES):
        seed = BASE + i
        rng = random.Random(f"{name}:{seed}")
        case = OPS[name](rng)
        counts[check(name, case, seed)] += 1
    # Both outcomes were exercised: the harness is not vacuous.
    assert counts["matched"] >= CASES // 2, counts


def _valid_cases(name, n):
    """The first n valid cases the op's generator draws (seeds BASE, BASE + 1, ...)."""
    seed = BASE
    while n:
        case = OPS[name](random.Random(f"{name}:{seed}"))
        if case.valid:
            yield seed, case
            n -= 1
        seed += 1


def _valid_cases_by_dtype(name, per_dtype, seeds=4000):
    """The first per_dtype valid cases of each dtype the op's generator draws (seeds BASE, BASE + 1,
    ..., at most `seeds` of them), in seed order."""
    taken = {}
    for seed in range(BASE, BASE + seeds):
        case = OPS[name](random.Random(f"{name}:{seed}"))
        if case.valid and taken.get(case.dtype, 0) < per_dtype:
            taken[case.dtype] = taken.get(case.dtype, 0) + 1
            yield seed, case
        if len(taken) == len(set(DTYPES)) and min(taken.values()) >= per_dtype:
            return


def _call(case, seed, mode):
    """Run the op on the case once under `mode` ("grad", "no_grad" or "inference"), with the
    global generator reset so dropout draws the same bits; the output, the leaves and the views
    of them that the op was given."""
    views, leaves = [], []
    for m, how, g in zip(case.inputs, case.layouts, case.grad):
        v, leaf = to_leaf(m.to(case.dtype) if m is not None else None, case.dtype, how, g and mode == "grad")
        views.append(v)
        leaves.append(leaf)
    torch.manual_seed(seed)
    if mode == "inference":
        with torch.inference_mode():
            return case.run(views), leaves, views
    if mode == "no_grad":
        with torch.no_grad():
            return case.run(views), leaves, views
    return case.run(views), leaves, views


@pytest.mark.parametrize("name", sorted(OPS))
def test_backward_twice_with_retain_graph_gives_the_same_gradients(name):
    """A backward reads what the forward kept and leaves it as it was: a second backward over
    the same graph (retain_graph=True, as a user computing two losses' gradients does) gives
    bitwise the first one's gradients."""
    for seed, case in _valid_cases(name, 12):
        out, leaves, _ = _call(case, seed, "grad")
        ws = [l for l in leaves if l is not None and l.requires_grad]
        if not ws or not out.requires_grad:
            continue
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
        first = torch.autograd.grad(out, ws, go, retain_graph=True, allow_unused=True)
        second = torch.autograd.grad(out, ws, go, allow_unused=True)
        for i, (a, b) in enumerate(zip(first, second)):
            assert (a is None) == (b is None), f"{name}, seed {seed} ({case.describe}): gradient {i} went missing"
            if a is not None:
                assert torch.equal(a, b), (
                    f"{name}, seed {seed} ({case.describe}): gradient {i} differs in the second backward"
                )


@pytest.mark.parametrize("name", sorted(OPS))
def test_no_grad_and_inference_mode_give_the_grad_mode_output(name):
    """Evaluation under torch.no_grad() and torch.inference_mode() runs the op and gives
    bitwise the output it gives when recording a graph, with no graph attached (6 cases of
    each dtype)."""
    for seed, case in _valid_cases_by_dtype(name, 6):
        want, _, _ = _call(case, seed, "grad")
        for mode in ("no_grad", "inference"):
            got, _, views = _call(case, seed, mode)
            assert not got.requires_grad, f"{name}, seed {seed}: the {mode} output records a graph"
            # dropout with p = 0 returns its input itself, as torch's does (the tensor the op
            # was given, made outside inference mode)
            if mode == "inference" and not any(got is v for v in views):
                assert got.is_inference(), f"{name}, seed {seed}: the inference-mode output is not an inference tensor"
            assert torch.equal(got, want.detach()), (
                f"{name}, seed {seed} ({case.describe}): the {mode} output differs from the grad-mode one"
            )


# The framework's GEMMs and attention kernels, as the profiler names them: BLAS chooses its
# kernel by the CPU and by the shapes, so two routes through GEMMs of other shapes may round
# alike on one CPU and apart on the next.
BLAS = re.compile(r"aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_scaled_dot_product\w*)")


def _blas_route(case, seed, mode):
    """The GEMMs one call makes, in order: (name, input shapes)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        _call(case, seed, mode)
    events = sorted(prof.events(), key=lambda e: (e.time_range.start, -e.time_range.end))
    return [(e.name, [list(s) for s in e.input_shapes]) for e in events if BLAS.fullmatch(e.name)]


@pytest.mark.parametrize("name", sorted(OPS))
def test_no_grad_and_inference_mode_take_the_grad_mode_route(name):
    """Bitwise equal outputs on this CPU do not show that another CPU agrees (issue 61: the
    gated MLP's plain kernel projected a fused gate_up weight in two GEMMs, its autograd kernel
    in one; equal on one CPU, 1.5e-5 apart on another). Whatever the CPU, evaluation under
    no_grad and inference_mode makes the GEMMs of the grad-mode forward, with the same shapes,
    in the same order (6 cases of each dtype)."""
    for seed, case in _valid_cases_by_dtype(name, 6):
        want = _blas_route(case, seed, "grad")
        for mode in ("no_grad", "inference"):
            got = _blas_route(case, seed, mode)
            assert got == want, f"{name}, seed {seed} ({case.describe}): the {mode} route {got} is not {want}"


@pytest.mark.parametrize("name", sorted(OPS))
def test_saved_tensor_hooks_carry_what_the_backward_reads(name):
    """Every op keeps its tensors through autograd's saved tensors, so hooks that move them
    (torch.autograd.graph.save_on_cpu, activation offloading) serve its backward: packed into
    copies, the gradients are the unhooked ones (bitwise; the copy of a strided view is
    contiguous, and a matmul over it may round differently, so there within the dtype's
    tolerance)."""
    for seed, case in _valid_cases(name, 12):
        runs = []
        for hooked in (False, True):
            copies = []

            def pack(t):
                copies.append(t.clone())
                return copies[-1]

            # the unhooked run installs no hooks: an identity pack would tie a saved output to
            # its own graph in a cycle that outlives a case that ends before its backward
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if hooked else contextlib.nullcontext()
            with hooks:
                out, leaves, _ = _call(case, seed, "grad")
            ws = [l for l in leaves if l is not None and l.requires_grad]
            if not ws or not out.requires_grad:
                break
            go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(
                out.dtype
            )
            runs.append(torch.autograd.grad(out, ws, go, allow_unused=True))
        if len(runs) < 2:
            continue
        for i, (a, b) in enumerate(zip(*runs)):
            if a is None:
                assert b is None
            elif all(how == "contiguous" for how in case.layouts):
                assert torch.equal(a, b), f"{name}, seed {seed} ({case.describe}): gradient {i} differs under hooks"
            else:
                torch.testing.assert_close(b, a, msg=lambda m: f"{name}, seed {seed} ({case.describe}): {m}")
