"""What tempo.plan returns: a Plan (the setup and one MethodPlan per method), its table, JSON and
chart (report.py), and Plan.on: the same plan on another GPU."""

import copy
import json

from . import models
from .job import _Job
from .models import PlanError
from .search import _Search


class MethodPlan:
    """One method's plan. Attributes: peak (bytes), fits, where (phase, layer and operator of the
    peak), breakdown (bytes at the peak: weights, gradients, optimizer state, activations,
    transients, other), activations (held after the forward, all layers) and
    activations_per_layer, head (what the LM head and loss hold after the forward),
    largest_transient, flops (the step's matmul FLOPs: forward and backward, recomputation
    included), traffic (the bytes its memory-bound operators move), time (the step's predicted
    seconds on the device, time_parts what they are made of), reserved (the caching allocator's
    segments at most, GPU), host (the most bytes held in host memory at once), max_seq (the
    longest sequence at batch 1 that fits, every shorter multiple of seq_step fitting too) and
    max_batch (the largest batch at seq that fits), notes, error (why the method could not be
    planned, else None)."""

    def __init__(self, name, **fields):
        self.name = name
        self.peak = self.reserved = None
        self.fits = None
        self.where = None
        self.breakdown = {}
        self.activations = self.head = self.largest_transient = None
        self.activations_per_layer = []
        self.flops = self.traffic = self.time = None
        self.time_parts = {}
        self.host = 0
        self.notes = []
        self.error = None
        self._search = None
        self._found = {}  # axis -> the answer, where searched already (in a planning process)
        self.__dict__.update(fields)

    def _searched(self, axis):
        if self.error is not None:
            return None
        if axis not in self._found and self._search is not None:
            self._found[axis] = self._search(axis)
        return self._found.get(axis)

    @property
    def max_seq(self):
        """The longest sequence at batch 1 that fits, every shorter multiple of the plan's
        seq_step fitting as well; searched on first read."""
        return self._searched("seq")

    @property
    def max_batch(self):
        """The largest batch at the plan's seq that fits, every smaller one fitting as well;
        searched on first read."""
        return self._searched("batch")

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
    iterating gives the methods; `best` the fastest method that fits (by predicted step time);
    str() is the table, to_json() and plot(path) the rest."""

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

    @property
    def best(self):
        """The method that fits with the shortest predicted step (None if none fits): what
        tempo.optimize(model, method=plan.best) applies."""
        fitting = [r for r in self.rows.values() if r.error is None and r.fits and r.time is not None]
        return min(fitting, key=lambda r: r.time).name if fitting else None

    def ranked(self):
        """The methods that fit, fastest first (by predicted step time)."""
        fitting = [r for r in self.rows.values() if r.error is None and r.fits and r.time is not None]
        return [r.name for r in sorted(fitting, key=lambda r: r.time)]

    def __str__(self):
        from .report import table

        return table(self)

    __repr__ = __str__

    def to_json(self):
        return json.dumps({"setup": self.setup, "methods": {m: r.as_dict() for m, r in self.rows.items()}}, indent=1)

    def plot(self, path, seqs=None):
        from .report import plot

        return plot(self, path, seqs)

    def on(self, device, budget=None, host=None):
        """The same plan on another GPU (a name in DEVICES or a byte count; budget and host as
        plan()'s): the steps stand (a step's tensors and the caching allocator's rounding do not
        depend on the GPU's size), what fits, the times and the searches are the new device's.
        The traced steps are shared, so searching on several GPUs traces each (batch, seq) once."""
        kind, capacity = models.device_of(device)
        if kind != self.kind:
            raise PlanError("tempo.plan: Plan.on moves a plan between GPUs; this one is for %r" % self.device)
        setup = models.device_setup(dict(self.setup), device, budget, host)
        job = _Job(self._job.config, self._job.cls, self._job.causal, setup)
        job.records, job.verdicts, job.primed = self._job.records, self._job.verdicts, self._job.primed
        rows = {}
        for name, row in self.rows.items():
            moved = copy.copy(row)
            moved._found = {}
            moved.notes = list(row.notes)
            if row.error is None:
                job.refigure(moved)
                moved._search = _Search(job, name).find
            rows[name] = moved
        return Plan(setup, rows, job)


def _gib(n):
    return "-" if n is None else "%.2f GiB" % (n / 2**30)
