#!/usr/bin/env python3
"""One small case of each CUDA op, forward and backward, for compute-sanitizer (memcheck,
racecheck) in scripts/gpu_check.sh: odd widths (the vector tail), a kept norm column, 16- and
32-bit data. Prints one line per op; exits non-zero if an op raises.

    compute-sanitizer --tool memcheck --kernel-name kns=tempo python scripts/sanitize_ops.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import opinfo  # noqa: E402  (tests/python/opinfo.py: the op table, each op's sample call)

import tempo  # noqa: E402,F401  (loads the op library)


def main():
    bad = 0
    for dtype in (torch.float32, torch.bfloat16):
        for name, f in opinfo.cases(dtype, "cuda").items():
            try:
                y = f()
                if y.requires_grad:
                    y.float().square().sum().backward()
                torch.cuda.synchronize()
                print("%-28s %-9s ok" % (name, str(dtype).replace("torch.", "")), flush=True)
            except Exception as e:  # noqa: BLE001
                bad += 1
                print("%-28s %-9s FAILED: %s" % (name, dtype, e), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
