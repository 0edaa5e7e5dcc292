"""python -m tempo.frontier on the CPU with a tiny LLaMA and MiB budgets: one JSON line per
(method, budget) written as measured, each largest batch checked independently (a plain
transformers model and AdamW under tempo.memory.cpu_limit: it fits, one more does not), the
loss curves against sdpa's, a failing or unavailable method as a row, the time limit, the
table, CSV, SVG and summary."""

import csv
import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import tempo  # noqa: E402
from tempo.apps import frontier  # noqa: E402

pytestmark = pytest.mark.cpu_only
TINY = ["--model", "llama", "--size", "tiny", "--vocab", "512", "--seq", "32", "--precision", "fp32"]


def run_main(capsys, *args):
    capsys.readouterr()
    try:
        code = frontier.main(list(args))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def independent_step(batch, budget, seq=32):
    """The frontier's sdpa method rebuilt by hand: the same preset model (seed 0), AdamW, one
    unbudgeted step (the optimizer's state), then one step at `batch` x `seq` under the budget
    on every tracked byte. True if it fits."""
    from tempo.apps.runner import build_model, synthetic_batch

    torch.manual_seed(0)
    model, _, _ = build_model("llama", "tiny", vocab=512)
    model.set_attn_implementation("sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(b):
        opt.zero_grad(set_to_none=True)
        model(**synthetic_batch(model, b, seq, True, 7, torch.device("cpu"))).loss.backward()
        opt.step()

    step(1)
    opt.zero_grad(set_to_none=True)
    try:
        with tempo.memory.cpu_limit(budget):
            step(batch)
        return True
    except torch.OutOfMemoryError:
        return False


def test_frontier_rows_batches_losses_and_outputs(tmp_path, capsys):
    tempo.memory.track()
    jsonl, csv_path, svg = tmp_path / "f.jsonl", tmp_path / "f.csv", tmp_path / "f.svg"
    # tempo+compile: tempo's ops traced by torch.compile over the batches the search tries (dynamic
    # sizes after the first): their meta kernels give shapes alone there
    methods = ["sdpa", "sdpa+ckpt", "compile-mem0.2", "liger", "tempo-sdpa", "tempo", "tempo+compile"]
    code, out, err = run_main(
        capsys,
        *TINY,
        "--budgets",
        "96MiB,64MiB",
        "--methods",
        ",".join(methods),
        "--steps",
        "1",
        "--loss-steps",
        "3",
        "--compile-backend",
        "aot_eager",
        "--jsonl",
        str(jsonl),
        "--csv",
        str(csv_path),
        "--plot",
        str(svg),
    )
    assert code == 0, err
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    # every (method, budget), budgets ascending, in the order the methods were given
    assert [(r["method"], r["budget"]) for r in rows] == [(m, b) for m in methods for b in ("64MiB", "96MiB")]
    for r in rows:
        assert set(frontier.FIELDS) <= set(r)
        if r["method"] == "liger":  # Triton needs CUDA; not installed here either
            assert r["error"].startswith("did not run: Liger-Kernel") and r["max_batch"] is None
            continue
        assert r["error"] is None, r
        assert r["max_batch"] >= 1 and r["peak_bytes"] <= r["budget_bytes"], r
        assert r["tokens_per_s"] > 0 and r["spread"] == 0.0  # one timed step
        assert r["optimizer"].startswith("AdamW")
    by = {(r["method"], r["budget"]): r for r in rows}
    # a larger budget never holds a smaller batch
    for m in methods:
        if m != "liger":
            assert by[(m, "96MiB")]["max_batch"] >= by[(m, "64MiB")]["max_batch"]
    # independent check of sdpa's largest batch under 64 MiB: it fits, one more does not
    mb = by[("sdpa", "64MiB")]["max_batch"]
    assert independent_step(mb, 64 * 2**20)
    assert not independent_step(mb + 1, 64 * 2**20)
    # tempo keeps fewer activation bytes at batch 1 and fits a larger batch than sdpa
    assert by[("tempo-sdpa", "64MiB")]["activations_b1"] < by[("sdpa", "64MiB")]["activations_b1"]
    assert by[("tempo-sdpa", "64MiB")]["max_batch"] > mb
    # LLaMA has no dropout: the loss curves of sdpa, checkpointing and tempo agree (fp32 rounding)
    for m in ("sdpa+ckpt", "tempo-sdpa", "tempo"):
        assert abs(by[(m, "64MiB")]["loss_mean"] / by[("sdpa", "64MiB")]["loss_mean"] - 1) < 1e-5, m
    # the table, the summary, CSV and SVG
    assert "llama-tiny-v512, seq 32, fp32, cpu" in out
    assert "budget 64MiB: tempo's best" in out and "vs best peer" in out
    assert "activations at batch 1: tempo's fewest" in out and "loss over 3 steps" in out
    with open(csv_path) as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) and table[0]["method"] == "sdpa"
    text = svg.read_text()
    assert text.startswith("<svg") and text.count("<polyline") == len(methods) - 1  # liger did not run


def test_sequence_axis_torchs_chunked_head_offload_and_checkpointing(tmp_path, capsys):
    """--axis seq: at batch 1 each method's longest sequence (multiples of --seq-step), checked
    independently for sdpa (it fits, one step more does not); the peers with PyTorch's chunked
    F.linear_cross_entropy as their head train to sdpa's loss; offloading is CUDA's (a row saying
    so on the CPU); tempo fits a longer sequence than sdpa, and tempo+ckpt one at least as long as
    checkpointing's."""
    tempo.memory.track()
    jsonl = tmp_path / "s.jsonl"
    methods = ["sdpa", "sdpa+torch-lce", "sdpa+ckpt+torch-lce", "sdpa+ckpt+offload", "tempo-sdpa", "tempo+ckpt"]
    code, out, err = run_main(
        capsys,
        *TINY,
        "--budgets",
        "64MiB",
        "--methods",
        ",".join(methods),
        "--axis",
        "seq",
        "--seq-step",
        "32",
        "--max-seq",
        "4096",
        "--steps",
        "1",
        "--loss-steps",
        "2",
        "--jsonl",
        str(jsonl),
    )
    assert code == 0, err
    by = {r["method"]: r for r in (json.loads(line) for line in jsonl.read_text().splitlines())}
    assert by["sdpa+ckpt+offload"]["error"].startswith("did not run: offloading to host memory is for a GPU")
    for m in methods:
        if m != "sdpa+ckpt+offload":
            r = by[m]
            assert r["error"] is None and r["max_batch"] == 1 and r["max_seq"] % 32 == 0 and r["max_seq"] >= 32, r
            assert r["peak_bytes"] <= r["budget_bytes"] and r["axis"] == "seq"
            assert abs(r["loss_mean"] / by["sdpa"]["loss_mean"] - 1) < 1e-5, m
    s = by["sdpa"]["max_seq"]
    assert independent_step(1, 64 * 2**20, seq=s) and not independent_step(1, 64 * 2**20, seq=s + 32)
    assert by["tempo-sdpa"]["max_seq"] > s
    assert by["tempo+ckpt"]["max_seq"] >= by["sdpa+ckpt+torch-lce"]["max_seq"]
    assert "llama-tiny-v512, batch 1, fp32, cpu" in out and "longest sequence at batch 1" in out


def test_a_failing_method_is_a_row_and_the_time_limit_is_kept(tmp_path, capsys, monkeypatch):
    tempo.memory.track()

    def broken(*args, **kwargs):
        raise RuntimeError("patch refused for the test")

    monkeypatch.setattr(tempo.hf, "optimize", broken)  # what tempo.methods.apply patches with
    jsonl = tmp_path / "f.jsonl"
    code, out, err = run_main(
        capsys, *TINY, "--budgets", "64MiB", "--methods", "tempo-sdpa,sdpa", "--steps", "1", "--jsonl", str(jsonl)
    )
    assert code == 0, err
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert rows[0]["method"] == "tempo-sdpa" and rows[0]["error"] == "failed: RuntimeError: patch refused for the test"
    assert rows[1]["method"] == "sdpa" and rows[1]["error"] is None and rows[1]["max_batch"] >= 1
    assert "budget 64MiB: tempo fits no batch; best peer sdpa" in out
    monkeypatch.undo()
    code, out, err = run_main(capsys, *TINY, "--budgets", "64MiB", "--methods", "sdpa", "--time-limit", "0")
    assert code == 0, err
    assert "not measured: the time limit (0 s) was reached" in out


def test_bad_arguments_are_refused_by_name(capsys):
    code, _, err = run_main(capsys, *TINY, "--methods", "sdpa,flash")
    assert code == 2 and "unknown method ['flash']" in err
    code, out, err = run_main(capsys, *TINY, "--budgets", "all", "--methods", "sdpa")
    assert code == "tempo.frontier: the budget 'all' (the whole device) is for CUDA; on cpu give sizes"
    code, _, err = run_main(capsys, *TINY, "--budgets", "lots", "--methods", "sdpa")
    assert "cannot read a size from 'lots'" in str(code)
    code, _, err = run_main(capsys, "--model", "llama", "--size", "7b")
    assert code == 2 and "llama has sizes" in err


def test_tempo_auto_decides_under_each_budget(tmp_path, capsys):
    """The tempo-auto method runs tempo.auto under each budget and reports its choice (it once
    imported tempo.auto from a module path that no longer existed, failing every such row)."""
    jsonl = tmp_path / "f.jsonl"
    code, out, err = run_main(
        capsys,
        *TINY,
        "--budgets",
        "64MiB",
        "--methods",
        "tempo-auto",
        "--steps",
        "1",
        "--loss-steps",
        "1",
        "--jsonl",
        str(jsonl),
    )
    assert code == 0, err
    (row,) = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert row["error"] is None, row
    assert row["choice"] and row["max_batch"] >= 1 and row["peak_bytes"] <= row["budget_bytes"], row
