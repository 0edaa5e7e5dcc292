"""Fake (meta) kernels of the tempo ops whose output shape depends on tensor values, for
torch.compile and FakeTensor tracing. The other ops' meta kernels are in C++."""

import torch


def _kept_capacity(n):
    """norm_kept_capacity in csrc/torch/ops/norm.cpp: the slots of the device's kept columns."""
    return torch.sym_min(n, torch.sym_max(16, n // 64))


def _kept_reference(op, weight, bias):
    """The parameter the kept columns are sized by, after norm.cpp's argument checks."""
    ref = weight if weight is not None else bias
    torch._check(ref is not None, lambda: "tempo::%s: needs a weight or a bias" % op)
    if weight is not None and bias is not None:
        torch._check(
            weight.device == bias.device,
            lambda: (
                "tempo::%s: argument 'bias' must be on the device of "
                "weight (%s), got %s" % (op, weight.device, bias.device)
            ),
        )
        torch._check(
            weight.shape == bias.shape,
            lambda: (
                "tempo::%s: argument 'bias' must have the shape of "
                "weight %s, got %s" % (op, list(weight.shape), list(bias.shape))
            ),
        )
    return ref


@torch.library.register_fake("tempo::norm_kept_slots")
def _norm_kept_slots(weight, bias, dtype=None):
    ref = _kept_reference("norm_kept_slots", weight, bias)
    return ref.new_empty((_kept_capacity(ref.numel()),), dtype=torch.int64)


@torch.library.register_fake("tempo::norm_kept_columns")
def _norm_kept_columns(weight, bias, dtype=None):
    ref = _kept_reference("norm_kept_columns", weight, bias)
    n = ref.numel()
    if ref.device.type != "cpu":  # -1-padded slots of a size fixed by the width (norm.cpp)
        return ref.new_empty((_kept_capacity(n),), dtype=torch.int64)
    ctx = torch.library.get_ctx()
    k = ctx.new_dynamic_size(max=n) if isinstance(n, int) else ctx.new_dynamic_size()
    return ref.new_empty((k,), dtype=torch.int64)
