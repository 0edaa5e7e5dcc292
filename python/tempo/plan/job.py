"""The planning of one model and setup (tempo.plan's worker): a method's training step traced on
fake tensors (engine.py), its record turned into the figures a device reports (allocator.py for a
GPU), the breakdown at the peak; LoRA, 4-bit bases and FSDP2 sharding as the plan models them."""

import contextlib
import copy
import math
import types

import torch

from .. import methods
from ..methods import Unavailable
from . import allocator, engine, models
from .search import _Search


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
        """tempo.optimize's probes, run once on a small CPU model of the family (the tempo bases
        then patch the fake model by their verdicts): the method's tempo part alone (its host
        memory and heads are the planned device's, not the probe's)."""
        from ..hf import probes

        if self.verdicts is None:
            self.verdicts = {}
        m = methods.parse(method)
        if m.tempo and "tempo" not in self.verdicts:
            with probes.remembered() as verdicts:
                small = self.cls(models.small_config(self.config))
                with contextlib.ExitStack() as stack:
                    methods.apply(m.without_host(), small, stack, planned=engine.FakeDevice("cpu"))
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
                applied = methods.apply(method, model, stack, planned=engine.FakeDevice(s["kind"]))
                run, notes = applied.run, applied.notes
                if s["lora"]:  # adapters put into the model's own modules: `run` runs them too
                    model = _with_lora(model, s["lora"], weights)
                engine.tag("inputs")
                ids = torch.zeros(batch, seq, dtype=torch.long)
                data = {"input_ids": ids, "labels": torch.zeros(batch, seq, dtype=torch.long)}
                optimizer = engine.PlannedOptimizer(model.parameters(), s["optimizer"])
                engine.train(model, run, data, optimizer, autocast)
                host = applied.host.host if applied.host is not None else 0
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
        from . import MethodPlan  # the package's, which imports this module

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
