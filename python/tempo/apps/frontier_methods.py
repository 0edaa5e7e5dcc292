"""The methods tempo.frontier compares (apps/frontier.py's docstring lists them; tempo.methods
spells and applies them): the default rows, the optimizer every method steps, and the memory
budgets."""

import argparse
import contextlib

import torch

from .. import methods
from .._measure import parse_bytes


PEERS = (
    "eager",
    "sdpa",
    "sdpa+ckpt",
    "sdpa+ckpt+offload",
    "sdpa+ckpt-offload",
    "sdpa+compile",
    "sdpa+compile-mem0.5",
    "sdpa+compile-mem0.2",
)
TORCH_LCE = "+torch-lce"
METHODS = (
    PEERS
    + tuple(p + TORCH_LCE for p in PEERS)
    + (
        "trl",
        "trl-offload",
        "hf-offload",
        "sdpa+liger",
        "tempo-sdpa",
        "tempo",
        "tempo+compile",
        "tempo+compile-mem0.5",
        "tempo+compile-mem0.2",
        "tempo+ckpt",
        "tempo+ckpt-offload",
        "tempo+liger",
        "tempo-auto",
        "tempo+recompute-up",
        "tempo+recompute-gate_up",
    )
)
PRECISIONS = ("autocast-bf16", "bf16", "fp32")
FIELDS = (
    "model",
    "axis",
    "seq",
    "precision",
    "device",
    "method",
    "budget",
    "budget_bytes",
    "max_batch",
    "max_seq",
    "tokens_per_s",
    "step_ms",
    "spread",
    "peak_bytes",
    "activations_b1",
    "loss_mean",
    "choice",
    "optimizer",
    "error",
)


def known(name):
    """Whether the frontier measures `name`: a method tempo.methods parses, or tempo-auto."""
    if name == "tempo-auto":
        return True
    try:
        methods.parse(name)
    except ValueError:
        return False
    return True


def learned_positions(model):
    """The number of positions a model's learned position embedding holds (BERT, GPT-2), or None
    (rotary models: LLaMA, Qwen2, Gemma)."""
    n = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Embedding) and ("position" in name or name.endswith("wpe")):
            return min(n or m.num_embeddings, m.num_embeddings)
    return None


@contextlib.contextmanager
def method_applied(name, model, compile_backend):
    """`model` (fresh, train mode) under method `name` for as long as the block runs; yields
    the callable that trains (the compiled module for the compile methods). tempo-auto: the model
    as it is (tempo.auto decides under each budget)."""
    if name == "tempo-auto":
        model.set_attn_implementation("sdpa")
        yield model
        return
    with methods.applied(name, model, compile_backend=compile_backend) as done:
        yield done.run


def _optimizer(model):
    """AdamW, fused where this torch has it for these parameters; (optimizer, its name)."""
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return opt, "AdamW (fused)"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True), "AdamW (foreach)"


def budgets_of(text, device):
    """'8GiB,16GiB,all' -> [(label, bytes)] in ascending order; 'all' is the whole CUDA device."""
    out = []
    for part in [s for s in text.split(",") if s]:
        if part == "all":
            if device.type != "cuda":
                raise ValueError(
                    "tempo.frontier: the budget 'all' (the whole device) is for CUDA; on %s give sizes" % device.type
                )
            out.append(("all", torch.cuda.get_device_properties(device).total_memory))
        else:
            try:
                out.append((part, parse_bytes(part)))
            except argparse.ArgumentTypeError as e:
                raise ValueError("tempo.frontier: %s" % e) from None
    if not out:
        raise ValueError("tempo.frontier: no budget given")
    return sorted(out, key=lambda b: b[1])
