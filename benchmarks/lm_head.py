#!/usr/bin/env python3
"""tempo.linear_cross_entropy beside PyTorch's own chunked F.linear_cross_entropy (with
LinearCrossEntropyOptions()) and the plain F.cross_entropy(F.linear(...)): for each vocabulary
and row count, the bytes held after the forward (what the backward will read), the peak over
forward and backward beyond what was held before, both exact (tempo's counting allocator), and
the time of forward + backward (the methods interleaved, the median of --steps), as a ratio to
tempo's. fp32 on the CPU; --device cuda measures the caching allocator's bytes, and adds
Liger-Kernel's fused linear cross entropy where it is installed. A method that runs out of
--limit bytes is a row saying so.

    python benchmarks/lm_head.py --vocab 32000,128256,256000 --rows 4096,16384 --json build/results/lm_head.json
"""

import argparse
import gc
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import tempo


def methods(device):
    out = {
        "tempo": lambda h, w, y: tempo.linear_cross_entropy(h, w, None, y),
        "torch-chunked": lambda h, w, y: F.linear_cross_entropy(h, w, y, options=torch.nn.LinearCrossEntropyOptions()),
        "plain": lambda h, w, y: F.cross_entropy(F.linear(h, w), y),
    }
    try:  # TRL's chunked log-prob head, as its trainers install it (trl.trainer.utils.add_fused_lm_head)
        from trl.kernels import ChunkedLogProbFunction

        out["trl"] = lambda h, w, y: (
            -ChunkedLogProbFunction.apply(h, w, None, y, 1.0, 32768, None, 1.0, ("entropy", "is_top1"))[0].mean()
        )
    except ImportError:
        pass
    if device.type == "cuda":
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            out["liger"] = lambda h, w, y: liger_fused_linear_cross_entropy(h, w, y)
        except ImportError:
            pass
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, h, w, y, device, limit):
    """(held after the forward, peak over forward + backward, seconds) of one step, or None past `limit`."""
    h.grad = w.grad = None
    gc.collect()
    sync(device)
    try:
        with tempo.memory.cpu_limit(limit) if device.type == "cpu" and limit else _nothing():
            base = tempo.memory.stats(device)[0]
            tempo.memory.reset_peak(device)
            t0 = time.perf_counter()
            loss = fn(h, w, y)
            sync(device)
            held = tempo.memory.stats(device)[0] - base
            loss.backward()
            sync(device)
            seconds = time.perf_counter() - t0
            peak = tempo.memory.stats(device)[1] - base
    except torch.OutOfMemoryError:
        return None
    finally:
        loss = None
        gc.collect()
    return held, peak, seconds


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", default="32000,128256,256000")
    p.add_argument("--rows", default="4096,16384")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--limit", default="16GiB", help="CPU: a method needing more than this is a row saying so")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    from tempo._measure import format_bytes, parse_bytes

    limit = parse_bytes(a.limit) if a.limit else 0
    if device.type == "cpu":
        tempo.memory.track()
    rows_out = []
    for V in [int(v) for v in a.vocab.split(",")]:
        for N in [int(n) for n in a.rows.split(",")]:
            g = torch.Generator().manual_seed(0)
            h = (torch.randn(N, a.hidden, generator=g) * 0.5).to(device).requires_grad_()
            w = (torch.randn(V, a.hidden, generator=g) * 0.02).to(device).requires_grad_()
            y = torch.randint(0, V, (N,), generator=g).to(device)
            fns = methods(device)
            found = {m: [] for m in fns}
            failed = set()
            for i in range(a.steps + 1):  # the first round: a warm-up, its bytes kept (they repeat exactly)
                for m, fn in fns.items():
                    if m in failed:
                        continue
                    r = measure(fn, h, w, y, device, limit)
                    if r is None:
                        failed.add(m)
                    else:
                        found[m].append(r)
            base = statistics.median(r[2] for r in found["tempo"][1:]) if len(found["tempo"]) > 1 else None
            for m in fns:
                if m in failed:
                    row = {
                        "vocab": V,
                        "rows": N,
                        "hidden": a.hidden,
                        "method": m,
                        "error": "out of memory under %s" % a.limit,
                    }
                    print("V=%-7d N=%-6d %-14s %s" % (V, N, m, row["error"]), flush=True)
                else:
                    held, peak = found[m][0][0], found[m][0][1]
                    secs = statistics.median(r[2] for r in found[m][1:])
                    row = {
                        "vocab": V,
                        "rows": N,
                        "hidden": a.hidden,
                        "method": m,
                        "held_after_forward": held,
                        "peak": peak,
                        "seconds": secs,
                        "time_vs_tempo": secs / base if base else None,
                        "error": None,
                    }
                    print(
                        "V=%-7d N=%-6d %-14s held %12s  peak %12s  %.3f s  %.2fx tempo"
                        % (V, N, m, format_bytes(held), format_bytes(peak), secs, row["time_vs_tempo"] or 0),
                        flush=True,
                    )
                rows_out.append(row)
            del h, w, y
            gc.collect()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows_out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
