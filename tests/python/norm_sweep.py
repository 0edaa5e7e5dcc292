"""The gamma/beta sweep behind the norms' accuracy bound, shared by tests/python/ops/test_norm.py
and benchmarks/norm_accuracy.py. One tensor holds every case as a column: gamma in GAMMAS (with
signs) times beta / |gamma| in RATIOS, plus ordinary columns; gradients of tempo's op and of
torch's own op in the same dtype are compared per column with float64 torch on the same
(rounded) inputs.

Per-column errors, each scaled so that cancellation does not count against either side:
  dx:      ||dx[:, j] - ref|| / ||ref[:, j]||
  dgamma:  |dgamma_j - ref| / sum_i |dy_ij xhat_ij|
  dbeta:   |dbeta_j - ref| / sum_i |dy_ij|
"""

import torch
import torch.nn.functional as F

import tempo

GAMMAS = [0.0, 1e-38, -1e-38, 1e-33, -1e-20, 1e-13, 1e-6, -1e-3, 1.0, 1e3]
RATIOS = [0.0, 1.0, -10.0, 1e3, 1e8]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# The stated bound (docs/accuracy.md): relative error at most BOUND[dtype], or 4x torch's own
# error in that column where that is larger. In 16-bit BOUND is twice torch's own worst error
# or two rounding units (2^-8 bf16, 2^-11 fp16), whichever is larger: recovering xhat from a
# 16-bit y costs up to about 1.5 rounding units in RMSNorm's dx, where torch (keeping x) has
# ~0.3 (docs/accuracy.md).
BOUND = {torch.float32: 1e-5, torch.float64: 1e-12}
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def columns(kind, dtype, ordinary=64, seed=0, param_dtype=None):
    """gamma, beta (float64, representable in param_dtype (default dtype); beta None for
    rms_norm), with every (gamma, ratio) pair as one column; betas that overflow dtype are set
    to 0."""
    param_dtype = param_dtype or dtype
    g = torch.Generator().manual_seed(seed)
    gam, bet = [], []
    for gv in GAMMAS:
        for r in RATIOS if kind == "layer_norm" else [0.0]:
            gam.append(gv)
            bet.append(r * abs(gv))
    gam += (1 + 0.3 * torch.randn(ordinary, generator=g, dtype=torch.float64, device="cpu")).tolist()
    bet += (0.1 * torch.randn(ordinary, generator=g, dtype=torch.float64, device="cpu")).tolist()
    w = torch.tensor(gam, dtype=torch.float64).to(param_dtype)
    b = torch.tensor(bet, dtype=torch.float64).to(param_dtype)
    b = torch.where(torch.isfinite(b.to(dtype)), b, torch.zeros_like(b))
    return w.double(), (b.double() if kind == "layer_norm" else None)


def _grads(fn, x, w, b, dy):
    ps = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    if b is not None:
        ps.append(b.clone().requires_grad_(True))
    y = fn(*ps) if b is not None else fn(ps[0], ps[1], None)
    return [y.detach().double()] + [t.double() for t in torch.autograd.grad(y, ps, dy)]


def measure(kind, dtype, rows=48, seed=0, param_dtype=None):
    """Per-column errors of tempo and of torch (dicts of float64 tensors over columns), the
    kept columns (bool over columns), and the columns' gamma / beta. param_dtype: the
    parameters' dtype (default dtype; float32 under 16-bit data, as torch's CPU layer_norm
    takes them)."""
    param_dtype = param_dtype or dtype
    w64, b64 = columns(kind, dtype, seed=seed, param_dtype=param_dtype)
    cols = w64.numel()
    g = torch.Generator().manual_seed(seed + 1)  # CPU draws, moved to the device under test
    dev = torch.get_default_device()
    x = (2 * torch.randn(rows, cols, generator=g, dtype=torch.float64, device="cpu") + 0.5).to(dev, dtype)
    dy = torch.randn(rows, cols, generator=g, dtype=torch.float64, device="cpu").to(dev, dtype)
    if kind == "layer_norm":
        ours = lambda x, w, b: tempo.layer_norm(x, cols, w, b)  # noqa: E731
        ref = lambda x, w, b: F.layer_norm(x, [cols], w, b)  # noqa: E731
    else:
        ours = lambda x, w, b: tempo.rms_norm(x, cols, w, 1e-6)  # noqa: E731
        ref = lambda x, w, b: F.rms_norm(x, [cols], w, 1e-6)  # noqa: E731
    d = lambda t: None if t is None else t.to(param_dtype)  # noqa: E731
    exact = _grads(ref, x.double(), w64, b64, dy.double())
    theirs = ref
    if param_dtype != dtype:  # torch's CPU kernel for 16-bit x and float32 parameters, on any device
        theirs = lambda x, w, b: ref(x.float(), w, b).to(x.dtype)  # noqa: E731
    got = {"tempo": _grads(ours, x, d(w64), d(b64), dy), "torch": _grads(theirs, x, d(w64), d(b64), dy)}
    x64 = x.double()
    if kind == "layer_norm":
        xhat = (x64 - x64.mean(-1, keepdim=True)) * torch.rsqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-5)
    else:
        xhat = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6)
    scale_w = (dy.double() * xhat).abs().sum(0)
    scale_b = dy.double().abs().sum(0)
    errors = {}
    for who, o in got.items():
        e = {
            "y": ((o[0] - exact[0]).norm(dim=0) / exact[0].norm(dim=0).clamp_min(1e-300)),
            "dx": ((o[1] - exact[1]).norm(dim=0) / exact[1].norm(dim=0).clamp_min(1e-300)),
            "dgamma": (o[2] - exact[2]).abs() / scale_w.clamp_min(1e-300),
        }
        if b64 is not None:
            e["dbeta"] = (o[3] - exact[3]).abs() / scale_b.clamp_min(1e-300)
        e["nonfinite"] = sum(int((~torch.isfinite(t)).sum()) for t in o[1:])
        errors[who] = e
    kept = torch.zeros(cols, dtype=torch.bool, device=w64.device)
    kept[torch.ops.tempo.norm_kept_columns(d(w64), d(b64), dtype)] = True
    return errors, kept, w64, b64


def bound(dtype, torch_err):
    """The per-column bound for an output whose torch errors are torch_err (over columns)."""
    base = BOUND[dtype] if dtype in BOUND else max(2 * torch_err.max().item(), 2 * UNIT[dtype])
    return torch.clamp(4 * torch_err, min=base)
