"""`python -m tempo.slim`: SLiM's chunked training against full backpropagation, for each chunk
size: the step's peak bytes, its time and the gradients' discrepancy (docs/slim.md). The model and
the chunked backward are the library's (tempo/slim.py)."""

import argparse
import json
import statistics
import time

import torch

from .. import memory
from ..slim import PRESETS, PerformerLM, full_loss_and_backward, loss_and_backward


def measure(model, tokens, chunks, repeats=1):
    """For each chunk size (None: full backpropagation): the step's peak bytes above what was
    held (tempo's CPU tracker, or CUDA's allocator), its time (median of `repeats`), and the
    relative L2 gradient discrepancy to full backpropagation. A warm-up step each, then
    `repeats` rounds of one step per configuration."""
    device = tokens.device
    if device.type == "cpu":
        memory.track()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)  # held before every step: the peaks count the step's own work
    configs = [None] + [c for c in chunks if c is not None]

    def step(chunk):
        for p in params:
            p.grad.zero_()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        memory.reset_peak(device)
        start = memory.stats(device)[0]
        t0 = time.perf_counter()
        loss = full_loss_and_backward(model, tokens) if chunk is None else loss_and_backward(model, tokens, chunk)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms = (time.perf_counter() - t0) * 1e3
        peak = memory.stats(device)[1] - start
        g = torch.cat([p.grad.flatten().double() for p in params])
        return {"peak_bytes": peak, "ms": ms, "loss": float(loss), "grad": g}

    first = {c: step(c) for c in configs}  # also the warm-up
    times = {c: [] for c in configs}
    for _ in range(repeats):  # interleaved, so that drift on a shared machine hits all alike
        for c in configs:
            times[c].append(step(c)["ms"])
    ref = first[None]["grad"]
    rows = [
        {
            "chunk": c,
            "peak_bytes": first[c]["peak_bytes"],
            "step_ms": statistics.median(times[c]),
            "loss": first[c]["loss"],
            "grad_rel_discrepancy": ((first[c]["grad"] - ref).norm() / ref.norm()).item(),
        }
        for c in configs
    ]
    order = {c: i for i, c in enumerate(chunks)}
    return sorted(rows, key=lambda r: order.get(r["chunk"], -1))


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m tempo.slim",
        description="SLiM: peak memory, step time and gradient discrepancy to full backpropagation for each chunk size",
    )
    p.add_argument("--preset", default="copy", choices=sorted(PRESETS))
    p.add_argument("--seq", type=int, default=None, help="sequence length L (default: the preset's)")
    p.add_argument("--chunks", default="64,128,full", help="comma-separated chunk sizes; 'full' = full backprop")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up (median)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    chunks = []
    for c in a.chunks.split(","):
        if c == "full":
            chunks.append(None)
        elif c.isdigit() and int(c) > 0:
            chunks.append(int(c))
        else:
            p.error("--chunks takes positive integers and 'full', got %r" % c)
    L = a.seq or PRESETS[a.preset][0]
    if L < 2:
        p.error("--seq must be at least 2")
    torch.manual_seed(0)
    model = PerformerLM.preset(a.preset, max_len=L, **({"layers": a.layers} if a.layers else {})).to(a.device)
    tokens = torch.randint(0, 256, (1, L + 1), device=a.device)
    rows = [dict(preset=a.preset, seq=L, **r) for r in measure(model, tokens, chunks, a.repeats)]
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    full = next(r for r in rows if r["chunk"] is None)
    print(
        "%s, L = %d, %s (peak: bytes above what was held; discrepancy: relative L2 to full backprop)"
        % (a.preset, L, a.device)
    )
    print("%-8s %14s %8s %12s %8s %14s" % ("chunk", "peak", "vs full", "step ms", "vs full", "discrepancy"))
    for r in rows:
        print(
            "%-8s %10.2f MiB %7.3fx %12.1f %7.2fx %14.2e"
            % (
                "full" if r["chunk"] is None else r["chunk"],
                r["peak_bytes"] / 2**20,
                r["peak_bytes"] / full["peak_bytes"],
                r["step_ms"],
                r["step_ms"] / full["step_ms"],
                r["grad_rel_discrepancy"],
            )
        )
    return 0
