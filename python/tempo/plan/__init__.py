"""tempo.plan(model_or_config, *, batch, seq, ...): the memory of a training step, predicted
without the device, per method: the peak (what `torch.cuda.max_memory_allocated()` reports on a
GPU, what tempo.memory counts on the CPU), where it falls, what it is made of, the step's matmul
FLOPs, and the longest sequence and largest batch that fit.

    import tempo
    p = tempo.plan("Llama-3.1-8B", batch=1, seq=8192, device="H100-80GB", precision="bf16")
    p["tempo"].peak, p["tempo"].fits, p["tempo"].where, p["tempo"].max_seq
    print(p)                       # the table; p.to_json(), p.plot("plan.svg")

    python -m tempo.plan Llama-3.1-8B --seq 8192 --device H100-80GB [--json] [--plot FILE.svg]

How: the model is built from its config on fake tensors, two training steps run on them (the
second is planned), and tempo's planner count records every storage allocated and freed
(engine.py); for a GPU the record is replayed through a model of CUDA's caching allocator
(allocator.py). Each method is applied by tempo.methods.apply, as everywhere else; tempo's own ops
allocate on fake tensors exactly what they allocate on the device. docs/plan.md says what is
and is not modelled, and how the plan held against measurement.
"""

import copy
import json
import sys
import types

from .. import methods as _methods
from . import models
from .job import _Job
from .models import DEVICES, PRESETS, PlanError
from .search import _Search

# What a plan makes by default: the peers' recipes people run beside tempo's methods, each
# keeping different tensors (tempo.methods.parse spells any other combination).
DEFAULT_METHODS = (
    "sdpa",
    "sdpa+trl-head",
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
    "eager",
    "sdpa+ckpt",
    "sdpa+torch-lce",
    "tempo-sdpa",
    "tempo+recompute-up",
    "tempo+offload",
    "tempo+ckpt+offload",
)

PRECISIONS = ("bf16", "bf16-autocast", "fp32")
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
# Not counted by max_memory_allocated, yet on the device: the CUDA context and the libraries'
# handles (about 0.5 GiB with cuBLAS on a Hopper GPU, more with NCCL): a plan fits a GPU when
# its reserved memory and this fit.
CUDA_CONTEXT = 768 << 20


class MethodPlan:
    """One method's plan. Attributes: peak (bytes), fits, where (phase, layer and operator of the
    peak), breakdown (bytes at the peak: weights, gradients, optimizer state, activations,
    transients, other), activations (held after the forward, all layers) and
    activations_per_layer, head (what the LM head and loss hold after the forward),
    largest_transient, flops (the step's matmul FLOPs: forward and backward, recomputation
    included), reserved (the caching allocator's segments at the peak, GPU), host (bytes offloaded
    to host memory), max_seq (the longest sequence at batch 1 that fits) and max_batch (the largest
    batch at seq that fits), notes, error (why the method could not be planned, else None)."""

    def __init__(self, name, **fields):
        self.name = name
        self.peak = self.reserved = None
        self.fits = None
        self.where = None
        self.breakdown = {}
        self.activations = self.head = self.largest_transient = None
        self.activations_per_layer = []
        self.flops = None
        self.host = 0
        self.notes = []
        self.error = None
        self._search = None
        self.__dict__.update(fields)

    @property
    def max_seq(self):
        """The longest sequence at batch 1 that fits (a multiple of the plan's seq_step), planned
        on first read."""
        return self._search("seq") if self._search and self.error is None else None

    @property
    def max_batch(self):
        """The largest batch at the plan's seq that fits, planned on first read."""
        return self._search("batch") if self._search and self.error is None else None

    def as_dict(self):
        out = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        out["max_seq"], out["max_batch"] = self.max_seq, self.max_batch
        return out

    def __repr__(self):
        if self.error:
            return "<plan %s: %s>" % (self.name, self.error)
        return "<plan %s: peak %s, fits %s>" % (self.name, _gib(self.peak), self.fits)


class Plan:
    """The plans of a model's training step, one per method: `plan[method]` (a MethodPlan),
    iterating gives the methods; str() is the table, to_json() and plot(path) the rest."""

    def __init__(self, setup, rows, job=None):
        self.setup = setup
        self.rows = rows
        self._job = job
        self.__dict__.update(setup)

    def __getitem__(self, method):
        if method not in self.rows:
            raise KeyError("no plan of method %r here; planned: %s" % (method, ", ".join(self.rows)))
        return self.rows[method]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)

    def __str__(self):
        from .report import table

        return table(self)

    __repr__ = __str__

    def to_json(self):
        return json.dumps({"setup": self.setup, "methods": {m: r.as_dict() for m, r in self.rows.items()}}, indent=1)

    def plot(self, path, seqs=None):
        from .report import plot

        return plot(self, path, seqs)

    def on(self, device, budget=None):
        """The same plan on another GPU (a name in DEVICES or a byte count; budget as plan()'s):
        the peaks stand (a step's tensors and the caching allocator's rounding do not depend on
        the GPU's size), what fits and the searches are the new budget's. The planned steps are
        shared, so searching on several GPUs plans each (batch, seq) once."""
        kind, capacity = models.device_of(device)
        if kind != self.kind:
            raise PlanError("tempo.plan: Plan.on moves a plan between GPUs; this one is for %r" % self.device)
        setup = dict(self.setup, device=models.device_name(device), capacity=capacity)
        setup["budget"] = capacity - CUDA_CONTEXT if budget is None else budget
        job = _Job(self._job.config, self._job.cls, self._job.causal, setup)
        job.peaks, job.verdicts, job.primed = self._job.peaks, self._job.verdicts, self._job.primed
        rows = {}
        for name, row in self.rows.items():
            moved = copy.copy(row)
            if row.error is None:
                held = row.reserved if row.reserved is not None else row.peak
                moved.fits = held <= setup["budget"]
                moved._search = _Search(job, name).find
            rows[name] = moved
        return Plan(setup, rows, job)


def _gib(n):
    return "-" if n is None else "%.2f GiB" % (n / 2**30)


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
    seq_step=256,
    workers=None,
):
    """Plans a training step of `model_or_config` (a preset name: tempo.plan.PRESETS; a
    transformers config or its folder; a model) at `batch` x `seq` tokens per method (default
    DEFAULT_METHODS; any spelling tempo.methods.parse takes) on `device` (a name in tempo.plan.DEVICES, a byte count
    for a GPU of that size, or "cpu"). precision: "bf16" (bf16 weights, float32 optimizer
    state), "bf16-autocast" (float32 weights, bf16 autocast) or "fp32". optimizer: "adamw",
    "adamw8bit" (2 bytes a parameter) or "sgd". lora: None, a rank (16-bit frozen base), or
    {"r": rank, "bits": 16 or 4}: adapters on every linear layer of the blocks, the rest frozen.
    gpus: FSDP2 full sharding over that many GPUs. budget: the bytes to fit in (default: the
    device's memory less CUDA_CONTEXT; on the CPU none unless given). seq_step: the granularity of
    max_seq. workers: processes to plan the methods in (default: one a core for three methods or
    more). Returns a Plan."""
    kind, capacity = models.device_of(device)
    if precision not in PRECISIONS:
        raise PlanError("tempo.plan: unknown precision %r; known: %s" % (precision, ", ".join(PRECISIONS)))
    if optimizer not in OPTIMIZERS:
        raise PlanError("tempo.plan: unknown optimizer %r; known: %s" % (optimizer, ", ".join(OPTIMIZERS)))
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
    given = methods if methods is not None else DEFAULT_METHODS
    chosen = list([given] if isinstance(given, (str, _methods.Method)) else given)
    for i, m in enumerate(chosen):
        try:
            _methods.parse(m)
            chosen[i] = m.name if isinstance(m, _methods.Method) else m
        except ValueError as e:
            raise PlanError(str(e).replace("tempo.methods:", "tempo.plan:")) from None
    if budget is None and capacity is not None:
        budget = capacity - CUDA_CONTEXT
    setup = dict(
        model=name,
        batch=batch,
        seq=seq,
        device=models.device_name(device),
        kind=kind,
        capacity=capacity,
        budget=budget,
        precision=precision,
        optimizer=optimizer,
        lora=lora,
        gpus=gpus,
        seq_step=seq_step,
        positions=positions,
    )
    job = _Job(config, cls, causal, setup)
    rows = {}
    workers = _workers(workers, len(chosen))
    groups = [chosen[i::workers] for i in range(workers)]
    others = [_start_worker(config, cls.__name__, causal, setup, g) for g in groups[1:]]
    for method in groups[0]:
        rows[method] = job.plan_method(method)
    for worker in others:
        for row in _finish_worker(worker, job):
            row._search = _Search(job, row.name).find if row.error is None else None
            rows[row.name] = row
    rows = {m: rows[m] for m in chosen}
    return Plan(setup, rows, job)


def _workers(workers, methods):
    """Processes to plan the methods in: each plan is one core's work (PyTorch's fake tensors are
    Python), so up to one a core; one for fewer than three methods (a process costs seconds to
    start)."""
    if workers is not None:
        return max(1, int(workers))
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, methods) if methods >= 3 else 1


def _start_worker(config, cls_name, causal, setup, methods):
    """A process planning `methods` (tempo/plan/_worker.py), started."""
    import os
    import pickle
    import subprocess

    import tempo

    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(tempo.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tempo.plan._worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdin.write(pickle.dumps((config, cls_name, causal, setup, methods)))
    proc.stdin.close()
    return proc


def _finish_worker(proc, job):
    import pickle

    out = proc.stdout.read()
    err = proc.stderr.read()
    if proc.wait() != 0 or not out:
        raise RuntimeError("tempo.plan: a planning process failed:\n%s" % err.decode(errors="replace")[-2000:])
    rows, peaks = pickle.loads(out)
    job.peaks.update(peaks)
    return rows


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
]
