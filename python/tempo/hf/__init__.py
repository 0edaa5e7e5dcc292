"""tempo.optimize and what it is made of, one concern a file:

_optimize.py  optimize(), report(), restore(): the walk over a model and its undo
rules.py      the table: which modules each technique matches and how each is patched
forwards.py   tempo's forwards for the layer types in the table
probes.py     patch-time probes: a module's own forward against tempo's on random inputs
patching.py   re-classing a module in place, pickling a patched model, plain-module tests
attention.py  tempo's attention in transformers' registry, the model-wide switch, "auto"
lm_head.py    the "lm_head" technique: a language model's loss without its logits
_report.py    tempo.report's table
"""

from .attention import ATTENTION, AttentionNotComputed
from ._optimize import optimize, report, restore
from .rules import FUSED_TECHNIQUES, TECHNIQUES

__all__ = ["optimize", "report", "restore", "ATTENTION", "AttentionNotComputed", "TECHNIQUES", "FUSED_TECHNIQUES"]
