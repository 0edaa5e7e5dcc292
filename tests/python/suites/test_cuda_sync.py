"""No host synchronisation on CUDA: a training step of a model patched by tempo.optimize (and
each op's forward and backward) runs under torch.cuda.set_sync_debug_mode("error"), which
raises at any call that waits for the device (.item(), a copy to pageable host memory,
nonzero). The norms decide their kept columns on the device (norm_kept_slots); the label
check of linear_cross_entropy asserts on the device. CUDA only."""

import contextlib
import warnings

import pytest
import torch

import opinfo
from configs import tiny_bert
import tempo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", list(opinfo.OPS))
def test_op_forward_and_backward_do_not_synchronise(op, dtype):
    """Each op's sample (tests/python/opinfo.py) on tensors already on the device: a warm-up call
    (allocator, kernels loaded), then the same call's forward and backward with none."""
    out, inputs = opinfo.step(op, dtype, "cuda", "small")
    with no_sync():
        out, inputs = opinfo.step(op, dtype, "cuda", "small", reuse=inputs)
    torch.cuda.synchronize()
    assert all(torch.isfinite(o).all() for o in out)
    assert all(t.grad is None or torch.isfinite(t.grad).all() for t in inputs.leaves)


def _bert():
    transformers = pytest.importorskip("transformers")
    cfg = tiny_bert(0.1, hidden_size=128, intermediate_size=256, vocab_size=500)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg).cuda().train()


@pytest.mark.parametrize("amp", [False, True])
def test_patched_training_step_does_not_synchronise(amp):
    model = tempo.optimize(_bert())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True, capturable=True)
    ids = torch.randint(0, 500, (4, 64), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            out = model(input_ids=ids)
        out.logits.float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with no_sync():
        for _ in range(2):
            step()
    torch.cuda.synchronize()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_kept_slot_overflow_warns_on_a_later_call():
    """More columns to keep than the slots (16 of 96 here): the rest are recovered from y in
    that step, and a later call, finding the count copied back, warns with the numbers."""
    x = torch.randn(8, 96, device="cuda", requires_grad=True)
    w = torch.full((96,), 1e-3, device="cuda")
    b = torch.ones(96, device="cuda")  # |beta| > 16 |gamma|: every column needs keeping
    tempo.layer_norm(x, (96,), w, b).sum().backward()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tempo.layer_norm(x, (96,), w, b).sum().backward()
    assert any("96 of 96 columns needed their xhat kept" in str(c.message) for c in caught), [
        str(c.message) for c in caught
    ]
