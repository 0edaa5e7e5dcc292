"""The docs hold code that runs: the README's Python block runs as it is written, and its C++
block builds with the CMake lines above it against this build and runs (each extracted from
README.md, not copied); every relative link in the README and docs/ leads to a file, and every
file path the sources name (comments, docstrings, messages) exists."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from common import ROOT, python_env


BUILD = os.environ.get("TEMPO_BUILD", os.path.join(ROOT, "build"))
pytestmark = pytest.mark.cpu_only


def blocks(path, language):
    """The fenced code blocks of `language` in the markdown file, in order."""
    with open(path) as f:
        text = f.read()
    return re.findall(r"^```%s\n(.*?)^```$" % re.escape(language), text, re.M | re.S)


def test_the_readme_python_block_runs(tmp_path):
    (code,) = blocks(os.path.join(ROOT, "README.md"), "python")
    script = tmp_path / "readme.py"
    script.write_text(code)
    env = python_env(HF_HUB_OFFLINE="1")
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # tempo.report's table: the norms, the gated MLP and the LM head were patched
    for technique in ("rms_norm", "gated_mlp", "lm_head"):
        assert re.search(r"%s\s+patched" % technique, r.stdout), r.stdout


@pytest.mark.skipif(not os.path.exists(os.path.join(BUILD, "TempoConfig.cmake")), reason="no CMake build of tempo")
def test_the_readme_cpp_block_builds_against_this_build_and_runs(tmp_path):
    readme = os.path.join(ROOT, "README.md")
    (cmake,) = blocks(readme, "cmake")
    (cpp,) = blocks(readme, "cpp")
    (tmp_path / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.22)\nproject(readme CXX)\n" + cmake)
    (tmp_path / "main.cpp").write_text(cpp)
    torch_dir = os.path.join(torch.utils.cmake_prefix_path, "Torch")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    for cmd in (
        [
            "cmake",
            "-S",
            str(tmp_path),
            "-B",
            str(tmp_path / "b"),
            *gen,
            "-DTempo_DIR=" + BUILD,
            "-DTorch_DIR=" + torch_dir,
        ],
        ["cmake", "--build", str(tmp_path / "b")],
    ):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (cmd, r.stdout[-3000:], r.stderr[-3000:])
    r = subprocess.run([str(tmp_path / "b" / "app")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout.startswith("largest difference from torch: ")


def test_the_readme_is_read_in_two_minutes():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 150, len(lines)


def test_every_relative_link_in_the_docs_leads_to_a_file():
    files = [os.path.join(ROOT, "README.md")] + [
        os.path.join(ROOT, "docs", n) for n in sorted(os.listdir(os.path.join(ROOT, "docs"))) if n.endswith(".md")
    ]
    broken = []
    for path in files:
        with open(path) as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            where = os.path.normpath(os.path.join(os.path.dirname(path), target.split("#")[0]))
            if not os.path.exists(where):
                broken.append("%s: %s" % (os.path.relpath(path, ROOT), target))
    assert not broken, broken


SOURCE_DIRS = ["csrc", "python", "tests", "scripts", "cmake", "benchmarks", "tools", "examples", ".ci"]
SOURCE_FILE = re.compile(r"\.(py|cpp|h|cu|cuh|cmake|sh|toml)$|^(Makefile|CMakeLists\.txt|run)$")
# a path in the tree (from a top-level folder, a header's tempo/... include name) or a markdown file
NAMED_PATH = re.compile(
    r"(?<![\w./$<{-])((?:\.\./)*(?:csrc|python|tests|docs|scripts|cmake|benchmarks|tools|examples|tempo)/"
    r"[\w./-]*?\.(?:py|cpp|h|cu|cuh|md|cmake|sh|json|toml)|[\w-]+\.md|\.\./shared/[\w./-]*\w)(?![\w.])"
)


def _sources():
    yield os.path.join(ROOT, "Makefile")
    yield os.path.join(ROOT, "CMakeLists.txt")
    yield os.path.join(ROOT, "pyproject.toml")
    for top in SOURCE_DIRS:
        for folder, dirs, names in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "corpus")]
            for n in names:
                if SOURCE_FILE.search(n):
                    yield os.path.join(folder, n)


def test_every_file_path_named_in_the_sources_exists():
    """A comment, docstring or message that names a file of the tree names one that exists (from
    the root, from the naming file's folder, or as a header's include name), and none names the
    references beside the checkout (../shared: the project cites none of them)."""
    sources = list(_sources())
    tree = [os.path.relpath(p, ROOT) for p in sources]
    tree += [os.path.relpath(os.path.join(d, n), ROOT) for d, _, ns in os.walk(os.path.join(ROOT, "docs")) for n in ns]
    tree += ["README.md", "build/include/tempo/ops.h"]  # the latter written by the build (cmake/TempoLayers.cmake)
    stale = []
    for path in sources:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
        for number, line in enumerate(lines, 1):
            if line.lstrip().startswith("#include"):
                continue
            for name in NAMED_PATH.findall(line):
                if name.startswith("../shared/"):
                    stale.append(
                        "%s:%d: %s (a reference outside the project)" % (os.path.relpath(path, ROOT), number, name)
                    )
                    continue
                here = os.path.normpath(os.path.join(os.path.dirname(path), name))
                if os.path.exists(os.path.join(ROOT, name)) or os.path.exists(here):
                    continue
                bare = name.lstrip("./")
                if any(t == bare or t.endswith("/" + bare) for t in tree):
                    continue
                stale.append("%s:%d: %s" % (os.path.relpath(path, ROOT), number, name))
    assert not stale, "\n".join(stale)
