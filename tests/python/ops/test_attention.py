"""tempo.attention and tempo.nn.SelfAttention: every backend against a float64 reference,
dropout against the same mask, exact kept bytes, errors."""

import math

import pytest
import torch

import tempo
from saved import saved_bytes
from tempo.nn.attention import eager_attention, sdpa_attention

# Each test runs on every available device (conftest.on_device).
pytestmark = pytest.mark.usefixtures("on_device")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def reference(q, k, v, mask=None, causal=False, keep=None, p=0.0):
    """softmax(q k^T / sqrt(d) + mask) (* keep / (1 - p)) v, in the inputs' dtype."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if causal:
        s = s.masked_fill(torch.ones(q.size(2), k.size(2), dtype=torch.bool).triu(1), float("-inf"))
    P = torch.softmax(s, -1)
    if keep is not None:
        P = P * keep / (1 - p)
    return P @ v


def masks(B, A, S, kind):
    if kind == "none":
        return None
    if kind == "padding":
        m = torch.ones(B, 1, 1, S, dtype=torch.bool)
        m[0, ..., S // 2 + 1 :] = False  # keys past the middle of sequence 0 are padding
        return m
    if kind == "bool":
        m = torch.rand(B, A, S, S) > 0.3
        m[..., 0] = True
        return m
    return torch.randn(B, 1, S, S) * 2  # additive


def grads(fn, ins, g):
    ins = [t.detach().clone().requires_grad_(True) for t in ins]
    out = fn(*ins)
    return [out.detach()] + list(torch.autograd.grad(out, ins, g.to(out.dtype)))


def check_close_to_reference(ours, theirs, ref, dtype):
    for o, t, r in zip(ours, theirs, ref):
        eo, et = (o.double() - r).abs().max().item(), (t.double() - r).abs().max().item()
        floor = 4 * torch.finfo(dtype).eps * (r.abs().max().item() + 1)
        assert eo <= 2 * et + floor, (eo, et)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("S,d", [(1, 32), (7, 64), (33, 80), (16, 128)])
@pytest.mark.parametrize(
    "kind,causal",
    [("none", False), ("padding", False), ("bool", False), ("additive", False), ("none", True), ("padding", True)],
)
def test_op_matches_reference(dtype, S, d, kind, causal):
    """tempo.attention within 2x of torch's own eager error in the same dtype (vs float64)."""
    B, A = 2, 3
    q, k, v = (torch.randn(B, A, S, d, dtype=torch.float64) for _ in range(3))
    g = torch.randn(B, A, S, d, dtype=torch.float64)
    mask = masks(B, A, S, kind)
    low = [t.to(dtype) for t in (q, k, v)]
    m_low = mask.to(dtype) if mask is not None and mask.dtype != torch.bool else mask
    ours = grads(lambda q, k, v: tempo.attention(q, k, v, m_low, 0.0, causal), low, g)
    theirs = grads(lambda q, k, v: reference(q, k, v, m_low, causal), low, g)
    ref = grads(lambda q, k, v: reference(q, k, v, mask, causal), [q, k, v], g)
    check_close_to_reference(ours, theirs, ref, dtype)


@pytest.mark.parametrize("mode", ["bits", "philox"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_dropout_against_the_same_mask(mode, dtype):
    B, A, S, d = 2, 4, 37, 32
    p = 0.2
    q, k, v = (torch.randn(B, A, S, d, dtype=torch.float64) for _ in range(3))
    g = torch.randn(B, A, S, d, dtype=torch.float64)
    mask = masks(B, A, S, "padding")
    low = [t.to(dtype) for t in (q, k, v)]
    # The debug entry point: the forward op returns the packed keep bits.
    torch.manual_seed(21)
    _, P, bits = torch.ops.tempo.attention_forward(*low, mask, p, False, None, "bits")
    keep = ((bits.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[: P.numel()].view(P.shape)

    def ours_fn(q, k, v):
        torch.manual_seed(21)
        return tempo.attention(q, k, v, mask, p, False, None, mode)

    ours = grads(ours_fn, low, g)
    theirs = grads(lambda q, k, v: reference(q, k, v, mask, False, keep.to(dtype), p), low, g)
    ref = grads(lambda q, k, v: reference(q, k, v, mask, False, keep.double(), p), [q, k, v], g)
    check_close_to_reference(ours, theirs, ref, dtype)


def test_kept_fraction():
    q = torch.randn(4, 8, 128, 16)
    for p in (0.1, 0.5):
        _, P, bits = torch.ops.tempo.attention_forward(q, q, q, None, p, False, None, "bits")
        n = P.numel()
        keep = ((bits.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[:n]
        assert abs(keep.sum().item() - (1 - p) * n) <= 5 * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("backend", ["tempo", "sdpa", "eager", "fused", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_module_backends_match_reference(backend, dtype):
    torch.manual_seed(3)
    H, A, B, S = 64, 4, 3, 11
    m = tempo.nn.SelfAttention(H, A, dropout=0.1, backend=backend, causal=False).to(dtype).eval()
    m64 = tempo.nn.SelfAttention(H, A, backend="eager").double().eval()
    m64.load_state_dict(m.state_dict())
    pad = torch.ones(B, S, dtype=torch.long)
    pad[1, 7:] = 0
    x = torch.randn(B, S, H, dtype=torch.float64)
    g = torch.randn(B, S, H, dtype=torch.float64)
    for causal in (False, True):
        m.causal = m64.causal = causal
        ours = grads(lambda x: m(x, pad), [x.to(dtype)], g)
        ref = grads(lambda x: m64(x, pad), [x], g)
        for o, r in zip(ours, ref):
            tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2}[dtype]
            assert (o.double() - r).abs().max().item() <= tol * (r.abs().max().item() + 1)
    assert m.last_backend in ("tempo", "sdpa", "eager", "tempo-fused")


def test_auto_picks_sdpa_without_dropout_and_tempo_with():
    m = tempo.nn.SelfAttention(32, 2, dropout=0.1)
    x = torch.randn(2, 5, 32)
    m.eval()
    m(x)
    assert m.last_backend == "sdpa"
    m.train()
    m(x)
    # torch's CPU sdpa falls back to its math path with dropout (S^2 tensors kept): tempo's;
    # its CUDA memory-efficient kernel takes dropout (fp32 too) and keeps no S^2 tensor: sdpa
    want = "sdpa" if torch.get_default_device().type == "cuda" else "tempo"
    assert m.last_backend == want


def test_saved_bytes_exact():
    """B=1, A=16, S=512, d=64, fp32, dropout on: beyond x, the q/k/v projection and the
    attention output, eager keeps 9 A S^2 bytes (P, byte mask, dropped P), tempo 4 A S^2 +
    A S^2 / 8 (P and the bits), sdpa (fused kernel, dropout off) no S^2 tensor."""
    A, S, d = 16, 512, 64
    H = A * d
    x = torch.randn(1, S, H)
    base = 5 * S * H * 4  # x, qkv (3 S H) and the attention output, fp32
    got = {}
    for backend, p in (
        ("eager", 0.1),
        ("tempo", 0.1),
        ("sdpa", 0.0),
        ("sdpa", 0.1),
        ("eager", 0.0),
        ("tempo", 0.0),
        ("fused", 0.1),
    ):
        m = tempo.nn.SelfAttention(H, A, dropout=p, backend=backend)
        got[backend, p], _ = saved_bytes(lambda: m(x), list(m.parameters()))
    s2 = A * S * S
    assert got["eager", 0.1] == base + 9 * s2
    assert got["tempo", 0.1] == base + 4 * s2 + s2 // 8
    assert got["eager", 0.0] == got["tempo", 0.0] == base + 4 * s2
    if torch.get_default_device().type == "cpu":
        assert got["sdpa", 0.0] == base + A * S * 4  # its log-sum-exp, one fp32 per row
        # With dropout torch's CPU sdpa falls back to its math path, which keeps 13 bytes per
        # probability (the figure bench_attention prints; why "auto" picks tempo there).
        assert got["sdpa", 0.1] == base + 13 * s2
        # tempo's memory-efficient attention (what "fused" runs here): q, k, v and a 16-byte seed
        assert got["fused", 0.1] == base + 16
    else:
        # torch's CUDA memory-efficient kernel (fp32): its log-sum-exp and its Philox seed and
        # offset (two int64), with or without dropout; "fused" runs that kernel on CUDA
        flash = base + A * S * 4 + 16
        assert got["sdpa", 0.0] == got["sdpa", 0.1] == got["fused", 0.1] == flash, got
    print(
        "kept beyond the projections: eager %d, tempo %d, sdpa %d bytes"
        % (got["eager", 0.1] - base, got["tempo", 0.1] - base, got["sdpa", 0.0] - base)
    )


def test_fully_masked_rows_give_zeros():
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    mask[0, 0, 2] = False  # query 2 sees no key
    out = tempo.attention(q, q, q, mask)
    assert torch.isfinite(out).all() and torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    (gq,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(gq).all()


def test_opcheck():
    q, k, v = (torch.randn(2, 3, 5, 8, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 1, 5, 5) > 0.2
    mask[..., 0] = True
    for args in (
        (q, k, v, None, 0.0, False, None, "bits"),
        (q, k, v, mask, 0.0, True, 0.5, "bits"),
        (q, k, v, mask, 0.3, False, None, "bits"),
        (q, k, v, None, 0.3, False, None, "philox"),
    ):
        torch.library.opcheck(torch.ops.tempo.attention, args)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, P, keep = torch.ops.tempo.attention_forward(qd, kd, vd, None, 0.3, False, None, "bits")
    torch.library.opcheck(
        torch.ops.tempo.attention_backward, (torch.randn_like(out), qd, kd, vd, P, keep, 0.3, None, "bits")
    )


def test_torch_compile_full_graph():
    m = tempo.nn.SelfAttention(32, 4, backend="tempo")
    params = list(m.parameters())

    def f(x, pad):
        return m(x, pad).square().mean()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    for S in (5, 9):
        x, pad = torch.randn(2, S, 32), torch.ones(2, S)
        pad[0, -1] = 0
        compiled(x, pad).backward()
        got = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        f(x, pad).backward()
        for a, p in zip(got, params):
            torch.testing.assert_close(a, p.grad)
            p.grad = None


def test_bad_input():
    q = torch.randn(2, 3, 5, 8)
    with pytest.raises(RuntimeError, match=r"tempo::attention: argument 'k' must have the head dim of q \(8\), got 4"):
        tempo.attention(q, torch.randn(2, 3, 5, 4), q)
    with pytest.raises(RuntimeError, match=r"tempo::attention: argument 'v' must have the sequence length of k"):
        tempo.attention(q, q, torch.randn(2, 3, 6, 8))
    with pytest.raises(RuntimeError, match=r"tempo::attention: q, k and v must have one number of heads"):
        tempo.attention(q, torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8))
    with pytest.raises(RuntimeError, match=r"tempo::attention: argument 'q' must be 4-D"):
        tempo.attention(q[0], q[0], q[0])
    with pytest.raises(
        RuntimeError, match=r"tempo::attention: argument 'attn_mask' of shape \[3, 5\] does not broadcast"
    ):
        tempo.attention(q, q, q, torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"tempo::attention: argument 'dropout_p' must be a probability"):
        tempo.attention(q, q, q, None, 1.5)
    with pytest.raises(RuntimeError, match=r"gradients of the mask are not supported"):
        tempo.attention(q, q, q, torch.zeros(5, 5, requires_grad=True))
    e = torch.randn(0, 3, 5, 8, requires_grad=True)
    out = tempo.attention(e, e, e)
    assert out.shape == (0, 3, 5, 8)
    out.sum().backward()
    with pytest.raises(ValueError, match="divisible"):
        tempo.nn.SelfAttention(30, 4)
    with pytest.raises(ValueError, match="backend"):
        tempo.nn.SelfAttention(32, 4, backend="flash")
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        tempo.nn.SelfAttention(32, 4)(torch.randn(2, 5, 32), torch.ones(2, 4))


def test_backends_agree_with_each_other():
    """The three cores on the same inputs (fp32, no dropout), through the functional forms."""
    q, k, v = (torch.randn(2, 4, 19, 16) for _ in range(3))
    mask = masks(2, 4, 19, "padding")
    a = tempo.attention(q, k, v, mask, 0.0, True)
    b = sdpa_attention(q, k, v, mask, 0.0, True)
    c = eager_attention(q, k, v, mask, 0.0, True)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_rows", [0, 1, 5])
def test_fused_attention_equals_attention(dtype, block_rows):
    """Blocks of query rows reproduce tempo.attention (the same dropout mask from the same
    generator state), values and gradients, with masks, causal and dropout."""
    B, A, S, d = 2, 3, 23, 16
    q, k, v = (torch.randn(B, A, S, d).to(dtype) for _ in range(3))
    g = torch.randn(B, A, S, d).to(dtype)
    mask = masks(B, A, S, "bool")
    for p, causal in ((0.0, False), (0.2, True), (0.3, False)):

        def run(fn):
            def f(q, k, v):
                torch.manual_seed(17)
                return fn(q, k, v)

            return grads(f, [q, k, v], g)

        a = run(lambda q, k, v: tempo.fused_attention(q, k, v, mask, p, causal, None, block_rows))
        b = run(lambda q, k, v: tempo.attention(q, k, v, mask, p, causal, None, "philox"))
        tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
        for x, y in zip(a, b):
            torch.testing.assert_close(x.double(), y.double(), rtol=tol, atol=tol)


def test_fused_attention_opcheck():
    q, k, v = (torch.randn(2, 3, 9, 8, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 1, 9, 9) > 0.2
    mask[..., 0] = True
    torch.library.opcheck(torch.ops.tempo.fused_attention, (q, k, v, mask, 0.3, True, None, 4))
    torch.library.opcheck(torch.ops.tempo.fused_attention, (q, k, v, None, 0.0, False, 0.5, 0))
    out, state = torch.ops.tempo.fused_attention_forward(q.detach(), k.detach(), v.detach(), mask, 0.3, False, None, 4)
    torch.library.opcheck(
        torch.ops.tempo.fused_attention_backward,
        (torch.randn_like(out), q.detach(), k.detach(), v.detach(), state, mask, 0.3, False, None, 4),
    )


def test_fused_attention_backend_names_the_kernel(on_device):
    """On CUDA without a mask or dropout (the same semantics) fused_attention runs torch's
    sdpa and says so; with a mask, dropout or block_rows, and on the CPU, tempo's own kernel.
    Either way the result and gradients are tempo.attention's."""
    q, k, v = (torch.randn(2, 3, 33, 16, requires_grad=True) for _ in range(3))
    cuda = q.is_cuda
    for causal in (False, True):
        assert tempo.fused_attention_backend(q, k, causal=causal) == ("torch-sdpa" if cuda else "tempo")
        out = tempo.fused_attention(q, k, v, causal=causal)
        ref = tempo.attention(q, k, v, causal=causal)
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
        g = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    mask = torch.rand(33, 33) > 0.3
    assert tempo.fused_attention_backend(q, k, mask) == "tempo"
    assert tempo.fused_attention_backend(q, k, None, 0.1) == "tempo"
    assert tempo.fused_attention_backend(q, k, block_rows=8) == "tempo"
    assert tempo.fused_attention_backend(q.double(), k.double()) == "tempo"
    assert tempo.fused_attention_backend(q[:, :, :5], k, causal=True) == "tempo"  # not square
