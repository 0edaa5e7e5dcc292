#!/usr/bin/env python3
"""The layering the build promises: core -> torch (ops) -> nn -> models -> train -> tools. A file may
include public headers of its own layer and of the layers below, and private headers only of
its own layer; no relative include may leave its layer's folder. Inside a layer the files
of one name (trainer.h, trainer.cpp: a component) may use other components, but never in a
circle (trainer uses distributed, so distributed may not use trainer). Exits 1 listing
violations.

    python tests/check_layers.py csrc
"""

import os
import re
import sys

LAYERS = ["core", "torch", "nn", "models", "train", "tools"]
# The public header folders each layer owns (under its include/), by the first path parts.
PUBLIC = {
    "core": lambda h: h.startswith("tempo/") and os.path.exists(os.path.join(ROOT, "core", "include", h)),
    # (and tempo/ops.h, which the build writes from the op registry: cmake/TempoLayers.cmake)
    "torch": lambda h: (
        h == "tempo/ops.h" or (h.startswith("tempo/") and os.path.exists(os.path.join(ROOT, "torch", "include", h)))
    ),
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


def component(path, base=None):
    """A file's component: its name without the extension (a public header and the source
    beside the layer's root that implements it: tempo/train/trainer.h, train/trainer.cpp),
    with its folder for the layer's private helpers (cuda/common.cuh is not tempo/common.h)."""
    name = os.path.splitext(os.path.basename(path))[0]
    if base is None:
        return name
    folder = os.path.relpath(os.path.dirname(path), base)
    return name if folder == "." or folder.split(os.sep)[0] == "include" else os.path.join(folder, name)


def cycles(root):
    """Circles of components inside a layer (a file of component A includes a header of B and
    one of B, transitively, a header of A), each as 'layer: a -> b -> a'."""
    bad = []
    for layer in LAYERS:
        base = os.path.join(root, layer)
        uses = {}
        for dirpath, _, files in os.walk(base):
            for name in files:
                if not name.endswith((".h", ".cpp", ".cu", ".cuh")):
                    continue
                with open(os.path.join(dirpath, name)) as f:
                    text = f.read()
                me = component(os.path.join(dirpath, name), base)
                for inc in INCLUDE.findall(text):
                    if inc.startswith("tempo/") and owner(inc) == layer and component(inc) != me:
                        uses.setdefault(me, set()).add(component(inc))
        found = set()

        def walk(node, path):
            for nxt in sorted(uses.get(node, ())):
                if nxt in path:
                    circle = path[path.index(nxt) :] + [nxt]
                    key = frozenset(circle)
                    if key not in found:
                        found.add(key)
                        bad.append("%s: components in a circle: %s" % (layer, " -> ".join(circle)))
                elif len(path) < 50:
                    walk(nxt, path + [nxt])

        for start in sorted(uses):
            walk(start, [start])
    return bad


if __name__ == "__main__":
    ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "csrc"))
    problems = check(ROOT) + cycles(ROOT)
    for p in problems:
        print(p)
    print("check_layers: %d violation(s) in %s" % (len(problems), ROOT))
    sys.exit(1 if problems else 0)
