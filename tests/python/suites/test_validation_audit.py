"""An audit of argument validation over every public tempo op (torch.ops.tempo.*): each tensor
argument given the wrong dtype, a non-CPU device (meta, beside CPU tensors) or the wrong shape
must raise an error whose message names the op and the argument ('name'), never run on, crash
or return garbage. The table below holds one valid call per op, and the op table
(tests/python/opinfo.py) the checks of the ops it names (their calls captured from its tiny
sample); the audit derives the bad calls, and a test fails listing every (op, argument,
perturbation) that was not refused with such a message. A new op names its schemas in its
op table entry (test_every_op_is_audited)."""

import re

import pytest
import torch

import tempo  # noqa: F401  (loads the op library)
from torch.utils._python_dispatch import TorchDispatchMode

import opinfo

# The counting allocator's controls and tempo.plan's recorders (memory_plan_*: start, tag, stop;
# memory_traffic_*: start, phase, stop), which take no tensors: nothing to validate.
SKIP = {
    "build_info",
    "memory_stats",
    "memory_reset_peak",
    "memory_set_cpu_limit",
    "memory_cpu_limit",
    "memory_track",
    "memory_plan_start",
    "memory_plan_tag",
    "memory_plan_stop",
    "memory_traffic_start",
    "memory_traffic_phase",
    "memory_traffic_stop",
}


def _valid_calls():
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    x, b8 = r(4, 8), r(8)
    calls = {}
    for act, extra in (("gelu", ("none",)), ("silu", ())):
        y, m = getattr(torch.ops.tempo, act + "_forward")(x, *extra, None)
        calls[act] = ((x, *extra, b8), {"bias": "shape"})
        calls[act + "_forward"] = ((x, *extra, b8), {"bias": "shape"})
        calls[act + "_backward"] = ((r(4, 8), y, m, *extra, True), {"grad": "shape", "mask": "shape"})
    yk, keep = torch.ops.tempo.dropout_forward(x, 0.1, "bits")
    calls["dropout"] = ((x, 0.1, "bits"), {})
    calls["dropout_forward"] = ((x, 0.1, "bits"), {})
    calls["dropout_backward"] = ((r(4, 8), keep, 0.1, "bits"), {"keep": "shape"})
    w, beta = r(8) + 2, r(8)
    y, rstd, kx = torch.ops.tempo.layer_norm_forward(x, [8], w, beta, 1e-5)
    calls["layer_norm"] = ((x, [8], w, beta, 1e-5), {"weight": "shape", "bias": "shape"})
    calls["layer_norm_forward"] = ((x, [8], w, beta, 1e-5), {"weight": "shape", "bias": "shape"})
    calls["layer_norm_backward"] = (
        (r(4, 8), y, rstd, [8], w, beta),
        {"grad": "shape", "rstd": "shape", "weight": "shape", "bias": "shape"},
    )
    yr, rr, _ = torch.ops.tempo.rms_norm_forward(x, [8], w, 1e-6)
    calls["rms_norm"] = ((x, [8], w, 1e-6), {"weight": "shape"})
    calls["rms_norm_forward"] = ((x, [8], w, 1e-6), {"weight": "shape"})
    calls["rms_norm_backward"] = ((r(4, 8), yr, rr, [8], w), {"grad": "shape", "rstd": "shape", "weight": "shape"})
    calls["norm_kept_columns"] = ((w, beta), {"bias": "shape"})
    calls["norm_kept_slots"] = ((w, beta), {"bias": "shape"})
    res = r(4, 8)
    yb, rb, kb, _ = torch.ops.tempo.bias_dropout_add_layer_norm_forward(x, b8, res, 0.1, w, beta, 1e-5, "bits")
    fused_norm_checks = {"bias": "shape", "residual": "shape", "weight": "shape", "beta": "shape"}
    calls["bias_dropout_add_layer_norm"] = ((x, b8, res, 0.1, w, beta, 1e-5, "bits"), fused_norm_checks)
    calls["bias_dropout_add_layer_norm_forward"] = ((x, b8, res, 0.1, w, beta, 1e-5, "bits"), fused_norm_checks)
    calls["bias_dropout_add_layer_norm_backward"] = (
        (r(4, 8), yb, rb, kb, 0.1, "bits", w, beta, True),
        {"grad": "shape", "rstd": "shape", "keep": "shape", "weight": "shape", "beta": "shape"},
    )
    q, k, v = r(2, 2, 5, 4), r(2, 2, 5, 4), r(2, 2, 5, 4)
    mask = torch.zeros(2, 1, 5, 5)
    out, probs, akeep = torch.ops.tempo.attention_forward(q, k, v, mask, 0.1, False, None, "bits")
    att = {"k": "shape", "v": -2, "attn_mask": "shape"}  # v's head dim may differ from q's; its length not
    calls["attention"] = ((q, k, v, mask, 0.1, False, None, "bits"), att)
    calls["attention_forward"] = ((q, k, v, mask, 0.1, False, None, "bits"), att)
    calls["attention_backward"] = (
        (r(2, 2, 5, 4), q, k, v, probs, akeep, 0.1, None, "bits"),
        {"grad": "shape", "k": "shape", "v": -2, "probs": "shape", "keep": "shape"},
    )
    fout, state = torch.ops.tempo.fused_attention_forward(q, k, v, mask, 0.1, False, None, 2)
    calls["fused_attention"] = ((q, k, v, mask, 0.1, False, None, 2), att)
    calls["fused_attention_backend"] = ((q, k, mask, 0.1, False, 2), {})
    calls["fused_attention_forward"] = ((q, k, v, mask, 0.1, False, None, 2), att)
    calls["fused_attention_backward"] = (
        (r(2, 2, 5, 4), q, k, v, state, mask, 0.1, False, None, 2),
        {"grad": "shape", "k": "shape", "v": -2, "keep": "shape", "attn_mask": "shape"},
    )
    qf, kf, lv = r(2, 2, 6, 3).abs(), r(2, 2, 6, 3).abs(), r(2, 2, 6, 4)
    num, den = r(2, 2, 3, 4), r(2, 2, 3).abs()
    cla = {"kf": "shape", "v": -2, "num": "shape", "den": "shape"}  # v's D sets num's; its length must be qf's
    for name in ("causal_linear_attention", "causal_linear_attention_prefix", "causal_linear_attention_forward"):
        calls[name] = ((qf, kf, lv, num, den, 1e-6), cla)
    calls["causal_linear_attention_backward"] = (
        (r(2, 2, 6, 4), r(2, 2, 3, 4), r(2, 2, 3), qf, kf, lv, num, den, 1e-6),
        {
            "grad_y": "shape",
            "grad_num": "shape",
            "grad_den": "shape",
            "kf": "shape",
            "v": -2,
            "num": "shape",
            "den": "shape",
        },
    )
    hid, wt, bt = r(6, 8), r(10, 8), r(10)
    labels = torch.tensor([1, 2, 3, -100, 9, 0])
    loss, lse = torch.ops.tempo.linear_cross_entropy_forward(hid, wt, bt, labels, -100, 0.0, "mean", 4)
    lce = {"weight": "shape", "bias": "shape", "labels": "shape"}
    calls["linear_cross_entropy"] = ((hid, wt, bt, labels, -100, 0.0, "mean", 4), lce)
    calls["linear_cross_entropy_forward"] = ((hid, wt, bt, labels, -100, 0.0, "mean", 4), lce)
    calls["linear_cross_entropy_backward"] = (
        (torch.tensor(1.0), hid, wt, bt, labels, lse, -100, 0.0, "mean", 4),
        {**lce, "lse": "shape"},
    )
    calls["linear_cross_entropy_stats"] = ((hid, wt, bt, labels, -100, 1.0, 1.0, None, 4), lce)
    # tempo.plan's allocator replay: (storage id, +bytes allocated / -bytes freed) per event
    events = torch.tensor([[1, 1024], [2, 4096], [1, -1024], [2, -4096]])
    calls["memory_plan_replay"] = ((events, 0, 0, 1 << 30, False), {"events": "shape"})
    calls["qkv_split"] = ((r(2, 3, 12), r(12), 2), {"z": "shape", "bias": "shape"})
    calls["qkv_split_backward"] = (
        (r(2, 2, 3, 2), r(2, 2, 3, 2), r(2, 2, 3, 2), True),
        {"grad_k": "shape", "grad_v": "shape"},
    )
    wg, wu, wd, bg, bu, bd = r(6, 8), r(6, 8), r(8, 6), r(6), r(6), r(8)
    gmlp = {
        "gate_weight": "shape",
        "up_weight": "shape",
        "down_weight": "shape",
        "gate_bias": "shape",
        "up_bias": "shape",
        "down_bias": "shape",
    }
    calls["gated_mlp"] = ((x, wg, wu, wd, bg, bu, bd, "silu", 0), gmlp)
    calls["gated_mlp_forward"] = ((x, wg, wu, wd, bg, bu, bd, "silu"), gmlp)
    _, gate, up = torch.ops.tempo.gated_mlp_forward(x, wg, wu, wd, bg, bu, bd, "silu")
    calls["gated_mlp_backward"] = (
        (r(4, 8), x, gate, up, wg, wu, wd, None, None, [True, True, True], "silu", 0, [True] * 4),
        {
            "grad": "shape",
            "gate": "shape",
            "up": "shape",
            "gate_weight": "shape",
            "up_weight": "shape",
            "down_weight": "shape",
        },
    )
    return calls


class _Calls(TorchDispatchMode):
    """The arguments of each tempo op the sample calls, forward and backward (the first call of
    each schema), as the op receives them below autograd."""

    def __init__(self):
        super().__init__()
        self.args = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("tempo::"):
            self.args.setdefault(name.split("::", 1)[1], tuple(a.detach() if torch.is_tensor(a) else a for a in args))
        return func(*args, **(kwargs or {}))


def _op_table_calls():
    """The schemas the op table (tests/python/opinfo.py) names for the audit, on the arguments its
    tiny sample passes them: a new op's audit lives beside its sample."""
    calls = {}
    for key, op in opinfo.OPS.items():
        if not op.audit:
            continue
        with _Calls() as seen:
            opinfo.step(key, torch.float32, "cpu", "tiny")
        for schema, shape_args in op.audit.items():
            assert schema in seen.args, (key, schema, sorted(seen.args))
            calls[schema] = (seen.args[schema], shape_args)
    return calls


CALLS = {**_valid_calls(), **_op_table_calls()}


def _schema(name):
    return getattr(torch.ops.tempo, name).default._schema


def _public_ops():
    return sorted(
        {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("tempo::")} - SKIP
    )


def test_every_op_is_audited():
    assert set(_public_ops()) == set(CALLS), "name the new op's schemas in its opinfo entry's audit"


def _bad_shape(t, dim):
    # one element fewer along `dim`, or (for scalars / dims of size 1) one more dim
    if t.dim() == 0 or t.shape[dim] <= 1:
        return t.unsqueeze(0).repeat_interleave(2, 0)
    return t.narrow(dim, 0, t.shape[dim] - 1).contiguous()


def _bad_dtype(t):
    return torch.ones(t.shape, dtype=torch.float32) if not t.is_floating_point() else t.to(torch.int32)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_tensor_argument_is_validated_with_a_message_naming_op_and_argument(name):
    args, shape_args = CALLS[name]
    schema = _schema(name)
    getattr(torch.ops.tempo, name)(*args)  # the valid call runs
    base = re.sub(r"_(forward|backward|prefix)$", "", name)
    misses = []
    tensor_args = [
        (i, a.name) for i, a in enumerate(schema.arguments) if i < len(args) and isinstance(args[i], torch.Tensor)
    ]
    for i, arg in tensor_args:
        bad = [("dtype", _bad_dtype(args[i]))]
        if i != tensor_args[0][0]:  # the first tensor may be meta (tracing); the others must match it
            bad.append(("device", args[i].to("meta")))
        if arg in shape_args:
            bad.append(("shape", _bad_shape(args[i], -1 if shape_args[arg] == "shape" else shape_args[arg])))
        for what, t in bad:
            call = list(args)
            call[i] = t
            try:
                getattr(torch.ops.tempo, name)(*call)
            except (RuntimeError, ValueError, TypeError, IndexError) as e:
                msg = str(e).split("\n")[0] if "Exception raised from" in str(e) else str(e)
                names_op = "tempo::" + name in msg or "tempo::" + base in msg
                # a device mismatch may be reported on the other argument of the pair (when the
                # perturbed one is the op's reference tensor): it must still say "device"
                names_arg = ("'%s'" % arg) in msg or (what == "device" and "device" in msg and "'" in msg)
                if not (names_op and names_arg):
                    misses.append("%s: %s %s -> %r" % (name, arg, what, msg[:160]))
                continue
            misses.append("%s: %s %s -> accepted" % (name, arg, what))
    assert not misses, "\n".join(misses)
