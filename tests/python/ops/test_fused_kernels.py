"""The Data Movement paper's fused activation backward: bias + dropout/GELU backward + the bias
gradient's reduction in one pass. References: torch's own ops, in fp64 where the comparison
should be exact. (tempo.qkv_split, the other fused layer kernel: test_qkv_split.py.)"""

import pytest
import torch

import tempo


ACTS = [
    (
        "gelu",
        lambda g, y, m: torch.ops.tempo.gelu_backward(g, y, m, "none", True),
        lambda x: torch.ops.tempo.gelu_forward(x, "none", None),
    ),
    (
        "gelu_tanh",
        lambda g, y, m: torch.ops.tempo.gelu_backward(g, y, m, "tanh", True),
        lambda x: torch.ops.tempo.gelu_forward(x, "tanh", None),
    ),
    (
        "silu",
        lambda g, y, m: torch.ops.tempo.silu_backward(g, y, m, True),
        lambda x: torch.ops.tempo.silu_forward(x, None),
    ),
]


@pytest.mark.parametrize("name,bwd,fwd", ACTS, ids=[a[0] for a in ACTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 9), (3, 5, 13), (64, 1024), (1, 7), (300, 257)])
def test_activation_backward_sums_the_bias_gradient_in_its_pass(name, bwd, fwd, dtype, shape, on_device):
    device = on_device  # the conftest fixture: each device this machine has
    """grad_bias from the fused pass equals grad_x (the same call's) summed over all but the last
    dim in fp64: sizes not a multiple of 8, one row, many rows (the threads' partial sums; on
    CUDA the row groups')."""
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * 3).to(device, dtype)
    y, m = fwd(x)
    dy = torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)
    gx, gb = bwd(dy, y, m)
    gx_alone = (
        torch.ops.tempo.gelu_backward(dy, y, m, "tanh" if name == "gelu_tanh" else "none")[0]
        if name.startswith("gelu")
        else torch.ops.tempo.silu_backward(dy, y, m)[0]
    )
    torch.testing.assert_close(gx, gx_alone, rtol=0, atol=0)
    want = gx.double().reshape(-1, shape[-1]).sum(0)
    # fp32 on CUDA sums in fp32 (row groups, then the groups): a few ulps of the larger sums
    tol = {torch.float32: 1e-6 if device == "cpu" else 1e-5, torch.float64: 1e-13, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(gb.double(), want.to(dtype).double(), rtol=tol, atol=tol)
    assert gb.dtype == dtype and gb.shape == (shape[-1],)


def test_activation_bias_gradient_of_the_module_path_matches_torch():
    # tempo.gelu / tempo.silu with a bias: autograd now takes the bias gradient from the fused pass
    for tempo_fn, torch_fn in (
        (lambda x, b: tempo.gelu(x, bias=b), lambda x, b: torch.nn.functional.gelu(x + b)),
        (lambda x, b: tempo.silu(x, bias=b), lambda x, b: torch.nn.functional.silu(x + b)),
    ):
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
