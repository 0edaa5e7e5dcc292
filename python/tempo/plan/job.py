"""The planning of one model and setup (tempo.plan's worker): a method's traced step (trace.py)
turned into the figures a device reports (the CPU's counting allocator, or CUDA's caching
allocator replayed by tempo::memory_plan_replay under the budget), whether it fits, the
breakdown at the peak; FSDP2 sharding as the plan models it."""

import dataclasses
import math

import torch

from ..methods import Unavailable
from . import allocator, timing
from .search import _Search
from .trace import Tracer, blocks_of


@dataclasses.dataclass
class Figures:
    """A record's figures on the planned device under a budget: the peak (max_memory_allocated's,
    or tempo.memory's on the CPU) over the planned step and the event at it; the caching
    allocator's reserved bytes at most over that step (a GPU's; None on the CPU); whether the
    step runs within the budget (None: no budget) and the event where it would not (-1); the
    bytes held after each event (the events as the device sees them: `events`)."""

    peak: int
    index: int
    reserved: int
    fits: bool
    first_failure: int
    current: torch.Tensor
    events: torch.Tensor
    excess: int = 0  # by how much the first request that did not fit passed the budget


class _Job(Tracer):
    """The planning of one model and setup, method by method."""

    def __init__(self, config, cls, causal, setup):
        super().__init__(config, cls, causal, setup)
        self.figured = {}  # (record key, budget) -> Figures

    # ---- a record's figures ------------------------------------------------------------------

    def figures(self, record, budget=None):
        """`record`'s Figures under `budget` (bytes; None: none)."""
        s = self.setup
        events, mark = record.events, record.mark
        if s["gpus"] > 1:
            events = _sharded(record, events, s["gpus"], record.build_end, mark)
            mark = allocator.step_start(record, events, 2)
        if s["kind"] == "cuda":
            after, _, stats = torch.ops.tempo.memory_plan_replay(
                events, record.build_end, mark, budget or 0, s["allocator"] == "expandable"
            )
            current = torch.cat([after[:1].expand(record.build_end) if len(after) else after, after])
            reserved, first, excess = int(stats[1]), int(stats[2]), int(stats[4])
        else:
            current = events[:, 1].cumsum(0)
            reserved, first, excess = None, -1, 0
        before = int(current[mark - 1]) if mark > 0 else 0
        after_mark = current[mark:]
        if len(after_mark) and int(after_mark.max()) >= before:
            index = int(after_mark.argmax()) + mark
            peak = int(current[index])
        else:
            index, peak = mark - 1, before
        if s["kind"] == "cpu" and budget is not None and peak > budget:
            first, excess = index, peak - budget
        fits = None if budget is None else first < 0 and self._host_fits(record)
        return Figures(peak, index, reserved, fits, first, current, events, excess)

    def _host_fits(self, record):
        host = self.setup.get("host")
        return host is None or record.host <= host

    def step(self, method, batch, seq, layers=None, traffic=False):
        """(Record, Figures under the setup's budget) of `method` at batch x seq, cached."""
        record = self.record(method, batch, seq, layers, traffic)
        key = (method, batch, seq, layers, self.setup["budget"])
        if key not in self.figured:
            self.figured[key] = self.figures(record, self.setup["budget"])
        return record, self.figured[key]

    def peak_of(self, method, batch, seq):
        """The planned step's peak of `method` at batch x seq (a GPU's: the allocated bytes)."""
        return self.step(method, batch, seq)[1].peak

    def fits(self, method, batch, seq):
        """Whether the whole model's step at batch x seq runs within the budget (and its host
        bytes within the host's)."""
        return bool(self.step(method, batch, seq)[1].fits)

    def estimate(self, method, batch, seq):
        """The whole model's allocated peak from models of 3 and 4 blocks: each phase's peak, per
        place of its block (first, middle, last), extrapolated along a line in the number of
        blocks; the largest. The whole model's where it has 4 blocks or fewer."""
        blocks = blocks_of(self.config)
        if blocks is None or blocks <= 4:
            return self.peak_of(method, batch, seq)
        phases = [self._phases(method, batch, seq, n) for n in (3, 4)]
        out = 0
        for name in set(phases[0]) & set(phases[1]):
            a, b = phases[0][name], phases[1][name]
            out = max(out, b + (blocks - 4) * (b - a))
        return out

    def _phases(self, method, batch, seq, layers):
        """The most bytes allocated in each phase of the planned step, the blocks' phases named
        by the block's place: first, middle or last."""
        record, f = self.step(method, batch, seq, layers)
        current, mark, tags = f.current, record.mark, record.tags
        out = {"before": int(current[mark - 1]) if mark > 0 else 0}
        names = {}
        for k, t in enumerate(tags):
            name = t.split(": ", 1)[-1]
            if ", layer " in name:
                head, rest = name.split(", layer ", 1)
                i = int(rest.split()[0])
                place = "first" if i == 0 else ("last" if i == layers - 1 else "middle")
                name = "%s, %s block%s" % (head, place, rest[len(str(i)) :])
            names[k] = name
        step_tags = f.events[mark:, 2]
        step_current = current[mark:]
        for tag in torch.unique(step_tags).tolist():
            name = names[tag]
            out[name] = max(out.get(name, 0), int(step_current[step_tags == tag].max()))
        return out

    # ---- a method's row ------------------------------------------------------------------------

    def refigure(self, row):
        """A row planned under another device's setup, its fits, reserved bytes and time made
        this setup's (Plan.on)."""
        record, f = self.step(row.name, self.setup["batch"], self.setup["seq"], traffic=True)
        row.fits, row.reserved = f.fits, f.reserved
        row.notes = [n for n in row.notes if "host memory are more than" not in n]
        self._note_host(row, record, f)
        timing.predict(self, row)

    def _note_host(self, row, record, f):
        if f.fits is False and not self._host_fits(record):
            row.notes.append(
                "its %.1f GiB in host memory are more than the host's %.1f GiB"
                % (record.host / 2**30, self.setup["host"] / 2**30)
            )

    def plan_method(self, method):
        s = self.setup
        from . import MethodPlan  # the package's, which imports this module

        row = MethodPlan(method)
        try:
            record, f = self.step(method, s["batch"], s["seq"], traffic=True)
        except Unavailable as e:
            row.error = str(e)
            return row
        row.notes = list(record.notes)
        row.host = record.host
        row.peak, row.reserved = f.peak, f.reserved
        events, index = f.events, f.index
        row.where = (
            record.tags[int(events[index, 2])] + " / " + record.ops[int(events[index, 3])] if index >= 0 else "-"
        )
        row.breakdown, row.activations, row.activations_per_layer, row.head, row.largest_transient = _breakdown(
            record, events, index, record.mark
        )
        row.flops = record.flops
        row.fits = f.fits
        self._note_host(row, record, f)
        row._search = _Search(self, method).find
        return row


def _sharded(record, events, gpus, build_end, mark):
    """The events of FSDP2's full sharding over `gpus` devices, from one device's: the weights,
    their gradients and the optimizer's state a gpus-th each (rounded up), and each block's
    parameters gathered whole for its forward and backward, with the next block's prefetched
    (two blocks' parameters at once), and in the backward its gradients whole until they are
    reduce-scattered."""
    events = events.clone()
    persistent = set(int(i) for i in events[:build_end][events[:build_end, 1] > 0, 0].tolist())
    persistent -= set(int(i) for i in events[:build_end][events[:build_end, 1] < 0, 0].tolist())
    opt_tags = [i for i, t in enumerate(record.tags) if t.endswith(": optimizer")]
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
    back_tags = [i for i, t in enumerate(record.tags) if "backward" in t]
    for k in range(end):
        ident, n, tag = int(events[k, 0]), int(events[k, 1]), int(events[k, 2])
        shard = ident in persistent or tag in opt_tags or (ident in alive_end and tag in back_tags and k >= mark)
        if shard:
            events[k, 1] = int(math.copysign(-(-abs(n) // gpus), n))
    layer_bytes = _layer_bytes(record, events, build_end, gpus)
    out, extra = [], 10**15
    current_tag = None
    for k in range(end):
        tag = record.tags[int(events[k, 2])]
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


def _layer_bytes(record, events, build_end, gpus):
    """One block's parameter bytes, unsharded (the largest build-time allocation group is not
    separable here: the model's parameters over its blocks)."""
    total = int(events[:build_end, 1].clamp_min(0).sum())
    layers = max(1, sum(1 for t in record.tags if t.startswith("step 2: forward, layer ")))
    return total // layers


def _breakdown(record, events, index, mark):
    """What is alive at the peak (event `index`), by what made it; the activations held after the
    forward, per layer; the head's; the largest temporary of the step."""
    tags = record.tags
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
            return "weights" if t.startswith("build") else "other"
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
