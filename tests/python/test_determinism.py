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

import tempo


def _inputs(seed, *shapes, positive=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(*s, generator=g) for s in shapes]
    if positive:
        out = [t.abs() + 0.1 for t in out]
    return [t.requires_grad_() for t in out]


def _run(fn, threads):
    """fn() under `threads` threads with the global seed fixed; outputs and input gradients."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(1234)
        inputs, outs = fn()
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        loss = sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs)
        # (statistics have no gradient: their outputs alone)
        grads = torch.autograd.grad(loss, inputs, allow_unused=True) if loss.requires_grad else ()
        return [o.detach().clone() for o in outs] + [g for g in grads if g is not None]
    finally:
        torch.set_num_threads(old)


def _gelu():
    x, b = _inputs(1, (64, 1024), (1024,))
    return (x, b), tempo.gelu(x, bias=b)


def _silu():
    x, b = _inputs(2, (96, 515), (515,))
    return (x, b), tempo.silu(x, bias=b)


def _dropout(mode):
    def f():
        (x,) = _inputs(3, (128, 777))
        return (x,), tempo.dropout(x, 0.3, mode=mode)

    return f


def _layer_norm():
    x, w, b = _inputs(4, (512, 768), (768,), (768,))
    return (x, w, b), tempo.layer_norm(x, [768], w, b)


def _rms_norm():
    x, w = _inputs(5, (300, 1000), (1000,))
    return (x, w), tempo.rms_norm(x, [1000], w)


def _bias_dropout_add_layer_norm():
    x, b, r, w, beta = _inputs(6, (400, 512), (512,), (400, 512), (512,), (512,))
    return (x, b, r, w, beta), tempo.bias_dropout_add_layer_norm(x, b, r, 0.1, w, beta)


def _attention(fused):
    def f():
        q, k, v = _inputs(7, (2, 4, 96, 32), (2, 4, 96, 32), (2, 4, 96, 32))
        op = tempo.fused_attention if fused else tempo.attention
        return (q, k, v), op(q, k, v, dropout_p=0.1, causal=True)

    return f


def _linear_attention(mode):
    def f():
        qf, kf = _inputs(8, (2, 4, 200, 16), (2, 4, 200, 16), positive=True)
        (v,) = _inputs(9, (2, 4, 200, 24))
        y, (num, den) = tempo.causal_linear_attention(qf, kf, v, mode=mode)
        return (qf, kf, v), (y, num, den)

    return f


def _linear_cross_entropy():
    h, w, b = _inputs(10, (256, 64), (1000, 64), (1000,))
    labels = torch.randint(0, 1000, (256,), generator=torch.Generator().manual_seed(11))
    return (h, w, b), tempo.linear_cross_entropy(h, w, b, labels)


def _linear_cross_entropy_stats():
    h, w, b = _inputs(10, (256, 64), (1000, 64), (1000,))
    labels = torch.randint(0, 1000, (256,), generator=torch.Generator().manual_seed(11))
    stats = tempo.linear_cross_entropy_stats(h, w, b, labels, temperature=0.7)
    return (h,), (stats["logprob"], stats["entropy"], stats["accuracy"].float())


def _gated_mlp(activation):
    def f():
        x, wg, wu, wd = _inputs(13, (300, 96), (160, 96), (160, 96), (96, 160))
        return (x, wg, wu, wd), tempo.gated_mlp(x, wg * 0.1, wu * 0.1, wd * 0.1, activation=activation, chunk=64)

    return f


def _qkv_split():
    z, b = _inputs(12, (4, 128, 3 * 256), (3 * 256,))
    return (z, b), tempo.qkv_split(z, b, 4)


def _rope():
    (x,) = _inputs(13, (4, 256, 8, 64))
    ang = torch.arange(256.0)[:, None] * torch.linspace(0.01, 1, 64)
    return (x,), tempo.rope(x.transpose(1, 2), ang.cos(), ang.sin())


OPS = {
    "gelu+bias": _gelu,
    "silu+bias": _silu,
    "dropout bits": _dropout("bits"),
    "dropout philox": _dropout("philox"),
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "bias_dropout_add_layer_norm": _bias_dropout_add_layer_norm,
    "attention": _attention(False),
    "fused_attention": _attention(True),
    "causal_linear_attention iterative": _linear_attention("iterative"),
    "causal_linear_attention prefix": _linear_attention("prefix"),
    "linear_cross_entropy": _linear_cross_entropy,
    "linear_cross_entropy_stats": _linear_cross_entropy_stats,
    "gated_mlp silu": _gated_mlp("silu"),
    "gated_mlp gelu_tanh": _gated_mlp("gelu_tanh"),
    "qkv_split": _qkv_split,
    "rope": _rope,
}


# The ops whose reductions run (in part) in ATen's matmuls, on the BLAS torch links, rather than
# in tempo's kernels.
BLAS_OPS = {
    "attention",
    "fused_attention",
    "causal_linear_attention prefix",
    "linear_cross_entropy",
    "linear_cross_entropy_stats",
    "gated_mlp silu",
    "gated_mlp gelu_tanh",
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


@pytest.mark.parametrize("name", sorted(OPS))
def test_bitwise_equal_across_runs_and_thread_counts(name):
    """Bitwise across runs at each thread count, and across thread counts, for every op; for the
    ops whose reductions are the BLAS's, across thread counts only where torch.mm itself is
    (otherwise within fp32 rounding of the 1-thread result)."""
    ref = _run(OPS[name], 1)
    strict = name not in BLAS_OPS or _blas_is_thread_count_stable()
    for threads in (1, 2, 3):
        got = _run(OPS[name], threads)
        again = _run(OPS[name], threads)
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
