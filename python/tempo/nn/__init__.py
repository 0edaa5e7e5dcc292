"""Drop-in modules."""

from .activation import GELU, SiLU
from .attention import SelfAttention
from .linear_attention import CausalLinearAttention, FeatureMap
from .dropout import Dropout
from .gated_mlp import GatedMLP
from .norm import LayerNorm, RMSNorm

__all__ = [
    "GELU",
    "SiLU",
    "LayerNorm",
    "RMSNorm",
    "Dropout",
    "GatedMLP",
    "SelfAttention",
    "CausalLinearAttention",
    "FeatureMap",
]
