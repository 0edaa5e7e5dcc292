"""The Data Movement paper's fused layer kernels that tempo adds to its ops: tempo.qkv_split (the
attention input bias: q/k/v bias add and head layout in one pass, dz gathered and the bias
gradient summed in one pass) and the activation backward with the bias gradient fused in
(bias + dropout/GELU backward + bias reduction). References: torch's own ops (view, permute,
sum), in fp64 where the comparison should be exact."""
import pytest
import torch

import tempo

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]
DTYPES = [(torch.float32, 1e-6, 1e-6), (torch.float64, 1e-13, 1e-13), (torch.bfloat16, 1e-2, 1e-2)]
# (batch, seq, heads, head_dim): BERT-base-like, odd, one token, long head dim
SHAPES = [(2, 16, 12, 64), (3, 13, 3, 12), (1, 1, 1, 1), (2, 5, 2, 129)]


def reference_split(z, bias, heads):
    B, S, M = z.shape
    y = z + bias if bias is not None else z
    return tuple(t.contiguous() for t in y.view(B, S, 3, heads, M // (3 * heads)).permute(2, 0, 3, 1, 4))


@pytest.mark.parametrize("dtype,rtol,atol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_qkv_split_forward_and_backward_match_torch(dtype, rtol, atol, shape, with_bias, device):
    B, S, A, D = shape
    g = torch.Generator().manual_seed(B * 1000 + S * 10 + A)
    z = torch.randn(B, S, 3 * A * D, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    bias = (torch.randn(3 * A * D, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
            if with_bias else None)
    out = tempo.qkv_split(z, bias, A)
    z2 = z.detach().clone().requires_grad_()
    b2 = bias.detach().clone().requires_grad_() if with_bias else None
    ref = reference_split(z2, b2, A)
    for o, r in zip(out, ref):
        assert o.shape == (B, A, S, D) and o.is_contiguous()
        torch.testing.assert_close(o, r, rtol=rtol, atol=atol)
    grads = [torch.randn(B, A, S, D, generator=g, dtype=torch.float64).to(device, dtype) for _ in range(3)]
    torch.autograd.backward(out, grads)
    torch.autograd.backward(ref, grads)
    torch.testing.assert_close(z.grad, z2.grad, rtol=0, atol=0)  # a gather: exact
    if with_bias:
        rows = z2.grad.double().reshape(-1, 3 * A * D)
        want = rows.sum(0)
        if device == "cpu":
            # Summed in double: torch's fp64 sum rounded to dtype.
            torch.testing.assert_close(bias.grad, want.to(dtype), rtol=rtol, atol=atol)
        else:
            # CUDA sums in the accumulation type (fp32; fp64 for fp64 data) over groups of rows,
            # then the groups in order: recursive summation's bound gamma_(n-1) sum |g| (Higham,
            # 4.4), plus the result's rounding to dtype.
            n, u = rows.shape[0], 2.0 ** (-53 if dtype == torch.float64 else -24)
            gamma = (n - 1) * u / (1 - (n - 1) * u)
            bound = gamma * rows.abs().sum(0) + want.abs() * torch.finfo(dtype).eps / 2 + 1e-300
            err = (bias.grad.double() - want).abs()
            assert torch.all(err <= bound), "worst error %.3e, its bound %.3e" % (
                err.max().item(), bound[int(torch.argmax(err / bound))].item())


def test_qkv_split_unused_outputs_count_as_zero_gradients():
    z = torch.randn(2, 7, 3 * 2 * 4, requires_grad=True)
    b = torch.randn(24, requires_grad=True)
    q, k, v = tempo.qkv_split(z, b, 2)
    (q * 2).sum().backward()  # k and v unused
    want = torch.zeros(2, 7, 3, 2, 4)
    want[:, :, 0] = 2
    torch.testing.assert_close(z.grad, want.view(2, 7, 24))
    torch.testing.assert_close(b.grad, want.view(-1, 24).sum(0))


def test_qkv_split_many_tokens_threads_sum_the_bias_gradient_like_torch():
    # enough elements for the parallel path (per-thread partial sums, added in order)
    z = torch.randn(8, 512, 3 * 4 * 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(192, dtype=torch.float64, requires_grad=True)
    gq, gk, gv = (torch.randn(8, 4, 512, 16, dtype=torch.float64) for _ in range(3))
    torch.autograd.backward(tempo.qkv_split(z, b, 4), [gq, gk, gv])
    torch.testing.assert_close(b.grad, z.grad.reshape(-1, 192).sum(0), rtol=1e-12, atol=1e-12)


def test_qkv_split_gradcheck_and_opcheck():
    z = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    b = torch.randn(12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z, b: tempo.qkv_split(z, b, 2), (z, b))
    torch.library.opcheck(torch.ops.tempo.qkv_split, (torch.randn(2, 3, 12), torch.randn(12), 2))
    torch.library.opcheck(torch.ops.tempo.qkv_split, (torch.randn(2, 3, 12), None, 1))
    grads = [torch.randn(2, 2, 3, 2) for _ in range(3)]
    torch.library.opcheck(torch.ops.tempo.qkv_split_backward, (*grads, True))
    torch.library.opcheck(torch.ops.tempo.qkv_split_backward, (*grads, False))


def test_qkv_split_under_torch_compile():
    lin = torch.nn.Linear(16, 48)

    def f(x):
        q, k, v = tempo.qkv_split(torch.nn.functional.linear(x, lin.weight), lin.bias, 4)
        return (q * k + v).square().mean()

    x = torch.randn(2, 5, 16)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), f(x))


def test_qkv_split_errors_name_the_op_and_argument():
    with pytest.raises(RuntimeError, match=r"tempo::qkv_split.*'z'.*\[batch, seq, 3 hidden\]"):
        tempo.qkv_split(torch.randn(4, 12), None, 2)
    with pytest.raises(RuntimeError, match=r"tempo::qkv_split.*'z'.*divisible by 3 heads = 15"):
        tempo.qkv_split(torch.randn(1, 2, 12), None, 5)
    with pytest.raises(RuntimeError, match=r"tempo::qkv_split.*'heads'.*positive"):
        tempo.qkv_split(torch.randn(1, 2, 12), None, 0)
    with pytest.raises(RuntimeError, match=r"tempo::qkv_split.*'bias'.*\[12\]"):
        tempo.qkv_split(torch.randn(1, 2, 12), torch.randn(6), 2)
    with pytest.raises(RuntimeError, match=r"tempo::qkv_split.*'bias'.*dtype"):
        tempo.qkv_split(torch.randn(1, 2, 12), torch.randn(12, dtype=torch.float64), 2)
    with pytest.raises(RuntimeError, match=r"tempo::qkv_split.*'z'"):
        tempo.qkv_split(torch.ones(1, 2, 12, dtype=torch.long), None, 2)
    with pytest.raises(RuntimeError, match=r"tempo::qkv_split_backward.*one shape"):
        torch.ops.tempo.qkv_split_backward(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 5))


ACTS = [("gelu", lambda g, y, m: torch.ops.tempo.gelu_backward(g, y, m, "none", True),
         lambda x: torch.ops.tempo.gelu_forward(x, "none", None)),
        ("gelu_tanh", lambda g, y, m: torch.ops.tempo.gelu_backward(g, y, m, "tanh", True),
         lambda x: torch.ops.tempo.gelu_forward(x, "tanh", None)),
        ("silu", lambda g, y, m: torch.ops.tempo.silu_backward(g, y, m, True),
         lambda x: torch.ops.tempo.silu_forward(x, None))]


@pytest.mark.parametrize("name,bwd,fwd", ACTS, ids=[a[0] for a in ACTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 9), (3, 5, 13), (64, 1024), (1, 7), (300, 257)])
@pytest.mark.parametrize("device", DEVICES)
def test_activation_backward_sums_the_bias_gradient_in_its_pass(name, bwd, fwd, dtype, shape, device):
    """grad_bias from the fused pass equals grad_x (the same call's) summed over all but the last
    dim in fp64: sizes not a multiple of 8, one row, many rows (the threads' partial sums; on
    CUDA the row groups')."""
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * 3).to(device, dtype)
    y, m = fwd(x)
    dy = torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)
    gx, gb = bwd(dy, y, m)
    gx_alone = (torch.ops.tempo.gelu_backward(dy, y, m, "tanh" if name == "gelu_tanh" else "none")[0]
                if name.startswith("gelu") else torch.ops.tempo.silu_backward(dy, y, m)[0])
    torch.testing.assert_close(gx, gx_alone, rtol=0, atol=0)
    want = gx.double().reshape(-1, shape[-1]).sum(0)
    # fp32 on CUDA sums in fp32 (row groups, then the groups): a few ulps of the larger sums
    tol = {torch.float32: 1e-6 if device == "cpu" else 1e-5, torch.float64: 1e-13, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(gb.double(), want.to(dtype).double(), rtol=tol, atol=tol)
    assert gb.dtype == dtype and gb.shape == (shape[-1],)


def test_activation_bias_gradient_of_the_module_path_matches_torch():
    # tempo.gelu / tempo.silu with a bias: autograd now takes the bias gradient from the fused pass
    for tempo_fn, torch_fn in ((lambda x, b: tempo.gelu(x, bias=b), lambda x, b: torch.nn.functional.gelu(x + b)),
                               (lambda x, b: tempo.silu(x, bias=b), lambda x, b: torch.nn.functional.silu(x + b))):
        x = torch.randn(6, 33, 70, dtype=torch.float64, requires_grad=True)
        b = torch.randn(70, dtype=torch.float64, requires_grad=True)
        gy = torch.randn(6, 33, 70, dtype=torch.float64)
        got = torch.autograd.grad(tempo_fn(x, b), (x, b), gy)
        want = torch.autograd.grad(torch_fn(x, b), (x, b), gy)
        for a, w in zip(got, want):
            torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10)


def test_activation_bias_gradient_of_an_empty_input_is_zero():
    y, m = torch.ops.tempo.gelu_forward(torch.randn(0, 5), "none", None)
    gx, gb = torch.ops.tempo.gelu_backward(torch.randn(0, 5), y, m, "none", True)
    assert gx.shape == (0, 5)
    torch.testing.assert_close(gb, torch.zeros(5))
