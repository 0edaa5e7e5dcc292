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


class _Search:
    """The longest sequence (batch 1) and the largest batch (at seq) whose planned step fits the
    budget, every smaller one fitting as well."""

    def __init__(self, job, method):
        self.job, self.method = job, method
        self.found = {}
        self.checked = {}  # axis -> the lengths (batches) below the answer checked one by one

    def find(self, axis):
        if axis in self.found:
            return self.found[axis]
        s = self.job.setup
        if s["budget"] is None:
            return None
        step = s["seq_step"] if axis == "seq" else 1
        cap = (s["positions"] or 1 << 20) // step if axis == "seq" else 1 << 16
        shape = (lambda n: (1, n * step)) if axis == "seq" else (lambda n: (n, s["seq"]))
        quick = lambda n: self.job.estimate(self.method, *shape(n))  # noqa: E731
        guess = max(1, _largest(quick, s["budget"], cap, quadratic=axis == "seq"))
        sizes = _Sizes(self.job, self.method, shape)
        n = _bracketed(sizes.fits, guess, cap)
        n, self.checked[axis] = _every_below(sizes, n, s["budget"], s["kind"])
        self.found[axis] = n * step or None
        return self.found[axis]


def _every_below(sizes, n, budget, kind):
    """The largest m <= n such that every k in [1, m] fits, checking one by one every k whose
    step's peak comes within a margin of the budget: on a GPU the most the caching allocator's
    segments were seen to hold beyond the allocated bytes, twice, and at least 1 GiB; on the CPU
    (which counts bytes exactly) 2% of the budget. Below that band a step's peak is further from
    the budget than any allocator overhead seen. (m, the k checked)."""
    checked = []
    k = n
    while k >= 1:
        margin = max(2 * sizes.overhead, (GIB if kind == "cuda" else 0), budget // 50)
        sizes.anchor_below(k, margin)
        fit, peak = sizes.fits_and_peak(k)
        checked.append(k)
        if not fit:
            n = k - 1
        elif peak <= budget - margin:
            break
        k -= 1
    return max(n, 0), checked


class _Sizes:
    """A method's whole-model steps at batch x seq = shape(n), traced, or where three traced steps
    around n have the same events and differ only in their sizes, made from them: each event's
    bytes a polynomial of degree two in n through the three (exactly: the sizes of a step's
    tensors are products of its shape), checked to give whole bytes and, where a fourth step was
    traced, to give its sizes. Replaying such a step under the budget costs milliseconds where a
    trace costs seconds."""

    def __init__(self, job, method, shape):
        self.job, self.method, self.shape = job, method, shape
        self.traced = {}  # n -> (Record, structure)
        self.peaks = {}  # n -> the step's peak, as planned
        self.overhead = 0  # the most reserved beyond allocated seen (a GPU's)
        self.trusted = None  # whether made steps reproduced a traced one (None: not checked yet)

    def _trace(self, n):
        if n not in self.traced:
            record = self.job.record(self.method, *self.shape(n))
            self.traced[n] = (record, record.structure())
            if self.job.setup["kind"] == "cuda":
                free = self.job.figures(record)  # no budget: the allocator's own overhead
                self.overhead = max(self.overhead, free.reserved - free.peak)
        return self.traced[n]

    def fits(self, n):
        return self.fits_and_peak(n)[0]

    def fits_and_peak(self, n):
        record = None if n in self.traced else self._made(n)
        if record is None:
            record = self._trace(n)[0]
        f = self.job.figures(record, self.job.setup["budget"])
        self.peaks[n] = f.peak
        return bool(f.fits), f.peak

    def anchor_below(self, k, margin):
        """Before checking k one by one: a step traced where the band below k likely ends (from
        the peaks' growth per unit), so that the steps between are made, not traced."""
        if k in self.traced or any(j < k for j in self.traced) or len(self.peaks) < 2:
            return
        (a, pa), (b, pb) = sorted(self.peaks.items())[:2]
        growth = (pb - pa) / (b - a) if b != a else 0
        width = int(margin / growth) + 2 if growth > 0 else k
        self._trace(max(1, k - width))

    def _made(self, n):
        """The record at n made from three traced ones with the same events around it, or None."""
        below = [k for k in self.traced if k < n]
        above = [k for k in self.traced if k > n]
        if not below or not above:
            return None
        lo, hi = max(below), min(above)
        others = sorted((k for k in self.traced if k not in (lo, hi)), key=lambda k: abs(k - n))
        if not others:
            return None
        points = sorted((lo, hi, others[0]))
        structure = self.traced[points[0]][1]
        if any(self.traced[k][1] != structure for k in points[1:]):
            return None
        if self.trusted is None:  # a fourth step traced, against the one made from the three
            check = next((k for k in others[1:] if self.traced[k][1] == structure), None)
            if check is None:
                check = (points[0] + points[-1]) // 2
                if check in points:
                    return None
                self._trace(check)
                if self.traced[check][1] != structure:
                    self.trusted = False
                    return None
            made = _interpolated([self.traced[k][0] for k in points], points, check)
            self.trusted = made is not None and torch.equal(made.events, self.traced[check][0].events)
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


def _bracketed(fits, guess, cap):
    """The largest n in [1, cap] with fits(n), 0 if none, from a guess: steps out from it,
    doubling, until a fitting and a failing n bracket the answer, then bisects."""
    if fits(guess):
        lo, hi, stride = guess, None, 1
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
        lo, hi, stride = 0, guess, 1
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
