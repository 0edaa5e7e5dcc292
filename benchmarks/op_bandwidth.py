#!/usr/bin/env python3
"""Bandwidth of each tempo kernel as a share of a plain copy on the same device: the bytes an
op must move (its inputs read once, its outputs written once, from shapes and dtypes) over its
measured time, against a device-to-device copy of the same tensor (torch's clone). Forward and
backward separately; the median of --repeats timed runs after warm-up (CUDA events on a GPU,
the wall clock on the CPU). Writes CSV and JSON; prints a table.

    python benchmarks/op_bandwidth.py --device cuda --rows 16384 --cols 4096 --dtypes fp32,bf16 \\
        --csv OUT.csv --json OUT.json
    python benchmarks/op_bandwidth.py --device cpu --rows 64 --cols 256    # a quick run anywhere
"""
import argparse
import csv
import json
import statistics
import sys
import time

import torch

import tempo

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def timer(device, repeats):
    """Median seconds of fn() over `repeats` runs, after two warm-up runs."""
    def run(fn):
        for _ in range(2):
            fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return run


def cases(rows, cols, dtype, device, seq):
    """(name, forward closure, backward closure, forward bytes, backward bytes) per op."""
    e = torch.empty((), dtype=dtype).element_size()
    n = rows * cols
    bits = (n + 7) // 8
    x = torch.randn(rows, cols, dtype=dtype, device=device)
    dy = torch.randn_like(x)
    w = torch.randn(cols, dtype=dtype, device=device)
    b = torch.randn(cols, dtype=dtype, device=device)
    out = []

    def with_grad(f, *inputs):
        """The forward, and a backward from a fresh graph's output each time (the forward untimed)."""
        leaves = [t.detach().requires_grad_(True) for t in inputs]

        def fwd():
            with torch.no_grad():
                f(*inputs)

        def bwd_setup():
            y = f(*leaves)
            return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)
        return fwd, bwd_setup

    # activation: read x, write y and 1 bit/element; backward reads y, dy and the bits, writes dx
    for name, f in (("gelu", lambda t: tempo.gelu(t)), ("silu", lambda t: tempo.silu(t))):
        fwd, bwd = with_grad(f, x)
        out.append((name, fwd, bwd, 2 * n * e + bits, 3 * n * e + bits))
    # norms: forward reads x and the parameters, writes y and one rstd per row; backward reads
    # y, dy, the parameters and rstd, writes dx and the parameter gradients
    fwd, bwd = with_grad(lambda t, g, bb: tempo.layer_norm(t, (cols,), g, bb), x, w, b)
    out.append(("layer_norm", fwd, bwd, 2 * n * e + 2 * cols * e + rows * 4,
                3 * n * e + 4 * cols * e + rows * 4))
    fwd, bwd = with_grad(lambda t, g: tempo.rms_norm(t, (cols,), g), x, w)
    out.append(("rms_norm", fwd, bwd, 2 * n * e + cols * e + rows * 4, 3 * n * e + 2 * cols * e + rows * 4))
    # dropout: read x, write y and the bits; backward reads dy and the bits, writes dx
    fwd, bwd = with_grad(lambda t: tempo.dropout(t, 0.1), x)
    out.append(("dropout", fwd, bwd, 2 * n * e + bits, 2 * n * e + bits))
    # bias + dropout + residual + LayerNorm in one pass: reads x, the residual and 3 vectors,
    # writes y, the bits and rstd; backward reads y, dy, the bits, gamma, beta and rstd, writes
    # dx, dresidual (the same tensor as dx when possible: counted once) and 3 vector gradients
    r = torch.randn_like(x)
    fwd, bwd = with_grad(lambda t, bb, rr, g, be: tempo.bias_dropout_add_layer_norm(t, bb, rr, 0.1, g, be),
                         x, b, r, w, b)
    out.append(("bias_dropout_add_layer_norm", fwd, bwd, 3 * n * e + 3 * cols * e + bits + rows * 4,
                3 * n * e + 5 * cols * e + bits + rows * 4))
    # attention over [batch, heads, seq, 64]: q, k, v read and the output written (the scores
    # stay on chip in the fused kernel); backward reads q, k, v, o, do, the row statistics, writes dq, dk, dv
    d = 64
    heads = max(1, n // (seq * d))
    q, k, v = (torch.randn(1, heads, seq, d, dtype=dtype, device=device) for _ in range(3))
    na = heads * seq * d
    do = torch.randn_like(q)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def att_fwd():
        with torch.no_grad():
            tempo.fused_attention(q, k, v)

    def att_bwd():
        y = tempo.fused_attention(*leaves)
        return lambda: torch.autograd.grad(y, leaves, do, retain_graph=True)
    out.append(("fused_attention", att_fwd, att_bwd, 4 * na * e, 8 * na * e + heads * seq * 8))
    return out, n * e


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--seq", type=int, default=512, help="attention's sequence length")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--csv")
    p.add_argument("--json")
    a = p.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("op_bandwidth: --device cuda but no CUDA device is available")
    run = timer(device, a.repeats)
    rows = []
    print("%-28s %-5s %-8s %10s %10s %8s" % ("op", "dtype", "pass", "GB/s", "copy GB/s", "% copy"))
    for name in a.dtypes.split(","):
        if name not in DTYPES:
            sys.exit("op_bandwidth: unknown dtype %r (one of %s)" % (name, ", ".join(DTYPES)))
        dtype = DTYPES[name]
        ops, tensor_bytes = cases(a.rows, a.cols, dtype, device, a.seq)
        src = torch.randn(a.rows, a.cols, device=device).to(dtype)
        copy_s = run(lambda: src.clone())
        copy_gbs = 2 * tensor_bytes / copy_s / 1e9
        for op, fwd, bwd_setup, fbytes, bbytes in ops:
            bwd = bwd_setup()
            for phase, fn, nbytes in (("forward", fwd, fbytes), ("backward", bwd, bbytes)):
                s = run(fn)
                gbs = nbytes / s / 1e9
                row = {"op": op, "dtype": name, "pass": phase, "device": device.type, "rows": a.rows, "cols": a.cols,
                       "bytes": nbytes, "seconds": s, "gb_per_s": gbs, "copy_gb_per_s": copy_gbs,
                       "share_of_copy": gbs / copy_gbs}
                rows.append(row)
                print("%-28s %-5s %-8s %10.1f %10.1f %7.0f%%" % (op, name, phase, gbs, copy_gbs, 100 * gbs / copy_gbs))
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
