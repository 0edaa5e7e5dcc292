"""tempo.optimize across Hugging Face architectures it was not written for (32 families:
encoders, decoders, mixtures of experts, encoder-decoders, a vision transformer): tiny models
built from configs, norm weights moved far from their initial values (as trained ones are),
dropout 0. With the model's own attention and with tempo's, tempo patches the layers listed here
and every parameter's gradient matches the unpatched model's within 1e-5 relative. (OLMo's
LayerNorm has no parameters, a layer tempo leaves as it is: only OLMo's gated MLP is patched.
Qwen2-MoE's shared expert is a gated MLP; its routed experts' SiLU is patched alone.)"""

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers as T  # noqa: E402

import tempo  # noqa: E402

# family: (model class, config class, config, what tempo patches with attention="keep", besides
# dropout: tempo's Dropout is expected wherever the model has an nn.Dropout, which depends on the
# transformers release, e.g. Falcon's attention dropout became functional in 5.25)
ARCHITECTURES = {
    "roberta": (
        T.RobertaForMaskedLM,
        T.RobertaConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            max_position_embeddings=70,
            pad_token_id=1,
        ),
        ["LayerNorm", "TempoGELUActivation", "TempoRobertaOutput", "TempoRobertaSelfOutput"],
    ),
    "distilbert": (
        T.DistilBertForMaskedLM,
        T.DistilBertConfig,
        dict(n_layers=2, dim=64, hidden_dim=128, n_heads=4, max_position_embeddings=64),
        ["LayerNorm", "TempoGELUActivation"],
    ),
    "albert": (
        T.AlbertForMaskedLM,
        T.AlbertConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            embedding_size=32,
            max_position_embeddings=64,
        ),
        ["LayerNorm", "TempoNewGELUActivation"],
    ),
    "electra": (
        T.ElectraForMaskedLM,
        T.ElectraConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            embedding_size=32,
            max_position_embeddings=64,
        ),
        ["LayerNorm", "TempoElectraOutput", "TempoElectraSelfOutput", "TempoGELUActivation"],
    ),
    "deberta-v2": (
        T.DebertaV2ForMaskedLM,
        T.DebertaV2Config,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
        ["LayerNorm", "TempoDebertaV2Output", "TempoDebertaV2SelfOutput", "TempoGELUActivation"],
    ),
    "mistral": (
        T.MistralForCausalLM,
        T.MistralConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
        ),
        ["TempoMistralMLP", "TempoMistralRMSNorm"],
    ),
    "qwen2": (
        T.Qwen2ForCausalLM,
        T.Qwen2Config,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        ),
        ["TempoQwen2MLP", "TempoQwen2RMSNorm"],
    ),
    "phi": (
        T.PhiForCausalLM,
        T.PhiConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
        ["LayerNorm", "TempoNewGELUActivation"],
    ),
    "phi3": (
        T.Phi3ForCausalLM,
        T.Phi3Config,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=0,
        ),
        ["TempoPhi3MLP", "TempoPhi3RMSNorm"],
    ),
    "gpt_neox": (
        T.GPTNeoXForCausalLM,
        T.GPTNeoXConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
        ["LayerNorm", "TempoGELUActivation"],
    ),
    "opt": (
        T.OPTForCausalLM,
        T.OPTConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            ffn_dim=128,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
        ),
        ["LayerNorm"],
    ),
    "bloom": (T.BloomForCausalLM, T.BloomConfig, dict(n_layer=2, hidden_size=64, n_head=4), ["LayerNorm"]),
    "falcon": (
        T.FalconForCausalLM,
        T.FalconConfig,
        dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4),
        ["LayerNorm", "TempoGELUActivation"],
    ),
    "gemma": (
        T.GemmaForCausalLM,
        T.GemmaConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
        ),
        ["TempoGemmaMLP", "TempoGemmaRMSNorm"],
    ),
    "olmo2": (
        T.Olmo2ForCausalLM,
        T.Olmo2Config,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        ),
        ["TempoOlmo2MLP", "TempoOlmo2RMSNorm"],
    ),
    "t5": (
        T.T5ForConditionalGeneration,
        T.T5Config,
        dict(num_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16, decoder_start_token_id=0, pad_token_id=0),
        ["TempoT5LayerNorm"],
    ),  # T5's LayerNorm is an RMSNorm: patched as one
    "cohere": (
        T.CohereForCausalLM,
        T.CohereConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        ["TempoCohereLayerNorm", "TempoCohereMLP"],
    ),  # a LayerNorm with weights and no bias
    "deberta": (
        T.DebertaForMaskedLM,
        T.DebertaConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),  # its own LayerNorm class, and torch's:
        ["LayerNorm", "TempoDebertaLayerNorm", "TempoGELUActivation"],
    ),
    "modernbert": (
        T.ModernBertForMaskedLM,
        T.ModernBertConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            max_position_embeddings=64,
            global_attn_every_n_layers=2,
            local_attention=8,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        ),
        ["LayerNorm", "TempoGELUActivation"],
    ),
    "mixtral": (
        T.MixtralForCausalLM,
        T.MixtralConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        ["TempoMixtralRMSNorm", "TempoSiLUActivation"],
    ),
    "qwen2_moe": (
        T.Qwen2MoeForCausalLM,
        T.Qwen2MoeConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
        ["TempoQwen2MoeMLP", "TempoQwen2MoeRMSNorm", "TempoSiLUActivation"],
    ),
    "gemma3": (
        T.Gemma3ForCausalLM,
        T.Gemma3TextConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            sliding_window=8,
        ),
        ["TempoGemma3MLP", "TempoGemma3RMSNorm"],
    ),
    "gptj": (
        T.GPTJForCausalLM,
        T.GPTJConfig,
        dict(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_positions=64),
        ["LayerNorm", "TempoNewGELUActivation"],
    ),
    "gpt_neo": (
        T.GPTNeoForCausalLM,
        T.GPTNeoConfig,
        dict(
            num_layers=2,
            hidden_size=64,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
            max_position_embeddings=64,
        ),
        ["LayerNorm", "TempoNewGELUActivation"],
    ),
    "gpt_bigcode": (
        T.GPTBigCodeForCausalLM,
        T.GPTBigCodeConfig,
        dict(n_layer=2, n_embd=64, n_head=4, n_positions=64),
        ["LayerNorm", "TempoGELUTanh"],
    ),
    "starcoder2": (
        T.Starcoder2ForCausalLM,
        T.Starcoder2Config,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        ),
        ["LayerNorm", "TempoGELUTanh"],
    ),
    "granite": (
        T.GraniteForCausalLM,
        T.GraniteConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        ),
        ["TempoGraniteMLP", "TempoGraniteRMSNorm"],
    ),
    "olmo": (
        T.OlmoForCausalLM,
        T.OlmoConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
        ["TempoOlmoMLP"],
    ),
    "xlm-roberta": (
        T.XLMRobertaForMaskedLM,
        T.XLMRobertaConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            max_position_embeddings=70,
            pad_token_id=1,
        ),
        ["LayerNorm", "TempoGELUActivation", "TempoXLMRobertaOutput", "TempoXLMRobertaSelfOutput"],
    ),
    "mpnet": (
        T.MPNetForMaskedLM,
        T.MPNetConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            max_position_embeddings=70,
            pad_token_id=1,
        ),
        ["LayerNorm", "TempoGELUActivation", "TempoMPNetOutput"],
    ),
    "bart": (
        T.BartForConditionalGeneration,
        T.BartConfig,
        dict(
            encoder_layers=2,
            decoder_layers=2,
            d_model=64,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            max_position_embeddings=64,
        ),
        ["LayerNorm", "TempoGELUActivation"],
    ),
    "vit": (
        T.ViTForImageClassification,
        T.ViTConfig,
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        ),
        ["LayerNorm", "TempoGELUActivation"],
    ),
}
_DROPOUTS = (
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
# These pass their attention function a relative position bias, which tempo's attention does not
# compute: attention="tempo" raises, naming it, at the first forward.
_BIASED_ATTENTION = ("t5",)
# A key projection's bias only shifts each softmax row, so its true gradient is 0: no relative error.
_ZERO_GRADIENT = ("key.bias", "k_lin.bias", "k_proj.bias", "key_proj.bias", "attn.k.bias")


def _model(family):
    cls, cfg_cls, kwargs, _ = ARCHITECTURES[family]
    cfg = cfg_cls(**kwargs, **({} if family == "vit" else {"vocab_size": 128}))
    for k in _DROPOUTS:
        if isinstance(getattr(cfg, k, None), float):
            setattr(cfg, k, 0.0)
    torch.manual_seed(0)
    model = cls(cfg).train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n.lower() or "ln" in n.lower():
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _batch(family):
    g = torch.Generator().manual_seed(1)
    if family == "vit":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.tensor([0, 1])}
    ids = torch.randint(2, 128, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def _calls_the_registry(model, batch):
    """Whether the model's attention goes through transformers' attention-function registry: a
    function registered there and named in the model's config is called by its forward. Those
    that compute attention in their own code (BLOOM, DeBERTa, DeBERTa-v2, GPT-Neo, MPNet; Falcon
    before transformers 5.25) are not: attention="tempo" cannot apply to them, and optimize says so
    (a warning and the report) instead of reporting a patch that does nothing."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def probe(module, *args, **kwargs):
        calls.append(type(module).__name__)
        return sdpa_attention_forward(module, *args, **kwargs)

    T.AttentionInterface.register("tempo_test_probe", probe)
    probed = copy.deepcopy(model)
    probed.set_attn_implementation("tempo_test_probe")  # refused (logged) where not supported
    if probed.config._attn_implementation != "tempo_test_probe":
        return False
    for module in probed.modules():  # transformers 5.17 leaves the copies of T5's config
        if hasattr(getattr(module, "config", None), "_attn_implementation"):
            module.config._attn_implementation = "tempo_test_probe"
    with torch.no_grad():
        probed(**batch)
    return bool(calls)


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_every_gradient_matches(family):
    ref = _model(family)
    batch = _batch(family)
    want = _grads(ref, batch)
    has_dropout = any(isinstance(m, torch.nn.Dropout) for m in ref.modules())
    expected = sorted(ARCHITECTURES[family][3] + (["Dropout"] if has_dropout else []))
    own_attention = not _calls_the_registry(ref, batch)
    for attention in ("keep", "tempo"):
        ours = copy.deepcopy(ref)
        if attention == "tempo" and own_attention:
            with pytest.warns(UserWarning, match="computes its attention itself"):
                tempo.optimize(ours, attention=attention)
            row = tempo.report(ours).rows[0]
            assert row[2] == "attention" and row[3].startswith("kept: ") and ours.config._attn_implementation != "tempo"
        elif attention == "tempo" and family in _BIASED_ATTENTION:
            tempo.optimize(ours, attention=attention)
            with pytest.raises(ValueError, match="passes `position_bias`"):
                _grads(ours, batch)
            continue
        else:
            tempo.optimize(ours, attention=attention)
            assert (
                ours.config._attn_implementation
                == {"keep": ref.config._attn_implementation, "tempo": "tempo"}[attention]
            )
        kinds = sorted({type(m).__name__ for m in ours.modules() if type(m).__module__.startswith("tempo.")})
        # the lm_head technique (tests/python/hf/test_lm_head.py) re-classes the LM (keeping its class's name and
        # module, tests/python/hf/test_hf_lifecycle.py) and its head
        head_rows = [r for r in tempo.report(ours).rows if r[2] == "lm_head"]
        if type(ref).__name__ in tempo.hf.lm_head.FAMILIES + tempo.hf.lm_head.MASKED_FAMILIES:
            assert head_rows and head_rows[0][3].startswith("patched"), head_rows
            assert type(ours) is not type(ref) and type(ours).__name__ == type(ref).__name__
            kinds.remove("TempoLinear")
        assert kinds == expected, (attention, kinds)
        got = _grads(ours, batch)
        assert got.keys() == want.keys()
        errors = sorted(
            (((got[n].double() - want[n].double()).norm() / want[n].double().norm()).item(), n)
            for n in want
            if not n.endswith(_ZERO_GRADIENT)
        )
        assert errors[-1][0] < 1e-5, (attention, errors[-3:])
