"""What tempo.plan plans: the model (a preset with a family's published shape, a transformers
config or its folder, a model instance; devices.py: the device), and how a model is built for
the count (on fake tensors) and for the patch-time probes (a small CPU model of the same
family)."""

import copy
import os

import torch

from .devices import DEVICES, GIB, PlanError, device_name, device_of, device_setup  # noqa: F401

# Published shapes (each family's config.json on the Hugging Face Hub), by the names people use.
# Only the fields that differ from the config class's defaults are given.
PRESETS = {
    "Llama-3.2-1B": (
        "LlamaConfig",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
        ),
    ),
    "Llama-3.2-3B": (
        "LlamaConfig",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
        ),
    ),
    "Llama-3.1-8B": (
        "LlamaConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
        ),
    ),
    "Qwen2.5-7B": (
        "Qwen2Config",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            max_position_embeddings=131072,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
        ),
    ),
    "Qwen3-8B": (
        "Qwen3Config",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
        ),
    ),
    "Mistral-7B": (
        "MistralConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32768,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            sliding_window=None,
        ),
    ),
    "Gemma-2-9B": (
        "Gemma2Config",
        dict(
            hidden_size=3584,
            intermediate_size=14336,
            num_hidden_layers=42,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            vocab_size=256000,
            max_position_embeddings=8192,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
        ),
    ),
    "Phi-3-mini": (
        "Phi3Config",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32064,
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            pad_token_id=32000,
        ),
    ),
    "OLMo-2-7B": (
        "Olmo2Config",
        dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=100352,
            max_position_embeddings=4096,
            rope_theta=500000.0,
            rms_norm_eps=1e-6,
        ),
    ),
    "Mixtral-8x7B": (
        "MixtralConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32000,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            sliding_window=None,
        ),
    ),
}


def config_of(model_or_config):
    """(transformers config, a name): from a preset name, a config, a folder holding a
    config.json, or a model (its config)."""
    import transformers

    if isinstance(model_or_config, str):
        if model_or_config in PRESETS:
            cls, fields = PRESETS[model_or_config]
            return getattr(transformers, cls)(**fields), model_or_config
        if os.path.isdir(model_or_config):
            try:
                config = transformers.AutoConfig.from_pretrained(model_or_config, local_files_only=True)
            except Exception as e:  # a folder without a readable config
                raise PlanError("tempo.plan: cannot read a transformers config from %s (%s)" % (model_or_config, e))
            return config, os.path.basename(os.path.normpath(model_or_config))
        raise PlanError(
            "tempo.plan: unknown preset %r and no such folder; presets: %s" % (model_or_config, ", ".join(PRESETS))
        )
    if isinstance(model_or_config, transformers.PretrainedConfig):
        return copy.deepcopy(model_or_config), getattr(model_or_config, "_name_or_path", "") or type(
            model_or_config
        ).__name__.replace("Config", "")
    if isinstance(model_or_config, torch.nn.Module):
        config = getattr(model_or_config, "config", None)
        if not isinstance(config, transformers.PretrainedConfig):
            raise PlanError(
                "tempo.plan: %s has no transformers config; plan a transformers model, its config or a preset"
                % type(model_or_config).__name__
            )
        return copy.deepcopy(config), type(model_or_config).__name__
    raise PlanError(
        "tempo.plan: expected a preset name, a transformers config, a folder or a model, got %s"
        % type(model_or_config).__name__
    )


def model_class(config):
    """The language model class transformers has for the config: masked LM where there is one
    (BERT, RoBERTa, ...), else causal."""
    from transformers.models.auto import modeling_auto

    kind = config.model_type
    if kind in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        import transformers

        return getattr(transformers, modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES[kind]), False
    if kind in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        import transformers

        return getattr(transformers, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind]), True
    raise PlanError(
        "tempo.plan: transformers has neither a masked nor a causal language model for model type %r" % kind
    )


def positions_of(config):
    """The sequence length the model's positions allow, or None (rotary models accept any; their
    config's max_position_embeddings is what they were trained to, and is checked as such)."""
    for name in ("max_position_embeddings", "n_positions"):
        n = getattr(config, name, None)
        if n:
            return n
    return None


def small_config(config):
    """The family's config at a small size (hidden 64, 1 to 2 layers, a small vocabulary), with
    everything else as it is: the model tempo.optimize's probes run on before the plan's."""
    c = copy.deepcopy(config)
    heads = None
    for name in ("num_attention_heads", "n_head", "encoder_attention_heads"):
        if getattr(c, name, None):
            heads = getattr(c, name)
            setattr(c, name, 4)
    kv = getattr(c, "num_key_value_heads", None)
    if kv:
        c.num_key_value_heads = 4 if heads and kv == heads else (1 if kv == 1 else 2)
    for name in ("hidden_size", "n_embd", "d_model"):
        if getattr(c, name, None):
            setattr(c, name, 64)
    if getattr(c, "head_dim", None):
        c.head_dim = 16
    for name, value in (
        ("intermediate_size", 128),
        ("n_inner", 128),
        ("moe_intermediate_size", 64),
        ("shared_expert_intermediate_size", 64),
    ):
        if getattr(c, name, None):
            setattr(c, name, value)
    for name, most in (("num_local_experts", 4), ("num_experts", 4), ("num_experts_per_tok", 2)):
        if getattr(c, name, None):
            setattr(c, name, min(getattr(c, name), most))
    for name in ("num_hidden_layers", "n_layer"):
        if getattr(c, name, None):
            setattr(c, name, min(getattr(c, name), 2))
    if getattr(c, "layer_types", None):
        c.layer_types = c.layer_types[: min(len(c.layer_types), 2)]
    if getattr(c, "vocab_size", None):
        c.vocab_size = max(256, (getattr(c, "pad_token_id", None) or 0) + 1)
    return c
