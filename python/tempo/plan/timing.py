"""A planned step's time on its device, from what the trace counted: the matmul FLOPs at the
device's matmul rate, the bytes the memory-bound operators move at its memory bandwidth
(recomputation included in both, as traced), and the bytes moved to and from host memory at the
link's rate, hidden behind the compute where the copies run on a stream of their own (TRL's
activation offloading) and added to it where they run on the compute stream (transformers'
checkpoints in host memory, which tempo's ckpt-offload uses for now). A GPU's rates are its
datasheet's (devices.FIGURES) at the efficiencies devices.py states; the CPU's are measured
here (devices.cpu_rates)."""

from .. import methods
from .devices import BANDWIDTH_EFFICIENCY, MATMUL_EFFICIENCY

# The operators whose time is their FLOPs', not their bytes': GEMMs and fused attention.
COMPUTE_BOUND = ("::mm", "::addmm", "::bmm", "::baddbmm", "::_grouped_mm", "scaled_dot_product", "attention")


def is_compute_bound(op):
    return any(k in op for k in COMPUTE_BOUND)


def predict(job, row):
    """Fills row.time (seconds) and row.time_parts from the row's record."""
    s = job.setup
    record = job.record(row.name, s["batch"], s["seq"], traffic=True)
    gpu = s["kind"] == "cuda"
    matmul = s["matmul"] * (MATMUL_EFFICIENCY if gpu else 1.0)
    if gpu and s["precision"] == "fp32":
        matmul /= 2  # TF32 tensor cores: half the bf16 rate
    bandwidth = s["bandwidth"] * (BANDWIDTH_EFFICIENCY if gpu else 1.0)
    parts = {"matmul": record.flops / matmul, "memory": record.traffic / bandwidth}
    compute = parts["matmul"] + parts["memory"]
    if record.moved and s.get("link"):
        copies = 2 * record.moved / s["link"]  # out in the forward, back in the backward
        if methods.parse(row.name).offload:  # TRL's side stream: hidden behind the compute
            parts["host"] = max(0.0, copies - compute)
        else:  # save_on_cpu on the compute stream
            parts["host"] = copies
    row.traffic = record.traffic
    row.time_parts = parts
    row.time = sum(parts.values())
