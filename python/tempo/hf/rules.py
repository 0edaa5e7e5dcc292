"""The table of what tempo.optimize patches: one row per layer type, (technique, match,
replace). A new layer type is a row here, and where tempo has no forward for it yet, one
function in forwards.py; docs/architecture.md walks through adding one."""

import torch
import torch.nn.functional as F

from .. import nn as tnn
from .forwards import (
    bias_dropout_add_layer_norm_forward,
    bias_gelu_forward,
    fused_gated_mlp_forward,
    gated_activation,
    gated_experts_forward,
    gated_mlp_forward,
    gelu_approximate,
    hf_gelu_forward,
    hf_gelu_tanh_forward,
    hf_layer_norm_forward,
    hf_rms_norm_forward,
    hf_rms_norm_offset_forward,
    hf_silu_forward,
    norm_bias,
    norm_eps,
    qkv_split_forward,
)
from .patching import retype, subclass
from .probes import Differs, probe, probed

TECHNIQUES = (
    "gelu",
    "silu",
    "layer_norm",
    "rms_norm",
    "dropout",
    "bias_dropout_add_layer_norm",
    "gated_mlp",
    "lm_head",
)
# The Data Movement paper's bias fusions, added by fused=True (or named in techniques):
# "qkv_split" (BERT/RoBERTa self-attention: one GEMM for q, k, v without the bias add, then
# tempo.qkv_split adds the bias and writes the head layout in one pass), "bias_gelu"
# (BERT/RoBERTa intermediate blocks: the dense layer without its bias add, the bias added
# inside tempo.gelu's pass, its gradient summed in the backward's pass).
FUSED_TECHNIQUES = ("qkv_split", "bias_gelu")


def _rms_norm(m):
    if type(m) is torch.nn.RMSNorm:
        return retype(tnn.RMSNorm)(m)
    shape = (2, 3, m.weight.shape[0])
    try:
        probe(m, hf_rms_norm_forward, shape)
        return subclass(m, "Tempo", hf_rms_norm_forward)
    except Differs:
        pass
    try:
        probe(m, hf_rms_norm_offset_forward, shape)
    except Differs as e:
        raise Differs(str(e) + "; neither x-hat * w nor x-hat * (1 + w)") from None
    return subclass(m, "Tempo", hf_rms_norm_offset_forward)


def _is_named_norm(m, suffix):
    """A norm class of a model's own (transformers' or a user's), found by its name and its
    state: a vector of weights and an eps. What its forward computes is probed at patch time."""
    w = getattr(m, "weight", None)
    return (
        type(m).__name__.endswith(suffix)
        and isinstance(w, torch.nn.Parameter)
        and w.dim() == 1
        and isinstance(norm_eps(m), float)
    )


def _is_bias_dropout_add_layer_norm(m):
    return (
        type(m).__name__.endswith("Output")
        and isinstance(getattr(m, "dense", None), torch.nn.Linear)
        and isinstance(getattr(m, "dropout", None), torch.nn.Dropout)
        and isinstance(getattr(m, "LayerNorm", None), torch.nn.LayerNorm)
        and len(m.LayerNorm.normalized_shape) == 1
    )


def _is_bias_gelu(m):
    # BertIntermediate / RobertaIntermediate: dense then a GELU
    return (
        type(m).__name__.endswith("Intermediate")
        and isinstance(getattr(m, "dense", None), torch.nn.Linear)
        and m.dense.bias is not None
        and gelu_approximate(getattr(m, "intermediate_act_fn", None)) is not None
    )


def _is_qkv_split(m):
    # BertSelfAttention / RobertaSelfAttention: query, key, value Linears with biases
    lin = [getattr(m, n, None) for n in ("query", "key", "value")]
    return (
        type(m).__name__ in ("BertSelfAttention", "RobertaSelfAttention")
        and type(m).__module__.startswith("transformers.")
        and all(isinstance(x, torch.nn.Linear) and x.bias is not None for x in lin)
        and hasattr(m, "num_attention_heads")
        and hasattr(m, "scaling")
    )


def _linear(m, name):
    """A projection: torch's Linear, or a module standing in for one (peft's LoRA layers, which
    name their sizes as Linear does and are called as they are: tempo/nn/gated_mlp.py)."""
    lin = getattr(m, name, None)
    ok = isinstance(lin, torch.nn.Module) and all(
        isinstance(getattr(lin, a, None), int) for a in ("in_features", "out_features")
    )
    return lin if ok else None


def _is_gated_mlp(m):
    # LlamaMLP and its kind: gate_proj, up_proj [I, H], down_proj [H', I] and act_fn
    gate, up, down = (_linear(m, n) for n in ("gate_proj", "up_proj", "down_proj"))
    return (
        gate is not None
        and up is not None
        and down is not None
        and (gate.in_features, gate.out_features) == (up.in_features, up.out_features)
        and down.in_features == gate.out_features
        and gated_activation(getattr(m, "act_fn", None)) is not None
    )


def _is_fused_gated_mlp(m):
    # Phi3MLP: gate_up_proj [2 I, H] (gate rows first), down_proj [H', I], activation_fn
    gate_up, down = _linear(m, "gate_up_proj"), _linear(m, "down_proj")
    return (
        gate_up is not None
        and down is not None
        and gate_up.out_features == 2 * down.in_features
        and gated_activation(getattr(m, "activation_fn", None)) is not None
    )


def _is_gated_experts(m):
    # transformers' experts modules in their default layout (use_experts_implementation's defaults: gated,
    # gate and up concatenated, not transposed, no biases, no norm after each expert)
    gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return (
        isinstance(gate_up, torch.nn.Parameter)
        and isinstance(down, torch.nn.Parameter)
        and gate_up.dim() == 3
        and down.dim() == 3
        and gate_up.shape[0] == down.shape[0]
        and gate_up.shape[1] == 2 * down.shape[2]
        and gate_up.shape[2] == down.shape[1]
        and isinstance(getattr(m, "num_experts", None), int)
        and getattr(m, "has_gate", False) is True
        and not getattr(m, "has_bias", True)
        and not getattr(m, "is_transposed", True)
        and getattr(m, "is_concatenated", False) is True
        and not getattr(m, "has_post_expert_norm", True)
        and gated_activation(getattr(m, "act_fn", None)) is not None
    )


def _experts_inputs(m):
    # 7 tokens routed to 2 experts each (every expert reached), and their routing weights
    n, k = 7, min(2, m.num_experts)
    return [
        (n, m.gate_up_proj.shape[2]),
        lambda g: torch.stack([torch.randperm(m.num_experts, generator=g)[:k] for _ in range(n)]),
        lambda g: torch.rand(n, k, generator=g),
    ]


def _gated_experts(m):
    implementation = getattr(getattr(m, "config", None), "_experts_implementation", None)
    if implementation not in (None, "eager"):
        raise Differs(
            "transformers runs these experts with its %r implementation, not the per-expert loop tempo "
            "replaces (load the model with experts_implementation='eager' to patch them)" % implementation
        )
    return probed(gated_experts_forward, _experts_inputs)(m)


def _is_functional_gelu_layer(m):
    # torch's own TransformerEncoderLayer / TransformerDecoderLayer with activation="gelu":
    # its activation is the function F.gelu, an attribute rather than a child module
    return (
        type(m) in (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)
        and getattr(m, "activation", None) is F.gelu
    )


def _functional_gelu(m):
    m.activation = tnn.GELU("none")  # a child module now; restore puts the function back
    m.__dict__["_tempo_replaced_attribute"] = ("activation", F.gelu)
    return m


def _act_class(*names):
    def match(m):
        return type(m).__name__ in names and type(m).__module__.startswith("transformers.")

    return match


# (technique, match, replace); the first matching row whose replace does not refuse (a probe
# that finds another computation) applies. `replace` patches the module in place (its class,
# or for a function held as an attribute, a child module in its place) and returns it.
RULES = [
    ("qkv_split", _is_qkv_split, lambda m: subclass(m, "Tempo", qkv_split_forward)),  # transformers' classes only
    ("bias_gelu", _is_bias_gelu, probed(bias_gelu_forward, lambda m: [(1, 3, m.dense.in_features)])),
    (
        "bias_dropout_add_layer_norm",
        _is_bias_dropout_add_layer_norm,
        probed(
            bias_dropout_add_layer_norm_forward, lambda m: [(1, 3, m.dense.in_features), (1, 3, m.dense.out_features)]
        ),
    ),
    # the gated MLP (act_fn or activation_fn is then no longer called: optimize skips it); probed, so an
    # MLP whose forward does something else with the same modules is left
    ("gated_mlp", _is_gated_mlp, probed(gated_mlp_forward, lambda m: [(1, 3, m.gate_proj.in_features)])),
    ("gated_mlp", _is_fused_gated_mlp, probed(fused_gated_mlp_forward, lambda m: [(1, 3, m.gate_up_proj.in_features)])),
    ("gated_mlp", _is_gated_experts, _gated_experts),
    ("layer_norm", lambda m: type(m) is torch.nn.LayerNorm, retype(tnn.LayerNorm)),
    ("rms_norm", lambda m: type(m) is torch.nn.RMSNorm or _is_named_norm(m, "RMSNorm"), _rms_norm),
    # classes named LayerNorm that are not torch's: T5's (and MT5's, UMT5's, LongT5's, ...) is an
    # RMSNorm; Cohere's, DeBERTa's and torch.nn.LayerNorm subclasses subtract the mean. Each row
    # probes its form; a module whose forward is neither is left, and the report says why.
    ("rms_norm", lambda m: _is_named_norm(m, "LayerNorm") and norm_bias(m) is None, _rms_norm),
    (
        "layer_norm",
        lambda m: _is_named_norm(m, "LayerNorm"),
        probed(hf_layer_norm_forward, lambda m: [(2, 3, m.weight.shape[0])]),
    ),
    ("gelu", lambda m: type(m) is torch.nn.GELU and m.approximate in ("none", "tanh"), retype(tnn.GELU)),
    ("gelu", _is_functional_gelu_layer, _functional_gelu),
    ("gelu", _act_class("GELUActivation"), lambda m: subclass(m, "Tempo", hf_gelu_forward)),
    (
        "gelu",
        _act_class("NewGELUActivation", "GELUTanh", "PytorchGELUTanh"),
        lambda m: subclass(m, "Tempo", hf_gelu_tanh_forward),
    ),
    ("silu", lambda m: type(m) is torch.nn.SiLU, retype(tnn.SiLU)),
    ("silu", _act_class("SiLUActivation"), lambda m: subclass(m, "Tempo", hf_silu_forward)),
    ("dropout", lambda m: type(m) is torch.nn.Dropout, retype(tnn.Dropout)),
]

LOOKS_PATCHABLE = ("norm", "gelu", "silu", "swish", "act", "dropout")

# What a module patched by a technique then runs itself: the children it no longer calls (the
# walk leaves them), and whether the rest of what is under it is walked as usual (the gated MLP's
# projections stay theirs: a LoRA adapter's dropout inside them is patched) or left (the fused
# ops run all of it).
ABSORBS = {
    "bias_dropout_add_layer_norm": (("LayerNorm", "dropout"), False),
    "bias_gelu": (("intermediate_act_fn",), False),
    "gated_mlp": (("act_fn", "activation_fn"), True),
}
# The option of tempo.optimize a technique takes: (its name, its default, the report's word). A
# value other than the default is set on each patched module as `_tempo_<name>`, which its
# forward reads.
OPTIONS = {"gated_mlp": ("mlp_recompute", "product", "recompute")}


def rules_for(module, chosen):
    return [r for r in RULES if r[0] in chosen and r[1](module)]
