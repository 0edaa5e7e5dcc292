"""The methods tempo.frontier compares (apps/frontier.py's docstring lists them): their names,
how each is applied to a fresh model for as long as it is measured, the optimizer every method
steps, and the memory budgets."""

import argparse
import contextlib
import inspect
import sys

import torch
import torch.nn.functional as F

from .._measure import parse_bytes
from ..hf import optimize
from ..hf.lm_head import set_head_loss
from .frontier_report import is_tempo
from .runner import (
    Unavailable,
    enable_checkpointing,
    liger_function,
)


PEERS = ("eager", "sdpa", "sdpa+ckpt", "sdpa+ckpt+offload", "compile", "compile-mem0.5", "compile-mem0.2")
TORCH_LCE = "+torch-lce"
METHODS = (
    PEERS
    + tuple(p + TORCH_LCE for p in PEERS)
    + (
        "liger",
        "tempo-sdpa",
        "tempo",
        "tempo+compile",
        "tempo+compile-mem0.5",
        "tempo+compile-mem0.2",
        "tempo+ckpt",
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


@contextlib.contextmanager
def _modeling_namespace_restored(model):
    """Liger patches the family's modeling module (its RMSNorm and MLP classes, its RoPE
    function) and may patch classes' forwards: both are put back afterwards, so that the
    methods measured later in this process see transformers' own."""
    module = sys.modules[type(model).__module__]
    names = dict(vars(module))
    forwards = {
        cls: cls.__dict__.get("forward")
        for cls in names.values()
        if isinstance(cls, type) and cls.__module__ == module.__name__
    }
    try:
        yield
    finally:
        for k in set(vars(module)) - set(names):
            delattr(module, k)
        for k, v in names.items():
            if vars(module).get(k) is not v:
                setattr(module, k, v)
        for cls, fwd in forwards.items():
            if fwd is not None and cls.__dict__.get("forward") is not fwd:
                cls.forward = fwd


def _apply_liger(fn, model, with_tempo):
    params = inspect.signature(fn).parameters
    kwargs = {"model": model}
    if with_tempo:  # only what tempo does not patch: RoPE and the gated MLP
        kwargs.update(
            {k: False for k in ("rms_norm", "layer_norm", "cross_entropy", "fused_linear_cross_entropy") if k in params}
        )
    fn(**kwargs)


def compile_budget(method):
    """(whether the method compiles, its activation_memory_budget or None for torch's default)."""
    base = method[: -len(TORCH_LCE)] if method.endswith(TORCH_LCE) else method
    if "compile" not in base:
        return False, None
    return True, float(base.rsplit("-mem", 1)[1]) if "-mem" in base else None


def learned_positions(model):
    """The number of positions a model's learned position embedding holds (BERT, GPT-2), or None
    (rotary models: LLaMA, Qwen2, Gemma)."""
    n = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Embedding) and ("position" in name or name.endswith("wpe")):
            return min(n or m.num_embeddings, m.num_embeddings)
    return None


def torch_chunked_lce(hidden, weight, bias, labels, ignore_index=-100, reduction="mean"):
    """PyTorch's chunked F.linear_cross_entropy in tempo's head-loss signature (hf.lm_head.set_head_loss)."""
    return F.linear_cross_entropy(
        hidden,
        weight,
        labels,
        linear_bias=bias,
        ignore_index=ignore_index,
        reduction=reduction,
        options=torch.nn.LinearCrossEntropyOptions(),
    )


@contextlib.contextmanager
def method_applied(name, model, compile_backend):
    """`model` (fresh, train mode) under method `name` for as long as the block runs; yields
    the callable that trains (the compiled module for the compile methods)."""
    with contextlib.ExitStack() as stack:
        model.set_attn_implementation("eager" if name.startswith("eager") else "sdpa")
        if "liger" in name:
            fn = liger_function(model)  # Unavailable before anything is patched
            stack.enter_context(_modeling_namespace_restored(model))
            _apply_liger(fn, model, with_tempo=is_tempo(name))
        if "+offload" in name and next(model.parameters()).device.type != "cuda":
            raise Unavailable("offloading to host memory is for CUDA (on the CPU it is the same memory)")
        if name.endswith(TORCH_LCE):
            if not hasattr(F, "linear_cross_entropy"):
                raise Unavailable("this torch (%s) has no F.linear_cross_entropy (2.13 and later)" % torch.__version__)
            optimize(model, techniques="lm_head")
            set_head_loss(model, torch_chunked_lce)
        if is_tempo(name) and name != "tempo-auto":  # tempo-auto decides under each budget
            optimize(
                model,
                attention="auto" if name in ("tempo", "tempo+liger") else "sdpa",
                mlp_recompute=name.split("+recompute-", 1)[1] if "+recompute-" in name else "product",
            )
        if "+ckpt" in name and not enable_checkpointing(model):
            raise Unavailable("%s does not support gradient checkpointing" % type(model).__name__)
        compiled, budget = compile_budget(name)
        run = model
        if compiled:
            if budget is not None:
                stack.enter_context(torch._functorch.config.patch(activation_memory_budget=budget))
            stack.callback(torch._dynamo.reset)
            run = torch.compile(model, backend=compile_backend)
        if "+offload" in name:

            def offloaded(**batch):
                with torch.autograd.graph.save_on_cpu(pin_memory=True):
                    return model(**batch)

            run = offloaded
        yield run


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
