"""tempo's forwards for the layer types tempo.optimize patches: each is installed as the
forward of a subclass of the module's own class (patching.subclass), so `self` is the
module with its own parameters and settings."""

import torch
import torch.nn.functional as F

from .. import nn as tnn
from .. import ops
from .patching import hooked, original_forward, plain


def norm_eps(self):
    return getattr(self, "variance_epsilon", getattr(self, "eps", None))


def norm_bias(self):
    b = getattr(self, "bias", None)
    return b if isinstance(b, torch.nn.Parameter) else None


def hf_rms_norm_forward(self, hidden_states):  # x-hat * w (Llama, Mistral, Qwen2/3, T5's LayerNorm, ...)
    return ops.rms_norm(hidden_states, hidden_states.shape[-1], self.weight, norm_eps(self))


def hf_rms_norm_offset_forward(self, hidden_states):  # x-hat * (1 + w) (Gemma, Qwen3-Next, ...)
    return ops.rms_norm(hidden_states, hidden_states.shape[-1], 1.0 + self.weight, norm_eps(self))


def hf_layer_norm_forward(self, hidden_states):  # (x - mean) / std * w (+ b) (Cohere, DeBERTa, ...)
    return ops.layer_norm(hidden_states, hidden_states.shape[-1], self.weight, norm_bias(self), norm_eps(self))


def hf_gelu_forward(self, input):  # transformers' GELUActivation
    return ops.gelu(input, "none")


def hf_gelu_tanh_forward(self, input):  # NewGELUActivation, GELUTanh, PytorchGELUTanh
    return ops.gelu(input, "tanh")


def hf_silu_forward(self, input):  # transformers' SiLUActivation
    return ops.silu(input)


def bias_dropout_add_layer_norm_forward(self, hidden_states, input_tensor):
    # dense -> dropout -> LayerNorm(+ residual), as BertSelfOutput / BertOutput, in one pass.
    ln = self.LayerNorm
    if not (plain(self.dropout, torch.nn.Dropout, tnn.Dropout) and plain(ln, torch.nn.LayerNorm, tnn.LayerNorm)):
        return original_forward(self, hidden_states, input_tensor)
    if plain(self.dense, torch.nn.Linear):
        h, bias = F.linear(hidden_states, self.dense.weight), self.dense.bias
    else:  # e.g. LoRA on dense: dense runs as it is, dropout + residual + LayerNorm stay fused
        h, bias = self.dense(hidden_states), None
    return ops.bias_dropout_add_layer_norm(
        h, bias, input_tensor, self.dropout.p, ln.weight, ln.bias, ln.eps, training=self.training
    )


_GELU_APPROXIMATE = {
    "GELUActivation": "none",
    "NewGELUActivation": "tanh",
    "GELUTanh": "tanh",
    "PytorchGELUTanh": "tanh",
}


def gelu_approximate(act):
    cls = type(act)
    if cls in (torch.nn.GELU, tnn.GELU):
        return act.approximate
    # transformers' activation, re-classed by tempo.optimize. An attribute lookup, not the class's __dict__: under
    # torch.compile a mappingproxy read after any dict mutation in the graph (the LM head's) breaks fullgraph.
    cls = getattr(cls, "_tempo_patch", (cls,))[0]
    if cls.__module__.startswith("transformers."):
        return _GELU_APPROXIMATE.get(cls.__name__)
    return None


def bias_gelu_forward(self, hidden_states):
    approximate = gelu_approximate(self.intermediate_act_fn)
    if approximate is None or hooked(self.intermediate_act_fn):  # replaced after tempo.optimize, or hooked
        return original_forward(self, hidden_states)
    if not plain(self.dense, torch.nn.Linear):  # e.g. LoRA on dense: called as it is, then tempo's GELU
        return ops.gelu(self.dense(hidden_states), approximate)
    return ops.gelu(F.linear(hidden_states, self.dense.weight), approximate, bias=self.dense.bias)


def gated_activation(act):
    """The tempo.gated_mlp activation an MLP's activation module computes ("silu", "gelu",
    "gelu_tanh"), or None (not one tempo knows, or hooked: then the module's own forward runs)."""
    if act is None or hooked(act):
        return None
    cls = getattr(type(act), "_tempo_patch", (type(act),))[0]
    if cls in (torch.nn.SiLU, tnn.SiLU) or (
        cls.__name__ == "SiLUActivation" and cls.__module__.startswith("transformers.")
    ):
        return "silu"
    return {"none": "gelu", "tanh": "gelu_tanh"}.get(gelu_approximate(act))


def gated_mlp_forward(self, x):
    # down_proj(act_fn(gate_proj(x)) * up_proj(x)): LlamaMLP, MistralMLP, Qwen2/3's, Gemma's, OLMo's, ...
    act = gated_activation(self.act_fn)
    if act is None:
        return original_forward(self, x)
    return tnn.gated_mlp.gated_mlp(
        x, self.gate_proj, self.up_proj, self.down_proj, act, recompute=getattr(self, "_tempo_mlp_recompute", "product")
    )


def fused_gated_mlp_forward(self, hidden_states):
    # down_proj(act(gate) * up) with gate, up = gate_up_proj(x).chunk(2): Phi3MLP
    act = gated_activation(self.activation_fn)
    if act is None:
        return original_forward(self, hidden_states)
    return tnn.gated_mlp.fused_gated_mlp(
        hidden_states,
        self.gate_up_proj,
        self.down_proj,
        act,
        recompute=getattr(self, "_tempo_mlp_recompute", "product"),
    )


def gated_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    # transformers' experts modules (MixtralExperts, Qwen2MoeExperts, ...: gate_up_proj [E, 2 I, H] and down_proj
    # [E, H, I] parameters) in their eager form, each expert a tempo.gated_mlp; another experts implementation
    # (config._experts_implementation: grouped_mm, ...) runs as it is
    act = gated_activation(self.act_fn)
    implementation = getattr(getattr(self, "config", None), "_experts_implementation", None)
    if act is None or implementation not in (None, "eager"):
        return original_forward(self, hidden_states, top_k_index, top_k_weights)
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in expert_hit:
        expert = expert[0]
        if expert == self.num_experts:
            continue
        top_k_pos, token = torch.where(expert_mask[expert])
        y = ops.gated_mlp(
            hidden_states[token],
            self.gate_up_proj[expert],
            None,
            self.down_proj[expert],
            activation=act,
            recompute=getattr(self, "_tempo_mlp_recompute", "product"),
        )
        out.index_add_(0, token, (y * top_k_weights[token, top_k_pos, None]).to(out.dtype))
    return out


def qkv_split_forward(self, hidden_states, attention_mask=None, *args, **kwargs):
    # The original's third argument is its cache, named `cache` (transformers 5.24 on) or
    # `past_key_values` (5.17): passed on as it came when tempo does not compute this call.
    caches = list(args[:1]) + [kwargs.get(n) for n in ("cache", "past_key_values")]
    if (
        any(c is not None for c in caches)  # decoding with a cache
        or not all(plain(x, torch.nn.Linear) for x in (self.query, self.key, self.value))
    ):  # e.g. LoRA
        return original_forward(self, hidden_states, attention_mask, *args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.bert.modeling_bert import eager_attention_forward

    w = torch.cat([self.query.weight, self.key.weight, self.value.weight])
    b = torch.cat([self.query.bias, self.key.bias, self.value.bias])
    q, k, v = ops.qkv_split(F.linear(hidden_states, w), b, self.num_attention_heads)
    name = self.config._attn_implementation
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)
    else:  # transformers 5.0: "eager" is the modeling module's own function, not in the registry
        interface = eager_attention_forward if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]
    out, weights = interface(
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0 if not self.training else self.dropout.p,
        scaling=self.scaling,
        **kwargs,
    )
    return out.reshape(*hidden_states.shape[:-1], -1).contiguous(), weights
