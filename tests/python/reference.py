"""Independent references for the tests and the accuracy benchmark: PyTorch's own ops in
float64 (values, first and second derivatives) and rounding units of each dtype."""

import math

import torch
import torch.nn.functional as F

VARIANTS = {
    "gelu": (lambda x: F.gelu(x), lambda x, b=None: torch.ops.tempo.gelu(x, "none", b)),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), lambda x, b=None: torch.ops.tempo.gelu(x, "tanh", b)),
    "silu": (F.silu, lambda x, b=None: torch.ops.tempo.silu(x, b)),
}
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# The forward's largest error in ulps of the result: the CPU kernels compute in double and round
# once (half an ulp; 16-bit data goes through fp32, a second rounding: at most 2^-13 ulp
# more); the CUDA kernels of fp32 data use float-float fp32 arithmetic (csrc/core/
# math/activation_f32.h, kF32ForwardUlps: measured over every fp32 input). 16-bit data on CUDA
# uses plain fp32 arithmetic (act_forward_plain), rounded once more: kF16PathForwardUlps.
CUDA_F32_FORWARD_ULPS = {"gelu": 2.33, "gelu_tanh": 1.28, "silu": 1.27}
CUDA_16BIT_FORWARD_ULPS = 0.5 + 1 / 128


def forward_ulps(name, x):
    """The forward's error bound in ulps of its result, for x's device and dtype."""
    if x.dtype in (torch.float32, torch.float64) and x.device.type != "cuda" or x.dtype == torch.float64:
        return 0.5
    if x.device.type != "cuda":  # 16-bit on the CPU: double rounded to fp32, then to 16 bits
        return 0.5 + 2.0**-13
    if x.dtype == torch.float32:
        return CUDA_F32_FORWARD_ULPS[name]
    return CUDA_16BIT_FORWARD_ULPS


def exact(name, x64):
    """f(x), f'(x), f''(x) in float64 from PyTorch's ops and autograd.

    The GELUs are written without cancellation for x << 0 (PyTorch's own gelu computes
    1 + erf(x / sqrt 2) and 1 + tanh(a), which lose all relative accuracy there, even in
    float64): erf form as x erfc(-x / sqrt 2) / 2, tanh form as x / (1 + exp(-2a))."""
    x = x64.detach().clone().requires_grad_(True)
    if name == "gelu":
        y = 0.5 * x * torch.erfc(-x / math.sqrt(2))
    elif name == "gelu_tanh":
        a = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
        y = x * torch.sigmoid(2 * a)
    else:
        y = VARIANTS[name][0](x)
    (d1,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), x)
    return y.detach(), d1.detach(), d2.detach()


def half_ulp(v, dtype):
    """Half a unit in the last place of |v| in dtype (round-to-nearest error bound)."""
    fi = torch.finfo(dtype)
    mant = {torch.float32: 24, torch.float64: 53, torch.bfloat16: 8, torch.float16: 11}[dtype]
    a = v.abs().to(torch.float64)
    e = torch.floor(torch.log2(a.clamp_min(fi.tiny)))
    e = e.clamp_min(math.log2(fi.tiny))
    return torch.pow(2.0, e - mant + 1) * 0.5


def argmin(name):
    return {"gelu": -0.7517915246935645, "gelu_tanh": -0.7524614224867321, "silu": -1.2784645439248923}[name]


def sweep(name, dtype, n=1_000_000):
    """x in dtype: n points over [-20, 20] plus 20001 within 1e-2 of the argmin."""
    xs = argmin(name)
    x = torch.cat(
        [
            torch.linspace(-20, 20, n, dtype=torch.float64),
            torch.linspace(xs - 1e-2, xs + 1e-2, 20001, dtype=torch.float64),
        ]
    )
    return x.to(dtype)


def recovery_bound(name, x_dtype):
    """2 b(x) + 2 u(f'(x)) + 1e-6, with b the error any method that keeps only the rounded
    output and one bit cannot avoid (docs/accuracy.md, "The bound, and what the tests hold"), capped at the minimum."""
    dtype = x_dtype.dtype
    x64 = x_dtype.to(torch.float64)
    y, d1, d2 = exact(name, x64)
    xs = torch.tensor([argmin(name)], dtype=torch.float64)
    ys, _, d2s = exact(name, xs)
    widen = 2 * forward_ulps(name, x_dtype)  # the forward's error in half-ulps (1 on the CPU)
    uy = widen * half_ulp(y, dtype)
    cap = torch.sqrt(2 * d2s.abs() * widen * half_ulp(ys, dtype))
    b = torch.where(d1 != 0, d2.abs() * uy / d1.abs(), cap)
    b = torch.minimum(b, cap)
    return 2 * b + 2 * half_ulp(d1, dtype) + 1e-6, d1
