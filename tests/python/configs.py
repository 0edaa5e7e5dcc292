"""Tiny model configs the suites share, each defined once: `FAMILIES`, one small config per
Hugging Face family that tempo.optimize is tested on (test_optimize_architectures, test_lm_head
and test_hf_lifecycle pick their families from it by name; `hf_family` builds one without
dropout), `tiny(name, **changes)` any of them with fields changed, `tiny_bert` the BERT most
suites train."""

import copy

import torch
import transformers


# The shapes every family shares: 2 layers, hidden 64 (16 a head), intermediate 128, a 320-token
# vocabulary (the multimodal families' image tokens are its last ids: 317-319) with pad, bos and
# eos at 0, 1 and 2, 64 positions.
VOCAB = 320
TOKENS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SHAPE = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=64
)
LLAMA_LIKE = dict(SHAPE, num_key_value_heads=2, **TOKENS)
BERT_LIKE = dict(SHAPE, **TOKENS)
SMALL_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
_QWEN_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4, spatial_merge_size=2
)
_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3]}
_LLAMA4_TEXT = dict(
    LLAMA_LIKE,
    head_dim=16,
    num_local_experts=2,
    num_experts_per_tok=1,
    intermediate_size_mlp=128,
    interleave_moe_layer_step=1,
)
_GLM4_MOE_TEXT = dict(
    LLAMA_LIKE,
    head_dim=16,
    n_routed_experts=2,
    num_experts_per_tok=1,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)
_QWEN2_VL = dict(
    text_config=dict(LLAMA_LIKE, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}),
    vision_config=dict(depth=1, hidden_size=64, num_heads=2, in_chans=3, spatial_merge_size=2, patch_size=4),
    **TOKENS,
)

# family: (model class, config class, the config's fields). A comment says what a family brings
# that the others do not.
FAMILIES = {
    # decoders with a gated MLP and RMSNorm
    "llama": ("LlamaForCausalLM", "LlamaConfig", LLAMA_LIKE),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(LLAMA_LIKE, head_dim=16)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", LLAMA_LIKE),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(LLAMA_LIKE, head_dim=16)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(LLAMA_LIKE, head_dim=16)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", LLAMA_LIKE),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", LLAMA_LIKE),  # a LayerNorm without parameters
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", LLAMA_LIKE),
    "olmo3": ("Olmo3ForCausalLM", "Olmo3Config", dict(LLAMA_LIKE, sliding_window=8)),
    "glm4": ("Glm4ForCausalLM", "Glm4Config", dict(LLAMA_LIKE, head_dim=16)),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", LLAMA_LIKE),
    "hunyuan_dense": ("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", dict(LLAMA_LIKE, head_dim=16)),
    "exaone4": ("Exaone4ForCausalLM", "Exaone4Config", dict(LLAMA_LIKE, sliding_window=8)),
    # final-logit soft-capping (Gemma 3's set, as Gemma 2's default is)
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(LLAMA_LIKE, head_dim=16, final_logit_softcapping=3.0, attn_logit_softcapping=None),
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(LLAMA_LIKE, head_dim=16, final_logit_softcapping=3.0, attn_logit_softcapping=None, sliding_window=8),
    ),
    "gemma3n": (  # soft-capping in a config that validates its fields
        "Gemma3nForCausalLM",
        "Gemma3nTextConfig",
        dict(
            LLAMA_LIKE,
            head_dim=16,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=3.0,
            num_kv_shared_layers=0,
            laurel_rank=4,
            altup_num_inputs=2,
            activation_sparsity_pattern=[0.0, 0.0],
        ),
    ),
    # a logit scale (Cohere's x 0.25, a LayerNorm with weights and no bias; Granite's / 8)
    "cohere": ("CohereForCausalLM", "CohereConfig", dict(LLAMA_LIKE, logit_scale=0.25)),
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(LLAMA_LIKE, logits_scaling=8.0)),
    # mixtures of experts (the first two add a router's auxiliary loss after the loss function's)
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(
            LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1
        ),
    ),
    "qwen2_moe": (  # the shared expert is a gated MLP; the routed experts' SiLU is patched alone
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            LLAMA_LIKE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        ),
    ),
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig", _LLAMA4_TEXT),
    "gpt_oss": (
        "GptOssForCausalLM",
        "GptOssConfig",
        dict(
            LLAMA_LIKE,
            head_dim=16,
            num_local_experts=2,
            num_experts_per_tok=1,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "qwen3_next": (  # gated delta-rule layers beside attention, experts
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        dict(
            LLAMA_LIKE,
            head_dim=16,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            layer_types=["linear_attention", "full_attention"],
        ),
    ),
    "hunyuan_moe": (
        "HunYuanMoEV1ForCausalLM",
        "HunYuanMoEV1Config",
        dict(LLAMA_LIKE, head_dim=16, num_experts=2, moe_topk=1),
    ),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", _GLM4_MOE_TEXT),
    "falcon_h1": (  # Mamba-2 mixers beside attention; a head multiplier
        "FalconH1ForCausalLM",
        "FalconH1Config",
        dict(
            LLAMA_LIKE,
            head_dim=16,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=8,
            lm_head_multiplier=0.5,
        ),
    ),
    # Mllama's language model alone (a cross-attention layer, no image: skipped)
    "mllama_text": ("MllamaForCausalLM", "MllamaTextConfig", dict(LLAMA_LIKE, cross_attention_layers=[1])),
    # decoders with LayerNorm and a GELU MLP
    "gpt2": (
        "GPT2LMHeadModel",
        "GPT2Config",
        dict(n_layer=2, n_embd=64, n_head=4, n_positions=64, **TOKENS),
    ),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(SHAPE, **TOKENS)),
    "opt": (
        "OPTForCausalLM",
        "OPTConfig",
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            ffn_dim=128,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
            **TOKENS,
        ),
    ),
    "falcon": (
        "FalconForCausalLM",
        "FalconConfig",
        dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, **TOKENS),
    ),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(SHAPE, **TOKENS)),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(n_layer=2, hidden_size=64, n_head=4, **TOKENS)),
    "gptj": (
        "GPTJForCausalLM",
        "GPTJConfig",
        dict(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_positions=64, **TOKENS),
    ),
    "gpt_neo": (
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        dict(
            num_layers=2,
            hidden_size=64,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
            max_position_embeddings=64,
            **TOKENS,
        ),
    ),
    "gpt_bigcode": (
        "GPTBigCodeForCausalLM",
        "GPTBigCodeConfig",
        dict(n_layer=2, n_embd=64, n_head=4, n_positions=64, **TOKENS),
    ),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", LLAMA_LIKE),
    # encoders (masked LMs)
    "bert": ("BertForMaskedLM", "BertConfig", BERT_LIKE),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig", BERT_LIKE),
    "xlm_roberta": ("XLMRobertaForMaskedLM", "XLMRobertaConfig", BERT_LIKE),
    "electra": ("ElectraForMaskedLM", "ElectraConfig", dict(BERT_LIKE, embedding_size=48)),
    "albert": ("AlbertForMaskedLM", "AlbertConfig", dict(BERT_LIKE, embedding_size=32)),
    "distilbert": (
        "DistilBertForMaskedLM",
        "DistilBertConfig",
        dict(n_layers=2, dim=64, hidden_dim=128, n_heads=4, max_position_embeddings=64, **TOKENS),
    ),
    "deberta": ("DebertaForMaskedLM", "DebertaConfig", BERT_LIKE),  # its own LayerNorm class, and torch's
    "deberta_v2": ("DebertaV2ForMaskedLM", "DebertaV2Config", BERT_LIKE),
    "mpnet": ("MPNetForMaskedLM", "MPNetConfig", dict(BERT_LIKE, max_position_embeddings=70, pad_token_id=1)),
    "modernbert": (
        "ModernBertForMaskedLM",
        "ModernBertConfig",
        dict(BERT_LIKE, global_attn_every_n_layers=2, local_attention=8, cls_token_id=1, sep_token_id=2),
    ),
    # encoder-decoders (T5's LayerNorm is an RMSNorm)
    "t5": (
        "T5ForConditionalGeneration",
        "T5Config",
        dict(num_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16, decoder_start_token_id=0, **TOKENS),
    ),
    "bart": (
        "BartForConditionalGeneration",
        "BartConfig",
        dict(
            encoder_layers=2,
            decoder_layers=2,
            d_model=64,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            max_position_embeddings=64,
            **TOKENS,
        ),
    ),
    # a vision transformer (no vocabulary)
    "vit": (
        "ViTForImageClassification",
        "ViTConfig",
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        ),
    ),
    # multimodal: text-only batches through the language model and its head
    "qwen2_vl": (
        "Qwen2VLForConditionalGeneration",
        "Qwen2VLConfig",
        dict(_QWEN2_VL, vision_config=dict(_QWEN2_VL["vision_config"], embed_dim=32)),
    ),
    "qwen2_5_vl": (
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLConfig",
        dict(_QWEN2_VL, vision_config=dict(_QWEN2_VL["vision_config"], out_hidden_size=64)),
    ),
    "qwen3_vl": (
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLConfig",
        dict(
            text_config=dict(LLAMA_LIKE, head_dim=16, rope_scaling=_MROPE),
            vision_config=dict(_QWEN_VISION, deepstack_visual_indexes=[0]),
            **TOKENS,
        ),
    ),
    "glm4v": (
        "Glm4vForConditionalGeneration",
        "Glm4vConfig",
        dict(text_config=dict(LLAMA_LIKE, rope_scaling=_MROPE), vision_config=_QWEN_VISION, **TOKENS),
    ),
    "glm4v_moe": (
        "Glm4vMoeForConditionalGeneration",
        "Glm4vMoeConfig",
        dict(
            text_config=dict(_GLM4_MOE_TEXT, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2]}),
            vision_config=_QWEN_VISION,
            **TOKENS,
        ),
    ),
    "llava": (
        "LlavaForConditionalGeneration",
        "LlavaConfig",
        dict(
            text_config=dict(LLAMA_LIKE, model_type="llama"),
            image_token_index=319,
            vision_config=dict(SMALL_VISION, model_type="clip_vision_model", image_size=16, patch_size=8),
        ),
    ),
    "mllama": (
        "MllamaForConditionalGeneration",
        "MllamaConfig",
        dict(
            text_config=dict(LLAMA_LIKE, cross_attention_layers=[1]),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_global_layers=1,
                attention_heads=2,
                image_size=16,
                patch_size=8,
                vision_output_dim=64,
                intermediate_layers_indices=[0],
            ),
        ),
    ),
    "gemma3_mm": (  # Gemma 3's multimodal model (which does not soft-cap)
        "Gemma3ForConditionalGeneration",
        "Gemma3Config",
        dict(
            text_config=dict(LLAMA_LIKE, head_dim=16, sliding_window=8),
            vision_config=dict(SMALL_VISION, image_size=16, patch_size=8),
            mm_tokens_per_image=4,
            image_token_index=319,
            boi_token_index=317,
            eoi_token_index=318,
        ),
    ),
    "paligemma": (  # a Gemma 2 language model: soft-capping from the text config
        "PaliGemmaForConditionalGeneration",
        "PaliGemmaConfig",
        dict(
            text_config=dict(LLAMA_LIKE, model_type="gemma2", head_dim=16, final_logit_softcapping=3.0),
            vision_config=dict(SMALL_VISION, image_size=16, patch_size=8, projection_dim=64),
            image_token_index=319,
        ),
    ),
    "internvl": (
        "InternVLForConditionalGeneration",
        "InternVLConfig",
        dict(
            text_config=dict(LLAMA_LIKE, model_type="qwen2"),
            image_token_id=319,
            vision_config=dict(SMALL_VISION, image_size=[16, 16], patch_size=[8, 8]),
        ),
    ),
    "smolvlm": (
        "SmolVLMForConditionalGeneration",
        "SmolVLMConfig",
        dict(
            text_config=dict(LLAMA_LIKE, model_type="llama"),
            vision_config=dict(SMALL_VISION, image_size=16, patch_size=8),
            image_token_id=319,
            **TOKENS,
        ),
    ),
    "llama4_mm": (  # the multimodal model: its language model's logits, its own loss
        "Llama4ForConditionalGeneration",
        "Llama4Config",
        dict(
            text_config=_LLAMA4_TEXT,
            vision_config=dict(
                SMALL_VISION,
                image_size=16,
                patch_size=8,
                vision_output_dim=64,
                projector_input_dim=64,
                projector_output_dim=64,
            ),
            image_token_index=319,
        ),
    ),
}

# Every dropout field of the families' configs: hf_family sets each to 0, as the suites compare a
# patched model's loss and gradients with the unpatched model's.
DROPOUTS = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "dropout",
    "attention_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout",
    "classifier_dropout_prob",
    "qa_dropout",
    "seq_classif_dropout",
    "activation_dropout",
    "dropout_rate",
)


def tiny(name, **changes):
    """FAMILIES[name]'s config, `changes` over its fields (a nested dict's keys over that dict's)."""
    fields = copy.deepcopy(FAMILIES[name][2])
    for k, v in changes.items():
        fields[k] = dict(fields[k], **v) if isinstance(v, dict) and isinstance(fields.get(k), dict) else v
    return getattr(transformers, FAMILIES[name][1])(**fields)


def tiny_bert(dropout=0.0, **changes):
    """FAMILIES' 2-layer BERT (hidden 64, 4 heads, intermediate 128, 64 positions) with a
    128-token vocabulary, the hidden and attention dropout both `dropout`; `changes` override
    any field."""
    fields = dict(vocab_size=128, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return tiny("bert", **dict(fields, **changes))


def hf_family(name, tied=None, **changes):
    """(model class, config) of FAMILIES[name] with `changes` (as tiny's), every dropout 0;
    `tied` (True / False) sets tie_word_embeddings on the config and its text config, None leaves
    the family's default."""
    if tied is not None:
        changes["tie_word_embeddings"] = tied
        if "text_config" in FAMILIES[name][2]:
            changes["text_config"] = dict(changes.get("text_config", {}), tie_word_embeddings=tied)
    cfg = tiny(name, **changes)
    for c in (cfg, getattr(cfg, "text_config", None)):
        for k in DROPOUTS:
            if isinstance(getattr(c, k, None), float):
                setattr(c, k, 0.0)
    return getattr(transformers, FAMILIES[name][0]), cfg


# A key projection's bias only shifts each softmax row, so its true gradient is 0: the suites hold
# no relative error on it.
ZERO_GRADIENT = ("key.bias", "k_lin.bias", "k_proj.bias", "key_proj.bias", "attn.k.bias")


def hf_batch(name):
    """A training batch for FAMILIES[name]: two sequences of 12 tokens (ids 2..127, their own
    labels), or for ViT two 32x32 images and their classes."""
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.tensor([0, 1])}
    ids = torch.randint(2, 128, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}
