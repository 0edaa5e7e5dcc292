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
from configs import ZERO_GRADIENT, hf_batch, hf_family  # noqa: E402

# family (configs.FAMILIES): what tempo patches with attention="keep", besides dropout: tempo's
# Dropout is expected wherever the model has an nn.Dropout, which depends on the transformers
# release (Falcon's attention dropout became functional in 5.25)
EXPECTED = {
    "roberta": ["LayerNorm", "TempoGELUActivation", "TempoRobertaOutput", "TempoRobertaSelfOutput"],
    "distilbert": ["LayerNorm", "TempoGELUActivation"],
    "albert": ["LayerNorm", "TempoNewGELUActivation"],
    "electra": ["LayerNorm", "TempoElectraOutput", "TempoElectraSelfOutput", "TempoGELUActivation"],
    "deberta_v2": ["LayerNorm", "TempoDebertaV2Output", "TempoDebertaV2SelfOutput", "TempoGELUActivation"],
    "mistral": ["TempoMistralMLP", "TempoMistralRMSNorm"],
    "qwen2": ["TempoQwen2MLP", "TempoQwen2RMSNorm"],
    "phi": ["LayerNorm", "TempoNewGELUActivation"],
    "phi3": ["TempoPhi3MLP", "TempoPhi3RMSNorm"],
    "gpt_neox": ["LayerNorm", "TempoGELUActivation"],
    "opt": ["LayerNorm"],
    "bloom": ["LayerNorm"],
    "falcon": ["LayerNorm", "TempoGELUActivation"],
    "gemma": ["TempoGemmaMLP", "TempoGemmaRMSNorm"],
    "olmo2": ["TempoOlmo2MLP", "TempoOlmo2RMSNorm"],
    "t5": ["TempoT5LayerNorm"],  # an RMSNorm named LayerNorm: patched as one
    "cohere": ["TempoCohereLayerNorm", "TempoCohereMLP"],  # a LayerNorm with weights and no bias
    "deberta": ["LayerNorm", "TempoDebertaLayerNorm", "TempoGELUActivation"],  # its own LayerNorm class, and torch's
    "modernbert": ["LayerNorm", "TempoGELUActivation"],
    "mixtral": ["TempoMixtralRMSNorm", "TempoSiLUActivation"],
    "qwen2_moe": ["TempoQwen2MoeMLP", "TempoQwen2MoeRMSNorm", "TempoSiLUActivation"],
    "gemma3": ["TempoGemma3MLP", "TempoGemma3RMSNorm"],
    "gptj": ["LayerNorm", "TempoNewGELUActivation"],
    "gpt_neo": ["LayerNorm", "TempoNewGELUActivation"],
    "gpt_bigcode": ["LayerNorm", "TempoGELUTanh"],
    "starcoder2": ["LayerNorm", "TempoGELUTanh"],
    "granite": ["TempoGraniteMLP", "TempoGraniteRMSNorm"],
    "olmo": ["TempoOlmoMLP"],  # its LayerNorm has no parameters: left as it is
    "xlm_roberta": ["LayerNorm", "TempoGELUActivation", "TempoXLMRobertaOutput", "TempoXLMRobertaSelfOutput"],
    "mpnet": ["LayerNorm", "TempoGELUActivation", "TempoMPNetOutput"],
    "bart": ["LayerNorm", "TempoGELUActivation"],
    "vit": ["LayerNorm", "TempoGELUActivation"],
}
# These pass their attention function a relative position bias, which tempo's attention does not
# compute: attention="tempo" raises, naming it, at the first forward.
_BIASED_ATTENTION = ("t5",)


def _model(family):
    cls, cfg = hf_family(family)
    torch.manual_seed(0)
    model = cls(cfg).train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n.lower() or "ln" in n.lower():
                p.add_(torch.randn_like(p) * 0.3)
    return model


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


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_every_gradient_matches(family):
    ref = _model(family)
    batch = hf_batch(family)
    want = _grads(ref, batch)
    has_dropout = any(isinstance(m, torch.nn.Dropout) for m in ref.modules())
    expected = sorted(EXPECTED[family] + (["Dropout"] if has_dropout else []))
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
            if not n.endswith(ZERO_GRADIENT)
        )
        assert errors[-1][0] < 1e-5, (attention, errors[-3:])
