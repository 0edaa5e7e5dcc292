"""Patch-time probes: a module matched by its name and attributes is patched only after its
own forward and tempo's agree on random inputs, so that a layer computing something else is
left as it is and reported, not silently changed."""

import contextlib
import copy

import torch
from torch.nn.modules import module as _nn_module

from .patching import subclass


class Differs(Exception):
    """A module matched a rule by its structure, but its forward computes something else than
    the fused op would (probed at patch time): it is left as it is, and the report says why."""


# Verdicts remembered by class and replacement (probes.remembered), innermost last.
_REMEMBERED = []


@contextlib.contextmanager
def remembered():
    """Inside: a module's probe against a replacement runs once per module class; every later
    module of the class takes the first one's verdict. tempo.plan patches a small CPU model of the
    family first, then its plan's model of fake tensors (whose forward gives no values to
    compare) with the verdicts that model gave."""
    _REMEMBERED.append({})
    try:
        yield _REMEMBERED[-1]
    finally:
        _REMEMBERED.pop()


def probe(m, forward, *shapes):
    if not _REMEMBERED:
        return _probe(m, forward, *shapes)
    key = (type(m), forward)
    if key not in _REMEMBERED[-1]:
        try:
            _probe(m, forward, *shapes)
            _REMEMBERED[-1][key] = None
        except Differs as e:
            _REMEMBERED[-1][key] = e
    if _REMEMBERED[-1][key] is not None:
        raise Differs(str(_REMEMBERED[-1][key]))


def _probe(m, forward, *shapes):
    """Runs the module's own forward and `forward` (the replacement, with the module as self)
    on the same random inputs (a shape each, or a callable generator -> tensor for an input that
    is not random floats), in eval mode without grad, and raises Differs unless they
    agree to within a few units of the module's dtype. Matching HF layers by name and
    attributes alone would patch, say, Gemma's RMSNorm (x-hat * (1 + w)) as Llama's (x-hat * w)."""
    p = next(m.parameters(), None)
    if p is None:
        raise Differs("its forward cannot be probed (no parameters)")
    g = torch.Generator(device="cpu").manual_seed(0)
    if p.device.type == "meta":  # a model built without storage (to be loaded later, e.g. under FSDP): what the
        # forward computes does not depend on the values, so a CPU copy with random ones is probed instead
        m = _randomised(m, g)
    xs = [s(g) if callable(s) else _random(s, g) for s in shapes]  # a callable makes an input of its own (ids)
    want = _compare(m, forward, xs)
    if want == 0:  # its weights make every output 0 (a norm's gammas all 0): any form would agree, so the
        _compare(_randomised(m, g), forward, xs)  # form is told apart on a copy with random weights


def _random(shape, g):
    """Random fp32 values on the CPU, whatever the ambient context: a model is often built (and
    optimized) under `with torch.device("meta")` (from_pretrained, FSDP, deferred loading), under
    torch.set_default_device or torch.set_default_dtype, which would otherwise decide where and in
    what a probe's tensors are made. The probe casts them to the module's device and dtype."""
    return torch.randn(shape, generator=g, device="cpu", dtype=torch.float32)


def _randomised(m, g):
    """A copy of `m` with random parameters and buffers (on the CPU when `m` has no storage)."""
    m = copy.deepcopy(m)
    if next(m.parameters()).device.type == "meta":
        m = m.to_empty(device="cpu")
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            if t.is_floating_point():
                t.copy_(_random(t.shape, g))
    return m


def _compare(m, forward, xs):
    """probe's comparison on inputs `xs`; returns the largest magnitude of the module's output."""
    p = next(m.parameters())
    xs = [x.to(p.device, p.dtype) if x.is_floating_point() else x.to(p.device) for x in xs]
    modes = [(x, x.training) for x in m.modules()]
    m.eval()
    try:  # the forward's own factory calls (torch.arange without a device, say) made on the module's device
        with torch.no_grad(), hooks_suspended(m), torch.device(p.device):
            want = type(m).forward(m, *xs)
            got = forward(m, *xs)
    except Exception as e:  # a forward with other arguments or other outputs than the rule's
        raise Differs("its forward could not be probed as the rule's (%s: %s)" % (type(e).__name__, e)) from None
    finally:
        for x, training in modes:
            x.training = training
    if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and want.shape == got.shape):
        raise Differs("its forward returns something else than the rule's")
    want, got = want.double(), got.double()
    scale = want.abs().max().item()
    err = (got - want).abs().max().item() / max(scale, 1e-300)
    tol = 1e-4 if p.dtype in (torch.float32, torch.float64) else 2.0**-6
    if not err <= tol:
        raise Differs("its forward computes something else (probed: relative difference %.2g)" % err)
    return scale


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


@contextlib.contextmanager
def hooks_suspended(m):
    """The user's hooks (on `m`'s modules, and torch's global module hooks) do not see a probe's
    random inputs: the probe is tempo's check, not a forward of the model."""
    saved = [(x, name, getattr(x, name)) for x in m.modules() for name in _HOOKS]
    saved += [(_nn_module, "_global" + name, getattr(_nn_module, "_global" + name)) for name in _HOOKS]
    for owner, name, _ in saved:
        setattr(owner, name, type(getattr(owner, name))())
    try:
        yield
    finally:
        for owner, name, hooks in saved:
            setattr(owner, name, hooks)


def probed(forward, shapes):
    """A rule's replace: subclass the module with `forward` if the probe agrees."""

    def replace(m):
        probe(m, forward, *shapes(m))
        return subclass(m, "Tempo", forward)

    return replace
