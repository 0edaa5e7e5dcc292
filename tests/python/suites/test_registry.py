"""The op registry (csrc/ops.json) is the one list of tempo's ops: it names exactly the public
ops and the op library's schemas; its units are exactly the source files of one name in each
layer, and CMakeLists.txt names none of them by hand; the op table (tests/python/opinfo.py, read
by the sanitizer's script and the CUDA synchronisation, determinism, second-derivative and
autocast suites) and the property generators have a case of every op; each op's autocast kernel, dtypes and differentiable inputs are what the registry says."""

import inspect
import os
import re
import sys

import pytest
import torch

import tempo

import registry  # noqa: E402
from common import python_env

pytestmark = pytest.mark.cpu_only
ROOT = registry.ROOT


_module = registry.load


def test_the_registry_names_exactly_the_public_ops_and_the_schemas():
    public = {n for n in tempo.__all__ if callable(getattr(tempo, n)) and getattr(tempo, n).__module__ == "tempo.ops"}
    assert public == set(registry.NAMES), (sorted(public - set(registry.NAMES)), sorted(set(registry.NAMES) - public))
    for name in registry.NAMES:
        assert hasattr(torch.ops.tempo, name), name
        params = inspect.signature(getattr(tempo, name)).parameters
        for arg in registry.OPS[name]["differentiable"]:
            assert arg in params, (name, arg)
        assert registry.OPS[name]["unit"] in registry.UNITS, name


LAYER_DIRS = {
    "core": ["csrc/core/%s.cpp", "csrc/core/cpu/%s.cpp", "csrc/core/cuda/%s.cu"],
    "torch": ["csrc/torch/ops/%s.cpp", "csrc/torch/autograd/%s.cpp"],
    "nn": ["csrc/nn/%s.cpp"],
}
NOT_UNITS = {"common", "checkpoint"}  # shared helpers (and nn's activation checkpointing), not ops


def test_the_units_are_exactly_the_per_layer_files():
    for layer, patterns in LAYER_DIRS.items():
        units = {u for u, layers in registry.UNITS.items() if layer in layers}
        for pattern in patterns:
            folder, ext = os.path.dirname(pattern), os.path.splitext(pattern)[1]
            found = {os.path.splitext(f)[0] for f in os.listdir(os.path.join(ROOT, folder)) if f.endswith(ext)}
            if folder == "csrc/torch/ops":  # and the units' helpers, each of its unit's name
                helpers = {h for u, hs in registry.HELPERS.items() for h in hs}
                assert all(h.startswith(u + "_") for u, hs in registry.HELPERS.items() for h in hs)
                assert helpers <= found, sorted(helpers - found)
                found -= helpers
            assert found - NOT_UNITS == units, (pattern, sorted(found - NOT_UNITS - units), sorted(units - found))


def test_cmake_takes_the_op_sources_from_the_registry():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        text = f.read()
    assert "include(cmake/TempoOps.cmake)" in text
    for name in sorted(os.listdir(os.path.join(ROOT, "cmake"))):
        if name.endswith(".cmake") and name != "TempoOps.cmake":
            with open(os.path.join(ROOT, "cmake", name)) as f:
                text += f.read()
    with open(os.path.join(ROOT, "tests", "fuzz", "CMakeLists.txt")) as f:  # the fuzzers' own project too
        fuzz = f.read()
    assert "csrc/ops.json" in fuzz
    text += fuzz
    # a file's own compile options (activation.cu's --fmad=false) may name it; no source list does
    text = "\n".join(line for line in text.splitlines() if "set_source_files_properties" not in line)
    for unit in registry.UNITS:
        assert not re.search(r"csrc/(core|torch/ops|torch/autograd|nn)/(cpu/|cuda/)?%s\.(cpp|cu)\b" % unit, text), unit


def _read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


@pytest.mark.parametrize("unit", sorted(u for u, layers in registry.UNITS.items() if "core" in layers))
def test_every_core_unit_has_its_tests_in_each_harness(unit):
    """The per-unit places of docs/architecture.md's checklist that hold a kernel to its reference:
    a GoogleTest file of the core (tests/cpp/core/test_<unit>.cpp, or a file naming it beside
    another unit; tempo_core_tests builds every file of that folder); a case of the CUDA emulator (tests/simt); a fuzz
    target's function (tests/fuzz/fuzz_core.cpp: fuzz_<unit>), called from its entry point."""
    core_tests = [f for f in os.listdir(os.path.join(ROOT, "tests/cpp/core")) if f.endswith(".cpp")]
    mine = [f for f in core_tests if unit in f[: -len(".cpp")].split("test_", 1)[-1]]
    assert mine, "no tests/cpp/core/test_%s.cpp" % unit
    cmake = _read("cmake/TempoTests.cmake")  # tempo_core_tests builds every tests/cpp/core/test_*.cpp
    assert "file(GLOB TEMPO_CORE_TEST_SOURCES CONFIGURE_DEPENDS tests/cpp/core/test_*.cpp)" in cmake
    assert "add_executable(tempo_core_tests ${TEMPO_CORE_TEST_SOURCES})" in cmake
    simt = _read("tests/simt/test_simt.cpp")
    # (the emulated entry points register themselves: tests/simt/translate.py, api.h's call)
    assert re.search(r'simt_api::call\("%s_\w*(forward|backward)"' % unit, simt), "no emulator case of " + unit
    fuzz = _read("tests/fuzz/fuzz_core.cpp")
    assert re.search(r"^void fuzz_%s\(Gen& g\)" % unit, fuzz, re.M), "no fuzz_%s in fuzz_core.cpp" % unit
    assert re.search(r"^\s+fuzz_%s\(g\);" % unit, fuzz, re.M), "fuzz_%s is never called" % unit


def _checklist():
    """The rows of docs/architecture.md's checklist table: (place, per)."""
    text = _read("docs/architecture.md")
    table = text.split("<!-- checklist: the test reads the rows between these markers -->")[1]
    table = table.split("<!-- end of checklist -->")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.strip().splitlines()[2:]]
    return [(r[1].strip("`"), r[2]) for r in rows]


def _layer_of(place):
    """The layer whose units a checklist place serves: the core's kernels and their harnesses, the
    op library's files, or (python/, csrc/ops.json) every op."""
    if place.startswith(("csrc/core", "tests/cpp/core", "tests/simt", "tests/fuzz", "tests/python/ops/test_<unit>")):
        return "core"
    return "torch" if place.startswith("csrc/torch") else None


def test_the_checklist_holds_for_every_unit():
    """Each place of the checklist (docs/architecture.md) for every unit of the registry: a
    new-file place (a path with <unit>) exists for each unit of its layer (a test file may cover
    two units, as test_norm_dropout.cpp does); an edited place names each unit of its layer, or
    each op, as its `per` column says. 15 places; a unit missing one fails here by name."""
    rows = _checklist()
    assert len(rows) == 15 and len({p for p, _ in rows}) == 15, rows
    missing = []
    for place, per in rows:
        layer = _layer_of(place)
        units = [u for u, layers in registry.UNITS.items() if layer is None or layer in layers]
        if "<unit>" in place:
            folder = os.path.dirname(place)
            prefix, suffix = os.path.basename(place).split("<unit>")
            names = os.listdir(os.path.join(ROOT, folder))
            for u in units:
                covered = prefix + u + suffix in names or (
                    prefix == "test_"
                    and any(n.startswith(prefix) and n.endswith(suffix) and u in n[len(prefix) :] for n in names)
                )
                if not covered:
                    missing.append(place.replace("<unit>", u))
        else:
            text = _read(place)
            wanted = [n for n in registry.NAMES if registry.OPS[n]["unit"] in units] if per == "op" else units
            missing += ["%s names no %s" % (place, w) for w in wanted if not re.search(r"\b%s\b" % w, text)]
    assert not missing, missing


@pytest.mark.parametrize("suite", ["opinfo", "properties"])
def test_every_suite_has_every_op(suite):
    """The op table (tests/python/opinfo.py), which the sanitizer's script, CUDA synchronisation,
    determinism, second derivatives and autocast loop over, and the property generators."""
    if suite == "properties":
        keys = _module("tests/python/suites/test_properties.py", "_reg_properties").OPS
    else:
        keys = _module("tests/python/opinfo.py", "_reg_opinfo").OPS
    assert not registry.missing(keys), "%s has no case of %s" % (suite, registry.missing(keys))


def test_the_op_table_says_which_ops_draw_a_mask():
    """An op the table marks random gives another output on a second call with the global
    generator running on (a new mask), the others bitwise the same: what the CUDA graph suite
    compares its replays by."""
    opinfo = _module("tests/python/opinfo.py", "_reg_opinfo_random")
    for key, op in opinfo.OPS.items():
        first, inputs = opinfo.run(key, torch.float32, "cpu", "small")
        again, _ = opinfo.run(key, torch.float32, "cpu", "small", reuse=inputs, reseed=False)
        same = all(torch.equal(a, b) for a, b in zip(first, again))
        assert same != op.random, (key, op.random)


def test_the_op_table_says_what_each_second_derivative_is():
    opinfo = _module("tests/python/opinfo.py", "_reg_opinfo_second")
    for key, op in opinfo.OPS.items():
        name = registry.base(key)
        assert op.second in ("refuses", "linear", "torch", "none"), key
        assert (op.second == "none") == (not registry.OPS[name]["differentiable"]), key


@pytest.mark.parametrize("name", registry.NAMES)
def test_autocast_kernel_as_the_registry_says(name):
    for key in ("AutocastCPU", "AutocastCUDA"):
        has = torch._C._dispatch_has_kernel_for_dispatch_key("tempo::" + name, key)
        assert has == (registry.OPS[name]["autocast"] != "none"), (name, key, has)


@pytest.mark.parametrize("name", registry.on("cpu"))
def test_each_dtype_runs_forward_and_backward_on_the_cpu(name):
    """The op table's case of the op (and its variants), in every dtype the registry
    names: forward, and backward where it has differentiable inputs; the output in the dtype."""
    opinfo = _module("tests/python/opinfo.py", "_reg_opinfo_dtypes")
    for dtype in registry.dtypes(name):
        cases = {k: f for k, f in opinfo.cases(dtype, "cpu").items() if registry.base(k) == name}
        assert cases, name
        for key, f in cases.items():
            y = f()
            assert y.is_floating_point() and y.dtype in (dtype, torch.float32), (key, dtype, y.dtype)
            assert y.requires_grad == bool(registry.OPS[name]["differentiable"]), key
            if y.requires_grad:
                y.float().square().sum().backward()


def test_the_library_never_imports_its_applications():
    """python/tempo/apps (the bench, the frontier, their runner) sit on the library; importing
    tempo and its layers loads none of them."""
    import subprocess

    code = (
        "import sys, tempo, tempo.hf, tempo.nn, tempo._auto, tempo.memory, tempo.slim; "
        "print(sorted(m for m in sys.modules if m.startswith('tempo.apps') or m in ('tempo.bench', 'tempo.frontier')))"
    )
    env = python_env()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])


def test_cuda_kernels_follow_one_naming_rule():
    """Every CUDA kernel in csrc/core/cuda/<unit>.cu is <unit or one of its ops>_<what>_kernel."""
    folder = os.path.join(ROOT, "csrc", "core", "cuda")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".cu"):
            continue
        unit = name[:-3]
        prefixes = (unit,) + tuple(n for n in registry.NAMES if registry.OPS[n]["unit"] == unit)
        with open(os.path.join(folder, name)) as f:
            kernels = re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)", f.read())
        assert kernels, name
        for k in kernels:
            assert k.endswith("_kernel") and k.startswith(tuple(p + "_" for p in prefixes)), (name, k)


def test_no_python_module_of_the_package_is_over_450_lines():
    """The package stays readable: no module of python/tempo over 450 lines (an application or a
    concern that grows gets a module of its own)."""
    long = []
    for folder, _, files in os.walk(os.path.join(ROOT, "python", "tempo")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    n = sum(1 for _ in f)
                if n > 450:
                    long.append((os.path.relpath(os.path.join(folder, name), ROOT), n))
    assert not long, long
