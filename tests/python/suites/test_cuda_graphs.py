"""tempo's dropping ops inside CUDA graphs (torch.cuda.graph, and torch.compile's
mode="reduce-overhead", which records CUDA graphs): each replay draws a new mask, from the CUDA
generator's state that PyTorch rewrites in device memory before every replay, and the backward
recorded beside the forward reads that replay's mask. Outside a capture the seed comes from the
CPU generator (test_dropout.py's CPU/CUDA agreement); a seed drawn on the host while recording
would be frozen into the graph, every step dropping the same elements. CUDA only."""

import copy

import pytest
import torch
import torch.nn.functional as F

import opinfo
from configs import tiny_bert
import tempo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

P = 0.3
REPLAYS = 3


def capture(step, *inputs):
    """step(*inputs) recorded in a CUDA graph (after a warm-up on a side stream, as PyTorch
    asks); returns the graph and the step's outputs (static tensors each replay rewrites)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(*inputs)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step(*inputs)
    return g, outs


def replays(g, outs):
    got = []
    for _ in range(REPLAYS):
        g.replay()
        torch.cuda.synchronize()
        got.append([o.detach().clone() for o in outs])
    return got


def assert_masks_differ(masks):
    for i in range(len(masks)):
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), f"replays {j} and {i} dropped the same elements"
    for m in masks:
        frac = m.float().mean().item()
        assert abs(frac - (1 - P)) < 0.05, f"kept fraction {frac:.3f}, expected {1 - P}"


@pytest.mark.parametrize("mode", ["bits", "philox"])
def test_dropout_replays_draw_new_masks_and_the_backward_reads_them(mode):
    x = torch.ones(64, 1031, device="cuda", requires_grad=True)

    def step(x):
        y = tempo.dropout(x, P, mode=mode)
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        return y, dx

    g, outs = capture(step, x)
    got = replays(g, outs)
    for y, dx in got:
        # x = 1 and an output gradient of 1: the backward's dx is the forward's y, bit for bit,
        # only when both used one mask
        assert torch.equal(dx, y)
    assert_masks_differ([y != 0 for y, _ in got])


@pytest.mark.parametrize("op", ["attention-bits", "attention-philox", "fused_attention"])
def test_attention_replays_draw_new_masks_and_the_backward_reads_them(op):
    B, A, S, d = 2, 3, 64, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, A, S, d, device="cuda", generator=gen)
    k = torch.randn(B, A, S, d, device="cuda", generator=gen)
    # v = I: the output is the dropped probabilities themselves
    v = torch.eye(S, device="cuda").expand(B, A, S, S).contiguous().requires_grad_(True)
    go = torch.randn(B, A, S, S, device="cuda", generator=gen)

    def step(v):
        if op == "fused_attention":
            out = tempo.fused_attention(q, k, v, None, P)
        else:
            out = tempo.attention(q, k, v, None, P, mode=op.split("-")[1])
        (dv,) = torch.autograd.grad(out, v, go)
        return out, dv

    g, outs = capture(step, v)
    got = replays(g, outs)
    for out, dv in got:
        # dv = P_dropped^T go, with the forward's P_dropped
        torch.testing.assert_close(dv, out.transpose(-1, -2) @ go, rtol=1e-4, atol=1e-4)
    assert_masks_differ([out != 0 for out, _ in got])


def test_bias_dropout_add_layer_norm_replays_draw_new_masks_and_the_backward_reads_them():
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(256, 128, device="cuda", generator=gen).requires_grad_(True)
    res = torch.zeros(256, 128, device="cuda")
    go = torch.randn(256, 128, device="cuda", generator=gen)

    def step(x):
        y = tempo.bias_dropout_add_layer_norm(x, None, res, P, None, None, 1e-5)
        (dx,) = torch.autograd.grad(y, x, go)
        return y, dx

    g, outs = capture(step, x)
    got = replays(g, outs)
    for y, dx in got:
        keep = dx != 0  # the backward's mask: dx = keep / (1 - p) * (LayerNorm's dh)
        want = F.layer_norm(x.detach() * keep / (1 - P), (128,), eps=1e-5)  # the forward with that mask
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    assert_masks_differ([dx != 0 for _, dx in got])


def test_reduce_overhead_compile_of_a_patched_bert_drops_anew_each_step():
    """torch.compile(mode="reduce-overhead") of a BERT patched with every technique, dropout on:
    the same batch gives a different loss each step (a new mask), every loss and gradient is
    finite, and in eval mode the compiled model gives eager's output."""
    transformers = pytest.importorskip("transformers")
    cfg = tiny_bert(0.1, hidden_size=128, intermediate_size=256, vocab_size=500)
    torch.manual_seed(0)
    model = tempo.optimize(transformers.BertForMaskedLM(cfg), attention="tempo", fused=True).cuda().train()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, mode="reduce-overhead")
    ids = torch.randint(0, 500, (4, 64), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    losses = []
    for _ in range(5):
        loss = F.cross_entropy(compiled(input_ids=ids).logits.flatten(0, 1), ids.flatten())
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert len(set(losses[2:])) == len(losses[2:]), f"replayed steps repeat a loss (the same mask): {losses}"
    model.eval(), eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, eager(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_norms_in_a_graph_stay_exact_as_the_weights_change(kind):
    """The kept columns depend on the weights, which change between replays (the optimizer's
    step): on CUDA they are decided by device ops into fixed slots (norm_kept_slots), which the
    graph records, so each replay decides them again from the weights it finds and the
    gradients stay torch's whatever the weights become, a zero gamma included."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(64, 96, device="cuda", generator=gen, requires_grad=True)
    w = torch.randn(96, device="cuda", generator=gen, requires_grad=True)
    b = torch.randn(96, device="cuda", generator=gen, requires_grad=True)
    go = torch.randn(64, 96, device="cuda", generator=gen)

    def run(fn):
        y = fn(x, w, b)
        return (y,) + torch.autograd.grad(y, (x, w) if kind == "rms_norm" else (x, w, b), go)

    ours = (
        (lambda x, w, b: tempo.rms_norm(x, (96,), w, 1e-6))
        if kind == "rms_norm"
        else (lambda x, w, b: tempo.layer_norm(x, (96,), w, b, 1e-5))
    )
    ref = (
        (lambda x, w, b: F.rms_norm(x.double(), (96,), w.double(), 1e-6))
        if kind == "rms_norm"
        else (lambda x, w, b: F.layer_norm(x.double(), (96,), w.double(), b.double(), 1e-5))
    )
    g, outs = capture(lambda: run(ours))
    for step in range(3):
        with torch.no_grad():  # what an optimizer does between steps, down to a zero gamma
            w.mul_(0.5).add_(0.1 * step)
            w[step] = 0.0
            w[10 + step] = 1e-30
        g.replay()
        want = run(ref)
        for got, exact in zip(outs, want):
            torch.testing.assert_close(got.double(), exact.double(), rtol=1e-4, atol=1e-4)


def test_linear_cross_entropy_in_a_graph_matches_torch_as_the_batch_changes():
    """The label check cannot read a result on the host in a capture (it asserts on the device
    there, as torch's cross_entropy does); with valid labels, each replay over new hidden
    states and labels gives torch's loss and gradients."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    N, H, V = 96, 64, 1000
    h = torch.randn(N, H, device="cuda", generator=gen, requires_grad=True)
    w = (0.1 * torch.randn(V, H, device="cuda", generator=gen)).requires_grad_(True)
    labels = torch.randint(0, V, (N,), device="cuda", generator=gen)

    def step():
        loss = tempo.linear_cross_entropy(h, w, None, labels)
        return (loss,) + torch.autograd.grad(loss, (h, w))

    g, outs = capture(step)
    for _ in range(3):
        with torch.no_grad():
            h.copy_(torch.randn(N, H, device="cuda", generator=gen))
            labels.copy_(torch.randint(0, V, (N,), device="cuda", generator=gen))
            labels[:5] = -100  # ignored rows
        g.replay()
        hd, wd = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
        ref = F.cross_entropy(hd @ wd.t(), labels)
        want = (ref,) + torch.autograd.grad(ref, (hd, wd))
        for got, exact in zip(outs, want):
            torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", list(opinfo.OPS))
def test_every_op_replays_in_a_graph_as_it_runs_eagerly(op, dtype):
    """Each op of the op table (tests/python/opinfo.py), forward and backward recorded in one
    graph: its replays give bitwise the outputs and gradients of the same call run eagerly, and
    for the ops that drop, finite values from a new mask each replay (the tests above check the
    masks themselves)."""
    out, inputs = opinfo.run(op, dtype, "cuda", "small")

    def step():
        o, i = opinfo.step(op, dtype, "cuda", "small", reuse=inputs, reseed=False)
        return list(o) + [t.grad for t in i.leaves if t.grad is not None]

    want = [t.detach().clone() for t in step()]
    g, outs = capture(step)
    got = replays(g, outs)
    for r in got:
        assert len(r) == len(want), op
        for k, (a, b) in enumerate(zip(r, want)):
            if opinfo.OPS[op].random:
                assert torch.isfinite(a.float()).all(), (op, k)
            else:
                assert torch.equal(a, b), (op, k, (a.float() - b.float()).abs().max().item())
