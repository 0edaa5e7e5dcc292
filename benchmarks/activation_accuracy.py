#!/usr/bin/env python3
"""Gradient accuracy of tempo's in-place activations against the exact fp64 derivative,
next to PyTorch's own op in the same dtype (which keeps x). Dense sweep: 10^6 points over
[-20, 20] plus 20001 points within 1e-2 of the argmin, per variant and dtype.

    python benchmarks/activation_accuracy.py [--markdown docs/accuracy.md] [--csv FILE]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
sys.path.insert(0, os.path.dirname(__file__))
from report import replace_between, write_csv  # noqa: E402
import tempo  # noqa: E402,F401
from reference import DTYPES, VARIANTS, argmin, recovery_bound, sweep  # noqa: E402


def grad(fn, x):
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    return g.to(torch.float64)


def window(x, e_tempo, e_torch, xs):
    """Outer edge of the farthest band |x - x*| in [10^(k/4), 10^((k+1)/4)) in which tempo's
    largest error exceeds twice PyTorch's largest error in that band (0: no such band)."""
    d = (x.to(torch.float64) - xs).abs()
    edge = 0.0
    for k in range(-28, 9):
        lo, hi = 10 ** (k / 4), 10 ** ((k + 1) / 4)
        band = (d >= lo) & (d < hi) if k > -28 else d < hi
        if band.any() and e_tempo[band].max() > 2 * e_torch[band].max():
            edge = hi
    return edge


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--markdown")
    ap.add_argument("--csv")
    args = ap.parse_args()
    rows = []
    for name, (torch_fn, tempo_fn) in VARIANTS.items():
        for dtype in DTYPES:
            x = sweep(name, dtype)
            bound, exact = recovery_bound(name, x)
            e_tempo = (grad(tempo_fn, x) - exact).abs()
            e_torch = (grad(torch_fn, x) - exact).abs()
            rel = lambda e: (e / exact.abs().clamp_min(1e-3)).max().item()  # noqa: E731
            far = (x.to(torch.float64) - argmin(name)).abs() > 0.05
            rows.append(
                dict(
                    op=name,
                    dtype=str(dtype).replace("torch.", ""),
                    points=x.numel(),
                    tempo_max_abs=e_tempo.max().item(),
                    torch_max_abs=e_torch.max().item(),
                    tempo_max_abs_far=e_tempo[far].max().item(),
                    torch_max_abs_far=e_torch[far].max().item(),
                    tempo_max_rel=rel(e_tempo),
                    torch_max_rel=rel(e_torch),
                    worst_over_bound=(e_tempo / bound).max().item(),
                    worse_window=window(x, e_tempo, e_torch, argmin(name)),
                    nonfinite=int((~torch.isfinite(grad(tempo_fn, x))).sum()),
                )
            )
            r = rows[-1]
            print(
                "%-10s %-9s tempo max abs %.2e (|x-x*|>0.05: %.2e)  torch %.2e (%.2e)  err/bound %.2f  window %.3g"
                % (
                    r["op"],
                    r["dtype"],
                    r["tempo_max_abs"],
                    r["tempo_max_abs_far"],
                    r["torch_max_abs"],
                    r["torch_max_abs_far"],
                    r["worst_over_bound"],
                    r["worse_window"],
                ),
                flush=True,
            )
    if args.csv:
        write_csv(args.csv, rows)
    if args.markdown:
        table = [
            "| op | dtype | tempo max abs | torch max abs | tempo max abs, x farther than 0.05 from x* "
            "| torch, same | tempo max rel | torch max rel | max err / bound | window where tempo > 2x torch |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            table.append(
                "| %s | %s | %.2e | %.2e | %.2e | %.2e | %.2e | %.2e | %.2f | %s |"
                % (
                    r["op"],
                    r["dtype"],
                    r["tempo_max_abs"],
                    r["torch_max_abs"],
                    r["tempo_max_abs_far"],
                    r["torch_max_abs_far"],
                    r["tempo_max_rel"],
                    r["torch_max_rel"],
                    r["worst_over_bound"],
                    "none" if r["worse_window"] == 0 else "within %.2g of x*" % r["worse_window"],
                )
            )
        replace_between(args.markdown, "accuracy-table", table)


if __name__ == "__main__":
    main()
