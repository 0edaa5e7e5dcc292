"""tempo.gelu / tempo.silu against PyTorch: values, gradients within the recovery bound,
autograd with bias, opcheck, torch.compile, exact saved bytes, training, bad input."""

import pytest
import torch
import torch.nn.functional as F

import tempo
from reference import DTYPES, VARIANTS, exact, forward_ulps, half_ulp, recovery_bound, sweep
from saved import saved_bytes

# Each test runs on every available device (conftest.on_device).
pytestmark = pytest.mark.usefixtures("on_device")

NAMES = list(VARIANTS)


def grad_of(fn, x, *extra):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x, *extra)
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    return y.detach(), g


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_error_at_most_torch_error(name, dtype):
    """Flash-attention's rule: our error against fp64 <= 2x PyTorch's own error in dtype,
    plus one rounding of the output (on CUDA for fp32: the fp32 forward's stated error)."""
    torch_fn, tempo_fn = VARIANTS[name]
    x = sweep(name, dtype, n=200_001)
    ref, _, _ = exact(name, x.to(torch.float64))
    ours = tempo_fn(x).to(torch.float64)
    theirs = torch_fn(x).to(torch.float64)
    slack = max(2, 2 * forward_ulps(name, x)) * half_ulp(ref, dtype) + (1e-300 if dtype == torch.float64 else 0)
    cond = ref.abs() * (1 + x.double() ** 2 + x.double().abs() ** 3) * 4e-16  # f ill-conditioned for x << 0
    allowed = 2 * (theirs - ref).abs() + slack + cond
    excess = (ours - ref).abs() - allowed
    i = int(torch.argmax(excess))
    assert excess[i] <= 0, "x=%r: ours %r, torch %r, exact %r; error %.3e > allowed %.3e (%d points over)" % (
        x[i].item(),
        ours[i].item(),
        theirs[i].item(),
        ref[i].item(),
        (ours[i] - ref[i]).abs().item(),
        allowed[i].item(),
        int((excess > 0).sum()),
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradient_within_recovery_bound(name, dtype):
    """|tempo gradient - exact| <= 2 b(x) + 2 u(f'(x)) + 1e-6 over 10^6 points in [-20, 20]
    and a fine grid around the argmin; finite everywhere."""
    _, tempo_fn = VARIANTS[name]
    x = sweep(name, dtype)
    _, g = grad_of(tempo_fn, x)
    bound, d1 = recovery_bound(name, x)
    err = (g.to(torch.float64) - d1).abs()
    assert torch.isfinite(g).all()
    worst = int(torch.argmax(err / bound))
    assert torch.all(err <= bound), "x=%r got %r exact %r bound %r" % (
        x[worst].item(),
        g[worst].item(),
        d1[worst].item(),
        bound[worst].item(),
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_bias_gradients_match_torch(name, dtype):
    torch_fn, tempo_fn = VARIANTS[name]
    x = (torch.randn(6, 5, 33, dtype=dtype) * 2).requires_grad_()
    b = torch.randn(33, dtype=dtype).requires_grad_()
    w = torch.randn(6, 5, 33, dtype=dtype)
    g1 = torch.autograd.grad((tempo_fn(x, b) * w).sum(), (x, b))
    g2 = torch.autograd.grad((torch_fn(x + b) * w).sum(), (x, b))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-8, atol=1e-9)
    for a, c in zip(g1, g2):
        torch.testing.assert_close(a, c, **tol)


@pytest.mark.parametrize("name", NAMES)
def test_opcheck(name):
    _, tempo_fn = VARIANTS[name]
    op = torch.ops.tempo.gelu if name.startswith("gelu") else torch.ops.tempo.silu
    extra = ("tanh" if name == "gelu_tanh" else "none",) if name.startswith("gelu") else ()
    x = torch.randn(4, 9, requires_grad=True)
    b = torch.randn(9, requires_grad=True)
    torch.library.opcheck(op, (x, *extra))
    torch.library.opcheck(op, (x, *extra, b))
    torch.library.opcheck(op, (torch.randn(3, 17, dtype=torch.float64),) + extra)
    fwd = torch.ops.tempo.gelu_forward if name.startswith("gelu") else torch.ops.tempo.silu_forward
    bwd = torch.ops.tempo.gelu_backward if name.startswith("gelu") else torch.ops.tempo.silu_backward
    xx = torch.randn(5, 11)
    torch.library.opcheck(fwd, (xx, *extra, None) if extra else (xx, None))
    y, m = fwd(xx, *extra, None) if extra else fwd(xx, None)
    torch.library.opcheck(bwd, (torch.randn_like(y), y, m, *extra))
    torch.library.opcheck(bwd, (torch.randn_like(y), y, m, *extra, True))


@pytest.mark.parametrize("name", NAMES)
def test_torch_compile_full_graph(name):
    torch_fn, tempo_fn = VARIANTS[name]
    lin1, lin2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 8)

    def f(x):
        return lin2(tempo_fn(lin1(x))).square().mean()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows in (3, 10):
        x = torch.randn(rows, 16)
        loss = compiled(x)
        loss.backward()
        g_compiled = [p.grad.clone() for p in (*lin1.parameters(), *lin2.parameters())]
        for p in (*lin1.parameters(), *lin2.parameters()):
            p.grad = None
        f(x).backward()
        for a, p in zip(g_compiled, (*lin1.parameters(), *lin2.parameters())):
            torch.testing.assert_close(a, p.grad)
            p.grad = None


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_saved_bytes_exact(name, dtype):
    """Linear -> act -> Linear: tempo keeps exactly the activation's input less ceil(n/8) bytes."""
    torch_fn, tempo_fn = VARIANTS[name]
    lin1 = torch.nn.Linear(32, 131, dtype=dtype)
    lin2 = torch.nn.Linear(131, 16, dtype=dtype)
    params = (*lin1.parameters(), *lin2.parameters())
    x = torch.randn(7, 3, 32, dtype=dtype, requires_grad=True)
    ref_bytes, _ = saved_bytes(lambda: lin2(torch_fn(lin1(x))), params)
    our_bytes, _ = saved_bytes(lambda: lin2(tempo_fn(lin1(x))), params)
    n = 7 * 3 * 131
    # torch: x, the activation's input and its output; tempo: x, the output and the mask.
    assert ref_bytes == (7 * 3 * 32 + 2 * n) * x.element_size()
    assert ref_bytes - our_bytes == n * x.element_size() - (n + 7) // 8


@pytest.mark.parametrize("name", NAMES)
def test_mlp_training_matches_torch(name):
    """Linear-act-Linear trained 100 steps from one seed: losses within 1e-4 relative."""
    torch_fn, tempo_fn = VARIANTS[name]

    def train(act):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 64), act, torch.nn.Linear(64, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        xs = torch.randn(100, 32, 20, generator=gen, device="cpu").to(torch.get_default_device())
        ys = torch.sin(xs.sum(-1, keepdim=True))
        losses = []
        for i in range(100):
            loss = F.mse_loss(model(xs[i]), ys[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return torch.tensor(losses, dtype=torch.float64)

    class Wrap(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x):
            return self.fn(x)

    ref = train(Wrap(torch_fn))
    ours = train(Wrap(tempo_fn))
    assert torch.all((ours - ref).abs() <= 1e-4 * ref.abs())


def test_modules_are_drop_in():
    x = torch.randn(4, 10)
    for ours, theirs in (
        (tempo.nn.GELU(), torch.nn.GELU()),
        (tempo.nn.GELU(approximate="tanh"), torch.nn.GELU(approximate="tanh")),
        (tempo.nn.SiLU(), torch.nn.SiLU()),
    ):
        torch.testing.assert_close(ours(x), theirs(x))
        assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert "tanh" in repr(tempo.nn.GELU(approximate="tanh"))
    with pytest.raises(ValueError, match="approximate"):
        tempo.nn.GELU(approximate="erf")


def test_bad_input_names_op_and_argument():
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"tempo::gelu: argument 'x'.*Int"):
        tempo.gelu(torch.ones(3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"tempo::silu: argument 'x'.*Bool"):
        tempo.silu(torch.ones(3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"tempo::gelu: argument 'bias' must have shape \[4\]"):
        tempo.gelu(x, bias=torch.randn(5))
    with pytest.raises(RuntimeError, match=r"tempo::silu: argument 'bias' must be on the device of x"):
        tempo.silu(x, bias=torch.randn(4, device="meta"))
    with pytest.raises(RuntimeError, match=r"tempo::gelu: argument 'approximate' must be 'none' or 'tanh', got 'fast'"):
        tempo.gelu(x, approximate="fast")


@pytest.mark.parametrize("name", NAMES)
def test_empty_and_non_finite_like_torch(name):
    torch_fn, tempo_fn = VARIANTS[name]
    e = torch.empty(0, 5, requires_grad=True)
    y = tempo_fn(e)
    assert y.shape == (0, 5)
    y.sum().backward()
    assert e.grad.shape == (0, 5)
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), -1e30, 1e30, 0.0])
    y1, g1 = grad_of(tempo_fn, x)
    y2, g2 = grad_of(lambda t: torch_fn(t), x)
    # NaN/inf inputs: NaN gradients, as PyTorch. Huge finite inputs: the limits 0 and 1
    # (PyTorch's tanh form overflows x^3 there and returns NaN).
    assert torch.equal(torch.isnan(g1[:3]), torch.isnan(g2[:3]))
    assert g1[3] == 0 and g1[4] == 1 and abs(g1[5] - 0.5) < 1e-6
    # Values: as PyTorch, except erf-GELU(+inf), where PyTorch's CPU kernel gives NaN and
    # tempo gives the limit +inf (docs/accuracy.md).
    same = torch.isnan(y1) == torch.isnan(y2)
    if name == "gelu":
        assert y1[1] == float("inf")
        same[1] = True
    assert same.all()
    finite = torch.isfinite(y2)
    torch.testing.assert_close(y1[finite], y2[finite])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_16bit_forward_on_every_input(name, dtype, on_device):
    """Every finite bf16/fp16 input, against float64: within half an ulp on the CPU (double,
    rounded once) and within kF16PathForwardUlps on CUDA (plain fp32 with the device's expf /
    erfcf, rounded to 16 bits), in ulps of the 16-bit result."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype)
    x = x[torch.isfinite(x)]
    y = VARIANTS[name][1](x).double()
    ref, _, _ = exact(name, x.double())
    fi = torch.finfo(dtype)
    ok = ref.abs() <= fi.max
    ulp = (2 * half_ulp(ref, dtype)).clamp_min(fi.smallest_normal * fi.eps)
    err = ((y - ref).abs() / ulp)[ok]
    bound = forward_ulps(name, x)
    assert err.max().item() <= bound, (err.max().item(), x[ok][err.argmax()].item())
