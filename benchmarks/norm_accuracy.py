#!/usr/bin/env python3
"""Accuracy of tempo's in-place LayerNorm / RMSNorm against float64, next to PyTorch's own op
in the same dtype (which keeps x), over the gamma / beta sweep of tests/python/norm_sweep.py:
gamma in {0, +-1e-38, 1e-33, 1e-20, 1e-13, 1e-6, 1e-3, 1, 1e3} x beta / |gamma| in
{0, 1, 10, 1e3, 1e8}, plus 64 ordinary columns (gamma ~ N(1, 0.3), beta ~ N(0, 0.1)), 48 rows,
x ~ 2 N(0, 1) + 0.5, dy ~ N(0, 1); the worst column over SEEDS seeds.

    python benchmarks/norm_accuracy.py [--markdown docs/accuracy.md] [--csv FILE] [--seeds N]
"""

import argparse
import os
import sys


sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
sys.path.insert(0, os.path.dirname(__file__))
from report import replace_between, write_csv  # noqa: E402
import tempo  # noqa: E402,F401
from norm_sweep import DTYPES, bound, measure  # noqa: E402

OUTS = ["dx", "dgamma", "dbeta"]


def summarise(kind, dtype, seeds):
    row = dict(op=kind, dtype=str(dtype).replace("torch.", ""))
    worst = {}
    for seed in range(seeds):
        errors, kept, w, _ = measure(kind, dtype, seed=seed)
        row["columns"], row["kept"] = kept.numel(), int(kept.sum())
        for out in OUTS:
            if out not in errors["tempo"]:
                continue
            ours, theirs = errors["tempo"][out], errors["torch"][out]
            vals = {
                "tempo": ours.max().item(),
                "torch": theirs.max().item(),
                "tempo_kept": ours[kept].max().item(),
                "over_bound": (ours / bound(dtype, theirs)).max().item(),
            }
            for k, v in vals.items():
                worst[out + "_" + k] = max(worst.get(out + "_" + k, 0.0), v)
        worst["nonfinite"] = worst.get("nonfinite", 0) + errors["tempo"]["nonfinite"]
    row.update(worst)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--markdown")
    ap.add_argument("--csv")
    ap.add_argument("--seeds", type=int, default=10)
    args = ap.parse_args()
    rows = []
    for kind in ("layer_norm", "rms_norm"):
        for dtype in DTYPES:
            r = summarise(kind, dtype, args.seeds)
            rows.append(r)
            print(
                "%-10s %-9s kept %2d/%d  " % (r["op"], r["dtype"], r["kept"], r["columns"])
                + "  ".join(
                    "%s %.1e/%.1e (kept %.1e, /bound %.2f)"
                    % (o, r[o + "_tempo"], r[o + "_torch"], r[o + "_tempo_kept"], r[o + "_over_bound"])
                    for o in OUTS
                    if o + "_tempo" in r
                )
                + "  nonfinite %d" % r["nonfinite"],
                flush=True,
            )
    if args.csv:
        write_csv(args.csv, [{k: r.get(k, "") for k in rows[0]} for r in rows])
    if args.markdown:
        table = [
            "| op | dtype | kept columns | dx: tempo / torch (kept) | dgamma: tempo / torch (kept) "
            "| dbeta: tempo / torch | worst error / bound |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            cell = lambda o: (
                "%.1e / %.1e (%.1e)" % (r[o + "_tempo"], r[o + "_torch"], r[o + "_tempo_kept"])  # noqa
                if o + "_tempo" in r
                else "-"
            )
            db = "%.1e / %.1e" % (r["dbeta_tempo"], r["dbeta_torch"]) if "dbeta_tempo" in r else "-"
            over = max(r[o + "_over_bound"] for o in OUTS if o + "_over_bound" in r)
            table.append(
                "| %s | %s | %d of %d | %s | %s | %s | %.2f |"
                % (r["op"], r["dtype"], r["kept"], r["columns"], cell("dx"), cell("dgamma"), db, over)
            )
        replace_between(args.markdown, "norm-accuracy-table", table)


if __name__ == "__main__":
    main()
