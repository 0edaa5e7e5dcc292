"""tempo.optimize's "lm_head" technique on Hugging Face causal LMs (small random configs): the
training loss from the hidden states by tempo.linear_cross_entropy equals the unpatched
model's (fp32, 1e-6) and so does every parameter's gradient (1e-5 of its largest), with tied
and untied heads, ignored label rows and num_items_in_batch; the logits never exist (held
bytes after the forward <= 0.25x on the LLaMA case of issue 44); eval, generation, calls
without labels and output_hidden_states are unchanged; families that transform the logits are
refused by name."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tempo  # noqa: E402
from tempo import lm_head  # noqa: E402

pytestmark = pytest.mark.cpu_only


def _cfg(name, tied):
    common = dict(vocab_size=320, tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    llama_like = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, **common)
    if name in ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"):
        cls = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
               "phi3": "Phi3"}[name]
        extra = {"head_dim": 16} if name in ("qwen3", "gemma") else {}
        cfg = getattr(transformers, cls + "Config")(**llama_like, **extra)
        return getattr(transformers, cls + "ForCausalLM"), cfg
    if name == "gpt2":
        return transformers.GPT2LMHeadModel, transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    if name == "gpt_neox":
        return transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            max_position_embeddings=64, **common)
    if name == "opt":
        return transformers.OPTForCausalLM, transformers.OPTConfig(
            num_hidden_layers=2, hidden_size=64, ffn_dim=128, num_attention_heads=4, max_position_embeddings=64,
            word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0, **common)
    if name == "falcon":
        return transformers.FalconForCausalLM, transformers.FalconConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
            **common)
    raise KeyError(name)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "gpt_neox", "opt", "falcon"]


def _pair(name, tied):
    cls, cfg = _cfg(name, tied)
    torch.manual_seed(0)
    ref = cls(cfg).train()
    ours = tempo.optimize(copy.deepcopy(ref), techniques="lm_head")
    return ref, ours


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 320, (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :7] = -100  # ignored rows (a prompt)
    labels[1, -3:] = -100
    return ids, labels


def _grads(model, loss):
    return {n: g for (n, _), g in zip(model.named_parameters(),
                                      torch.autograd.grad(loss, list(model.parameters()), allow_unused=True))
            if g is not None}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("name", FAMILIES)
def test_loss_and_every_gradient_equal_the_unpatched_model(name, tied):
    ref, ours = _pair(name, tied)
    assert lm_head.FAMILIES and type(ours).__name__.startswith("Tempo")
    if tied:
        assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    ids, labels = _batch()
    for kw in ({}, {"num_items_in_batch": torch.tensor(29)}):
        a = ref(input_ids=ids, labels=labels, **kw)
        b = ours(input_ids=ids, labels=labels, **kw)
        assert b.logits is None and b["logits"] is None
        assert abs(a.loss.item() - b.loss.item()) <= 1e-6 * max(1.0, abs(a.loss.item())), (a.loss, b.loss)
        ga, gb = _grads(ref, a.loss), _grads(ours, b.loss)
        assert ga.keys() == gb.keys()
        # 1e-5 of each gradient's largest element; a gradient that is zero in exact arithmetic
        # (OPT's k_proj bias: softmax ignores a shift of every logit) is rounding noise, held
        # against 1e-3 of the largest gradient of the model instead
        top = max(g.abs().max().item() for g in ga.values())
        for n in ga:
            err = (ga[n] - gb[n]).abs().max().item() / max(ga[n].abs().max().item(), 1e-3 * top)
            assert err <= 1e-5, (n, err)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_eval_generation_hidden_states_and_restore_are_unchanged(name):
    ref, ours = _pair(name, False)
    ids, labels = _batch()
    # no labels in training: the logits as before
    torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits)
    # output_hidden_states with labels in training: the hidden states, no logits
    a = ref(input_ids=ids, labels=labels, output_hidden_states=True)
    b = ours(input_ids=ids, labels=labels, output_hidden_states=True)
    assert len(a.hidden_states) == len(b.hidden_states)
    for x, y in zip(a.hidden_states, b.hidden_states):
        torch.testing.assert_close(x, y)
    # eval with labels: the model's own forward, logits and loss
    ref.eval(), ours.eval()
    a, b = ref(input_ids=ids, labels=labels), ours(input_ids=ids, labels=labels)
    torch.testing.assert_close(b.logits, a.logits)
    torch.testing.assert_close(b.loss, a.loss)
    with torch.no_grad():
        ga = ref.generate(ids[:, :5], max_new_tokens=6, do_sample=False)
        gb = ours.generate(ids[:, :5], max_new_tokens=6, do_sample=False)
    torch.testing.assert_close(ga, gb)
    ours.train()
    assert any(r[2] == "lm_head" and r[3].startswith("patched") for r in tempo.report(ours).rows)
    tempo.restore(ours)
    assert type(ours) is type(ref) and type(ours.get_output_embeddings()) is torch.nn.Linear
    assert ours(input_ids=ids, labels=labels).logits is not None


def test_logit_transforming_and_unknown_families_are_refused_by_name():
    cfg = transformers.Gemma2Config(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, vocab_size=64, final_logit_softcapping=30.0)
    m = tempo.optimize(transformers.Gemma2ForCausalLM(cfg).train(), techniques="all")
    rows = [r for r in tempo.report(m).rows if r[2] == "lm_head"]
    assert rows and rows[0][3].startswith("skipped") and "final_logit_softcapping" in rows[0][3]
    assert type(m).__name__ == "Gemma2ForCausalLM"  # the model's class is left as it was
    ref, _ = _pair("llama", False)
    cp = copy.deepcopy(ref)
    cp.loss_function = lambda *a, **k: torch.zeros(())
    with pytest.raises(ValueError, match="nothing to patch"):
        tempo.optimize(cp, techniques="lm_head")


def test_the_logits_are_never_held():
    """Issue 44's case: LLaMA hidden 256, 2 layers, 4 heads, 2 KV heads, vocab 32000, batch 2,
    S=512, train mode: bytes held after the forward with labels, unpatched vs tempo.optimize
    (all techniques), by tempo.memory.Scope."""
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=32000, max_position_embeddings=512)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).train()
    ours = tempo.optimize(copy.deepcopy(ref))
    ids = torch.randint(0, 32000, (2, 512), generator=torch.Generator().manual_seed(2))

    def held(model):
        with tempo.memory.Scope() as scope:
            loss = model(input_ids=ids, labels=ids).loss
        kept = scope.held
        loss.backward()
        model.zero_grad(set_to_none=True)
        return kept, loss.detach()

    before, loss_ref = held(ref)
    after, loss = held(ours)
    print("held after the forward: unpatched %.1f MiB, tempo %.1f MiB (%.3fx)" % (
        before / 2**20, after / 2**20, after / before))
    assert after <= 0.25 * before, (before, after)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
