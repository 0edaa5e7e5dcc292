"""Drop-in modules."""
from .activation import GELU, SiLU

__all__ = ["GELU", "SiLU"]
