import functools
import os
import subprocess
import sys

import pytest
import torch

import tempo  # noqa: F401  (loads the op library)

# The suites live in subfolders by concern (ops, suites, hf, cli, apps, package); the helpers
# they share (common, configs, registry, opinfo, reference, saved, ...) live here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Every device this machine has: the op tests run once per device (torchvision's
# cpu_and_cuda()), so the CUDA kernels are tested the moment a GPU is there.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_configure(config):
    # Under pytest-xdist (make check: a worker per core), each worker and every process it starts
    # (the tempo CLI, python -c, torchrun) computes on its share of the cores: with torch's
    # default, a thread per core in every worker, the workers' OpenMP threads wait on each other
    # (the op and suite tests took 111 s on 2 cores, 61 s with a thread each). The suites that
    # check threading set their own counts (test_determinism: 1 thread against several); make
    # sanitize runs its suites in one process with every core.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = str(max(1, len(os.sched_getaffinity(0)) // workers))
        os.environ.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        torch.set_num_threads(int(threads))
    config.addinivalue_line(
        "markers",
        "cpu_only: the test checks something only the CPU has (the CPU memory "
        "tracker, a CPU-only reference); it runs on the CPU alone",
    )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_compiler():
    """Each test compiles from scratch: torch.compile's caches are per code object, and the
    patched forwards (tempo/hf) are shared by every model, so compiled tests that ran before
    would count against dynamo's recompile limit (8) of a later one."""
    yield
    torch._dynamo.reset()


@pytest.fixture(params=DEVICES)
def on_device(request):
    """Runs the test with torch's default device set to each available device in turn:
    tensors the test makes without a device land there, and the references (float64 torch
    ops, scalar loops) run beside them."""
    if request.param != "cpu" and request.node.get_closest_marker("cpu_only"):
        pytest.skip("checks a CPU-only facility")
    with torch.device(request.param):
        yield request.param


@functools.lru_cache(maxsize=None)
def build_lacks(binary, *names):
    """Why the tempo command line at `binary` cannot do what the `tempo env` lines NAMES (such
    as "hf checkpoints", "tokenizer") describe: the first such line that says "no: ..." (a
    build without an optional library), else None."""
    if not os.path.exists(binary):
        return None
    env = subprocess.run([binary, "env"], capture_output=True, text=True, timeout=60).stdout
    for line in env.splitlines():
        name, _, value = line.partition("  ")
        if name.strip() in names and value.strip().startswith("no:"):
            return "%s: %s" % (name.strip(), value.strip()[len("no: ") :])
    return None
