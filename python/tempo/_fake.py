"""Fake (meta) kernels of the tempo ops whose output shape depends on tensor values, for
torch.compile and FakeTensor tracing. The other ops' meta kernels are in C++."""
import torch


@torch.library.register_fake("tempo::norm_kept_columns")
def _norm_kept_columns(weight, bias, dtype=None):
    ref = weight if weight is not None else bias
    torch._check(ref is not None, lambda: "tempo::norm_kept_columns: needs a weight or a bias")
    if weight is not None and bias is not None:
        torch._check(weight.device == bias.device, lambda: "tempo::norm_kept_columns: argument 'bias' must be on the "
                     "device of weight (%s), got %s" % (weight.device, bias.device))
        torch._check(weight.shape == bias.shape, lambda: "tempo::norm_kept_columns: argument 'bias' must have the "
                     "shape of weight %s, got %s" % (list(weight.shape), list(bias.shape)))
    n = ref.numel()
    k = torch.library.get_ctx().new_dynamic_size(max=n) if isinstance(n, int) else torch.library.get_ctx().new_dynamic_size()
    return ref.new_empty((k,), dtype=torch.int64)
