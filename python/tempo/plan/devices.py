"""The devices tempo.plan plans for: each GPU's memory, the host memory a training process has
beside it, the host link, and the rates a step's time is predicted from; the CPU's rates are
measured on this machine."""

import dataclasses
import functools
import time

import numpy
import torch

GIB = 1 << 30
CUDA_CONTEXT = 768 << 20  # the CUDA context and the libraries' handles, outside max_memory_allocated


@dataclasses.dataclass(frozen=True)
class Device:
    """A GPU as the plan sees it. memory: what the driver reports (nvidia-smi's total); host: the
    host memory one training process may hold beside it (a server's memory over its GPUs, or a
    workstation's); link: host <-> device bytes/s of pinned copies (about 80% of the PCIe link's
    rate each way); matmul: dense bf16 tensor-core FLOP/s (fp32 matmuls as TF32: half); bandwidth:
    memory bytes/s; source: where the figures come from."""

    memory: int
    host: int
    link: float
    matmul: float
    bandwidth: float
    source: str


# Datasheet figures (dense, no sparsity). A plan's time takes them at the efficiencies below; a
# lent GPU's measurement (scripts/gpu_check.sh) is what checks them.
FIGURES = {
    "RTX-4090-24GB": Device(
        24564 << 20,
        64 * GIB,
        25e9,
        165e12,
        1.008e12,
        "NVIDIA Ada GPU architecture whitepaper (RTX 4090: 165 TFLOPS dense FP16/BF16 tensor with FP32 "
        "accumulate, 1,008 GB/s); PCIe Gen4 x16; a 64 GiB workstation",
    ),
    "A100-40GB": Device(
        40960 << 20,
        128 * GIB,
        25e9,
        312e12,
        1.555e12,
        "NVIDIA A100 datasheet (312 TFLOPS BF16 dense, 1,555 GB/s); PCIe Gen4 x16; DGX A100 320GB: 1 TB over 8 GPUs",
    ),
    "L40S-48GB": Device(
        46068 << 20,
        128 * GIB,
        25e9,
        362e12,
        0.864e12,
        "NVIDIA L40S datasheet (362 TFLOPS BF16 dense, 864 GB/s); PCIe Gen4 x16; 1 TB over 8 GPUs",
    ),
    "A100-80GB": Device(
        81920 << 20,
        256 * GIB,
        25e9,
        312e12,
        2.039e12,
        "NVIDIA A100 datasheet (312 TFLOPS BF16 dense, 2,039 GB/s SXM); PCIe Gen4 x16; DGX A100 640GB: 2 TB "
        "over 8 GPUs",
    ),
    "H100-80GB": Device(
        81559 << 20,
        256 * GIB,
        50e9,
        989e12,
        3.35e12,
        "NVIDIA H100 datasheet (SXM: 989 TFLOPS BF16 dense, 3.35 TB/s); PCIe Gen5 x16; DGX H100: 2 TB over 8 GPUs",
    ),
    "H200-141GB": Device(
        143771 << 20,
        256 * GIB,
        50e9,
        989e12,
        4.8e12,
        "NVIDIA H200 datasheet (SXM: 989 TFLOPS BF16 dense, 4.8 TB/s); PCIe Gen5 x16; DGX H200: 2 TB over 8 GPUs",
    ),
}
DEVICES = {name: d.memory for name, d in FIGURES.items()}
# What a step reaches of the datasheet rates: large bf16 GEMMs about two thirds of the tensor
# cores' peak, memory-bound kernels about 80% of the bandwidth (planned, not yet measured on a
# lent GPU).
MATMUL_EFFICIENCY = 0.65
BANDWIDTH_EFFICIENCY = 0.8


class PlanError(ValueError):
    """A plan that cannot be made as asked, with why (an unknown preset or device, a config that
    cannot be built, a method that does not apply, a sequence beyond the model's positions)."""


def device_of(device):
    """(kind, capacity in bytes or None): kind "cpu" or "cuda"; a name from DEVICES, a byte
    count (a GPU of that size) or "cpu"."""
    if isinstance(device, str) and device.lower() == "cpu":
        return "cpu", None
    if isinstance(device, bool):
        raise PlanError("tempo.plan: device must be a name, a byte count or 'cpu', got %r" % (device,))
    if isinstance(device, int):
        if device <= 0:
            raise PlanError("tempo.plan: a device's size must be positive, got %d bytes" % device)
        return "cuda", device
    if isinstance(device, str):
        for name, size in DEVICES.items():
            if device.lower() == name.lower():
                return "cuda", size
    known = ", ".join(list(DEVICES) + ["cpu"])
    raise PlanError("tempo.plan: unknown device %r; known: %s, a byte count, or 'cpu'" % (device, known))


def device_name(device):
    if isinstance(device, int):
        return "%.1f GiB" % (device / GIB)
    for name in DEVICES:
        if isinstance(device, str) and device.lower() == name.lower():
            return name
    return device


def figures_of(device):
    """The Device of a GPU name; a byte count: an H100's rates with that memory; None for the CPU."""
    kind, capacity = device_of(device)
    if kind == "cpu":
        return None
    name = device_name(device)
    if name in FIGURES:
        return FIGURES[name]
    return dataclasses.replace(FIGURES["H100-80GB"], memory=capacity, source="an H100's rates, the memory given")


def device_setup(setup, device, budget=None, host=None):
    """`setup` with the device's fields: device, kind, capacity, budget (the memory less the CUDA
    context, unless given), host (bytes: the device's default unless given; None on the CPU) and
    the rates (the CPU's measured here)."""
    kind, capacity = device_of(device)
    d = figures_of(device)
    setup.update(device=device_name(device), kind=kind, capacity=capacity)
    setup["budget"] = budget if budget is not None else (capacity - CUDA_CONTEXT if capacity is not None else None)
    if host is not None and (isinstance(host, bool) or not isinstance(host, int) or host <= 0):
        raise PlanError("tempo.plan: host is a positive number of bytes, got %r" % (host,))
    if d is None:
        rates = cpu_rates()
        setup.update(host=host, link=None, matmul=rates["matmul"], bandwidth=rates["bandwidth"])
    else:
        setup.update(host=host if host is not None else d.host, link=d.link, matmul=d.matmul, bandwidth=d.bandwidth)
    return setup


@functools.lru_cache(maxsize=None)
def cpu_rates():
    """This CPU's rates as a training step meets them, measured once per process: matmul FLOP/s
    (fp32 GEMMs of a decoder's shapes, at least 0.2 s of them) and memory bytes/s (a copy of 64
    MiB, read and written). The buffers are numpy's, outside torch's allocator: the measurement
    moves neither tempo.memory's count nor a CPU limit's (it may run inside tempo.auto's)."""

    def buffer(*shape):
        return torch.from_numpy(numpy.random.default_rng(0).standard_normal(shape, dtype=numpy.float32))

    a, b, c = buffer(512, 1024), buffer(1024, 1024), buffer(512, 1024)
    torch.mm(a, b, out=c)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.2:
        torch.mm(a, b, out=c)
        n += 1
    matmul = 2 * 512 * 1024 * 1024 * n / (time.perf_counter() - start)
    x, y = buffer(16 << 20), buffer(16 << 20)
    y.copy_(x)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.2:
        y.copy_(x)
        n += 1
    bandwidth = 2 * x.numel() * 4 * n / (time.perf_counter() - start)
    return {"matmul": matmul, "bandwidth": bandwidth}
