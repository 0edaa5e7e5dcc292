"""tempo.nn.GatedMLP: the gated MLP of LLaMA-style models, down(act(gate(x)) * up(x)), keeping
two intermediate-wide tensors for backward (gate(x) and up(x)) where autograd keeps four.

Its projections are torch.nn.Linear modules named as transformers names them (gate_proj,
up_proj, down_proj; gate_up_proj for a fused one), so state dicts load both ways. With plain
Linear projections the module runs the fused op tempo.gated_mlp. A projection that is wrapped
or replaced (peft's LoRA layers, a quantized Linear, a hook) is called as it is, and the
product act(gate) * up and the down projection run under a saved-tensor hook that keeps gate
and up only: whatever the down projection and the product save of act(gate) or of h (LoRA's
A matrix saves h too) is recomputed from them in the backward (recompute_gated below).
"""

import functools

import torch
import torch.nn.functional as F

from .. import ops

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
RECOMPUTE = ("product", "up", "gate_up")
_TORCH_FUNCTION = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def recompute_gated(gate, up, activation, down):
    """down(act(gate) * up), act one of ACTIVATIONS, keeping gate and up for backward and no
    other tensor of the intermediate width: the activation and the product, wherever an op of
    this region saves them (the product's own backward, `down`'s weight gradient, a LoRA
    adapter's A), are saved as recipes and recomputed from gate and up when the backward reads
    them. `down` is any callable (a LoRA-wrapped Linear). Where saved-tensor hooks are already
    active (activation checkpointing, torch.autograd.graph.save_on_cpu) or under torch.compile,
    the region runs as it is, so that those keep deciding what is saved."""
    act = _TORCH_FUNCTION[activation]
    if (
        torch.compiler.is_compiling()
        or not torch.is_grad_enabled()
        or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    ):
        return down(act(gate) * up)
    g, u = gate.detach(), up.detach()  # the recipes' inputs, without the graph that made them
    # storage -> what it holds, by the storage's identity (its StorageImpl: also for fake tensors,
    # whose data pointers are all null); identities only, so nothing here keeps a or h alive
    marks = {}

    def pack(t):
        kind = marks.get(t.untyped_storage()._cdata)
        if kind is None:
            return t
        return kind, t.shape, t.stride(), t.storage_offset(), t.dtype

    def unpack(saved):
        if isinstance(saved, torch.Tensor):
            return saved
        kind, shape, stride, offset, dtype = saved
        with torch.no_grad():
            value = act(g) if kind == "act" else act(g) * u
        return value.to(dtype).as_strided(shape, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        a = act(gate)
        marks[a.untyped_storage()._cdata] = "act"
        h = a * up
        marks[h.untyped_storage()._cdata] = "h"
        del a
        return down(h)


def _plain(*modules):
    from ..hf.patching import hooked  # tempo.hf imports tempo.nn

    return all(type(m) is torch.nn.Linear and not hooked(m) for m in modules)


class GatedMLP(torch.nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) with tempo.gated_mlp's saving.

    hidden, intermediate: the widths; activation "silu" (SwiGLU), "gelu_tanh" or "gelu" (GeGLU);
    bias: the projections' biases; fused: one gate_up_proj Linear [2 intermediate, hidden] (the
    gate's rows first) instead of gate_proj and up_proj; chunk: tempo.gated_mlp's backward block;
    recompute: what its backward recomputes ("product", "up", "gate_up": tempo.gated_mlp)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        activation: str = "silu",
        bias: bool = False,
        fused: bool = False,
        chunk: int = 0,
        recompute: str = "product",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError("tempo.nn.GatedMLP: activation must be one of %s, got %r" % (ACTIVATIONS, activation))
        if not (isinstance(chunk, int) and chunk >= 0):
            raise ValueError("tempo.nn.GatedMLP: chunk must be an int >= 0 (0: automatic), got %r" % (chunk,))
        check_recompute(recompute, "tempo.nn.GatedMLP")
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.activation, self.fused, self.chunk, self.recompute = activation, fused, chunk, recompute
        if fused:
            self.gate_up_proj = torch.nn.Linear(hidden, 2 * intermediate, **kw)
        else:
            self.gate_proj = torch.nn.Linear(hidden, intermediate, **kw)
            self.up_proj = torch.nn.Linear(hidden, intermediate, **kw)
        self.down_proj = torch.nn.Linear(intermediate, hidden, **kw)

    def extra_repr(self) -> str:
        more = "" if self.recompute == "product" else ", recompute=%r" % self.recompute
        return "activation=%r, fused=%s%s" % (self.activation, self.fused, more)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return fused_gated_mlp(x, self.gate_up_proj, self.down_proj, self.activation, self.chunk, self.recompute)
        return gated_mlp(x, self.gate_proj, self.up_proj, self.down_proj, self.activation, self.chunk, self.recompute)


def check_recompute(recompute, who):
    if recompute not in RECOMPUTE:
        raise ValueError("%s: recompute must be one of %s, got %r" % (who, RECOMPUTE, recompute))


def gated_mlp(x, gate_proj, up_proj, down_proj, activation, chunk=0, recompute="product"):
    """The gated MLP of three projection modules: tempo.gated_mlp where all three are plain
    Linear modules, else the modules called as they are with recompute_gated's saving (which
    keeps gate and up whatever `recompute` asks: a wrapped projection is not re-run)."""
    if _plain(gate_proj, up_proj, down_proj):
        return ops.gated_mlp(
            x,
            gate_proj.weight,
            up_proj.weight,
            down_proj.weight,
            gate_proj.bias,
            up_proj.bias,
            down_proj.bias,
            activation,
            chunk,
            recompute,
        )
    return recompute_gated(gate_proj(x), up_proj(x), activation, down_proj)


def fused_gated_mlp(x, gate_up_proj, down_proj, activation, chunk=0, recompute="product"):
    """The same with one gate_up projection (its output's first half is the gate)."""
    if _plain(gate_up_proj, down_proj):
        return ops.gated_mlp(
            x,
            gate_up_proj.weight,
            None,
            down_proj.weight,
            gate_up_proj.bias,
            None,
            down_proj.bias,
            activation,
            chunk,
            recompute,
        )
    gate, up = gate_up_proj(x).chunk(2, dim=-1)
    return recompute_gated(gate, up, activation, down_proj)
