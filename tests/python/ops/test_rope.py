"""tempo.rope, the rotary position embedding in one pass. References: transformers'
apply_rotary_pos_emb (LLaMA's), and the same formula in torch's ops in float64; the saved
bytes against autograd's count; the op's checks and its behaviour under torch.compile."""

import pytest
import torch

import tempo

# (torch dtype, tolerance against the float64 formula): one rounding of the result to the
# dtype, plus float32's products for the 16/32-bit types
DTYPES = [(torch.float32, 2e-6), (torch.float64, 1e-14), (torch.bfloat16, 8e-3), (torch.float16, 1e-3)]


def tables(B, S, r, dtype, base=10000.0, per_row=False, seed=0):
    """LLaMA's cos and sin ([B or 1, S, r]) for positions 0..S-1, or per batch row shifted ones
    (packed or left-padded sequences)."""
    g = torch.Generator().manual_seed(seed)
    inv = base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    pos = torch.arange(S, dtype=torch.float64)[None] + (torch.randint(0, 50, (B, 1), generator=g) if per_row else 0)
    emb = torch.cat([pos[..., None] * inv, pos[..., None] * inv], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def formula(x, cos, sin):
    """x cos + rotate_half(x) sin over the first r columns, in float64, the rest passed through."""
    r = cos.shape[-1]
    c = cos.double().reshape(cos.shape[0] if cos.dim() > 2 else 1, 1, x.shape[2], r)
    s = sin.double().reshape(c.shape)
    xr = x.double()[..., :r]
    rot = torch.cat([-xr[..., r // 2 :], xr[..., : r // 2]], -1)
    return torch.cat([xr * c + rot * s, x.double()[..., r:]], -1)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 9, 64, 64), (1, 3, 5, 10, 6), (2, 2, 1, 16, 16), (3, 1, 7, 128, 32)])
def test_forward_and_backward_match_the_float64_formula(on_device, dtype, tol, transposed, shape):
    B, H, S, D, r = shape
    g = torch.Generator().manual_seed(B * 100 + S)
    x64 = torch.randn(B, S, H, D, generator=g, dtype=torch.float64).transpose(1, 2)
    if not transposed:
        x64 = x64.contiguous()
    x = x64.to(on_device, dtype).requires_grad_()
    for per_row in (False, True):
        cos, sin = (t.to(on_device) for t in tables(B, S, r, dtype, per_row=per_row))
        out = tempo.rope(x, cos, sin)
        assert out.shape == x.shape and out.dtype == dtype
        assert out.stride() == torch.empty_like(x).stride()  # x's layout, as torch's elementwise ops
        want = formula(x.detach(), cos, sin)
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
        gout = torch.randn(B, H, S, D, generator=g, dtype=torch.float64).to(on_device, dtype)
        (gx,) = torch.autograd.grad(out, x, gout)
        x2 = x.detach().double().requires_grad_()
        (want_gx,) = torch.autograd.grad(formula(x2, cos, sin), x2, gout.double())
        torch.testing.assert_close(gx.double(), want_gx, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_apply_rotary_pos_emb_on_its_own_tables(on_device, dtype):
    """q and k as LLaMA's attention makes them (a transposed projection), with the cos and sin
    of transformers' LlamaRotaryEmbedding: tempo.rope gives apply_rotary_pos_emb's q and k (the
    same formula; fp32 bitwise up to one fused multiply-add's rounding, bf16 within one rounding,
    since transformers rounds each of its four steps to bf16 and tempo once)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama as ml

    cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, rope_theta=5e5)
    rotary = ml.LlamaRotaryEmbedding(cfg).to(on_device)
    B, S = 2, 33
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, S, 2, 64, generator=g).to(on_device, dtype).transpose(1, 2)
    k = torch.randn(B, S, 1, 64, generator=g).to(on_device, dtype).transpose(1, 2)
    pos = torch.arange(S, device=on_device)[None].expand(B, S) + torch.tensor([[0], [7]], device=on_device)
    cos, sin = rotary(q, pos)
    want_q, want_k = ml.apply_rotary_pos_emb(q, k, cos, sin)
    exact_q, exact_k = formula(q, cos, sin), formula(k, cos, sin)
    for got, want, exact in ((tempo.rope(q, cos, sin), want_q, exact_q), (tempo.rope(k, cos, sin), want_k, exact_k)):
        assert got.dtype == want.dtype
        eps = torch.finfo(dtype).eps
        # tempo's error against the exact value is at most one rounding; transformers' more
        ours, theirs = (got.double() - exact).abs(), (want.double() - exact).abs()
        assert (ours <= exact.abs() * eps / 2 + 4 * 2.0**-24 * (q.abs().max().double())).all()
        assert ours.max() <= theirs.max() + 1e-12


def test_keeps_only_the_tables_for_backward():
    """autograd holds the caller's cos and sin (the same storages, no copy) and nothing of x:
    transformers' formula keeps the same two tables, plus its five intermediate kernels' traffic."""
    x = torch.randn(2, 4, 16, 32, requires_grad=True)
    cos, sin = tables(1, 16, 32, torch.float32)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tempo.rope(x * 1, cos, sin)
    kept = [t for t in saved if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()]
    assert {t.untyped_storage().data_ptr() for t in kept} <= {
        cos.untyped_storage().data_ptr(),
        sin.untyped_storage().data_ptr(),
    }, [tuple(t.shape) for t in kept]


def test_twice_differentiable_and_opcheck():
    """The backward is the transposed rotation, itself differentiable by the rotation: gradgradcheck
    in float64; torch.library's opcheck of both ops (schema, fake tensors, autograd registration)."""
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    cos, sin = (t.double() for t in tables(2, 4, 4, torch.float64, per_row=True))
    assert torch.autograd.gradcheck(lambda t: tempo.rope(t, cos, sin), (x,))
    assert torch.autograd.gradgradcheck(lambda t: tempo.rope(t, cos, sin) * t, (x,))
    torch.library.opcheck(torch.ops.tempo.rope, (torch.randn(2, 3, 4, 6), *tables(1, 4, 6, torch.float32)))
    torch.library.opcheck(torch.ops.tempo.rope_backward, (torch.randn(2, 3, 4, 6), *tables(2, 4, 4, torch.float32)))
    x16 = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.tempo.rope, (x16, *tables(1, 4, 8, torch.float32)))


def test_tables_that_need_a_gradient_get_torchs():
    """Learned tables: the gradient with respect to cos and sin too (torch's ops), equal to the
    formula's in float64."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = (t.double().requires_grad_() for t in tables(1, 5, 6, torch.float64))
    assert torch.autograd.gradcheck(lambda a, c, s: tempo.rope(a, c, s), (x, cos, sin))
    gradb = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda g, c, s: torch.ops.tempo.rope_backward(g, c, s), (gradb, cos, sin))


def test_under_torch_compile():
    x = torch.randn(2, 3, 8, 16, requires_grad=True)
    cos, sin = tables(1, 8, 16, torch.float32)

    def f(t):
        return tempo.rope(t.transpose(1, 2).transpose(1, 2) * 2, cos, sin).square().mean()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), f(x))
    (g1,) = torch.autograd.grad(compiled(x), x)
    (g2,) = torch.autograd.grad(f(x), x)
    torch.testing.assert_close(g1, g2)


def test_errors_name_the_op_and_argument():
    x = torch.randn(1, 2, 4, 8)
    cos, sin = tables(1, 4, 8, torch.float32)
    with pytest.raises(RuntimeError, match=r"tempo::rope.*'x'.*\[batch, heads, seq, head_dim\]"):
        tempo.rope(x[0], cos, sin)
    with pytest.raises(RuntimeError, match=r"tempo::rope.*'cos' and 'sin'.*seq = 4"):
        tempo.rope(x, cos[:, :3], sin[:, :3])
    with pytest.raises(RuntimeError, match=r"tempo::rope.*r even, at most head_dim = 8"):
        tempo.rope(x, *tables(1, 4, 10, torch.float32))
    with pytest.raises(RuntimeError, match=r"tempo::rope.*r even"):
        tempo.rope(x, cos[..., :5], sin[..., :5])
    with pytest.raises(RuntimeError, match=r"tempo::rope.*b 1 or 1"):
        tempo.rope(x, *tables(3, 4, 8, torch.float32, per_row=True))
    with pytest.raises(RuntimeError, match=r"tempo::rope.*one shape"):
        tempo.rope(x, cos, sin[..., :6])
    with pytest.raises(RuntimeError, match=r"tempo::rope.*'cos'.*dtype of x.*float32 for 16-bit"):
        tempo.rope(x, cos.double(), sin.double())
    with pytest.raises(RuntimeError, match=r"tempo::rope.*'cos'.*dtype of x"):
        tempo.rope(x.double(), cos, sin)
    with pytest.raises(RuntimeError, match=r"tempo::rope.*'x'"):
        tempo.rope(x.long(), cos, sin)
    with pytest.raises(RuntimeError, match=r"tempo::rope_backward.*'grad'"):
        torch.ops.tempo.rope_backward(x[0], cos, sin)
