"""The random draws of the property harness (tests/python/suites/test_properties.py): the Case
record a generator returns, and the sizes, shapes, values and memory layouts it draws from. The
generators live in the harness, or in the op table (tests/python/opinfo.py) for the ops whose
entry holds one."""

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

SIZES = [1, 1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 64, 65]
LONG = [127, 257, 1031, 4099]
DTYPES = [torch.float32, torch.float32, torch.float64, torch.bfloat16, torch.float16]


@dataclass
class Case:
    """One drawn call: inputs (float64 masters), how tempo and the reference run on them."""

    inputs: List[Optional[torch.Tensor]]
    dtype: torch.dtype
    run: Callable  # run(tensors) -> output tensor (tempo)
    reference: Callable  # reference(tensors) -> output tensor, run in float64
    valid: bool = True
    grad: List[bool] = field(default_factory=list)  # which inputs get a gradient
    layouts: List[str] = field(default_factory=list)
    activation: Optional[str] = None  # the activations: their gradient is held to the recovery bound
    # The natural size of each input's gradient where the result cancels (the in-place norms:
    # the terms their backward adds, scaled by rstd): grad_scale(inputs in float64, grad_out).
    grad_scale: Optional[Callable] = None
    describe: str = ""
    # The same for the output: a sum of terms rounded in the dtype on the way (the gated MLP's
    # product h before the down projection), output_scale(inputs in float64).
    output_scale: Optional[Callable] = None
    torch_ref: Optional[Callable] = None  # PyTorch's own op for its error in the case's dtype (default: reference)


def size(rng, long_ok=False):
    if long_ok and rng.random() < 0.1:
        return rng.choice(LONG)
    if rng.random() < 0.05:
        return 0
    return rng.choice(SIZES)


def shape(rng, dims, max_numel=12000, last_long=True):
    for _ in range(20):
        s = [size(rng) for _ in range(dims - 1)] + [size(rng, last_long)]
        if math.prod(s) <= max_numel:
            return s
    return [1] * dims


def values(rng, s, kind="normal"):
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    x = torch.randn(s, generator=g, dtype=torch.float64)
    if kind == "wide" and rng.random() < 0.3:
        x = x * 10.0 ** rng.uniform(-3, 2)
    return x


def draw_layouts(rng, n):
    return [rng.choice(["contiguous", "contiguous", "transposed", "strided", "expanded"]) for _ in range(n)]
