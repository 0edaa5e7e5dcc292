#!/usr/bin/env python3
"""Accuracy of tempo's in-place LayerNorm / RMSNorm against float64, next to PyTorch's own op
in the same dtype (which keeps x). 256 rows, x ~ 2 N(0, 1) + 0.5, gamma ~ N(1, 0.3) with 8
columns set to 1e-6, beta ~ N(0, 0.1), output gradient ~ N(0, 1).

    python benchmarks/norm_accuracy.py [--markdown docs/accuracy.md] [--csv FILE]
"""
import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
sys.path.insert(0, os.path.dirname(__file__))
from report import replace_between, write_csv  # noqa: E402
import tempo  # noqa: E402
from reference import half_ulp  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TINY = [0, 3, 100, 511, 700, 900, 1000, 1023]


def run(fn, x, w, b, g):
    x, w = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    ps = [x, w] + ([b.detach().clone().requires_grad_(True)] if b is not None else [])
    y = fn(x, *ps[1:]) if b is not None else fn(x, w, None)
    return [y.detach().double()] + [t.double() for t in torch.autograd.grad(y, ps, g)]


def measure(kind, dtype, rows=256, cols=1024):
    torch.manual_seed(0)
    x = (2 * torch.randn(rows, cols, dtype=torch.float64) + 0.5).to(dtype)
    w64 = 1 + 0.3 * torch.randn(cols, dtype=torch.float64)
    w64[TINY] = 1e-6
    w = w64.to(dtype)
    b = (0.1 * torch.randn(cols, dtype=torch.float64)).to(dtype) if kind == "layer_norm" else None
    g = torch.randn(rows, cols, dtype=torch.float64).to(dtype)
    if kind == "layer_norm":
        ours = lambda x, w, b: tempo.layer_norm(x, cols, w, b)  # noqa: E731
        ref = lambda x, w, b: F.layer_norm(x, [cols], w, b)  # noqa: E731
    else:
        ours = lambda x, w, b: tempo.rms_norm(x, cols, w, 1e-6)  # noqa: E731
        ref = lambda x, w, b: F.rms_norm(x, [cols], w, 1e-6)  # noqa: E731
    d = lambda t: None if t is None else t.double()  # noqa: E731
    exact = run(ref, x.double(), w.double(), d(b), g.double())
    o, t = run(ours, x, w, b, g), run(ref, x, w, b, g)
    good = w.double().abs() >= 0.2
    tiny = torch.zeros(cols, dtype=torch.bool)
    tiny[TINY] = True
    err = lambda a, i: (a[i] - exact[i]).abs()  # noqa: E731
    # The documented bound on the dx error where gamma is tiny (docs/accuracy.md).
    x64 = x.double()
    rstd = 1 / torch.sqrt((x64.var(-1, unbiased=False, keepdim=True) + 1e-5) if kind == "layer_norm"
                          else (x64.square().mean(-1, keepdim=True) + 1e-6))
    yb = o[0] - (b.double() if b is not None else 0)
    e = torch.minimum(4 * half_ulp(o[0], dtype) / w.double().abs(), torch.tensor(2 * math.sqrt(cols)))
    scale = (rstd * g.double().abs() * w.double().abs()).max() + exact[1].abs().max() + 1
    bound = (rstd * (g.double() * yb).mean(-1, keepdim=True).abs() * e + 2 * err(t, 1).max()
             + 2 * torch.finfo(dtype).eps * scale)
    return dict(
        op=kind, dtype=str(dtype).replace("torch.", ""),
        y_tempo=err(o, 0).max().item(), y_torch=err(t, 0).max().item(),
        dx_tempo=err(o, 1)[:, good].max().item(), dx_torch=err(t, 1)[:, good].max().item(),
        dw_tempo=err(o, 2)[good].max().item(), dw_torch=err(t, 2)[good].max().item(),
        dx_tiny_tempo=err(o, 1)[:, tiny].max().item(), dx_tiny_torch=err(t, 1)[:, tiny].max().item(),
        dx_tiny_over_bound=(err(o, 1)[:, tiny] / bound[:, tiny]).max().item(),
        dw_tiny_tempo=err(o, 2)[tiny].max().item(), dw_tiny_torch=err(t, 2)[tiny].max().item(),
        nonfinite=sum(int((~torch.isfinite(v)).sum()) for v in o),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--markdown")
    ap.add_argument("--csv")
    args = ap.parse_args()
    rows = []
    for kind in ("layer_norm", "rms_norm"):
        for dtype in DTYPES:
            r = measure(kind, dtype)
            rows.append(r)
            print("%-10s %-9s y %.1e/%.1e dx %.1e/%.1e dgamma %.1e/%.1e | tiny gamma: dx %.1e/%.1e (err/bound %.2f) "
                  "dgamma %.1e/%.1e nonfinite %d" % (
                      r["op"], r["dtype"], r["y_tempo"], r["y_torch"], r["dx_tempo"], r["dx_torch"], r["dw_tempo"],
                      r["dw_torch"], r["dx_tiny_tempo"], r["dx_tiny_torch"], r["dx_tiny_over_bound"],
                      r["dw_tiny_tempo"], r["dw_tiny_torch"], r["nonfinite"]), flush=True)
    if args.csv:
        write_csv(args.csv, rows)
    if args.markdown:
        table = ["| op | dtype | y: tempo / torch | dx, gamma >= 0.2: tempo / torch | dgamma, gamma >= 0.2: tempo / torch "
                 "| dx, gamma = 1e-6: tempo / torch (err / bound) | dgamma, gamma = 1e-6: tempo / torch |",
                 "|---|---|---|---|---|---|---|"]
        for r in rows:
            table.append("| %s | %s | %.1e / %.1e | %.1e / %.1e | %.1e / %.1e | %.1e / %.1e (%.2f) | %.1e / %.1e |" % (
                r["op"], r["dtype"], r["y_tempo"], r["y_torch"], r["dx_tempo"], r["dx_torch"], r["dw_tempo"],
                r["dw_torch"], r["dx_tiny_tempo"], r["dx_tiny_torch"], r["dx_tiny_over_bound"], r["dw_tiny_tempo"],
                r["dw_tiny_torch"]))
        replace_between(args.markdown, "norm-accuracy-table", table)


if __name__ == "__main__":
    main()
