"""Tempo: drop-in layers that keep less for the backward pass (PyTorch front end).

The ops are ``torch.ops.tempo.*`` from the same shared library the C++ API uses; the
functions here are thin, typed wrappers, and ``tempo.nn`` holds the modules.
"""

import torch

from ._library import library_path, load_library

load_library()

from . import _fake, _flops, memory, nn  # noqa: E402,F401
from . import ops  # noqa: E402
from .ops import *  # noqa: E402,F401,F403  (the ops: tempo.ops.__all__)
from .ops import fused_attention_backend  # noqa: E402,F401  (for tempo.fused_attention_backend)
from .hf import optimize, report, restore  # noqa: E402
from ._auto import AutoReport, auto  # noqa: E402
from . import plan  # noqa: E402  (a module that is also the function: tempo.plan(...))

__version__ = torch.ops.tempo.build_info()[0]  # CMake's project version, compiled into the library
__all__ = [
    "optimize",
    "report",
    "restore",
    "auto",
    "AutoReport",
    "plan",
    *ops.__all__,
    "nn",
    "memory",
    "library_path",
]
