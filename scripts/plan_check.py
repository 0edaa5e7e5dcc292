"""tempo.plan against the device: for each model, sequence length and method, the plan's peak of
the second training step against the peak the same step reaches when run for real (random bf16
weights, SGD without momentum, batch 1). On CUDA: torch.cuda.max_memory_allocated (and the
plan's reserved bytes against max_memory_reserved); on the CPU (the GPU check's dry run): tempo's
counting allocator, on a small LLaMA in fp32 (in bf16 the CPU kernels of torch's chunked loss
cast through temporaries inside their element-wise ops, which fake tensors do not see: 1 MiB a
chunk at a 2,048-token vocabulary).

    python scripts/plan_check.py --device cuda --allocator expandable --json OUT.json  # 1B and 8B shapes
    python scripts/plan_check.py --device cuda --allocator default --json OUT.json
    python scripts/plan_check.py --device cpu --json OUT.json    # the dry run

--allocator sets PYTORCH_CUDA_ALLOC_CONF for this process before CUDA starts (expandable:
expandable_segments:True; default: PyTorch's default allocator) and plans under the same setting:
one process per setting, as the allocator reads it once.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

ALLOC_CONF = {"expandable": "expandable_segments:True", "default": ""}


def _allocator_from_argv():
    """The --allocator setting, in the environment before torch starts CUDA."""
    setting = "expandable"
    for i, arg in enumerate(sys.argv):
        if arg == "--allocator" and i + 1 < len(sys.argv):
            setting = sys.argv[i + 1]
        elif arg.startswith("--allocator="):
            setting = arg.split("=", 1)[1]
    if setting in ALLOC_CONF:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF[setting]


_allocator_from_argv()

import torch  # noqa: E402

import tempo  # noqa: E402
from tempo import methods as tempo_methods  # noqa: E402
from tempo.plan import DEFAULT_METHODS  # noqa: E402
from tempo.plan.validate import FAMILIES, measure_cpu, measure_cuda  # noqa: E402

METHODS = ",".join(DEFAULT_METHODS + ("sdpa+ckpt", "sdpa+torch-lce", "sdpa+trl-head"))
CASES = {
    "cuda": [("Llama-3.2-1B", (2048, 8192)), ("Llama-3.1-8B", (1024, 4096))],
    "cpu": [("llama", (64, 256))],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--allocator", choices=tuple(ALLOC_CONF), default="expandable")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    methods = a.methods.split(",")
    if a.device == "cpu":
        methods = [m for m in methods if not tempo_methods.parse(m).host_memory]  # offloading is a GPU's
    rows = []
    for model, seqs in CASES[a.device]:
        config = FAMILIES[model]() if model in FAMILIES else model
        for seq in seqs:
            t = time.time()
            device = torch.cuda.get_device_properties(0).total_memory if a.device == "cuda" else "cpu"
            precision = "bf16" if a.device == "cuda" else "fp32"
            p = tempo.plan(
                config,
                batch=1,
                seq=seq,
                methods=methods,
                device=device,
                precision=precision,
                optimizer="sgd",
                allocator=a.allocator,
            )
            planned_s = time.time() - t
            for m in methods:
                row = dict(
                    model=model,
                    seq=seq,
                    method=m,
                    allocator=a.allocator,
                    plan_peak=p[m].peak,
                    plan_reserved=p[m].reserved,
                )
                if p[m].error:
                    row["error"] = p[m].error
                else:
                    try:
                        if a.device == "cuda":
                            row["allocated"], row["reserved"] = measure_cuda(config, m, 1, seq, "bf16", "sgd")
                        else:
                            row["allocated"] = measure_cpu(config, m, 1, seq, precision, optimizer="sgd")
                            row["reserved"] = None
                        row["error_pct"] = 100.0 * (row["plan_peak"] - row["allocated"]) / row["allocated"]
                    except torch.OutOfMemoryError as e:
                        row["error"] = "out of memory: %s" % str(e).split("\n")[0][:160]
                        torch.cuda.empty_cache()
                rows.append(row)
                print(
                    "%-14s %6d %-26s plan %14s measured %14s %s (reserved: plan %s, measured %s)"
                    % (
                        model,
                        seq,
                        m,
                        row["plan_peak"],
                        row.get("allocated"),
                        "%+.3f%%" % row["error_pct"] if "error_pct" in row else row.get("error"),
                        row["plan_reserved"],
                        row.get("reserved"),
                    ),
                    flush=True,
                )
            print("planned in %.1f s" % planned_s, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    worst = max((abs(r["error_pct"]) for r in rows if "error_pct" in r), default=None)
    print("largest difference: %s" % ("-" if worst is None else "%.3f%%" % worst))
    return 0 if worst is not None and worst <= 3.0 else 1


if __name__ == "__main__":
    sys.exit(main())
