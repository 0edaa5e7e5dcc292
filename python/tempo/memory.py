"""Exact memory accounting (the C++ tempo::memory API): bytes held now and the peak, on CPU
through a counting allocator, on CUDA from the caching allocator's statistics."""

import gc
import math
import numbers

import torch


def track() -> None:
    """Install the counting CPU allocator (idempotent). Tensors allocated before are not counted."""
    torch.ops.tempo.memory_track()


def stats(device="cpu"):
    """(current, peak) bytes on the device."""
    current, peak = torch.ops.tempo.memory_stats(torch.device(device))
    return current, peak


def reset_peak(device="cpu") -> None:
    torch.ops.tempo.memory_reset_peak(torch.device(device))


def _limit_bytes(nbytes, who):
    """A limit in bytes: an int (or a finite float, truncated) >= 0; anything else is an
    error naming the caller, not a conversion error from deep inside."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real):
        raise TypeError("%s: the limit is a number of bytes (0: none), got %r" % (who, nbytes))
    if not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError("%s: the limit must be a finite number of bytes >= 0 (0: none), got %r" % (who, nbytes))
    return int(nbytes)


def set_cpu_limit(nbytes: int) -> None:
    """A CPU budget: an allocation that would take the counted bytes past ``nbytes`` raises
    ``torch.OutOfMemoryError``, as a full GPU does (0 removes it). Counts only tensors
    allocated after tracking began (a limit starts tracking)."""
    torch.ops.tempo.memory_set_cpu_limit(_limit_bytes(nbytes, "tempo.memory.set_cpu_limit"))


def get_cpu_limit() -> int:
    """The CPU limit in bytes now (0: none)."""
    return torch.ops.tempo.memory_cpu_limit()


class cpu_limit:
    """``with tempo.memory.cpu_limit(nbytes): ...``: the limit inside the block only; on leaving
    it, the limit from before the block (none, or one set outside) is back."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = _limit_bytes(nbytes, "tempo.memory.cpu_limit")
        self._before = []

    def __enter__(self):
        self._before.append(get_cpu_limit())
        set_cpu_limit(self.nbytes)
        return self

    def __exit__(self, *exc):
        set_cpu_limit(self._before.pop())
        return False


class Scope:
    """Bytes held and the peak over a ``with`` block, relative to its start:
    ``with tempo.memory.Scope() as s: ...; s.held, s.peak``. Python's cyclic garbage collector
    is paused inside the block: a collection there would free tensors of before the block and
    count them against it (the held bytes of one forward then depended on what ran earlier)."""

    def __init__(self, device="cpu") -> None:
        self.device = torch.device(device)
        self.start = 0
        self.held = self.peak = 0
        self._collecting = False

    def __enter__(self):
        if self.device.type == "cpu":
            track()
        self._collecting = gc.isenabled()
        gc.disable()
        reset_peak(self.device)
        self.start = stats(self.device)[0]
        return self

    def update(self):
        current, peak = stats(self.device)
        self.held, self.peak = current - self.start, peak - self.start
        return self

    def __exit__(self, *exc):
        self.update()
        if self._collecting:
            gc.enable()
        return False
