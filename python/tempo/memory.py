"""Exact memory accounting (the C++ tempo::memory API): bytes held now and the peak, on CPU
through a counting allocator, on CUDA from the caching allocator's statistics."""
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


class Scope:
    """Bytes held and the peak over a ``with`` block, relative to its start:
    ``with tempo.memory.Scope() as s: ...; s.held, s.peak``."""

    def __init__(self, device="cpu") -> None:
        self.device = torch.device(device)
        self.start = 0
        self.held = self.peak = 0

    def __enter__(self):
        if self.device.type == "cpu":
            track()
        reset_peak(self.device)
        self.start = stats(self.device)[0]
        return self

    def update(self):
        current, peak = stats(self.device)
        self.held, self.peak = current - self.start, peak - self.start
        return self

    def __exit__(self, *exc):
        self.update()
        return False
