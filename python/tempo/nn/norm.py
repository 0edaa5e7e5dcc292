"""Drop-in replacements for torch.nn.LayerNorm, torch.nn.RMSNorm and torch.nn.Dropout.

They subclass the torch modules, so parameters, state dicts, initialisation and
isinstance checks are torch's; only forward differs (what the backward keeps).
"""
import torch

from .. import ops


class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm whose backward keeps the output and one rstd per row, not the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm whose backward keeps the output and one rstd per row, not the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class Dropout(torch.nn.Dropout):
    """torch.nn.Dropout whose backward keeps 1 bit per element ("bits") or only a Philox seed
    ("philox") instead of a byte mask. ``inplace`` is accepted and ignored."""

    def __init__(self, p: float = 0.5, inplace: bool = False, mode: str = "bits") -> None:
        super().__init__(p, inplace)
        if mode not in ("bits", "philox"):
            raise ValueError("tempo.nn.Dropout: argument 'mode' must be 'bits' or 'philox', got %r" % (mode,))
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.dropout(x, self.p, self.training, self.mode)

    def extra_repr(self) -> str:
        return "p=%r, mode=%r" % (self.p, self.mode)
