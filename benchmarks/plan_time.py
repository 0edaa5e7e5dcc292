"""tempo.plan's time model against the CPU it runs on: each method's predicted step time (its
matmul FLOPs at this CPU's measured GEMM rate, its memory-bound operators' bytes at its measured
copy bandwidth) beside the step measured on the same CPU, as ratios to sdpa's, side by side in
one run (the methods' steps interleaved over rounds, the median taken: this machine is shared).

    python benchmarks/plan_time.py [--layers 4] [--seq 1024] [--rounds 5]

Writes docs/results/plan-time-cpu.md (and .json). The target: every predicted ratio within 15%
of the measured one."""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

METHODS = ("sdpa", "sdpa+ckpt", "sdpa+torch-lce", "trl", "tempo", "tempo+recompute-gate_up", "tempo+ckpt")


def config(layers):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=4096,
    )


def measure(cfg, seq, rounds):
    """{method: median step seconds}: one model per method, their steps interleaved."""
    import contextlib

    import torch
    import transformers

    from tempo import methods
    from tempo.plan import engine

    stacks, runs, models_, opts = {}, {}, {}, {}
    for m in METHODS:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).train()
        stack = contextlib.ExitStack()
        runs[m] = methods.apply(m, model, stack, planned=engine.FakeDevice("cpu")).run
        stacks[m], models_[m] = stack, model
        opts[m] = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(3, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "labels": ids}

    def step(m):
        opts[m].zero_grad(set_to_none=True)
        t = time.perf_counter()
        runs[m](**data).loss.backward()
        opts[m].step()
        return time.perf_counter() - t

    for m in METHODS:  # warm-up: the optimizer's state, the first call of each shape
        step(m)
    times = {m: [] for m in METHODS}
    for _ in range(rounds):
        for m in METHODS:
            times[m].append(step(m))
    for s in stacks.values():
        s.close()
    return {m: statistics.median(v) for m, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "plan-time-cpu"))
    a = p.parse_args(argv)
    import tempo
    from tempo.plan import devices

    cfg = config(a.layers)
    plan = tempo.plan(cfg, batch=1, seq=a.seq, device="cpu", precision="fp32", methods=list(METHODS), workers=1)
    rates = devices.cpu_rates()
    real = measure(cfg, a.seq, a.rounds)
    rows = []
    for m in METHODS:
        r = plan[m]
        predicted = r.time / plan["sdpa"].time
        measured = real[m] / real["sdpa"]
        rows.append(
            dict(
                method=m,
                tflop=r.flops / 1e12,
                traffic_gb=r.traffic / 1e9,
                predicted_s=r.time,
                measured_s=real[m],
                predicted_ratio=predicted,
                measured_ratio=measured,
                error=predicted / measured - 1,
            )
        )
    worst = max(abs(r["error"]) for r in rows)
    head = "| method | TFLOP | traffic GB | predicted s | measured s | predicted / sdpa | measured / sdpa | error |"
    lines = [
        "# tempo.plan's step time against this CPU's (planned and measured side by side)",
        "",
        "`python benchmarks/plan_time.py --layers %d --seq %d --rounds %d`, %s, %s, torch %s, %d threads: a LLaMA"
        " of hidden 1,024, intermediate 2,816, %d layers, 8 heads (4 KV), vocabulary 8,192, batch 1 x %d tokens,"
        " fp32, fused AdamW. The plan's time: the step's matmul FLOPs at this CPU's measured GEMM rate (%.1f"
        " GFLOP/s) plus the bytes its memory-bound operators move at its measured copy bandwidth (%.1f GB/s);"
        " measured: the median of %d steps of each method, interleaved."
        % (
            a.layers,
            a.seq,
            a.rounds,
            datetime.date.today().isoformat(),
            platform.processor() or platform.machine(),
            __import__("torch").__version__,
            __import__("torch").get_num_threads(),
            a.layers,
            a.seq,
            rates["matmul"] / 1e9,
            rates["bandwidth"] / 1e9,
            a.rounds,
        ),
        "",
        head,
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            "| %s | %.3f | %.2f | %.2f | %.2f | %.3f | %.3f | %+.1f%% |"
            % (
                r["method"],
                r["tflop"],
                r["traffic_gb"],
                r["predicted_s"],
                r["measured_s"],
                r["predicted_ratio"],
                r["measured_ratio"],
                100 * r["error"],
            )
        )
    lines += ["", "Largest error of a ratio: %.1f%% (target: within 15%%)." % (100 * worst)]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out + ".md", "w") as f:
            f.write(text)
        with open(a.out + ".json", "w") as f:
            json.dump({"rates": rates, "rows": rows}, f, indent=1)
    return 0 if worst <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
