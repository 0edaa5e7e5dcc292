"""The op registry (csrc/ops.json) for the test suites: every cross-cutting suite takes its list
of ops from here (test_registry.py fails any suite that misses one)."""

import importlib.util
import json
import os

import torch

from common import ROOT  # noqa: E402

with open(os.path.join(ROOT, "csrc", "ops.json")) as _f:
    _REGISTRY = json.load(_f)

UNITS = _REGISTRY["units"]  # unit -> the layers with files of its name
HELPERS = _REGISTRY.get("helpers", {})  # unit -> its further torch-layer files
OPS = {op["name"]: op for op in _REGISTRY["ops"]}
NAMES = sorted(OPS)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtypes(name):
    """The torch dtypes op `name` takes."""
    return [DTYPES[d] for d in OPS[name]["dtypes"]]


def on(device):
    """The ops that run on `device` ("cpu" or "cuda")."""
    return [n for n in NAMES if device in OPS[n]["devices"]]


def base(key):
    """The registry op a suite's case key names: the key itself or its prefix before a variant
    suffix ("dropout_philox" -> "dropout", "gelu_tanh" -> "gelu")."""
    for n in sorted(NAMES, key=len, reverse=True):
        if key == n or key.startswith(n + "_") or key.startswith(n + "+") or key.startswith(n + " "):
            return n
    return None


def missing(keys, device=None):
    """The registry ops (on `device`, or all) that none of a suite's case keys names."""
    covered = {base(k) for k in keys}
    return sorted(set(on(device) if device else NAMES) - covered)


def load(path, name):
    """The Python file at `path` (from the repository's root) as a module named `name`: the
    scripts and suites whose tables or cases another suite reads."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
