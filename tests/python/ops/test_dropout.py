"""tempo.dropout: statistics, exact use of the forward mask, seeding, modes, memory, errors."""

import math

import pytest
import torch
import torch.nn.functional as F

import tempo
from saved import saved_bytes

# Each test runs on every available device (conftest.on_device).
pytestmark = pytest.mark.usefixtures("on_device")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def unpack(bits, n):
    """Packed keep bits (bit i % 8 of byte i // 8) as a bool tensor of n elements."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((bits.unsqueeze(1) >> shifts) & 1).flatten()[:n].bool()


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5, 0.9])
def test_kept_fraction_within_binomial_bounds(p):
    n = 1_000_003
    x = torch.ones(n)
    keep = tempo.dropout(x, p) != 0
    kept = keep.sum().item()
    sd = math.sqrt(n * p * (1 - p))
    assert abs(kept - (1 - p) * n) <= 5 * sd
    # Every bit position of a mask byte, and pairs of neighbours, behave as independent draws.
    per_lane = keep[: n // 8 * 8].view(-1, 8).float().mean(0)
    assert ((per_lane - (1 - p)).abs() <= 5 * math.sqrt(p * (1 - p) / (n // 8))).all()
    both = (keep[:-1] & keep[1:]).float().mean().item()
    assert abs(both - (1 - p) ** 2) <= 5 * math.sqrt((1 - p) ** 2 * (1 - (1 - p) ** 2) / n)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["bits", "philox"])
def test_values_and_backward_use_the_forward_mask(mode, dtype):
    n = 10007  # not a multiple of 8: a partial last mask byte
    x = torch.randn(n, dtype=torch.float64).to(dtype).requires_grad_(True)
    p = 0.3
    torch.manual_seed(11)
    y, keep_t = torch.ops.tempo.dropout_forward(x.detach(), p, "bits")
    keep = unpack(keep_t, n)
    torch.manual_seed(11)
    y2 = tempo.dropout(x, p, mode=mode)
    scale = 1 / (1 - p)
    # float64 reference with the same mask, rounded once to the dtype
    ref = (x.detach().double() * keep.double() * scale).to(dtype)
    assert torch.equal(y2.detach(), y) and torch.equal(y, ref)
    g = torch.randn(n, dtype=torch.float64).to(dtype)
    (gx,) = torch.autograd.grad(y2, x, g)
    assert torch.equal(gx, (g.double() * keep.double() * scale).to(dtype))
    # zeros exactly where dropped, in both directions
    assert torch.equal(gx[~keep] == 0, torch.ones_like(gx[~keep], dtype=torch.bool))


def test_same_seed_same_mask_and_modes_agree():
    x = torch.randn(3, 1000)
    torch.manual_seed(5)
    a = tempo.dropout(x, 0.4)
    torch.manual_seed(5)
    b = tempo.dropout(x, 0.4, mode="philox")
    c = tempo.dropout(x, 0.4)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # a fresh draw on the next call


def test_identity_zeros_and_eval():
    x = torch.randn(50, requires_grad=True)
    assert tempo.dropout(x, 0.0) is x
    assert tempo.dropout(x, 0.7, training=False) is x
    y = tempo.dropout(x, 1.0)
    assert torch.equal(y, torch.zeros_like(x))
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, torch.zeros_like(x))
    m = tempo.nn.Dropout(0.5).eval()
    assert m(x) is x
    m.train()
    assert (m(x) == 0).any()
    empty = torch.empty(0, 3, requires_grad=True)
    assert tempo.dropout(empty, 0.5).shape == (0, 3)


def test_saved_bytes_exact():
    """bits keeps ceil(n / 8) bytes, philox 16 bytes; torch's CPU dropout keeps its scaled
    noise tensor (x's dtype: 4 bytes per element here; its CUDA kernel keeps a bool mask)."""
    n = 1001
    lin = torch.nn.Linear(7, 11)
    x = torch.randn(91, 7)
    params = list(lin.parameters())
    torch_bytes, _ = saved_bytes(lambda: F.dropout(lin(x), 0.2), params)
    bits, _ = saved_bytes(lambda: tempo.dropout(lin(x), 0.2), params)
    philox, _ = saved_bytes(lambda: tempo.dropout(lin(x), 0.2, mode="philox"), params)
    base = 91 * 7 * 4  # the Linear keeps x
    assert torch_bytes == base + (4 * n if torch.get_default_device().type == "cpu" else n)
    assert bits == base + (n + 7) // 8
    assert philox == base + 16


def test_opcheck():
    x = torch.randn(4, 13, requires_grad=True)
    for mode in ("bits", "philox"):
        torch.library.opcheck(torch.ops.tempo.dropout, (x, 0.25, mode))
        torch.library.opcheck(torch.ops.tempo.dropout_forward, (x.detach(), 0.25, mode))
        y, keep = torch.ops.tempo.dropout_forward(x.detach(), 0.25, mode)
        torch.library.opcheck(torch.ops.tempo.dropout_backward, (torch.randn_like(y), keep, 0.25, mode))


def test_torch_compile_draws_a_fresh_mask_each_call():
    lin = torch.nn.Linear(8, 64)

    def f(x):
        return tempo.dropout(lin(x), 0.5)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 8)
    torch.manual_seed(1)
    a = compiled(x)
    b = compiled(x)
    assert not torch.equal(a != 0, b != 0)
    torch.manual_seed(1)
    c = f(x)
    assert torch.equal(a, c)  # the same seed gives the eager mask
    a.sum().backward()


def test_bad_input_names_op_and_argument():
    x = torch.randn(4)
    with pytest.raises(ValueError, match=r"tempo.dropout: argument 'p'"):
        tempo.dropout(x, 1.5)
    with pytest.raises(ValueError, match=r"tempo.dropout: argument 'mode'"):
        tempo.dropout(x, 0.5, mode="bytes")
    with pytest.raises(RuntimeError, match=r"tempo::dropout: argument 'p' must be a probability in \[0, 1\], got -0.1"):
        torch.ops.tempo.dropout(x, -0.1)
    with pytest.raises(RuntimeError, match=r"tempo::dropout: argument 'x' must be float32"):
        torch.ops.tempo.dropout(torch.ones(3, dtype=torch.int32), 0.5)
    with pytest.raises(RuntimeError, match=r"tempo::dropout_backward: argument 'keep' must hold"):
        torch.ops.tempo.dropout_backward(x, torch.zeros(3, dtype=torch.uint8), 0.5, "bits")
    with pytest.raises(ValueError, match="mode"):
        tempo.nn.Dropout(0.1, mode="bytes")


def test_non_finite_propagates():
    """As PyTorch's x * mask * scale: kept inf stays inf, kept NaN stays NaN, dropped non-finite
    elements give NaN (x * 0), dropped finite ones 0."""
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0] * 64)
    torch.manual_seed(2)
    y, keep_bits = torch.ops.tempo.dropout_forward(x, 0.3, "bits")
    keep = unpack(keep_bits, x.numel())
    ref = x.double() * keep.double() / 0.7
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    assert torch.equal(y[finite].double(), ref[finite].float().double())


@pytest.mark.cpu_only  # it places its tensors on both devices itself
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CPU/CUDA mask agreement)")
@pytest.mark.parametrize("mode", ["bits", "philox"])
def test_cuda_matches_cpu(mode):
    x = torch.randn(3, 4097, dtype=torch.float64)
    torch.manual_seed(9)
    a = tempo.dropout(x, 0.3, mode=mode)
    torch.manual_seed(9)
    b = tempo.dropout(x.cuda(), 0.3, mode=mode)
    assert torch.equal(a, b.cpu())
    xc = x.cuda().requires_grad_(True)
    torch.manual_seed(9)
    (g,) = torch.autograd.grad(tempo.dropout(xc, 0.3, mode=mode).sum(), xc)
    assert torch.equal(g.cpu() != 0, a != 0)
