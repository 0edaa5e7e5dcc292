"""Determinism on CPU: the same seed gives bitwise the same outputs and gradients of every tempo
op across runs and across thread counts (1, 2, 3 threads; the ops' parallel paths engage from
32768 elements). The reductions over rows (the norms' weight and bias gradients, the bias
gradients fused into the activation backward and tempo.qkv_split) add fixed groups of rows in
a fixed order, whatever the thread count; dropout masks are a function of (seed, offset,
element). The ATen matmuls inside attention, linear attention's prefix mode and
linear_cross_entropy are PyTorch's; they are checked here as well, on this machine's BLAS."""

import functools

import pytest
import torch

import opinfo
import tempo  # noqa: F401  (loads the op library)


def _run(name, threads):
    """Op `name`'s large sample (tests/python/opinfo.py: past the parallel threshold) under
    `threads` threads with the global seed fixed; its outputs and input gradients."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        outs, inputs = opinfo.run(name, torch.float32, "cpu", "large", seed=1234)
        loss = sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs)
        # (statistics have no gradient: their outputs alone)
        grads = torch.autograd.grad(loss, inputs.leaves, allow_unused=True) if loss.requires_grad else ()
        return [o.detach().clone() for o in outs] + [g for g in grads if g is not None]
    finally:
        torch.set_num_threads(old)


OPS = sorted(opinfo.OPS)


# The ops whose reductions run (in part) in ATen's matmuls, on the BLAS torch links, rather than
# in tempo's kernels.
BLAS_OPS = {
    "attention",
    "fused_attention",
    "causal_linear_attention_prefix",
    "linear_cross_entropy",
    "linear_cross_entropy_stats",
    "gated_mlp",
    "gated_mlp_fused",
}


@functools.lru_cache(maxsize=None)  # one probe per run, not one per op
def _blas_is_thread_count_stable():
    """Whether torch.mm gives bitwise the same product at 1, 2 and 3 threads on this machine, on
    a product with a long reduction (linear_cross_entropy's input gradient: [256, 1000] x
    [1000, 64]). MKL on AVX-512 machines splits such a reduction over threads: it does not."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 1000, generator=g), torch.randn(1000, 64, generator=g)
    old = torch.get_num_threads()
    try:
        products = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            products.append(a @ b)
    finally:
        torch.set_num_threads(old)
    return all(torch.equal(p, products[0]) for p in products)


@pytest.mark.parametrize("name", OPS)
def test_bitwise_equal_across_runs_and_thread_counts(name):
    """Bitwise across runs at each thread count, and across thread counts, for every op; for the
    ops whose reductions are the BLAS's, across thread counts only where torch.mm itself is
    (otherwise within fp32 rounding of the 1-thread result)."""
    ref = _run(name, 1)
    strict = name not in BLAS_OPS or _blas_is_thread_count_stable()
    for threads in (1, 2, 3):
        got = _run(name, threads)
        again = _run(name, threads)
        assert len(got) == len(ref) == len(again)
        for i, (a, b, c) in enumerate(zip(got, ref, again)):
            assert torch.equal(a, c), "%s: tensor %d differs between two runs with %d threads" % (name, i, threads)
            if strict:
                assert torch.equal(a, b), "%s: tensor %d differs with %d threads (max %.3g)" % (
                    name,
                    i,
                    threads,
                    (a.double() - b.double()).abs().max().item(),
                )
            else:
                torch.testing.assert_close(
                    a,
                    b,
                    rtol=1e-5,
                    atol=1e-6 * max(b.abs().max().item(), 1e-30),
                    msg=lambda m: "%s, tensor %d, %d threads: %s" % (name, i, threads, m),
                )
