"""Drop-in replacements for torch.nn.GELU and torch.nn.SiLU.

They subclass the torch modules, so state dicts, repr and isinstance checks are torch's, and
tempo.optimize can re-class a model's own modules in place (keeping their hooks and every
reference to them); only forward differs (what the backward keeps).
"""

import torch

from .. import ops


class GELU(torch.nn.GELU):
    """torch.nn.GELU whose backward keeps only the output and a 1-bit mask."""

    def __init__(self, approximate: str = "none") -> None:
        if approximate not in ("none", "tanh"):
            raise ValueError("tempo.nn.GELU: argument 'approximate' must be 'none' or 'tanh', got %r" % (approximate,))
        super().__init__(approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gelu(x, self.approximate)


class SiLU(torch.nn.SiLU):
    """torch.nn.SiLU whose backward keeps only the output and a 1-bit mask.

    ``inplace`` is accepted for signature compatibility; the input is never overwritten
    (the saving comes from not keeping it, not from writing over it).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu(x)
