"""Measuring helpers shared by tempo.bench and tempo.auto: a budget enforced as a real
out-of-memory error, the largest-batch search, byte sizes in and out."""

import argparse
import contextlib
import gc
import os

import torch

from . import memory


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def heap_frozen():
    """Inside: the objects that exist on entry are left out of the collector's scans
    (gc.freeze), so the full gc.collect() before each measured step scans what measuring
    created, not every object of transformers and the user's program: 0.25 s a collection
    with transformers' BERT loaded, 40% of tempo.auto's time on MiniLM, against about a
    millisecond. Objects from before that become garbage inside are collected after. Not
    done where the program has frozen objects itself, since gc.unfreeze would release them."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def budget_enforced(device, budget):
    """Inside: a real out-of-memory error past `budget` bytes (all tracked bytes on CPU; the
    caching allocator's fraction of the device on CUDA, the fraction from before given back
    after)."""
    if budget is None:
        yield
        return
    if device.type == "cpu":
        with memory.cpu_limit(budget):
            yield
    else:
        # The fraction's functions take a device with an index: a plain "cuda" (as
        # `python -m tempo.bench --device cuda` gives) is the current device. Without this the
        # first H200 run of tempo.bench stopped at "Expected a torch.device with a specified
        # index" before any step.
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        # (get_per_process_memory_fraction is newer than some torch releases we run on: 1.0,
        # the allocator's default, where it is missing.)
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        before = getter(index) if getter is not None else 1.0
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), index)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(before, index)


def fits(step, batch, device, budget):
    """The measurements of `step(batch)` under the budget, or None on out-of-memory (only
    torch.OutOfMemoryError counts; any other error propagates)."""
    try:
        with budget_enforced(device, budget):
            return step(batch)
    except torch.OutOfMemoryError:
        free(device)
        return None


def largest_batch(probe, budget, fitted=()):
    """The largest batch for which `probe(batch)` (a step's measurements with "peak_bytes",
    or None when it ran out of memory) fits the budget, as the C++ bench finds it: each
    candidate predicted from a linear model of the step's peak in the batch (its slope from
    the steps measured so far) and verified by running it. Once a batch has failed, no
    candidate lies beyond the middle of what is still open (a bisection when the prediction
    overshoots), and at least one more than the largest seen to fit is tried, so the search
    ends on a batch that fits next to one that does not. fitted: (batch, measurements) pairs
    already seen to fit under a budget no larger than this one (a smaller budget's search):
    the search starts from them, with their slope, instead of from batch 1. Returns (batch,
    its measurements), or (None, None) if batch 1 does not fit."""
    points = sorted(fitted, key=lambda p: p[0])
    if not points:
        p1 = probe(1)
        if p1 is None:
            return None, None
        points = [(1, p1)]
    (b0, first), (lo, at_lo) = points[0], points[-1]
    hi = None
    slope = max((at_lo["peak_bytes"] - first["peak_bytes"]) / (lo - b0), 1.0) if lo > b0 else None
    for _ in range(40):
        if hi is not None and hi - lo <= 1:
            break
        cand = 2 * lo if slope is None else lo + max(1, int((budget - at_lo["peak_bytes"]) // slope))
        if hi is not None:
            cand = min(cand, (lo + hi) // 2)
        at = probe(cand)
        if at is None:
            hi = cand
        else:
            slope = max((at["peak_bytes"] - first["peak_bytes"]) / (cand - b0), 1.0)
            lo, at_lo = cand, at
    return lo, at_lo


def format_bytes(n):
    v, u = float(n), 0
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    while u < 4 and abs(v) >= 1024:
        v, u = v / 1024, u + 1
    return "%d B" % n if u == 0 else "%.2f %s" % (v, units[u])


def parse_bytes(text):
    units = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    num = text.rstrip("KMGiB")
    unit = text[len(num) :]
    try:
        v = float(num) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError("cannot read a size from %r (e.g. 11GiB, 512MiB)" % text)
    if not v > 0 or v == float("inf"):  # NaN compares false
        raise argparse.ArgumentTypeError("a size must be positive and finite, got %r" % text)
    return int(v)


def check_outputs(parser, plot, outputs):
    """Before any measurement (not after it): `plot` (--plot) names an .svg file, and each
    (flag, path) of `outputs` with a path can be written, its folder existing; else a parser
    error naming the flag."""
    if plot and not plot.endswith(".svg"):
        parser.error("--plot writes SVG; give a file name ending in .svg")
    for flag, path in list(outputs) + [("--plot", plot)]:
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            parser.error("cannot write %s %s: %s is not a folder" % (flag, path, folder))
