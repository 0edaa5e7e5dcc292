"""tempo.memory: the counting CPU allocator counts known allocations exactly."""

import pytest
import torch

import tempo


def test_counts_known_allocations_exactly():
    with tempo.memory.Scope() as s:
        a = torch.empty(1000, dtype=torch.float32)
        b = torch.empty(3, 7, dtype=torch.uint8)
        assert s.update().held == 4000 + 21
        del a
        assert s.update().held == 21
        c = torch.zeros(10, dtype=torch.float64)
        assert s.update().peak == 4021
        del b, c
    assert s.held == 0 and s.peak == 4021


def test_reset_peak_and_stats():
    tempo.memory.track()
    x = torch.empty(2048)
    del x
    tempo.memory.reset_peak()
    current, peak = tempo.memory.stats()
    assert peak == current


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stats_count_an_allocation():
    with tempo.memory.Scope("cuda") as s:
        x = torch.empty(1 << 20, device="cuda")
        assert s.update().held >= 4 << 20
        del x
