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
(allocator.py). Each method is applied as the frontier applies it (methods.py); tempo's own ops
allocate on fake tensors exactly what they allocate on the device. docs/plan.md says what is
and is not modelled, and how the plan held against measurement.
"""

import contextlib
import copy
import json
import math
import sys
import types

import torch

from ..apps.runner import Unavailable
from . import allocator, engine, methods as methods_module, models
from .methods import DEFAULT_METHODS, METHODS, NOT_TRACED
from .models import DEVICES, PRESETS, PlanError

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
    DEFAULT_METHODS; METHODS lists all) on `device` (a name in tempo.plan.DEVICES, a byte count
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
    chosen = list(DEFAULT_METHODS if methods is None else ([methods] if isinstance(methods, str) else methods))
    unknown = [m for m in chosen if m not in METHODS and not any(k in m for k in NOT_TRACED)]
    if unknown:
        raise PlanError("tempo.plan: unknown method(s) %s; known: %s" % (unknown, ", ".join(METHODS)))
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


class _Job:
    """The planning of one model and setup, method by method."""

    def __init__(self, config, cls, causal, setup):
        self.config, self.cls, self.causal, self.setup = config, cls, causal, setup
        self.verdicts = None
        self.primed = set()  # (method, batch, seq) whose shapes FakeTensorMode's cache holds
        self.peaks = {}  # (method, batch, seq) -> the planned peak (a GPU's: its reserved bytes)

    def peak_of(self, method, batch, seq):
        """The planned step's peak of `method` at batch x seq (a GPU's: the allocated bytes; what
        fits is decided on the reserved ones: reserve_of), cached."""
        key = (method, batch, seq)
        if key not in self.peaks:
            trace, _, _ = self.trace(method, batch, seq)
            peak, _, reserved, _, _, _ = self.figures(trace)
            self.peaks[key] = (peak, reserved if reserved is not None else peak)
        return self.peaks[key][0]

    def reserve_of(self, method, batch, seq):
        self.peak_of(method, batch, seq)
        return self.peaks[(method, batch, seq)][1]

    def extrapolated(self, method, batch, seq):
        """The peak (a GPU's reserved bytes) of the whole model from models of 3 and 4 blocks: each
        phase's peak, per place of its block (first, middle, last), extrapolated along a line in
        the number of blocks; the largest. The whole model's plan where it has 4 blocks or fewer."""
        blocks = _blocks(self.config)
        if blocks is None or blocks <= 4:
            return self.reserve_of(method, batch, seq)
        key = (method, batch, seq, "extrapolated")
        if key not in self.peaks:
            phases = [self._phases(method, batch, seq, n) for n in (3, 4)]
            out = 0
            for name in set(phases[0]) & set(phases[1]):
                a, b = phases[0][name], phases[1][name]
                out = max(out, b + (blocks - 4) * (b - a))
            self.peaks[key] = (out, out)
        return self.peaks[key][0]

    def _phases(self, method, batch, seq, layers):
        """The largest bytes held (a GPU's reserved bytes) in each phase of the planned step, the
        blocks' phases named by the block's place: first, middle or last."""
        trace, _, _ = self.trace(method, batch, seq, layers=layers)
        peak, index, reserved, events, current, mark = self.figures(trace)
        if reserved is not None:  # the reserved bytes only grow: the step's is its end's
            return {"step": reserved}
        out = {"before": int(current[mark - 1]) if mark > 0 else 0}
        tags = trace.tags
        for k in range(mark, len(events)):
            tag = tags[int(events[k, 2])]
            name = tag.split(": ", 1)[-1]
            if ", layer " in name:
                head, rest = name.split(", layer ", 1)
                i = int(rest.split()[0])
                place = "first" if i == 0 else ("last" if i == layers - 1 else "middle")
                name = "%s, %s block%s" % (head, place, rest[len(str(i)) :])
            out[name] = max(out.get(name, 0), int(current[k]))
        return out

    # ---- one traced step ------------------------------------------------------------------

    def _verdicts(self, method):
        """tempo.optimize's probes, run once on a small CPU model of the family (methods.py's
        tempo methods then patch the fake model by their verdicts)."""
        from ..hf import probes

        if self.verdicts is None:
            self.verdicts = {}
        if method.startswith("tempo") and "tempo" not in self.verdicts:
            with probes.remembered() as verdicts:
                small = self.cls(models.small_config(self.config))
                with contextlib.ExitStack() as stack:
                    methods_module.apply(method, small, self.config, self.causal, "cpu", stack)
            self.verdicts["tempo"] = verdicts
        return self.verdicts.get("tempo", {})

    def trace(self, method, batch, seq, layers=None):
        """(Trace, notes, host bytes) of `method` at batch x seq (layers: a model of that many
        blocks instead of the config's), traced warm: FakeTensorMode caches each operator's
        output by its inputs' shapes, and the first call of a shape (a cache miss) allocates
        more than the operator does (the output made twice to check the cache entry, a kernel's
        scratch the cached path skips), so a step traced cold would hold phantom blocks that move
        the caching allocator's segments and splits. Each (method, batch, seq) is first run once
        on a model of two blocks (every shape the whole model's step has), unrecorded."""
        key = (method, batch, seq)
        if key not in self.primed:
            blocks = _blocks(self.config)
            self._traced(method, batch, seq, layers=min(2, blocks) if blocks else None)
            self.primed.add(key)
        return self._traced(method, batch, seq, layers)

    def _traced(self, method, batch, seq, layers=None):
        from torch._subclasses.fake_tensor import FakeTensorMode

        from ..hf import probes

        config = self.config
        if layers is not None:
            config = copy.deepcopy(config)
            for attr in ("num_hidden_layers", "n_layer"):
                if getattr(config, attr, None):
                    setattr(config, attr, layers)
            if getattr(config, "layer_types", None):
                config.layer_types = [config.layer_types[i % len(config.layer_types)] for i in range(layers)]
        s = self.setup
        weights = torch.float32 if s["precision"] in ("fp32", "bf16-autocast") else torch.bfloat16
        if s["lora"]:
            weights = torch.float32 if s["precision"] == "fp32" else torch.bfloat16
        verdicts = self._verdicts(method)
        autocast = (
            (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
            if s["precision"] == "bf16-autocast"
            else contextlib.nullcontext
        )
        with engine.recording(s["kind"]) as holder, probes.remembered() as known:
            known.update(verdicts)
            with (
                FakeTensorMode(),
                engine.custom_ops_run_through(),
                engine.not_tracing(),
                engine.grouped_mm_any_dtype(),
                contextlib.ExitStack() as stack,
            ):
                engine.tag("build")
                model = self.cls._from_config(config, dtype=weights)
                model.train()
                run, notes, offload = methods_module.apply(method, model, config, self.causal, s["kind"], stack)
                if s["lora"]:  # adapters put into the model's own modules: `run` runs them too
                    model = _with_lora(model, s["lora"], weights)
                engine.tag("inputs")
                ids = torch.zeros(batch, seq, dtype=torch.long)
                data = {"input_ids": ids, "labels": torch.zeros(batch, seq, dtype=torch.long)}
                optimizer = engine.PlannedOptimizer(model.parameters(), s["optimizer"])
                engine.train(model, run, data, optimizer, autocast)
                host = offload.host if offload is not None else 0
        return holder[0], notes, host

    # ---- from a trace to its figures --------------------------------------------------------

    def figures(self, trace):
        """(peak, index of the peak in the cleaned events, reserved, the events, the current
        bytes after each event): the planned step's peak as the device reports it."""
        events = allocator.cleaned(trace)
        mark = allocator.step_start(trace, events, 2)
        build_end = allocator.first(trace, events, lambda t: t != "build")
        if self.setup["gpus"] > 1:
            events = _sharded(trace, events, self.setup["gpus"], build_end, mark)
            mark = allocator.step_start(trace, events, 2)
        if self.setup["kind"] == "cuda":
            peak, reserved, after = allocator.replay_cuda(events, mark, build_end)
            current = torch.tensor([0] * build_end + after, dtype=torch.long)
            # the build as the device sees it: its survivors (replay_cuda's view)
            current[:build_end] = current[build_end] if build_end < len(current) else 0
        else:
            current = events[:, 1].cumsum(0)
            reserved = None
        before = int(current[mark - 1]) if mark > 0 else 0
        after_mark = current[mark:]
        if len(after_mark) and int(after_mark.max()) >= before:
            index = int(after_mark.argmax()) + mark
            peak = int(current[index])
        else:
            index, peak = mark - 1, before
        return peak, index, reserved, events, current, mark

    def plan_method(self, method):
        s = self.setup
        row = MethodPlan(method)
        try:
            trace, notes, host = self.trace(method, s["batch"], s["seq"])
        except Unavailable as e:
            row.error = str(e)
            return row
        row.notes = notes
        row.host = host
        peak, index, reserved, events, current, mark = self.figures(trace)
        row.peak, row.reserved = peak, reserved
        row.where = trace.tags[int(events[index, 2])] + " / " + trace.ops[int(events[index, 3])] if index >= 0 else "-"
        row.breakdown, row.activations, row.activations_per_layer, row.head, row.largest_transient = _breakdown(
            trace, events, index, mark
        )
        row.flops = trace.flops_of("step 2")
        self.peaks[(method, s["batch"], s["seq"])] = (peak, reserved if reserved is not None else peak)
        if s["budget"] is not None:
            row.fits = (reserved if reserved is not None else peak) <= s["budget"]
        row._search = _Search(self, method).find
        return row


def _blocks(config):
    for attr in ("num_hidden_layers", "n_layer"):
        if getattr(config, attr, None):
            return getattr(config, attr)
    return None


def _with_lora(model, lora, weights):
    """PEFT's LoRA (rank r, alpha 2r, every linear layer of the blocks) on the model; a 4-bit base
    as bitsandbytes' NF4 with nested statistics keeps it (half a byte an element, one byte of
    absolute maximum a block of 64 and a float32 per 256 of those), dequantised to 16 bits for
    each matmul and not kept."""
    import peft
    import peft.tuners.tuners_utils as peft_tuners

    config = peft.LoraConfig(r=lora["r"], lora_alpha=2 * lora["r"], target_modules="all-linear", lora_dropout=0.0)
    # the adapters are made float32 on the plan's device, where peft then keeps them for a 16-bit base
    # (autocast_adapter_dtype); its moves to the base layer's device are the one step that fake
    # tensors refuse (module._apply swaps them), and move nothing here
    move, to = peft_tuners.BaseTunerLayer._move_adapter_to_device_of_base_layer, torch.nn.Module.to
    peft_tuners.BaseTunerLayer._move_adapter_to_device_of_base_layer = lambda self, *a, **k: None
    torch.nn.Module.to = lambda self, *a, **k: self
    try:
        model = peft.get_peft_model(model, config)
    finally:
        peft_tuners.BaseTunerLayer._move_adapter_to_device_of_base_layer, torch.nn.Module.to = move, to
    if lora["bits"] == 4:
        for module in model.modules():
            base = getattr(module, "base_layer", None)
            if isinstance(base, torch.nn.Linear):
                _to_4bit(base, weights)
    return model


class _Dequantized(torch.autograd.Function):
    """A frozen 4-bit linear layer's matmul: the weight dequantised for it (a temporary), and
    again in the backward; nothing of it kept."""

    @staticmethod
    def forward(ctx, x, packed, shape, dtype):
        ctx.shape, ctx.dtype = shape, dtype
        w = torch.empty(shape, dtype=dtype)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        w = torch.empty(ctx.shape, dtype=ctx.dtype)
        return grad @ w, None, None, None


def _to_4bit(linear, dtype):
    n = linear.weight.numel()
    shape = tuple(linear.weight.shape)
    linear.weight = torch.nn.Parameter(
        torch.empty(n // 2 + n // 64 + 4 * (-(-n // (64 * 256))), dtype=torch.uint8), requires_grad=False
    )
    linear.forward = types.MethodType(
        lambda self, x: _Dequantized.apply(x, self.weight, shape, dtype) + (self.bias if self.bias is not None else 0),
        linear,
    )


def _sharded(trace, events, gpus, build_end, mark):
    """The events of FSDP2's full sharding over `gpus` devices, from one device's: the weights,
    their gradients and the optimizer's state a gpus-th each (rounded up), and each block's
    parameters gathered whole for its forward and backward, with the next block's prefetched
    (two blocks' parameters at once), and in the backward its gradients whole until they are
    reduce-scattered."""
    events = events.clone()
    persistent = set(int(i) for i in events[:build_end][events[:build_end, 1] > 0, 0].tolist())
    persistent -= set(int(i) for i in events[:build_end][events[:build_end, 1] < 0, 0].tolist())
    opt_tags = [i for i, t in enumerate(trace.tags) if t.endswith(": optimizer")]
    end = len(events)
    alive_end = set()
    live = {}
    for k in range(end):
        ident, n = int(events[k, 0]), int(events[k, 1])
        if n > 0:
            live[ident] = k
        else:
            live.pop(ident, None)
    alive_end = set(live)
    back_tags = [i for i, t in enumerate(trace.tags) if "backward" in t]
    for k in range(end):
        ident, n, tag = int(events[k, 0]), int(events[k, 1]), int(events[k, 2])
        shard = ident in persistent or tag in opt_tags or (ident in alive_end and tag in back_tags and k >= mark)
        if shard:
            events[k, 1] = int(math.copysign(-(-abs(n) // gpus), n))
    layer_bytes = _layer_bytes(trace, events, build_end, gpus)
    out, extra = [], 10**15
    current_tag = None
    for k in range(end):
        tag = trace.tags[int(events[k, 2])]
        if tag != current_tag and (", layer " in tag):
            if current_tag is not None and ", layer " in current_tag:
                out.append([extra, -2 * layer_bytes, events[k, 2], 0])
                extra += 1
            gathered = 2 * layer_bytes + (layer_bytes if "backward" in tag else 0)
            out.append([extra, gathered, events[k, 2], 0])
            layer_bytes_now = gathered
        elif tag != current_tag and current_tag is not None and ", layer " in current_tag:
            out.append([extra, -layer_bytes_now, events[k, 2], 0])
            extra += 1
        current_tag = tag
        out.append(events[k].tolist())
    return torch.tensor(out, dtype=torch.long)


def _layer_bytes(trace, events, build_end, gpus):
    """One block's parameter bytes, unsharded (the largest build-time allocation group is not
    separable here: the model's parameters over its blocks)."""
    total = int(events[:build_end, 1].clamp_min(0).sum())
    layers = max(1, sum(1 for t in trace.tags if t.startswith("step 2: forward, layer ")))
    return total // layers


def _breakdown(trace, events, index, mark):
    """What is alive at the peak (event `index`), by what made it; the activations held after the
    forward, per layer; the head's; the largest temporary of the step."""
    tags = trace.tags
    step2 = events[mark:]
    forward_end = mark + next((k for k, e in enumerate(step2.tolist()) if "backward" in tags[e[2]]), len(step2))
    born = {}
    live_at_peak, live_at_fwd_end = {}, {}
    freed_in_step = {}
    for k, (ident, n, tag, _) in enumerate(events.tolist()):
        if n > 0:
            born[ident] = (n, tag, k)
        else:
            if ident in born and born[ident][2] >= mark:
                freed_in_step[ident] = born[ident][0]
            born.pop(ident, None)
        if k == index:
            live_at_peak = dict(born)
        if k == forward_end - 1:
            live_at_fwd_end = dict(born)
    alive_at_end = set(born)

    def kind(ident, n, tag, k):
        t = tags[tag]
        if not t.startswith("step"):
            return "weights" if t == "build" else "other"
        if t.startswith("step 1") and t.endswith("optimizer"):
            return "optimizer state"
        if k >= mark and ("forward" in t or "head and loss" in t) and "recomputed" not in t:
            return "activations"
        if k >= mark and ident in alive_at_end:
            return "gradients"
        if k >= mark:
            return "transients"
        return "other"

    breakdown = {}
    for ident, (n, tag, k) in live_at_peak.items():
        c = kind(ident, n, tag, k)
        breakdown[c] = breakdown.get(c, 0) + n
    per_layer, head, activations = {}, 0, 0
    for ident, (n, tag, k) in live_at_fwd_end.items():
        if k < mark:
            continue
        t = tags[tag]
        activations += n
        if ", layer " in t:
            layer = int(t.split(", layer ")[1].split()[0])
            per_layer[layer] = per_layer.get(layer, 0) + n
        elif "head and loss" in t:
            head += n
    largest = max(freed_in_step.values(), default=0)
    return breakdown, activations, [per_layer[i] for i in sorted(per_layer)], head, largest


class _Search:
    """The longest sequence (batch 1) and the largest batch (at seq) whose planned step fits the
    budget. The search plans models of 3 and 4 blocks (blocks are identical: each phase's peak
    moves by the same bytes from one block more to the next) and extrapolates each phase to the
    model's blocks; its answer is then planned whole, and stepped down until the whole plan fits
    (up while the next one fits): a length that fits beside one a step longer that does not (a
    batch beside the next), by the whole model's plans."""

    def __init__(self, job, method):
        self.job, self.method = job, method
        self.found = {}

    def find(self, axis):
        if axis in self.found:
            return self.found[axis]
        s = self.job.setup
        budget = s["budget"]
        if budget is None:
            return None
        step = s["seq_step"] if axis == "seq" else 1
        cap = (s["positions"] or 1 << 20) // step if axis == "seq" else 1 << 16
        if axis == "seq":
            whole = lambda n: self.job.reserve_of(self.method, 1, n * step)  # noqa: E731
            quick = lambda n: self.job.extrapolated(self.method, 1, n * step)  # noqa: E731
        else:
            whole = lambda n: self.job.reserve_of(self.method, n, s["seq"])  # noqa: E731
            quick = lambda n: self.job.extrapolated(self.method, n, s["seq"])  # noqa: E731
        n = max(1, _largest(quick, budget, cap, quadratic=axis == "seq"))
        self.found[axis] = _bracketed(whole, budget, n, cap) * step or None
        return self.found[axis]


def _bracketed(f, budget, guess, cap):
    """The largest n in [1, cap] with f(n) <= budget (f increasing), 0 if none, from a guess:
    steps out from it, doubling, until a fitting and a failing n bracket the answer, then
    bisects."""
    if f(guess) <= budget:
        lo, hi, stride = guess, None, 1
        while hi is None and lo < cap:
            probe = min(cap, lo + stride)
            if f(probe) <= budget:
                lo = probe
            else:
                hi = probe
            stride *= 2
        if hi is None:
            return lo
    else:
        lo, hi, stride = 0, guess, 1
        while lo == 0:
            probe = hi - stride
            if probe < 1:
                if f(1) > budget:
                    return 0
                lo = 1
            elif f(probe) <= budget:
                lo = probe
            else:
                hi = probe
            stride *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if f(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def _largest(f, budget, cap, quadratic):
    """The largest n in [1, cap] with f(n) <= budget (f increasing), 0 if none: candidates from a
    fit of f's values (a line, or a quadratic), then bisection between a fitting and a failing n."""
    seen = {}

    def value(n):
        if n not in seen:
            seen[n] = f(n)
        return seen[n]

    if value(1) > budget:
        return 0
    lo, hi = 1, None
    probe = min(cap, 4)
    while hi is None and lo < cap:
        if value(probe) <= budget:
            lo = probe
            xs = sorted(seen)
            guess = _extrapolate(xs, [seen[x] for x in xs], budget, quadratic)
            probe = min(cap, max(lo + 1, guess if guess else 2 * lo))
            if lo == cap:
                break
        else:
            hi = probe
    if hi is None:
        return lo
    while hi - lo > 1:
        xs = sorted(seen)
        guess = _extrapolate(xs, [seen[x] for x in xs], budget, quadratic)
        mid = guess if guess and lo < guess < hi else (lo + hi) // 2
        if mid in (lo, hi):
            mid = (lo + hi) // 2
        if value(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def _extrapolate(xs, ys, budget, quadratic):
    """The n where a fit through the last points reaches the budget (floor), or None."""
    if len(xs) < 2:
        return None
    if quadratic and len(xs) >= 3:
        (x1, x2, x3), (y1, y2, y3) = xs[-3:], ys[-3:]
        d = (x1 - x2) * (x1 - x3) * (x2 - x3)
        a = (x3 * (y2 - y1) + x2 * (y1 - y3) + x1 * (y3 - y2)) / d
        b = (x3 * x3 * (y1 - y2) + x2 * x2 * (y3 - y1) + x1 * x1 * (y2 - y3)) / d
        c = y1 - a * x1 * x1 - b * x1
        if abs(a) > 1e-12:
            disc = b * b - 4 * a * (c - budget)
            if disc >= 0:
                root = (-b + math.sqrt(disc)) / (2 * a)
                if root > 0:
                    return int(root)
    (x1, x2), (y1, y2) = xs[-2:], ys[-2:]
    if y2 <= y1:
        return None
    return int(x2 + (budget - y2) * (x2 - x1) / (y2 - y1))


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
