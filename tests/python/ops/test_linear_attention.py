"""tempo.causal_linear_attention (SLiM's chunk op) against the quadratic formula in float64,
its gradients against autograd of that formula, chunks with the state carried against one
pass, both modes, what it keeps for backward, opcheck, compile and errors."""

import pytest
import torch

import tempo
from saved import saved_bytes

EPS = 1e-6


def reference(q, k, v, num=None, den=None, eps=EPS, dtype=torch.float64):
    """y_l = (num^T q_l + sum_{i<=l} (q_l . k_i) v_i) / (den . q_l + sum_{i<=l} q_l . k_i + eps), in
    float64 (or `dtype`: plain PyTorch in that precision), from the masked C x C score matrix
    (not the prefix sums the op uses)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    C = q.shape[-2]
    a = (q @ k.transpose(-1, -2)) * torch.ones(C, C, dtype=dtype, device=q.device).tril()
    n, d = a @ v, a.sum(-1, keepdim=True) + eps
    if num is not None:
        n = n + q @ num.to(dtype)
        d = d + (q * den.to(dtype).unsqueeze(-2)).sum(-1, keepdim=True)
    s_num = (k.unsqueeze(-1) * v.unsqueeze(-2)).sum(-3) + (0 if num is None else num.to(dtype))
    s_den = k.sum(-2) + (0 if den is None else den.to(dtype))
    return n / d, s_num, s_den


def inputs(B=2, A=3, C=17, M=8, D=5, dtype=torch.float32, state=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, A, C, M, generator=g, device="cpu") + 0.05  # feature maps are positive
    k = torch.rand(B, A, C, M, generator=g, device="cpu") + 0.05
    v = torch.randn(B, A, C, D, generator=g, device="cpu")
    st = torch.float64 if dtype == torch.float64 else torch.float32
    num = torch.randn(B, A, M, D, generator=g, device="cpu").to(st) if state else None
    den = (torch.rand(B, A, M, generator=g, device="cpu") * 3 + 0.5).to(st) if state else None
    dev = torch.get_default_device()
    move = lambda t: None if t is None else t.to(dev)
    return move(q.to(dtype)), move(k.to(dtype)), move(v.to(dtype)), move(num), move(den)


TOL = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("mode", ["iterative", "prefix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("state", [True, False])
def test_forward_matches_the_quadratic_formula(on_device, mode, dtype, state):
    q, k, v, num, den = inputs(dtype=dtype, state=state)
    y, (n, d) = tempo.causal_linear_attention(q, k, v, None if num is None else (num, den), mode=mode)
    ry, rn, rd = reference(q, k, v, num, den)
    assert y.dtype == dtype and n.dtype == d.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = TOL[dtype]
    torch.testing.assert_close(y.double(), ry, rtol=tol, atol=tol)
    torch.testing.assert_close(n.double(), rn, rtol=max(tol, 1e-6), atol=max(tol, 1e-5))
    torch.testing.assert_close(d.double(), rd, rtol=max(tol, 1e-6), atol=max(tol, 1e-5))


def _loss(y, n, d, g):
    return (y.double() * g[0]).sum() + (n.double() * g[1]).sum() + (d.double() * g[2]).sum()


@pytest.mark.parametrize("mode", ["iterative", "prefix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gradients_match_autograd_of_the_formula(on_device, mode, dtype):
    q, k, v, num, den = inputs(dtype=dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, num, den)]
    gen = torch.Generator().manual_seed(9)
    gy = torch.randn(2, 3, 17, 5, generator=gen, dtype=torch.float64, device="cpu").to(q.device)
    gn = torch.randn(2, 3, 8, 5, generator=gen, dtype=torch.float64, device="cpu").to(q.device)
    gd = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64, device="cpu").to(q.device)
    y, (n, d) = tempo.causal_linear_attention(*leaves[:3], (leaves[3], leaves[4]), mode=mode)
    got = torch.autograd.grad(_loss(y, n, d, (gy, gn, gd)), leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, num, den)]
    want = torch.autograd.grad(_loss(*reference(*ref_leaves), (gy, gn, gd)), ref_leaves)
    if dtype == torch.bfloat16:
        # The flash-attention rule: our error against float64 at most 2x that of plain PyTorch
        # computing the same formula in bfloat16 (its inputs and state in bfloat16).
        low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v, num, den)]
        plain = torch.autograd.grad(_loss(*reference(*low, dtype=torch.bfloat16), (gy, gn, gd)), low)
    for i, (name, a, b) in enumerate(zip(("qf", "kf", "v", "num", "den"), got, want)):
        err = ((a.double() - b).norm() / b.norm()).item()
        if dtype == torch.bfloat16:
            assert a.dtype == (torch.bfloat16 if i < 3 else torch.float32), (name, a.dtype)
            plain_err = ((plain[i].double() - b).norm() / b.norm()).item()
            assert err <= 2 * plain_err, (name, err, plain_err)
        else:
            assert err <= (1e-11 if dtype == torch.float64 else 1e-5), (name, err)


@pytest.mark.parametrize("mode", ["iterative", "prefix"])
@pytest.mark.parametrize("chunk", [1, 5, 17])
def test_chunks_with_the_state_carried_equal_one_pass_and_its_gradients(mode, chunk):
    """The state out of one chunk is the state in of the next; autograd through the chain
    gives the one-pass gradients (what SLiM's backward reproduces chunk by chunk)."""
    q, k, v, _, _ = inputs(dtype=torch.float64, state=False)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    y_full, (n_full, _) = tempo.causal_linear_attention(*leaves, mode=mode)
    g_full = torch.autograd.grad(y_full.pow(2).sum() + n_full.sum(), leaves)
    state, ys = None, []
    for s in range(0, 17, chunk):
        y, state = tempo.causal_linear_attention(*(t[:, :, s : s + chunk] for t in leaves), state, mode=mode)
        ys.append(y)
    y_chunks = torch.cat(ys, dim=2)
    torch.testing.assert_close(y_chunks, y_full, rtol=1e-12, atol=1e-12)
    g_chunks = torch.autograd.grad(y_chunks.pow(2).sum() + state[0].sum(), leaves)
    for a, b in zip(g_chunks, g_full):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_iterative_keeps_only_its_inputs_and_prefix_keeps_the_prefix_sums():
    C, M, D = 256, 32, 32
    q, k, v, num, den = inputs(B=1, A=2, C=C, M=M, D=D)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    it, _ = saved_bytes(lambda: tempo.causal_linear_attention(*leaves, (num, den), mode="iterative"))
    pre, _ = saved_bytes(lambda: tempo.causal_linear_attention(*leaves, (num, den), mode="prefix"))
    inputs_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, num, den))
    assert it <= inputs_bytes
    assert pre >= 2 * C * M * D * 4  # the C x M x D prefix sums (one sequence, two heads)


def test_empty_chunk_passes_the_state_through():
    q, k, v, num, den = inputs(C=0)
    y, (n, d) = tempo.causal_linear_attention(q, k, v, (num, den))
    assert y.shape == (2, 3, 0, 5)
    torch.testing.assert_close(n, num)
    torch.testing.assert_close(d, den)


def test_opcheck():
    q, k, v, num, den = inputs(C=6)
    for args in ((q, k, v, num, den, EPS), (q, k, v, None, None, EPS)):
        torch.library.opcheck(torch.ops.tempo.causal_linear_attention, args)
    torch.library.opcheck(torch.ops.tempo.causal_linear_attention_forward, (q, k, v, num, den, EPS))
    gy = torch.randn_like(v)
    torch.library.opcheck(
        torch.ops.tempo.causal_linear_attention_backward, (gy, torch.randn_like(num), None, q, k, v, num, den, EPS)
    )


def test_compile_fullgraph_matches_eager():
    q, k, v, num, den = inputs(C=9)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def f(q, k, v):
        y, (n, d) = tempo.causal_linear_attention(q, k, v, (num, den))
        return y.sum() + n.sum()

    g_eager = torch.autograd.grad(f(*leaves), leaves)
    g_comp = torch.autograd.grad(torch.compile(f, fullgraph=True)(*leaves), leaves)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b)


def test_errors_are_clear():
    q, k, v, num, den = inputs()
    with pytest.raises(RuntimeError, match="'kf' must have qf's shape"):
        tempo.causal_linear_attention(q, k[..., :3], v)
    with pytest.raises(RuntimeError, match="'v' must be"):
        tempo.causal_linear_attention(q, k, v[:, :, :4])
    with pytest.raises(RuntimeError, match="'num' \\(the state\\) must be Float for Float data"):
        tempo.causal_linear_attention(q, k, v, (num.double(), den.double()))
    with pytest.raises(RuntimeError, match="'num' must be"):
        tempo.causal_linear_attention(q, k, v, (num[..., :2], den))
    with pytest.raises(RuntimeError, match="eps"):
        tempo.causal_linear_attention(q, k, v, eps=-1.0)
    with pytest.raises(ValueError, match="mode must be"):
        tempo.causal_linear_attention(q, k, v, mode="scan")
    with pytest.raises(RuntimeError, match="both or neither"):
        torch.ops.tempo.causal_linear_attention(q, k, v, num, None, EPS)
    with pytest.raises(RuntimeError, match="double backward"):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        y, _ = tempo.causal_linear_attention(*leaves)
        (g,) = torch.autograd.grad(y.pow(2).sum(), leaves[0], create_graph=True)
        g.sum().backward()
