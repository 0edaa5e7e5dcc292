"""A drop-in replacement for torch.nn.Dropout.

It subclasses torch's module, so state dicts and isinstance checks are torch's, and
tempo.optimize can re-class a model's own Dropout in place; only forward differs (what the
backward keeps).
"""

import torch

from .. import ops


class Dropout(torch.nn.Dropout):
    """torch.nn.Dropout whose backward keeps 1 bit per element ("bits") or only a Philox seed
    ("philox") instead of a byte mask. ``inplace`` is accepted and ignored."""

    mode = "bits"  # what a torch.nn.Dropout that tempo.optimize re-classes in place keeps

    def __init__(self, p: float = 0.5, inplace: bool = False, mode: str = "bits") -> None:
        super().__init__(p, inplace)
        if mode not in ("bits", "philox"):
            raise ValueError("tempo.nn.Dropout: argument 'mode' must be 'bits' or 'philox', got %r" % (mode,))
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.dropout(x, self.p, self.training, self.mode)

    def extra_repr(self) -> str:
        return "p=%r, mode=%r" % (self.p, self.mode)
