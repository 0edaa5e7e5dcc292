#!/usr/bin/env python3
"""Counts the fp64 instructions in the SASS of each CUDA kernel of an object file and checks
that the activation kernels for 16/32-bit data have none (they must stay bandwidth-bound on
GPUs with a 1/32 to 1/64 fp64 rate). The fp64 kernels must have some: that proves the count
sees fp64 instructions at all. Prints one line per kernel; exit 1 on a violation.

    scripts/check_fp64_sass.py OBJECT.o [--cuobjdump PATH] [--kernels forward_kernel,backward_kernel]
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys

# Double-precision SASS: the D* arithmetic (DADD, DMUL, DFMA, DSETP, DMNMX, ...), conversions
# to or from F64, and the 64-bit reciprocal/sqrt seeds.
FP64 = re.compile(
    r"\b(D(?:ADD|MUL|FMA|SETP|SET|MNMX|MMA)|(?:F2F|F2I|I2F|FRND)\.[A-Z0-9.]*F64[A-Z0-9.]*"
    r"|MUFU\.(?:RCP64H|RSQ64H))\b"
)


def find_cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    # The CUDA torch's Triton ships one (the toolkit here has none).
    roots = [os.path.dirname(os.path.dirname(sys.executable)), ".venv-cuda"]
    for root in roots:
        hits = glob.glob(
            os.path.join(root, "lib", "python3*", "site-packages", "triton", "backends", "nvidia", "bin", "cuobjdump")
        )
        if hits:
            return hits[0]
    return None


def demangle(names):
    filt = shutil.which("c++filt")
    if not filt:
        return names
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names


INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+\S")


def kernels(sass):
    """{mangled name: [fp64 instructions, all instructions]}."""
    counts, name = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            counts[name] = [0, 0]
        elif name is not None and INSTRUCTION.search(line):
            counts[name][0] += len(FP64.findall(line))
            counts[name][1] += 1
    return counts


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("object")
    p.add_argument("--cuobjdump", default=None)
    p.add_argument(
        "--kernels",
        default="forward_kernel,backward_kernel",
        help="kernel names (substrings) that must have no fp64 for 16/32-bit data",
    )
    a = p.parse_args()
    tool = a.cuobjdump or find_cuobjdump()
    if not tool:
        sys.exit("check_fp64_sass: no cuobjdump (the CUDA toolkit's, or the CUDA torch venv's Triton's)")
    if not os.path.isfile(a.object):
        sys.exit("check_fp64_sass: no such object file: %s" % a.object)
    sass = subprocess.run([tool, "-sass", a.object], capture_output=True, text=True, check=True).stdout
    counts = kernels(sass)
    if not counts:
        sys.exit("check_fp64_sass: no kernels in %s" % a.object)
    names = list(counts)
    pretty = dict(zip(names, demangle(names)))
    wanted = a.kernels.split(",")
    bad, fp64_seen = [], False
    for name in names:
        d = pretty[name]
        if not any(k in d for k in wanted):
            continue
        # The element type is the kernel template's last argument: double, or a 16/32-bit type.
        is_double = re.search(r"(,\s*double>|EdEEv)", d + name) is not None
        fp64, total = counts[name]
        print("%6d fp64 of %6d instructions  %s" % (fp64, total, d))
        if is_double:
            fp64_seen = fp64_seen or fp64 > 0
        elif fp64:
            bad.append(d)
    if not fp64_seen:
        sys.exit("check_fp64_sass: no fp64 instruction found even in the double kernels: the count is broken")
    if bad:
        sys.exit("check_fp64_sass: fp64 instructions in kernels for 16/32-bit data:\n  " + "\n  ".join(bad))
    print("check_fp64_sass: no fp64 instruction in the 16/32-bit kernels (%s)" % ", ".join(wanted))


if __name__ == "__main__":
    main()
