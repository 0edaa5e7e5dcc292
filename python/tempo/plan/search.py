"""The longest sequence and the largest batch that fit a budget, such that every shorter one (every
smaller batch) fits too: estimated on models of 3 and 4 blocks, bracketed on the whole model's
steps replayed under the budget, then every length below it whose peak comes within a margin of
the budget checked as well (the caching allocator's segments make fitting non-monotone near the
budget: a length may not fit where a longer one does)."""

import dataclasses
import math
from fractions import Fraction

import torch

GIB = 1 << 30
# Where steps below an answer must be traced one by one (their events differ with the length),
# at most this many that fit are: the band below the budget a failing step was seen in can span
# most lengths under the default caching allocator.
CHECKED = 4


class _Search:
    """The longest sequence (batch 1) and the largest batch (at seq) whose planned step fits the
    budget, every smaller one fitting as well."""

    def __init__(self, job, method):
        self.job, self.method = job, method
        self.found = {}
        self.checked = {}  # axis -> how the lengths (batches) below the answer were checked

    def find(self, axis):
        if axis in self.found:
            return self.found[axis]
        s = self.job.setup
        if s["budget"] is None:
            return None
        step = s["seq_step"] if axis == "seq" else 1
        cap = (s["positions"] or 1 << 20) // step if axis == "seq" else 1 << 16
        shape = (lambda n: (1, n * step)) if axis == "seq" else (lambda n: (n, s["seq"]))
        sizes = _Sizes(self.job, self.method, shape)
        guess = max(1, min(cap, _guess(sizes, s, axis, step)))
        n = _boundary(sizes, guess, cap, s["budget"])
        while n >= 1 and not (sizes.fits(n, traced=True) and (n == cap or not sizes.fits(n + 1, traced=True))):
            n = _bracketed(lambda k: sizes.fits(k, traced=True), n, cap, stride=1)  # the boundary, traced
        n, self.checked[axis] = _every_below(sizes, n, s["budget"], s["kind"])
        self.found[axis] = n * step or None
        return self.found[axis]


def _guess(sizes, s, axis, step):
    """Where the allocated peak reaches the budget, along the line through the peaks at the
    plan's own shape (planned already) and half of it."""
    here = s["seq"] // step if axis == "seq" else s["batch"]
    here = max(2, here)
    points = [(k, sizes.peak(k)) for k in (here // 2, here)]
    (x0, y0), (x1, y1) = points
    if y1 <= y0:
        return here
    return int(x1 + (s["budget"] - y1) * (x1 - x0) / (y1 - y0))


def _boundary(sizes, guess, cap, budget):
    """An n that fits with n + 1 not (or n = cap; 0 if 1 does not fit), from a guess, by
    bisection of the bracket found so far; a probe that does not fit goes down at least by what
    its first failing request passed the budget over the peak's growth per unit (what fitting
    would take), where that is further than the middle."""
    lo, hi, n = 0, cap + 1, guess
    while hi - lo > 1:
        if not lo < n < hi:
            n = (lo + hi) // 2
        fit, peak, excess = sizes.probe(n)
        if fit:
            lo = n
            n = 2 * n if hi > cap else (lo + hi) // 2  # no failure seen yet: double
        else:
            hi = n
            growth = sizes.growth(n)
            jump = n - math.ceil(excess / growth) if growth > 0 else n - 1
            n = max(lo + 1, min(jump, (lo + hi) // 2))
    return lo


def _every_below(sizes, n, budget, kind):
    """The largest m <= n such that every k in [1, m] fits, and how that was checked: where the
    steps can be made from traced ones (their events the same at every size), every k below n is
    replayed; else every k whose peak comes within a margin of the budget (the most a failing
    step was seen below the budget, a quarter more, and at least 1 GiB on a GPU, 2% of the
    budget on the CPU) is, up to CHECKED traced steps that fit: below that band a step's peak is
    further from the budget than any shortfall seen."""
    k = n
    below = next((j for j in range(n - 1, 0, -1) if j not in sizes.traced), None)
    if below is not None and sizes.trusted is None:
        sizes._made(below)  # checks steps made from traced ones against a fourth, where it can
    exhaustive = sizes.trusted is True and sizes.uniform()
    traced = 0
    while k >= 1:
        margin = max(sizes.shortfall * 5 // 4, (GIB if kind == "cuda" else 0), budget // 50)
        before = len(sizes.traced)
        fit, peak = sizes.fits_and_peak(k)
        traced += len(sizes.traced) > before
        if not fit:
            n = k - 1
        elif not exhaustive and (peak <= budget - margin or traced >= CHECKED):
            how = "every length within %.1f GiB of the budget" % (margin / GIB)
            return max(n, 0), how if peak <= budget - margin else how + " down to %d" % k
        k -= 1
    return max(n, 0), "every length replayed" if exhaustive else "every length"


class _Sizes:
    """A method's whole-model steps at batch x seq = shape(n), traced, or where three traced steps
    have the same events and differ only in their sizes, made from them: each event's bytes a
    polynomial of degree two in n through the three (exactly: the sizes of a step's tensors are
    products of its shape), checked to give whole bytes and, against a fourth traced step, to
    give its sizes. Replaying such a step under the budget costs milliseconds where a trace costs
    seconds."""

    def __init__(self, job, method, shape):
        self.job, self.method, self.shape = job, method, shape
        self.traced = {}  # n -> (Record, structure)
        self.peaks = {}  # n -> the step's peak (allocated), as planned
        self.last_excess = 0
        self.shortfall = 0  # the most a step that did not fit was below the budget (allocated)
        self.trusted = None  # whether made steps reproduced a traced one (None: not checked yet)

    def _trace(self, n):
        if n not in self.traced:
            record = self.job.record(self.method, *self.shape(n))
            self.traced[n] = (record, record.structure())
        return self.traced[n]

    def peak(self, n):
        return self.fits_and_peak(n)[1]

    def probe(self, n):
        """(fits, peak, by how much its first failing request passed the budget) at n."""
        fit, peak = self.fits_and_peak(n)
        return fit, peak, self.last_excess

    def growth(self, n):
        """The peak's growth per unit of n, from the two planned n nearest it."""
        near = sorted(self.peaks, key=lambda k: abs(k - n))[:2]
        if len(near) < 2 or near[0] == near[1]:
            return 0
        (a, b) = sorted(near)
        return (self.peaks[b] - self.peaks[a]) / (b - a)

    def fits(self, n, traced=False):
        return self.fits_and_peak(n, traced)[0]

    def uniform(self):
        """Whether every traced step has the same events (only their sizes differ)."""
        structures = [st for _, st in self.traced.values()]
        return all(st == structures[0] for st in structures[1:])

    def fits_and_peak(self, n, traced=False):
        record = None if traced or n in self.traced else self._made(n)
        if record is None:
            record = self._trace(n)[0]
        f = self.job.figures(record, self.job.setup["budget"])
        self.peaks[n], self.last_excess = f.peak, f.excess
        if not f.fits:
            self.shortfall = max(self.shortfall, self.job.setup["budget"] - f.peak)
        return bool(f.fits), f.peak

    def _points(self, n):
        """Three traced n with the same events to make n from (n among or beyond them once made
        steps were checked), or None."""
        if len(self.traced) < 3:
            return None
        near = sorted(self.traced, key=lambda k: abs(k - n))
        structure = self.traced[near[0]][1]
        points = [k for k in near if self.traced[k][1] == structure][:3]
        if len(points) < 3:
            return None
        inside = min(points) < n < max(points)
        if not inside and not (self.trusted is True and self.uniform()):  # beyond them: where nothing varied
            return None
        between = [k for k in self.traced if min(points) < k < max(points) and self.traced[k][1] != structure]
        if between:
            return None
        return sorted(points)

    def _made(self, n):
        """The record at n made from three traced ones with the same events, or None."""
        points = self._points(n)
        if points is None:
            return None
        if self.trusted is None:  # a fourth step traced, against the one made from the three
            check = (points[0] + points[-1]) // 2
            if check in points:
                check = points[-1] + 1
            made = _interpolated([self.traced[k][0] for k in points], points, check)
            record, structure = self._trace(check)
            self.trusted = made is not None and structure == self.traced[points[0]][1]
            self.trusted = self.trusted and torch.equal(made.events, record.events)
            points = self._points(n)
            if not self.trusted or points is None:
                return None
        if self.trusted is False:
            return None
        return _interpolated([self.traced[k][0] for k in points], points, n)


def _interpolated(records, xs, x):
    """A record at x from three with the same events at xs: each event's bytes the quadratic
    through the three; None where a size comes out fractional or not positive (not a product of
    the shape)."""
    ys = torch.stack([r.events[:, 1] for r in records]).tolist()
    x0, x1, x2 = (Fraction(v) for v in xs)
    x = Fraction(x)
    w0 = (x - x1) * (x - x2) / ((x0 - x1) * (x0 - x2))
    w1 = (x - x0) * (x - x2) / ((x1 - x0) * (x1 - x2))
    w2 = (x - x0) * (x - x1) / ((x2 - x0) * (x2 - x1))
    # common denominator: integer arithmetic on the whole column at once
    den = math.lcm(w0.denominator, w1.denominator, w2.denominator)
    a, b, c = (int(w * den) for w in (w0, w1, w2))
    y = torch.tensor(ys, dtype=torch.long)
    num = a * y[0] + b * y[1] + c * y[2]
    if bool((num % den != 0).any()):
        return None
    sizes = num // den
    if bool(((sizes > 0) != (y[0] > 0)).any()):
        return None
    base = records[0]
    events = base.events.clone()
    events[:, 1] = sizes
    return dataclasses.replace(base, events=events, host=_line(xs, [r.host for r in records], x))


def _line(xs, ys, x):
    (x0, x1), (y0, y1) = xs[:2], ys[:2]
    return int(y0 + (y1 - y0) * (Fraction(x) - x0) / (x1 - x0))


def _bracketed(fits, guess, cap, stride=None):
    """The largest n in [1, cap] with fits(n), 0 if none, from a guess: steps out from it (first
    by `stride`, default 1/16 of the guess), doubling, until a fitting and a failing n bracket the
    answer, then bisects."""
    first = stride or max(1, guess // 16)
    if fits(guess):
        lo, hi, stride = guess, None, first
        while hi is None and lo < cap:
            probe = min(cap, lo + stride)
            if fits(probe):
                lo = probe
            else:
                hi = probe
            stride *= 2
        if hi is None:
            return lo
    else:
        lo, hi, stride = 0, guess, first
        while lo == 0:
            probe = hi - stride
            if probe < 1:
                if not fits(1):
                    return 0
                lo = 1
            elif fits(probe):
                lo = probe
            else:
                hi = probe
            stride *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
