#!/usr/bin/env python3
"""The layering the build promises: core -> torch (ops) -> nn -> models -> train -> tools. A file may
include public headers of its own layer and of the layers below, and private headers only of
its own layer; no relative include may leave its layer's folder. Exits 1 listing violations.

    python tests/check_layers.py csrc
"""
import os
import re
import sys

LAYERS = ["core", "torch", "nn", "models", "train", "tools"]
# The public header folders each layer owns (under its include/), by the first path parts.
PUBLIC = {
    "core": lambda h: h.startswith("tempo/") and os.path.exists(os.path.join(ROOT, "core", "include", h)),
    "torch": lambda h: h.startswith("tempo/") and os.path.exists(os.path.join(ROOT, "torch", "include", h)),
    "nn": lambda h: h.startswith("tempo/") and os.path.exists(os.path.join(ROOT, "nn", "include", h)),
    "models": lambda h: h.startswith("tempo/") and os.path.exists(os.path.join(ROOT, "models", "include", h)),
    "train": lambda h: h.startswith("tempo/") and os.path.exists(os.path.join(ROOT, "train", "include", h)),
    "tools": lambda h: False,
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def owner(header):
    for layer in LAYERS:
        if PUBLIC[layer](header):
            return layer
    return None


def check(root):
    bad = []
    for layer in LAYERS:
        base = os.path.join(root, layer)
        for dirpath, _, files in os.walk(base):
            for name in files:
                if not name.endswith((".h", ".cpp", ".cu", ".cuh")):
                    continue
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    text = f.read()
                for inc in INCLUDE.findall(text):
                    rel = os.path.relpath(path, root)
                    if inc.startswith("tempo/"):
                        o = owner(inc)
                        if o is None:
                            bad.append("%s: includes %s, which no layer's include/ holds" % (rel, inc))
                        elif LAYERS.index(o) > LAYERS.index(layer):
                            bad.append("%s: includes %s of the higher layer '%s'" % (rel, inc, o))
                    else:
                        target = os.path.normpath(os.path.join(dirpath, inc))
                        if not target.startswith(base + os.sep):
                            bad.append("%s: includes %s, outside its layer '%s'" % (rel, inc, layer))
    return bad


if __name__ == "__main__":
    ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "csrc"))
    problems = check(ROOT)
    for p in problems:
        print(p)
    print("check_layers: %d violation(s) in %s" % (len(problems), ROOT))
    sys.exit(1 if problems else 0)
