"""tempo.plan(model_or_config, *, batch, seq, ...): a training step predicted without the device,
per method: its memory peak (what `torch.cuda.max_memory_allocated()` reports on a GPU, what
tempo.memory counts on the CPU), where it falls and what it is made of, whether it runs within
the device's memory (and its host memory, for the methods that offload), the step's matmul FLOPs
and predicted time, and the longest sequence and largest batch that fit.

    import tempo
    p = tempo.plan("Llama-3.1-8B", batch=1, seq=8192, device="H100-80GB", precision="bf16")
    p["tempo"].peak, p["tempo"].fits, p["tempo"].where, p["tempo"].time, p["tempo"].max_seq
    p.best                         # the fastest method that fits: tempo.optimize(model, method=p.best)
    print(p)                       # the table; p.to_json(), p.plot("plan.svg")

    python -m tempo.plan Llama-3.1-8B --seq 8192 --device H100-80GB [--json] [--plot FILE.svg]

How: the model is built from its config on fake tensors, two training steps run on them (the
second is planned), and tempo's planner count records every storage allocated and freed
(engine.py, trace.py); for a GPU the record is replayed through a model of CUDA's caching
allocator (tempo::memory_plan_replay) under the budget. Each method is applied by
tempo.methods.apply, as everywhere else; tempo's own ops allocate on fake tensors exactly what
they allocate on the device. docs/plan.md says what is and is not modelled, and how the plan
held against measurement.
"""

import sys
import types

from .. import methods as _methods
from . import models, timing
from .devices import CUDA_CONTEXT, DEVICES, FIGURES  # noqa: F401
from .job import _Job
from .models import PRESETS, PlanError
from .result import MethodPlan, Plan
from .search import _Search

# What a plan makes by default: the peers' recipes people run beside tempo's methods, each
# keeping different tensors (tempo.methods.parse spells any other combination).
DEFAULT_METHODS = (
    "sdpa",
    "trl",
    "trl-offload",
    "hf-offload",
    "tempo",
    "tempo+recompute-gate_up",
    "tempo+ckpt",
    "tempo+ckpt-offload",
)
# Spellings the command line's help lists (any spelling tempo.methods.parse takes is planned).
METHODS = DEFAULT_METHODS + (
    "sdpa+trl-head",
    "eager",
    "sdpa+ckpt",
    "sdpa+torch-lce",
    "tempo-sdpa",
    "tempo+recompute-up",
    "tempo+offload",
    "tempo+ckpt+offload",
)
PRECISIONS = ("bf16", "bf16-autocast", "fp32")
OPTIMIZERS = ("adamw", "adamw-foreach", "adamw8bit", "sgd")
ALLOCATORS = ("expandable", "default")


def plan(
    model_or_config,
    *,
    batch=1,
    seq=2048,
    methods=None,
    device="H100-80GB",
    precision="bf16",
    optimizer="adamw",
    lora=None,
    gpus=1,
    budget=None,
    host=None,
    allocator="expandable",
    seq_step=256,
    workers=None,
    search=False,
    progress=None,
):
    """Plans a training step of `model_or_config` (a preset name: tempo.plan.PRESETS; a
    transformers config or its folder; a model) at `batch` x `seq` tokens per method (default
    DEFAULT_METHODS; any spelling tempo.methods.parse takes, a peer's recipe included) on `device`
    (a name in tempo.plan.DEVICES, a byte count for a GPU of that size, or "cpu"). precision:
    "bf16" (bf16 weights, float32 optimizer state), "bf16-autocast" (float32 weights, bf16
    autocast) or "fp32". optimizer: "adamw" (torch's fused AdamW, HF Trainer's default),
    "adamw-foreach" (torch's AdamW as torch.optim.AdamW(params) runs it on a GPU: for-each, with
    its temporaries), "adamw8bit" (2 bytes a parameter) or "sgd". lora: None, a rank (16-bit
    frozen base), or {"r": rank, "bits": 16 or 4}: adapters on every linear layer of the blocks,
    the rest frozen. gpus: FSDP2 full sharding over that many GPUs. budget: the bytes to fit in
    (default: the device's memory less CUDA_CONTEXT; on the CPU none unless given). host: the host
    memory a method may fill (bytes; default: the device's, DEVICES' FIGURES; on the CPU none).
    allocator: "expandable" (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, what the plan
    recommends: only partial pages are stranded, so it fits longer contexts) or "default"
    (PyTorch's default caching allocator). Under either, a length near the budget may fail where a
    longer one fits; max_seq is such that every multiple of seq_step up to it fits.
    seq_step: the granularity of max_seq. workers: processes to plan in (default: one a core for
    three methods or more). search: also search each method's max_seq and max_batch now, in those
    processes (else on first read). progress: called with a line as each method is done.
    Returns a Plan."""
    kind, _ = models.device_of(device)
    if precision not in PRECISIONS:
        raise PlanError("tempo.plan: unknown precision %r; known: %s" % (precision, ", ".join(PRECISIONS)))
    if optimizer not in OPTIMIZERS:
        raise PlanError("tempo.plan: unknown optimizer %r; known: %s" % (optimizer, ", ".join(OPTIMIZERS)))
    if allocator not in ALLOCATORS:
        raise PlanError("tempo.plan: unknown allocator %r; known: %s" % (allocator, ", ".join(ALLOCATORS)))
    for name, value in (("batch", batch), ("seq", seq), ("gpus", gpus), ("seq_step", seq_step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError("tempo.plan: %s must be a positive integer, got %r" % (name, value))
    if gpus > 1 and kind != "cuda":
        raise PlanError("tempo.plan: FSDP (gpus > 1) is for GPUs, not %r" % device)
    lora = _lora_of(lora)
    config, name = models.config_of(model_or_config)
    cls, causal = models.model_class(config)
    positions = models.positions_of(config)
    if positions and seq > positions:
        raise PlanError(
            "tempo.plan: seq %d is beyond %s's %d positions (max_position_embeddings)" % (seq, name, positions)
        )
    chosen = _chosen(methods)
    setup = dict(
        model=name,
        batch=batch,
        seq=seq,
        precision=precision,
        optimizer=optimizer,
        lora=lora,
        gpus=gpus,
        seq_step=seq_step,
        positions=positions,
        allocator=allocator,
    )
    models.device_setup(setup, device, budget, host)
    job = _Job(config, cls, causal, setup)
    workers = _workers(workers, len(chosen))
    if workers == 1:
        rows = {}
        for method in chosen:
            rows[method] = _planned(job, method, search)
            _say(progress, rows[method], len(rows), len(chosen))
    else:
        from ._worker import Pool

        rows = Pool(workers, config, cls.__name__, causal, setup).run(chosen, job, search, progress)
    for row in rows.values():
        if row.error is None:
            row._search = _Search(job, row.name).find
    return Plan(setup, {m: rows[m] for m in chosen}, job)


def _chosen(given):
    """The methods' spellings, each checked by tempo.methods.parse."""
    given = given if given is not None else DEFAULT_METHODS
    chosen = list([given] if isinstance(given, (str, _methods.Method)) else given)
    for i, m in enumerate(chosen):
        try:
            _methods.parse(m)
        except ValueError as e:
            raise PlanError(str(e).replace("tempo.methods:", "tempo.plan:")) from None
        chosen[i] = m.name if isinstance(m, _methods.Method) else m
    return chosen


def _planned(job, method, search):
    """One method's row, its time and, with search, its longest sequence and largest batch."""
    row = job.plan_method(method)
    if row.error is None:
        timing.predict(job, row)
        if search:
            finder = _Search(job, method).find
            row._found = {axis: finder(axis) for axis in ("seq", "batch")}
    return row


def _say(progress, row, done, total):
    if progress is None:
        return
    if row.error is not None:
        what = "does not apply"
    else:
        found = row._found
        what = "peak %.2f GiB" % (row.peak / 2**30) + (
            ", longest sequence %s" % found["seq"] if found.get("seq") is not None else ""
        )
    progress("planned %d/%d: %s (%s)" % (done, total, row.name, what))


def _workers(workers, methods):
    """Processes to plan the methods in: each plan is one core's work (PyTorch's fake tensors are
    Python), so up to one a core; one for fewer than three methods (a process costs seconds to
    start)."""
    if workers is not None:
        return max(1, int(workers))
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, methods) if methods >= 3 else 1


def _lora_of(lora):
    if lora is None:
        return None
    if isinstance(lora, bool):
        raise PlanError("tempo.plan: lora is a rank or {'r': rank, 'bits': 16 or 4}, got %r" % (lora,))
    if isinstance(lora, int):
        lora = {"r": lora}
    if not isinstance(lora, dict) or not isinstance(lora.get("r"), int) or lora["r"] < 1:
        raise PlanError("tempo.plan: lora is a rank or {'r': rank, 'bits': 16 or 4}, got %r" % (lora,))
    out = {"r": lora["r"], "bits": lora.get("bits", 16)}
    if out["bits"] not in (16, 4):
        raise PlanError("tempo.plan: LoRA's base is in 16 or 4 bits, got %r" % (out["bits"],))
    return out


class _CallableModule(types.ModuleType):
    """tempo.plan is this module and its function at once: tempo.plan(...) plans, tempo.plan.Plan
    and the rest are here, and python -m tempo.plan runs __main__."""

    def __call__(self, *args, **kwargs):
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = [
    "plan",
    "Plan",
    "MethodPlan",
    "PlanError",
    "PRESETS",
    "DEVICES",
    "METHODS",
    "DEFAULT_METHODS",
    "PRECISIONS",
    "OPTIMIZERS",
    "ALLOCATORS",
]
