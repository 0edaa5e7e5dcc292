"""tempo.memory: the counting CPU allocator counts known allocations exactly."""

import gc

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


def test_garbage_from_before_the_scope_is_not_counted_against_it():
    """A tensor in unreachable cyclic garbage made before the block: a collection inside the
    block (here due to the many lists it makes) would free it and count -4 MiB against the
    block. The collector waits for the block's end (and resumes then, nested blocks included);
    the held bytes are the block's own allocation."""

    class Node:
        pass

    tempo.memory.track()  # the tensor counted when made, so that its free would be counted
    node = Node()
    node.me, node.t = node, torch.empty(1 << 20)
    del node
    with tempo.memory.Scope() as outer:
        with tempo.memory.Scope() as s:
            kept = torch.empty(1000)
            churn = [[i] for i in range(100000)]
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    assert s.held == 4000 and outer.held == 4000, (s.held, outer.held)
    del kept, churn
    gc.collect()


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
