"""Drop-in modules."""
from .activation import GELU, SiLU
from .norm import Dropout, LayerNorm, RMSNorm

__all__ = ["GELU", "SiLU", "LayerNorm", "RMSNorm", "Dropout"]
