"""tempo.qkv_split, the Data Movement paper's attention input bias: the q/k/v bias add and the head
layout in one pass, dz gathered and the bias gradient summed in one pass. References: torch's own
ops (view, permute, sum), in fp64 where the comparison should be exact."""

import pytest
import torch

import tempo

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
def test_qkv_split_forward_and_backward_match_torch(dtype, rtol, atol, shape, with_bias, on_device):
    device = on_device  # the conftest fixture: each device this machine has
    B, S, A, D = shape
    g = torch.Generator().manual_seed(B * 1000 + S * 10 + A)
    z = torch.randn(B, S, 3 * A * D, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    bias = (
        torch.randn(3 * A * D, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
        if with_bias
        else None
    )
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
                err.max().item(),
                bound[int(torch.argmax(err / bound))].item(),
            )


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
