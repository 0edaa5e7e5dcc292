#!/usr/bin/env python3
"""Per CUDA kernel of the core's object files: registers, local memory (spills land there) and
stack from `cuobjdump -res-usage`, and from the SASS the instruction count and the 128-bit
global loads and stores (LDG.E.128 / STG.E.128). Checks, at sm_90: no kernel uses local memory
or stack (0 spill bytes), and the vectorised kernels (16/32-bit data: the activations' and
dropout's and the gated MLP's elementwise kernels, the norms' and the attention softmax's
row-in-registers kernels, linear_cross_entropy's backward) hold 128-bit loads and stores. The general kernels (fp64,
widths the fast ones do not take) and linear_cross_entropy's forward (it stores one value a
row) are listed with their load width.
Prints a table; writes it as CSV with --csv; exit 1 on a violation.

    scripts/check_kernel_resources.py build-cuda/CMakeFiles/tempo_core.dir/csrc/core/cuda/*.cu.o
"""

import argparse
import csv
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_fp64_sass import INSTRUCTION, demangle, find_cuobjdump  # noqa: E402

RES = re.compile(r"Function (\S+):\s*REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
# Kernels that must move 16-byte words: (object file stem, kernel name substring)
VECTORISED = [
    ("activation.cu", "forward_kernel"),
    ("activation.cu", "backward_kernel<"),
    ("dropout.cu", "dropout_forward_kernel<"),
    ("dropout.cu", "dropout_backward_kernel<"),
    ("norm.cu", "_rows_kernel<"),
    ("attention.cu", "_rows_kernel<"),
    ("attention.cu", "_packs_kernel<"),
    ("linear_cross_entropy.cu", "backward_kernel<"),
    ("gated_mlp.cu", "gated_mlp_"),
]


def sass_counts(tool, obj):
    sass = subprocess.run([tool, "-sass", obj], capture_output=True, text=True, check=True).stdout
    counts, name = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            counts[name] = {"instructions": 0, "ldg128": 0, "stg128": 0}
        elif name is not None and INSTRUCTION.search(line):
            c = counts[name]
            c["instructions"] += 1
            c["ldg128"] += bool(re.search(r"\bLDG\.E\.128\b|\bLDG\.E\.[A-Z.]*128\b", line))
            c["stg128"] += bool(re.search(r"\bSTG\.E\.128\b|\bSTG\.E\.[A-Z.]*128\b", line))
    return counts


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("objects", nargs="+")
    p.add_argument("--cuobjdump")
    p.add_argument("--csv")
    a = p.parse_args()
    tool = a.cuobjdump or find_cuobjdump()
    if not tool:
        sys.exit("check_kernel_resources: no cuobjdump")
    rows, bad = [], []
    for obj in a.objects:
        res = subprocess.run([tool, "-res-usage", obj], capture_output=True, text=True, check=True).stdout
        counts = sass_counts(tool, obj)
        found = RES.findall(res)
        names = [f[0] for f in found]
        pretty = dict(zip(names, demangle(names)))
        stem = os.path.basename(obj).replace(".o", "")
        for name, reg, stack, shared, local in found:
            d = pretty[name]
            c = counts.get(name, {"instructions": 0, "ldg128": 0, "stg128": 0})
            wide = re.search(r"(,\s*double>|EdEEv|<double>)", d + name) is None
            must_vec = (
                wide
                and any(stem == s and k in d for s, k in VECTORISED)
                and "bias_kernel" not in d
                and "keep_bits" not in d
            )
            row = {
                "object": stem,
                "kernel": d,
                "registers": int(reg),
                "stack": int(stack),
                "local": int(local),
                "shared": int(shared),
                "instructions": c["instructions"],
                "ldg128": c["ldg128"],
                "stg128": c["stg128"],
                "must_vectorise": must_vec,
            }
            rows.append(row)
            if int(local) or int(stack):
                bad.append("%s: %s B local, %s B stack (spills or a local array)" % (d, local, stack))
            if must_vec and not (c["ldg128"] and c["stg128"]):
                bad.append("%s: no 128-bit global load/store (%d LDG.128, %d STG.128)" % (d, c["ldg128"], c["stg128"]))
    print("%-4s %6s %6s %6s %7s %7s  %s" % ("reg", "local", "stack", "instr", "LDG128", "STG128", "kernel"))
    for r in rows:
        flag = "  [vectorised]" if r["must_vectorise"] else ""
        print(
            "%-4d %6d %6d %6d %7d %7d  %s%s"
            % (
                r["registers"],
                r["local"],
                r["stack"],
                r["instructions"],
                r["ldg128"],
                r["stg128"],
                r["kernel"][:150],
                flag,
            )
        )
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    if bad:
        print("check_kernel_resources: %d violation(s):\n  %s" % (len(bad), "\n  ".join(bad)))
        sys.exit(1)
    print(
        "check_kernel_resources: %d kernels, none with local memory or stack; the vectorised kernels hold "
        "128-bit loads and stores" % len(rows)
    )


if __name__ == "__main__":
    main()
