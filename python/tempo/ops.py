"""Functional forms of the tempo ops (same names as torch.ops.tempo.* and tempo:: in C++)."""
from typing import Optional

import torch


def gelu(x: torch.Tensor, approximate: str = "none", bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GELU(x + bias), as torch.nn.functional.gelu; backward keeps the output and 1 bit per element."""
    return torch.ops.tempo.gelu(x, approximate, bias)


def silu(x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SiLU(x + bias), as torch.nn.functional.silu; backward keeps the output and 1 bit per element."""
    return torch.ops.tempo.silu(x, bias)
