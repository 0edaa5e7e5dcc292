"""tempo's ops under torch.autocast (bf16 on CPU): each runs as torch's counterpart does under
CPU autocast (norms in x's dtype with float32 gamma and beta, attention in bf16, activations in
the wider dtype of x and bias), with the same output dtype, an error against float64 within 2x
torch's (the norms: within 1.1x), and gradients in the inputs' dtypes."""

import pytest
import registry
import torch
import torch.nn.functional as F

import tempo

AC = dict(device_type="cpu", dtype=torch.bfloat16)

CASES = registry.load("tests/python/opinfo.py", "_autocast_opinfo")  # the op table

# The output dtype each autocast kind of csrc/ops.json gives under CPU autocast (bf16), for inputs
# all of one dtype: lower_precision casts to bf16; head gives a float32 loss; the others run in the
# inputs' dtype (promote: the wider of x's and the bias's; norm: x's on the CPU; like_x: x's; none:
# no autocast kernel).
KIND_OUTPUT = {
    "lower_precision": lambda d: torch.bfloat16,
    "head": lambda d: torch.float32,
    "promote": lambda d: d,
    "norm": lambda d: d,
    "like_x": lambda d: d,
    "none": lambda d: d,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", registry.on("cpu"))
def test_every_op_under_autocast_gives_what_its_registry_kind_says(name, dtype):
    """Every op of the registry (each case of the op table, variants included) under CPU
    autocast: the output dtype its kind says, and a backward that gives each input's gradient in
    the input's own dtype."""
    kind = registry.OPS[name]["autocast"]
    assert kind in KIND_OUTPUT, (name, kind)
    cases = {k: f for k, f in CASES.cases(dtype, "cpu").items() if registry.base(k) == name}
    assert cases, name
    for key, f in cases.items():
        with torch.autocast(**AC):
            y = f()
        assert y.dtype == KIND_OUTPUT[kind](dtype), (key, kind, dtype, y.dtype)
        if y.requires_grad:
            inputs = graph_leaves(y)
            assert inputs, key
            (y.float().square().sum() * 1e-3).backward()
            for t in inputs:
                assert t.grad is not None and t.grad.dtype == t.dtype, (key, t.dtype, t.grad)
                t.grad = None


def graph_leaves(y):
    """The leaf tensors y's autograd graph reaches (its AccumulateGrad nodes' variables)."""
    seen, out, stack = set(), [], [y.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            out.append(fn.variable)
        stack.extend(f for f, _ in fn.next_functions)
    return out


def leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def rel(t, ref):
    return ((t.double() - ref).norm() / ref.norm()).item()


def test_norms_return_x_dtype_as_torch_layer_norm_does_on_cpu():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, 48, generator=g).bfloat16()  # a bf16 activation (a linear's output under autocast)
    w, b = torch.randn(48, generator=g), torch.randn(48, generator=g)
    w[3] = 1e-30  # recovery from y cannot serve this column: kept beside y (issue 10's guard)
    xs, ws, bs = leaves(x, w, b)
    xt, wt, bt = leaves(x, w, b)
    with torch.autocast(**AC):
        ref = F.layer_norm(xs, (48,), ws, bs, 1e-5)
        got = tempo.layer_norm(xt, (48,), wt, bt, 1e-5)
    assert got.dtype == ref.dtype == torch.bfloat16
    x64, w64, b64 = leaves(x.double(), w.double(), b.double())
    exact = F.layer_norm(x64, (48,), w64, b64, 1e-5)
    assert rel(got, exact) <= 1.1 * rel(ref, exact), (rel(got, exact), rel(ref, exact))
    gy = torch.randn(ref.shape, generator=g)
    (ref.float() * gy).sum().backward()
    (got.float() * gy).sum().backward()
    (exact * gy.double()).sum().backward()
    assert xt.grad.dtype == torch.bfloat16 and wt.grad.dtype == bt.grad.dtype == torch.float32
    for name, a, b_, e in (
        ("x", xt.grad, xs.grad, x64.grad),
        ("w", wt.grad, ws.grad, w64.grad),
        ("b", bt.grad, bs.grad, b64.grad),
    ):
        assert rel(a, e) <= 1.1 * rel(b_, e) + 1e-4, (name, rel(a, e), rel(b_, e))
    with torch.autocast(**AC):
        r2 = F.rms_norm(x, (48,), w, 1e-6)
        t2 = tempo.rms_norm(x, (48,), w, 1e-6)
    assert t2.dtype == r2.dtype == torch.bfloat16
    e2 = F.rms_norm(x.double(), (48,), w.double(), 1e-6)
    assert rel(t2, e2) <= 1.1 * rel(r2, e2)


@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bias_dropout_add_layer_norm_under_autocast(residual_dtype):
    """The fused op runs in the dtype eager's sum x + residual promotes to: bf16 for a bf16
    residual, fp32 for an fp32 residual stream (BERT's under CPU autocast, whose embeddings'
    LayerNorm is fp32), never rounding the residual to bf16."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 32, generator=g).bfloat16()
    res = torch.randn(3, 5, 32, generator=g).to(residual_dtype)
    w, b = torch.randn(32, generator=g), torch.randn(32, generator=g)
    with torch.autocast(**AC):
        got = tempo.bias_dropout_add_layer_norm(x, None, res, 0.0, w, b, 1e-5)
        ref = F.layer_norm(res + x, (32,), w, b, 1e-5)  # what eager computes
    assert got.dtype == ref.dtype == residual_dtype
    exact = F.layer_norm(res.double() + x.double(), (32,), w.double(), b.double(), 1e-5)
    assert rel(got, exact) <= 1.1 * rel(ref, exact), (rel(got, exact), rel(ref, exact))


def test_attention_runs_in_bf16_as_sdpa_does():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 9, 16, generator=g) for _ in range(3))
    with torch.autocast(**AC):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        got = tempo.attention(q, k, v, causal=True)
        fused = tempo.fused_attention(q, k, v, causal=True)
    assert got.dtype == fused.dtype == ref.dtype == torch.bfloat16
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    err = lambda t: (t.double() - exact).abs().max().item()
    assert err(got) <= 2 * err(ref) + 1e-3 and err(fused) <= 2 * err(ref) + 1e-3


def test_activations_promote_x_and_bias():
    g = torch.Generator().manual_seed(3)
    x, bias = torch.randn(6, 40, generator=g).bfloat16(), torch.randn(40, generator=g)
    with torch.autocast(**AC):
        got = tempo.gelu(x, bias=bias)
        s = tempo.silu(x, bias=bias)
    assert got.dtype == s.dtype == torch.float32
    torch.testing.assert_close(got, F.gelu(x.float() + bias), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s, F.silu(x.float() + bias), rtol=1e-6, atol=1e-6)
    with torch.autocast(**AC):  # one dtype: unchanged
        assert tempo.gelu(x).dtype == torch.bfloat16
