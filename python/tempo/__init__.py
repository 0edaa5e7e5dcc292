"""Tempo: drop-in layers that keep less for the backward pass (PyTorch front end).

The ops are ``torch.ops.tempo.*`` from the same shared library the C++ API uses; the
functions here are thin, typed wrappers, and ``tempo.nn`` holds the modules.
"""

import torch

from ._library import library_path, load_library

load_library()

from . import _fake, _flops, memory, nn  # noqa: E402,F401
from .ops import (  # noqa: E402
    attention,
    bias_dropout_add_layer_norm,
    causal_linear_attention,
    dropout,
    fused_attention,
    fused_attention_backend,  # noqa: F401  (tempo.ops's, exported for tempo.fused_attention_backend)
    gated_mlp,
    gelu,
    layer_norm,
    linear_cross_entropy,
    linear_cross_entropy_stats,
    qkv_split,
    rms_norm,
    silu,
)
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
    "gelu",
    "silu",
    "attention",
    "fused_attention",
    "causal_linear_attention",
    "gated_mlp",
    "linear_cross_entropy",
    "linear_cross_entropy_stats",
    "qkv_split",
    "dropout",
    "layer_norm",
    "rms_norm",
    "bias_dropout_add_layer_norm",
    "nn",
    "memory",
    "library_path",
]
