#!/usr/bin/env python3
"""Runs Auto-Tempo (tempo.auto) on a Hugging Face model built from a preset config (random
weights, as python -m tempo.bench builds it) or loaded from a local folder, under a memory
budget, and prints its report: each candidate's largest batch, samples/s and tokens/s, and
the choice.

    .venv/bin/python examples/python/auto_tempo.py --model bert --size large --seq 512 --budget 11GiB [--method fine]
"""

import argparse
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tempo  # noqa: E402
from tempo.apps.runner import build_model, synthetic_batch  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bert", help="bert | roberta | gpt2 | llama, or a local model folder")
    p.add_argument("--size", default="base")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--budget", default="4GiB")
    p.add_argument("--method", choices=("fast", "fine"), default="fast")
    p.add_argument("--steps", type=int, default=3, help="timed steps at each candidate's largest batch (median)")
    a = p.parse_args()
    tempo.memory.track()
    torch.manual_seed(0)
    model, name, causal = build_model(a.model, a.size, a.model if os.path.isdir(a.model) else None)
    seeds = iter(range(1, 1 << 30))
    try:
        report = tempo.auto(
            model,
            lambda n: synthetic_batch(model, n, a.seq, causal, next(seeds), torch.device("cpu")),
            budget=a.budget,
            method=a.method,
            steps=a.steps,
        )
    except ValueError as e:  # a budget too small, a bad argument: one line, not a traceback
        raise SystemExit(str(e))
    print("%s, seq %d, fp32, cpu (forward + backward; the budget also holds parameters and gradients)" % (name, a.seq))
    print(report)


if __name__ == "__main__":
    main()
