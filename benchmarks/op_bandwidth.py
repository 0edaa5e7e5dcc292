#!/usr/bin/env python3
"""Bandwidth of each tempo kernel as a share of a plain copy on the same device: the bytes an
op must move (its inputs read once, its outputs written once, from shapes and dtypes) over its
measured time, against a device-to-device copy of the same tensor (torch's clone). Forward and
backward separately; the median of --repeats timed runs after warm-up (CUDA events on a GPU,
the wall clock on the CPU). Writes CSV and JSON; prints a table.

Each op is timed beside torch's own op (or the unfused chain for a fused op) and Liger-Kernel's
where it has one (installed: on the GPU run from the wheel `make deps` puts in .deps/wheels),
in the same process; "vs tempo" is a row's time over tempo's (above 1: slower than tempo).

    python benchmarks/op_bandwidth.py --device cuda --rows 16384 --cols 1024,4096,8192 \\
        --dtypes fp32,bf16,fp16 --csv OUT.csv --json OUT.json
    python benchmarks/op_bandwidth.py --device cpu --rows 64 --cols 256    # a quick run anywhere
"""

import argparse
import csv
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

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


def liger_functional():
    """Liger-Kernel's functional ops when it is installed (and Triton runs here), else None."""
    try:
        from liger_kernel.transformers import functional as lf

        return lf
    except Exception as e:  # noqa: BLE001  (an ImportError, or Triton failing to load)
        print("op_bandwidth: Liger-Kernel not available (%s: %s); its rows are skipped" % (type(e).__name__, e))
        return None


def cases(rows, cols, dtype, device, seq, liger, attention):
    """(op, implementation, forward closure, backward setup, forward bytes, backward bytes)
    per op and implementation: tempo's, torch's own op (or the unfused chain for a fused op),
    and Liger-Kernel's where it has the op. The bytes are the op's minimum (tempo's saved
    tensors: y and 1 bit, rstd); a peer that keeps x moves the same or more, so each row's
    share of a copy is against those same bytes and the times compare directly."""
    e = torch.empty((), dtype=dtype).element_size()
    n = rows * cols
    bits = (n + 7) // 8
    x = torch.randn(rows, cols, dtype=dtype, device=device)
    dy = torch.randn_like(x)
    w = torch.rand(cols, dtype=dtype, device=device) + 0.5
    b = torch.randn(cols, dtype=dtype, device=device) * 0.1
    r = torch.randn_like(x)
    up = torch.randn_like(x)
    out = []

    def with_grad(f, inputs, grad):
        """The forward, and a backward from a fresh graph's output each time (the forward untimed);
        grad: the output's gradient (None for a scalar loss)."""
        leaves = [t.detach().requires_grad_(True) for t in inputs]

        def fwd():
            with torch.no_grad():
                f(*inputs)

        def bwd_setup():
            y = f(*leaves)
            return lambda: torch.autograd.grad(y, leaves, grad, retain_graph=True)

        return fwd, bwd_setup

    def add(op, impls, fbytes, bbytes, *inputs, grad=dy):
        for impl, f in impls:
            if f is None:
                continue
            fwd, bwd = with_grad(f, inputs, grad)
            out.append((op, impl, fwd, bwd, fbytes, bbytes))

    # activation: read x, write y and 1 bit/element; backward reads y, dy and the bits, writes dx
    add("gelu", [("tempo", tempo.gelu), ("torch", F.gelu)], 2 * n * e + bits, 3 * n * e + bits, x)
    add("silu", [("tempo", tempo.silu), ("torch", F.silu)], 2 * n * e + bits, 3 * n * e + bits, x)
    # SwiGLU silu(a) * b: reads a, b, writes the product (tempo keeps silu(a) and a bit, and b);
    # backward reads dy, the kept tensors, writes da, db
    add(
        "swiglu",
        [
            ("tempo", lambda a_, b_: tempo.silu(a_) * b_),
            ("torch", lambda a_, b_: F.silu(a_) * b_),
            ("liger", liger and liger.liger_swiglu),
        ],
        3 * n * e,
        5 * n * e,
        x,
        up,
    )
    # the whole gated MLP (H = I = cols here): time beside torch's chain and Liger's SwiGLU between torch's
    # linears; its bytes are the elementwise part's (gate, up read, h written; backward: gate, up, dh read, dgate,
    # dup, h written), so the GEMMs, which dominate, make its "share of a copy" low by design
    wmlp = [torch.randn(cols, cols, dtype=dtype, device=device) / cols**0.5 for _ in range(3)]

    def liger_mlp(t, wg, wu, wd):
        return F.linear(liger.liger_swiglu(F.linear(t, wg), F.linear(t, wu)), wd)

    add(
        "gated_mlp",
        [
            ("tempo", lambda t, wg, wu, wd: tempo.gated_mlp(t, wg, wu, wd)),
            ("torch", lambda t, wg, wu, wd: F.linear(F.silu(F.linear(t, wg)) * F.linear(t, wu), wd)),
            ("liger", liger and liger_mlp),
        ],
        3 * n * e,
        6 * n * e,
        x,
        *wmlp,
    )
    # norms: forward reads x and the parameters, writes y and one rstd per row; backward reads
    # y, dy, the parameters and rstd, writes dx and the parameter gradients
    add(
        "layer_norm",
        [
            ("tempo", lambda t, g, bb: tempo.layer_norm(t, (cols,), g, bb)),
            ("torch", lambda t, g, bb: F.layer_norm(t, (cols,), g, bb)),
            ("liger", liger and (lambda t, g, bb: liger.liger_layer_norm(t, g, bb, 1e-5))),
        ],
        2 * n * e + 2 * cols * e + rows * 4,
        3 * n * e + 4 * cols * e + rows * 4,
        x,
        w,
        b,
    )
    add(
        "rms_norm",
        [
            ("tempo", lambda t, g: tempo.rms_norm(t, (cols,), g, 1e-6)),
            ("torch", lambda t, g: F.rms_norm(t, (cols,), g, 1e-6)),
            ("liger", liger and (lambda t, g: liger.liger_rms_norm(t, g, 1e-6, in_place=False))),
        ],
        2 * n * e + cols * e + rows * 4,
        3 * n * e + 2 * cols * e + rows * 4,
        x,
        w,
    )
    # dropout: read x, write y and the bits; backward reads dy and the bits, writes dx
    add(
        "dropout",
        [("tempo", lambda t: tempo.dropout(t, 0.1)), ("torch", lambda t: F.dropout(t, 0.1))],
        2 * n * e + bits,
        2 * n * e + bits,
        x,
    )
    # bias + dropout + residual + LayerNorm in one pass: reads x, the residual and 3 vectors,
    # writes y, the bits and rstd; backward reads y, dy, the bits, gamma, beta and rstd, writes
    # dx, dresidual (counted once: the same values) and 3 vector gradients
    add(
        "bias_dropout_add_layer_norm",
        [
            ("tempo", lambda t, bb, rr, g, be: tempo.bias_dropout_add_layer_norm(t, bb, rr, 0.1, g, be)),
            ("torch", lambda t, bb, rr, g, be: F.layer_norm(rr + F.dropout(t + bb, 0.1), (cols,), g, be)),
        ],
        3 * n * e + 3 * cols * e + bits + rows * 4,
        3 * n * e + 5 * cols * e + bits + rows * 4,
        x,
        b,
        r,
        w,
        b,
    )
    # attention over [2, 16, seq, 64] and the LM head: once per dtype, at the first width
    if not attention:
        return out, n * e
    # tempo's (non-fused) attention with dropout 0.1 and a causal mask beside the eager chain torch
    # users run (matmul, softmax, dropout, matmul): both write the S x S probabilities; tempo keeps P
    # and 1 bit, the chain P, the byte mask and the dropped P. Bytes: q, k, v, o and P written once
    # (forward); the backward reads them and writes dq, dk, dv (its GEMMs are most of the time)
    dh, nh = 64, 16
    qa, ka, va = (torch.randn(2, nh, seq, dh, dtype=dtype, device=device) for _ in range(3))
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()

    def eager_attention(a_, b_, c_):
        scores = (a_ @ b_.transpose(-1, -2)) * dh**-0.5
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return F.dropout(probs, 0.1) @ c_

    nq, np_ = 2 * nh * seq * dh, 2 * nh * seq * seq
    dao = torch.randn_like(qa)
    add(
        "attention",
        [
            ("tempo", lambda a_, b_, c_: tempo.attention(a_, b_, c_, dropout_p=0.1, causal=True)),
            ("torch eager", eager_attention),
        ],
        4 * nq * e + np_ * e + np_ // 8,
        7 * nq * e + np_ * e + np_ // 8,
        qa,
        ka,
        va,
        grad=dao,
    )
    # the LM head's loss, hidden [rows / 4, width] against a 32000-word head: GEMM-bound (the bytes
    # are hidden and the weight read once; the share of a copy says little), timed beside
    # F.cross_entropy of F.linear's logits and Liger-Kernel's fused linear cross entropy
    vocab, nt = 32000, max(1, rows // 4)
    hl = torch.randn(nt, cols, dtype=dtype, device=device)
    wl = torch.randn(vocab, cols, dtype=dtype, device=device) * cols**-0.5
    yl = torch.randint(0, vocab, (nt,), device=device)
    lce_bytes = (nt + vocab) * cols * e + nt * 8
    add(
        "linear_cross_entropy",
        [
            ("tempo", lambda h_, w_: tempo.linear_cross_entropy(h_, w_, labels=yl)),
            ("torch", lambda h_, w_: F.cross_entropy(F.linear(h_, w_).float(), yl)),
            ("liger", liger and (lambda h_, w_: liger.liger_fused_linear_cross_entropy(h_, w_, yl))),
        ],
        lce_bytes,
        2 * lce_bytes,
        hl,
        wl,
        grad=None,
    )
    # fused attention over the same q, k, v: q, k, v read and the output written (the scores stay
    # on chip); backward reads q, k, v, o, do, the row statistics, writes dq, dk, dv
    backend = tempo.fused_attention_backend(qa, ka, causal=True)
    add(
        "fused_attention",
        [
            ("tempo (%s)" % backend, lambda a_, b_, c_: tempo.fused_attention(a_, b_, c_, causal=True)),
            ("tempo (own, masked)", lambda a_, b_, c_: tempo.fused_attention(a_, b_, c_, causal)),
            ("torch", lambda a_, b_, c_: F.scaled_dot_product_attention(a_, b_, c_, is_causal=True)),
        ],
        4 * nq * e,
        8 * nq * e + 2 * nh * seq * 8,
        qa,
        ka,
        va,
        grad=dao,
    )
    return out, n * e


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--cols", default="1024,4096,8192", help="widths, comma-separated")
    p.add_argument("--seq", type=int, default=512, help="attention's sequence length")
    p.add_argument("--dtypes", default="fp32,bf16,fp16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--ops", default="", help="only these ops (comma-separated; default all)")
    p.add_argument("--no-liger", action="store_true")
    p.add_argument("--csv")
    p.add_argument("--json")
    a = p.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("op_bandwidth: --device cuda but no CUDA device is available")
    liger = None if a.no_liger or device.type != "cuda" else liger_functional()
    only = set(filter(None, a.ops.split(",")))
    run = timer(device, a.repeats)
    rows = []
    sink = {"csv": None}

    def emit(row):
        """Keeps the row and appends it to the CSV at once (a time-out leaves the rows done)."""
        rows.append(row)
        if a.csv:
            if sink["csv"] is None:
                f = open(a.csv, "w", newline="")
                sink["csv"] = (f, csv.DictWriter(f, fieldnames=list(row)))
                sink["csv"][1].writeheader()
            sink["csv"][1].writerow(row)
            sink["csv"][0].flush()

    print(
        "%-28s %-22s %-5s %5s %-8s %9s %8s %7s %9s"
        % ("op", "impl", "dtype", "cols", "pass", "us", "GB/s", "% copy", "vs tempo")
    )
    for wi, cols in enumerate(int(c) for c in a.cols.split(",")):
        for name in a.dtypes.split(","):
            if name not in DTYPES:
                sys.exit("op_bandwidth: unknown dtype %r (one of %s)" % (name, ", ".join(DTYPES)))
            dtype = DTYPES[name]
            ops, tensor_bytes = cases(a.rows, cols, dtype, device, a.seq, liger, attention=wi == 0)
            src = torch.randn(a.rows, cols, device=device).to(dtype)
            copy_s = run(src.clone)
            copy_gbs = 2 * tensor_bytes / copy_s / 1e9
            tempo_s = {}
            for op, impl, fwd, bwd_setup, fbytes, bbytes in ops:
                if only and op not in only:
                    continue
                try:
                    bwd = bwd_setup()
                    phases = (("forward", fwd, fbytes), ("backward", bwd, bbytes))
                    for phase, fn, nbytes in phases:
                        s = run(fn)
                        if impl.startswith("tempo") and (op, phase) not in tempo_s:
                            tempo_s[(op, phase)] = s
                        gbs = nbytes / s / 1e9
                        rel = s / tempo_s[(op, phase)] if (op, phase) in tempo_s else float("nan")
                        row = {
                            "op": op,
                            "impl": impl,
                            "dtype": name,
                            "pass": phase,
                            "device": device.type,
                            "rows": a.rows,
                            "cols": cols,
                            "bytes": nbytes,
                            "seconds": s,
                            "gb_per_s": gbs,
                            "copy_gb_per_s": copy_gbs,
                            "share_of_copy": gbs / copy_gbs,
                            "time_vs_tempo": rel,
                            "error": "",
                        }
                        emit(row)
                        print(
                            "%-28s %-22s %-5s %5d %-8s %9.1f %8.1f %6.0f%% %9.2f"
                            % (op, impl, name, cols, phase, s * 1e6, gbs, 100 * gbs / copy_gbs, rel),
                            flush=True,
                        )
                except Exception as ex:  # noqa: BLE001  (a peer failing on a shape is a row, not a crash)
                    msg = "%s: %s" % (type(ex).__name__, str(ex).splitlines()[0][:200] if str(ex) else "")
                    emit(
                        {
                            "op": op,
                            "impl": impl,
                            "dtype": name,
                            "pass": "",
                            "device": device.type,
                            "rows": a.rows,
                            "cols": cols,
                            "bytes": 0,
                            "seconds": float("nan"),
                            "gb_per_s": float("nan"),
                            "copy_gb_per_s": copy_gbs,
                            "share_of_copy": float("nan"),
                            "time_vs_tempo": float("nan"),
                            "error": msg,
                        }
                    )
                    print("%-28s %-22s %-5s %5d failed: %s" % (op, impl, name, cols, msg), flush=True)
            del ops, src
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if sink["csv"] is not None:
        sink["csv"][0].close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
