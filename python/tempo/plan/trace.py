"""One method's training step traced on fake tensors (engine.py) into a Record: the storages it
allocates and frees, cleaned of the fake tensors' artefacts (allocator.cleaned), with where
each happened, the step's matmul FLOPs and the bytes held in host memory; LoRA and 4-bit bases as
the plan models them. Records are cached per (method, batch, seq, blocks)."""

import contextlib
import copy
import dataclasses
import types

import torch

from .. import methods
from . import allocator, engine, models
from .optimizers import PlannedOptimizer


@dataclasses.dataclass
class Record:
    """A traced step: `events` [N, 4] int64 (allocation id, +bytes or -bytes, tag index,
    operator index) as a device would see them; the tag and operator names; where the build
    ends and the planned (second) step starts; that step's matmul FLOPs and the bytes its
    memory-bound operators moved (tempo::memory_traffic_*); the most bytes it held in host memory
    at once and the bytes it moved there; what applying the method noted."""

    events: torch.Tensor
    tags: list
    ops: list
    build_end: int
    mark: int
    flops: float
    traffic: int
    host: int
    moved: int
    notes: list
    per_layer: dict = dataclasses.field(default_factory=dict)  # "flops", "traffic", "moved": layer -> step 2's

    def structure(self):
        """What must be equal for two records to differ only in their sizes: the events' order,
        tags, operators, signs and pairing of allocations with frees."""
        ev = self.events
        _, pairing = torch.unique(ev[:, 0], return_inverse=True)
        tags = [self.tags[t] for t in ev[:, 2].tolist()]
        ops = [self.ops[o] for o in ev[:, 3].tolist()]
        return (len(ev), tags, ops, (ev[:, 1] > 0).tolist(), pairing.tolist())


def blocks_of(config):
    for attr in ("num_hidden_layers", "n_layer"):
        if getattr(config, attr, None):
            return getattr(config, attr)
    return None


class Tracer:
    """Traces a model's steps for one setup, method by method, each (method, batch, seq) warm."""

    def __init__(self, config, cls, causal, setup):
        self.config, self.cls, self.causal, self.setup = config, cls, causal, setup
        self.verdicts = None
        self.primed = set()  # (method, batch, seq) whose shapes FakeTensorMode's cache holds
        self.records = {}  # (method, batch, seq, blocks or None) -> Record
        self.made = {}  # method -> whether its whole steps are made from 3 blocks (checked once)

    def record(self, method, batch, seq, layers=None, traffic=False):
        """The Record of `method` at batch x seq (layers: a model of that many blocks instead of
        the config's), traced warm: FakeTensorMode caches each operator's output by its inputs'
        shapes, and the first call of a shape (a cache miss) allocates more than the operator
        does (the output made twice to check the cache entry, a kernel's scratch the cached path
        skips), so a step traced cold would hold phantom blocks that move the caching
        allocator's segments and splits. Each (method, batch, seq) is first run once on a model
        of one block (every shape the whole model's step has), unrecorded. traffic: also count
        the bytes the memory-bound operators move (a fifth slower; Record.traffic is None
        without)."""
        key = (method, batch, seq, layers)
        if key not in self.records or (traffic and self.records[key].traffic is None):
            if layers is None and self._made(method, batch, seq, traffic):
                return self.records[key]
            if (method, batch, seq) not in self.primed:
                blocks = blocks_of(self.config)
                self._traced(method, batch, seq, layers=1 if blocks else None)
                self.primed.add((method, batch, seq))
            self.records[key] = self._traced(method, batch, seq, layers, traffic)
        return self.records[key]

    def _made(self, method, batch, seq, traffic):
        """The whole model's step made from that of a small one (blocks.py: 3 blocks, or 5, 7, 9
        where a block's frees reach further), the size checked once per method against a traced
        step of one block more; False where the model is small or no size passed."""
        from . import blocks

        n = blocks_of(self.config)
        if n is None or self.made.get(method) is False:
            return False
        if method not in self.made:
            self.made[method] = False
            for m in (3, 5, 7, 9, 11, 13):
                if n <= m + 1:
                    break
                try:
                    check = blocks.made(self.record(method, batch, seq, m, traffic), m + 1)
                    if blocks.same(check, self.record(method, batch, seq, m + 1)):
                        self.made[method] = m
                        break
                except blocks.Unmade:
                    continue
            if not self.made[method]:
                return False
        m = self.made[method]
        small = self.record(method, batch, seq, m, traffic)
        try:
            whole = blocks.made(small, n)
        except blocks.Unmade:
            self.made[method] = False
            return False
        more = n - m  # the middle block's counts, that many times more

        def grown(total, what):
            return None if total is None else total + more * small.per_layer.get(what, {}).get(m // 2, 0)

        whole.flops = grown(small.flops, "flops")
        whole.traffic = grown(small.traffic, "traffic")
        whole.host, whole.moved = grown(small.host, "moved"), grown(small.moved, "moved")
        whole.per_layer = small.per_layer
        self.records[(method, batch, seq, None)] = whole
        return True

    def _layer_class(self):
        """The class of the model's blocks (from a model of two blocks on the meta device)."""
        if not hasattr(self, "_block_class"):
            with torch.device("meta"):
                small = self.cls._from_config(self._config(2))
            layers = engine.layers_of(small)
            self._block_class = type(layers[0]) if layers else None
        return self._block_class

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

    def _config(self, layers):
        config = self.config
        if layers is not None:
            config = copy.deepcopy(config)
            for attr in ("num_hidden_layers", "n_layer"):
                if getattr(config, attr, None):
                    setattr(config, attr, layers)
            if getattr(config, "layer_types", None):
                config.layer_types = [config.layer_types[i % len(config.layer_types)] for i in range(layers)]
        return config

    def _traced(self, method, batch, seq, layers=None, traffic=False):
        from torch._subclasses.fake_tensor import FakeTensorMode

        from ..hf import probes

        config = self._config(layers)
        s = self.setup
        weights = torch.float32 if s["precision"] in ("fp32", "bf16-autocast") else torch.bfloat16
        if s["lora"]:
            weights = torch.float32 if s["precision"] == "fp32" else torch.bfloat16
        verdicts = self._verdicts(method)
        block = self._layer_class()  # outside the fake tensors' mode (it builds on the meta device)
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
                with _tagged_build(block):
                    model = self.cls._from_config(config, dtype=weights)
                model.train()
                applied = methods.apply(method, model, stack, planned=engine.FakeDevice(s["kind"]))
                if s["lora"]:  # adapters put into the model's own modules: `run` runs them too
                    model = _with_lora(model, s["lora"], weights)
                engine.tag("inputs")
                ids = torch.zeros(batch, seq, dtype=torch.long)
                data = {"input_ids": ids, "labels": torch.zeros(batch, seq, dtype=torch.long)}
                optimizer = PlannedOptimizer(model.parameters(), s["optimizer"], s["kind"])

                counting = []

                def on_step(step):
                    if step == 2:  # the planned step's traffic and host copies, from its start
                        if applied.host is not None:
                            applied.host.moved = 0
                            applied.host.moved_by_tag = {}
                        if traffic:
                            torch.ops.tempo.memory_traffic_start("step 2")
                            engine.CURRENT["traffic"] = True
                            counting.append(True)

                try:
                    engine.train(model, applied.run, data, optimizer, autocast, on_step=on_step)
                finally:
                    if counting:
                        engine.CURRENT["traffic"] = False
                        counted = torch.ops.tempo.memory_traffic_stop()
                host = applied.host.host if applied.host is not None else 0
                host_moved = applied.host.moved if applied.host is not None else 0
        trace = holder[0]
        per_layer = {"flops": _by_layer(trace.flops.items())}
        moved = None
        if counting:  # outside the fake tensors' mode
            by_tag = _memory_bound(*counted)
            for t, amount in optimizer.traffic_by_tag.items():  # its fused kernels' passes
                by_tag[t] = by_tag.get(t, 0) + amount
            moved = sum(by_tag.values())
            per_layer["traffic"] = _by_layer(by_tag.items())
        if applied.host is not None:
            per_layer["moved"] = _by_layer(applied.host.moved_by_tag.items())
        events = allocator.cleaned(trace)
        return Record(
            events=events,
            tags=trace.tags,
            ops=trace.ops,
            build_end=allocator.first(trace, events, lambda t: not t.startswith("build")),
            mark=allocator.step_start(trace, events, 2),
            flops=trace.flops_of("step 2"),
            traffic=moved,
            host=host,
            moved=host_moved,
            notes=applied.notes,
            per_layer=per_layer,
        )


def _by_layer(pairs):
    """Amounts by planner tag -> by layer (the planned step's, tags of a layer only)."""
    from .blocks import _layer

    out = {}
    for t, amount in pairs:
        if t.startswith("step 2") and _layer(t) is not None:
            out[_layer(t)] = out.get(_layer(t), 0) + amount
    return out


@contextlib.contextmanager
def _tagged_build(block):
    """Inside: each block's construction tagged "build, layer i" (its parameters' allocations)."""
    if block is None:
        yield
        return
    init, count = block.__init__, [0]

    def tagged(self, *args, **kwargs):
        engine.tag("build, layer %d" % count[0])
        count[0] += 1
        try:
            init(self, *args, **kwargs)
        finally:
            engine.tag("build")

    block.__init__ = tagged
    try:
        yield
    finally:
        block.__init__ = init


def _memory_bound(phases, ops, calls, read, written):
    """The bytes read and written by the operators whose time is their traffic (timing.py), by
    the planner's tag they ran under."""
    from .timing import is_compute_bound

    out = {}
    for phase, op, r, w in zip(phases, ops, read, written):
        if not is_compute_bound(op):
            out[phase] = out.get(phase, 0) + r + w
    return out


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
