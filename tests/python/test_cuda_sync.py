"""No host synchronisation on CUDA: a training step of a model patched by tempo.optimize (and
each op's forward and backward) runs under torch.cuda.set_sync_debug_mode("error"), which
raises at any call that waits for the device (.item(), a copy to pageable host memory,
nonzero). The norms decide their kept columns on the device (norm_kept_slots); the label
check of linear_cross_entropy asserts on the device. CUDA only."""

import contextlib
import warnings

import pytest
import torch

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


OPS = {
    "gelu": lambda x, w, b: tempo.gelu(x, bias=b),
    "silu": lambda x, w, b: tempo.silu(x),
    "dropout_bits": lambda x, w, b: tempo.dropout(x, 0.2),
    "dropout_philox": lambda x, w, b: tempo.dropout(x, 0.2, mode="philox"),
    "layer_norm": lambda x, w, b: tempo.layer_norm(x, (x.shape[-1],), w, b),
    "rms_norm": lambda x, w, b: tempo.rms_norm(x, (x.shape[-1],), w, 1e-6),
    "bias_dropout_add_layer_norm": lambda x, w, b: tempo.bias_dropout_add_layer_norm(x, b, x, 0.1, w, b),
    "attention": lambda x, w, b: tempo.attention(*(x.view(2, 4, 16, 32),) * 3, dropout_p=0.1),
    "fused_attention": lambda x, w, b: tempo.fused_attention(*(x.view(2, 4, 16, 32),) * 3, causal=True),
    "linear_cross_entropy": lambda x, w, b: tempo.linear_cross_entropy(
        x,
        torch.ones(50, x.shape[-1], device=x.device, dtype=x.dtype) * w[:1],
        None,
        torch.arange(x.shape[0], device=x.device) % 50,
    ),
    "linear_cross_entropy_stats": lambda x, w, b: (
        tempo.linear_cross_entropy_stats(
            x,
            torch.ones(50, x.shape[-1], device=x.device, dtype=x.dtype) * w[:1],
            None,
            torch.arange(x.shape[0], device=x.device) % 50,
        )["entropy"]
        + (x * 0).sum()
    ),
    "qkv_split": lambda x, w, b: torch.stack(tempo.qkv_split(torch.cat([x, x, x], -1).view(2, 64, 96), b.repeat(3), 4)),
    "rope": lambda x, w, b: tempo.rope(
        x.view(2, 64, 4, 8).transpose(1, 2),
        torch.linspace(-1, 1, 512, device=x.device, dtype=x.dtype).view(64, 8),
        torch.linspace(1, -1, 512, device=x.device, dtype=x.dtype).view(64, 8),
    ),
    "causal_linear_attention": lambda x, w, b: tempo.causal_linear_attention(
        x.view(2, 4, 16, 32).abs() + 0.1, x.view(2, 4, 16, 32).abs() + 0.1, x.view(2, 4, 16, 32)
    )[0],
    "gated_mlp": lambda x, w, b: tempo.gated_mlp(
        x,
        torch.ones(64, 32, device=x.device, dtype=x.dtype) * w[:1],
        None,
        torch.ones(32, 32, device=x.device, dtype=x.dtype) * b[:1],
        chunk=8,
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", list(OPS))
def test_op_forward_and_backward_do_not_synchronise(op, dtype):
    x = torch.randn(128, 32, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.rand(32, device="cuda", dtype=dtype) + 0.5).requires_grad_()
    b = torch.randn(32, device="cuda", dtype=dtype).mul_(0.1).requires_grad_()
    OPS[op](x, w, b).float().sum().backward()  # warm-up: allocator, kernels loaded
    with no_sync():
        y = OPS[op](x, w, b)
        y.float().square().sum().backward()
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad).all()


def _bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        vocab_size=500,
        max_position_embeddings=64,
    )
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
