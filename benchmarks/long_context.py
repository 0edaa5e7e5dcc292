"""The long-context page: how long a context each method fits on one GPU, and how fast its step is,
for Llama-3.1-8B full fine-tuning (bf16 weights, 8-bit AdamW, state on the GPU), planned by
tempo.plan on this CPU with the model's positions raised to 1,048,576 (as a RoPE-scaled
long-context run sets them), expandable segments.

    python benchmarks/long_context.py [--devices H100-80GB,H200-141GB] [--seq-step 16384]

Writes docs/results/long-context.md (and .json). Each method's longest context (every multiple of
the step up to it fits, its host memory within the device's host share), its matmul FLOPs and
predicted step time at 65,536 tokens, and at 131,072, 262,144 and 524,288 tokens the fastest
fitting method of tempo's and of the peers'."""

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "Llama-3.1-8B"
POSITIONS = 1 << 20
SEQ = 65536  # where each method's step (FLOPs, time) is shown
LENGTHS = (131072, 262144, 524288)
PEERS = ("trl", "trl-offload", "hf-offload", "sdpa+tiled-mlp+ckpt-offload+torch-lce")
OURS = ("tempo+ckpt", "tempo+ckpt-offload", "tempo+ckpt+tiles", "tempo+ckpt-offload+tiles")
SETUP = dict(precision="bf16", optimizer="adamw8bit")


def config():
    from tempo.plan import models

    cfg, _ = models.config_of(MODEL)
    cfg.max_position_embeddings = POSITIONS
    return cfg


def plan_device(device, step):
    import tempo

    rows = {}
    p = tempo.plan(config(), seq=SEQ, methods=list(PEERS + OURS), device=device, seq_step=step, search=True, **SETUP)
    for m in p:
        r = p[m]
        rows[m] = {"error": r.error} if r.error else dict(max_seq=r.max_seq, flops=r.flops, time=r.time, host=r.host)
        print(device, m, rows[m], flush=True)
    fastest = {}
    for seq in LENGTHS:
        q = tempo.plan(config(), seq=seq, methods=list(PEERS + OURS), device=device, **SETUP)
        fastest[seq] = [(m, q[m].time, q[m].peak, q[m].host) for m in q.ranked()]
        print(device, seq, fastest[seq][:2], flush=True)
    return {"methods": rows, "fastest": fastest}


def page(results, step, when):
    import torch
    import transformers

    lines = [
        "# Long context on one GPU: the longest context and the step's time by method (planned)",
        "",
        "`python benchmarks/long_context.py`, %s, torch %s, transformers %s: `tempo.plan` on this CPU (no GPU"
        % (when, torch.__version__, transformers.__version__),
        "used) for %s full fine-tuning, bf16 weights and gradients, 8-bit AdamW (state on the GPU), batch 1," % MODEL,
        "its positions raised to %s, expandable segments. Longest context: every multiple of %s tokens up to"
        % (format(POSITIONS, ","), format(step, ",")),
        "it fits the GPU (its memory less 768 MiB) and the host share (256 GiB). Time: the predicted step",
        "(FLOPs at 65% of dense bf16, memory-bound bytes at 80% of the bandwidth, host copies at 50 GB/s",
        "where not hidden; causal attention counts the pairs its mask passes). Methods: the peers' recipes",
        "`trl` (sdpa+ckpt+trl-head), `trl-offload` (+ TRL's activation offloading), `hf-offload`",
        "(transformers' offloaded checkpoints), and ALST's parts with the state on the GPU (its tiled MLP,",
        "offloaded checkpoints, a chunked loss: `sdpa+tiled-mlp+ckpt-offload+torch-lce`; ALST's published",
        "500K on one H100 also moves the weights' master copy and the optimizer state to the host, which",
        "the plan does not model yet); tempo's with checkpointing, checkpoints in host memory",
        "(`ckpt-offload`), and tiles (`+tiles`: each layer recomputed in query tiles, keys and values whole).",
        "",
    ]
    for device, r in results.items():
        lines += [
            "## %s" % device,
            "",
            "| method | longest context | TFLOP at %s | time at %s | host GiB at %s |"
            % (format(SEQ, ","), format(SEQ, ","), format(SEQ, ",")),
            "|---|---|---|---|---|",
        ]
        for m, row in r["methods"].items():
            if "error" in row:
                lines.append("| %s | %s | | | |" % (m, row["error"]))
                continue
            lines.append(
                "| %s | %s | %.0f | %.1f s | %s |"
                % (
                    m,
                    format(row["max_seq"], ",") if row["max_seq"] else "none",
                    row["flops"] / 1e12,
                    row["time"],
                    "%.1f" % (row["host"] / 2**30) if row["host"] else "-",
                )
            )
        lines += ["", "| tokens | fastest of tempo's | fastest peer recipe |", "|---|---|---|"]
        for seq, ranked in r["fastest"].items():
            ours = next((x for x in ranked if x[0] in OURS), None)
            peer = next((x for x in ranked if x[0] in PEERS), None)
            lines.append("| %s | %s | %s |" % (format(int(seq), ","), _cell(ours), _cell(peer)))
        lines.append("")
    return "\n".join(lines)


def _cell(fastest):
    return "%s, %.1f s" % tuple(fastest[:2]) if fastest else "none fits"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="H100-80GB,H200-141GB")
    ap.add_argument("--seq-step", type=int, default=16384)
    args = ap.parse_args()
    results = {d: plan_device(d, args.seq_step) for d in args.devices.split(",")}
    out = os.path.join(ROOT, "docs", "results", "long-context")
    with open(out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(page(results, args.seq_step, datetime.date.today().isoformat()))
    print("wrote docs/results/long-context.md")


if __name__ == "__main__":
    main()
