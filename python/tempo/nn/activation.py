"""Drop-in replacements for torch.nn.GELU and torch.nn.SiLU."""
import torch

from .. import ops


class GELU(torch.nn.Module):
    """torch.nn.GELU whose backward keeps only the output and a 1-bit mask."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError("tempo.nn.GELU: argument 'approximate' must be 'none' or 'tanh', got %r" % (approximate,))
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return "approximate=%r" % (self.approximate,)


class SiLU(torch.nn.Module):
    """torch.nn.SiLU whose backward keeps only the output and a 1-bit mask.

    ``inplace`` is accepted for signature compatibility; the input is never overwritten
    (the saving comes from not keeping it, not from writing over it).
    """

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu(x)
