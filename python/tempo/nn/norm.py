"""Drop-in replacements for torch.nn.LayerNorm and torch.nn.RMSNorm.

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
