#!/usr/bin/env python3
"""One small case of each CUDA op, forward and backward, for compute-sanitizer (memcheck,
racecheck) in scripts/gpu_check.sh: odd widths (the vector tail), a kept norm column, 16- and
32-bit data. Prints one line per op; exits non-zero if an op raises.

    compute-sanitizer --tool memcheck --kernel-name kns=tempo python scripts/sanitize_ops.py
"""

import sys

import torch

import tempo


def cases(dtype, dev="cuda"):
    """Each op of csrc/ops.json (tests/python/test_registry.py holds this to it) by name, or by
    name_variant: a function that runs it and returns a tensor to differentiate (None: an op
    without a gradient)."""
    x = torch.randn(37, 203, device=dev, dtype=dtype, requires_grad=True)
    w = torch.rand(203, device=dev, dtype=dtype) + 0.5
    w[5] = 0.0  # a kept column
    w.requires_grad_()
    b = (torch.randn(203, device=dev, dtype=dtype) * 0.1).requires_grad_()
    q = torch.randn(2, 3, 33, 16, device=dev, dtype=dtype, requires_grad=True)
    mask = torch.rand(33, 33, device=dev) > 0.2
    h = torch.randn(37, 24, device=dev, dtype=dtype, requires_grad=True)
    head = torch.randn(101, 24, device=dev, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 101, (37,), device=dev)
    labels[3] = -100
    pos = torch.rand(2, 17, 8, device=dev, dtype=dtype, requires_grad=True)
    vv = torch.randn(2, 17, 5, device=dev, dtype=dtype, requires_grad=True)
    wg = (torch.randn(2 * 45, 24, device=dev, dtype=dtype) * 0.2).requires_grad_()  # odd widths: the vector tails
    wd = (torch.randn(24, 45, device=dev, dtype=dtype) * 0.2).requires_grad_()
    # rope's tables: x's dtype, float32 beside 16-bit x (as transformers under autocast gives them)
    tdt = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    ang = torch.arange(33, device=dev, dtype=tdt)[:, None] * torch.rand(12, device=dev, dtype=tdt)
    return {
        "gelu": lambda: tempo.gelu(x, bias=b),
        "gelu_tanh": lambda: tempo.gelu(x, "tanh"),
        "silu": lambda: tempo.silu(x),
        "dropout_bits": lambda: tempo.dropout(x, 0.3),
        "dropout_philox": lambda: tempo.dropout(x, 0.3, mode="philox"),
        "layer_norm": lambda: tempo.layer_norm(x, (203,), w, b),
        "rms_norm": lambda: tempo.rms_norm(x, (203,), w, 1e-6),
        "bias_dropout_add_layer_norm": lambda: tempo.bias_dropout_add_layer_norm(x, b, x, 0.2, w, b),
        "attention": lambda: tempo.attention(q, q, q, mask, dropout_p=0.1),
        "fused_attention": lambda: tempo.fused_attention(q, q, q, mask, dropout_p=0.1),
        "qkv_split": lambda: torch.stack(tempo.qkv_split(torch.cat([q.flatten(1, 2)] * 3, -1)[:, :33], None, 4)),
        "rope": lambda: tempo.rope(q.view(2, 33, 3, 16).transpose(1, 2), ang.cos(), ang.sin()),  # 12 of 16 rotate
        "rope_own_dtype": lambda: tempo.rope(q, ang.cos().to(dtype), ang.sin().to(dtype)),
        "causal_linear_attention": lambda: tempo.causal_linear_attention(pos, pos, vv)[0],
        "linear_cross_entropy": lambda: tempo.linear_cross_entropy(h, head, None, labels),
        "linear_cross_entropy_stats": lambda: tempo.linear_cross_entropy_stats(h, head, None, labels)["entropy"],
        "gated_mlp": lambda: tempo.gated_mlp(h, wg[:45], wg[45:], wd, chunk=16),
        "gated_mlp_fused": lambda: tempo.gated_mlp(h, wg, None, wd, activation="gelu_tanh"),
    }


def main():
    bad = 0
    for dtype in (torch.float32, torch.bfloat16):
        for name, f in cases(dtype).items():
            try:
                y = f()
                if y.requires_grad:
                    y.float().square().sum().backward()
                torch.cuda.synchronize()
                print("%-28s %-9s ok" % (name, str(dtype).replace("torch.", "")), flush=True)
            except Exception as e:  # noqa: BLE001
                bad += 1
                print("%-28s %-9s FAILED: %s" % (name, dtype, e), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
