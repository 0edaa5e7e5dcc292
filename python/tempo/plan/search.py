"""The longest sequence and the largest batch that fit a budget: searched on models of 3 and 4
blocks, extrapolated, then confirmed on the whole model's plans."""

import math


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
