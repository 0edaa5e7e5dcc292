"""`tempo bench`: the JSON fields, the budget search, CSV, the plot, the ablation, errors.
Runs the built command line (build/tempo, or $TEMPO_BIN) on tiny models."""

import json
import os
import subprocess

import pytest
from common import BIN


TINY = [
    "--model",
    "custom",
    "--arch",
    "bert",
    "--hidden",
    "64",
    "--layers",
    "2",
    "--heads",
    "4",
    "--intermediate",
    "256",
    "--vocab",
    "512",
    "--seq",
    "32",
    "--batch",
    "2",
    "--steps",
    "1",
]

pytestmark = pytest.mark.skipif(not os.path.exists(BIN), reason="build/tempo is not built")


def bench(*args):
    return subprocess.run([BIN, "bench", *args], capture_output=True, text=True, timeout=600)


def test_json_fields_and_budget_search(tmp_path):
    csv = tmp_path / "rows.csv"
    svg = tmp_path / "plot.svg"
    r = bench(
        *TINY,
        "--methods",
        "eager,tempo,tempo-sdpa",
        "--budget",
        "64MiB",
        "--json",
        "--csv",
        str(csv),
        "--plot",
        str(svg),
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [x["method"] for x in rows] == ["eager", "tempo", "tempo-sdpa"]
    for x in rows:
        assert set(x) >= {
            "model",
            "seq",
            "dtype",
            "device",
            "method",
            "batch",
            "activation_bytes",
            "peak_bytes",
            "train_peak_bytes",
            "optimizer_peak_bytes",
            "step_ms",
            "tokens_per_s",
            "max_batch",
        }
        # the two phases' peaks are above what the step starts with, so below the step's peak
        assert x["activation_bytes"] <= x["train_peak_bytes"] < x["peak_bytes"]
        assert 0 < x["optimizer_peak_bytes"] < x["peak_bytes"]
        assert x["seq"] == 32 and x["batch"] == 2 and x["dtype"] == "fp32" and x["device"] == "cpu"
        assert 0 < x["activation_bytes"] < x["peak_bytes"]
        assert x["max_batch"] >= 1 and x["tokens_per_s"] > 0
        assert x["max_batch_tokens_per_s"] > 0 and x["max_batch_spread"] >= 0  # median of >= 3 steps, and their spread
    eager, tempo_, fused = rows
    assert tempo_["activation_bytes"] < eager["activation_bytes"]
    assert tempo_["train_peak_bytes"] < eager["train_peak_bytes"]
    assert fused["activation_bytes"] < tempo_["activation_bytes"]
    assert tempo_["max_batch"] >= eager["max_batch"]
    # one layer's forward + backward at batch 2, per sequence: the batch reads at least the
    # weights twice (the matmuls of the forward and of the backward), less under tempo (no byte
    # masks, outputs kept)
    weights = 4 * (4 * 64 * 64 + 2 * 64 * 256)
    assert all(2 * x["layer_bytes_moved"] > 2 * weights for x in rows)
    assert tempo_["layer_bytes_moved"] < eager["layer_bytes_moved"]
    assert csv.read_text().count("\n") == 4  # header + 3 rows
    bench(*TINY, "--methods", "eager", "--csv", str(csv))
    assert csv.read_text().count("\n") == 5  # appended
    assert svg.read_text().startswith("<svg")
    plain = bench(*TINY, "--methods", "eager,tempo")
    assert plain.returncode == 0 and "vs eager" in plain.stdout and "tempo" in plain.stdout


def test_data_movement_lists_each_operator_and_the_totals():
    r = bench(*TINY, "--methods", "eager,tempo", "--data-movement")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # eager runs ATen's softmax and GELU; tempo its own GELU and the core's attention softmax
    assert "aten::_softmax" in out and "aten::gelu" in out
    assert "tempo::gelu_forward" in out and "tempo core: attention softmax" in out
    assert "batch 2 (S = 32" in out
    totals = {line.split()[0]: line.split() for line in out.splitlines()[-2:]}
    assert set(totals) == {"eager", "tempo"} and totals["eager"][-1] == "1.000x"
    assert float(totals["tempo"][-1].rstrip("x")) < 1.0


def test_without_budget_max_batch_is_null():
    r = bench(*TINY, "--methods", "eager", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["max_batch"] is None
    assert json.loads(r.stdout)[0]["max_batch_spread"] is None


def test_ablation_prints_each_technique():
    r = bench(*TINY, "--ablation", "--ablation-seqs", "16,32")
    assert r.returncode == 0, r.stderr
    for t in ("in-place GELU", "in-place LayerNorm", "bit-packed dropout masks", "all of tempo"):
        assert t in r.stdout


def test_earlier_spellings_of_a_method_run_with_a_warning():
    """--policies and the method "checkpoint" (and +checkpoint, +mlp_up) of earlier versions run
    as --methods and eager+ckpt do, each with a warning on stderr naming the new spelling."""
    r = bench(*TINY, "--policies", "checkpoint,eager+ckpt,tempo+mlp_up", "--json")
    assert r.returncode == 0, r.stderr
    assert "--policies is deprecated; it is spelled --methods" in r.stderr
    assert "the method 'checkpoint' is deprecated; it is spelled 'eager+ckpt'" in r.stderr
    assert "'mlp_up' in method 'tempo+mlp_up' is deprecated; it is spelled 'recompute-up'" in r.stderr
    rows = {x["method"]: x for x in json.loads(r.stdout)}
    assert rows["checkpoint"]["activation_bytes"] == rows["eager+ckpt"]["activation_bytes"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "bert-huge"], "unknown model preset 'bert-huge'"),
        (["--methods", "eager,fast"], "unknown method 'fast'"),
        (["--seq", "0"], "--seq must be a positive integer"),
        (["--budget", "lots"], "cannot read a size"),
        (["--budget", "inf"], "a size must be a positive number below 4 EiB, got 'inf'"),  # was -8 EiB
        (["--budget", "nan"], "a size must be a positive number below 4 EiB"),
        (["--budget", "0x10"], "a size must be a positive number below 4 EiB"),
        (["--budget", "9999999999GiB"], "a size must be a positive number below 4 EiB"),
        (["--plot", "x.png"], "--plot writes SVG"),
        (
            ["--csv", "/nonexistent/x.csv"],
            "cannot write --csv /nonexistent/x.csv: /nonexistent is not a folder",
        ),  # at once
        (["--model", "custom", "--arch", "bert", "--hidden", "60", "--heads", "7"], "divisible by heads"),
        (["--model", "bert-large", "--layers", "100000"], "this host can still allocate"),  # not killed by the kernel
    ],
)
def test_bad_arguments_give_clear_errors(args, message):
    r = bench(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    # one line and the hint, not the whole usage
    assert r.stderr.strip().count("\n") == 0 and r.stderr.strip().endswith("(see tempo bench --help)"), r.stderr


def test_output_that_cannot_be_written_is_an_error_not_a_cut_short_file():
    """--csv, and stdout (--json redirected to a file), on a full disk (/dev/full): exit 1 and
    the reason, where the results used to be lost with exit 0."""
    r = bench(*TINY, "--methods", "eager", "--csv", "/dev/full")
    assert r.returncode == 1 and "tempo bench: --csv: writing /dev/full failed: No space left on device" in r.stderr, (
        r.stderr
    )
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [BIN, "bench", *TINY, "--methods", "eager", "--json"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=600,
        )
    assert r.returncode == 1 and "tempo: writing the output failed: No space left on device" in r.stderr, r.stderr


def test_sequence_longer_than_the_positions_is_an_error():
    r = bench("--model", "bert-base", "--seq", "513", "--methods", "eager")
    assert r.returncode == 2
    assert "sequence length 513 exceeds bert-base's 512 positions" in r.stderr, r.stderr
    r = bench("--model", "roberta-base", "--seq", "513", "--methods", "eager")  # 514 positions, from pad_id + 1
    assert r.returncode == 2 and "RoBERTa uses 515" in r.stderr, r.stderr
    r = bench(*TINY[:-6], "--seq", "600", "--batch", "1", "--steps", "1", "--methods", "eager", "--json")
    assert r.returncode == 2 and "--positions 600" in r.stderr
    r = bench(
        *TINY[:-6],
        "--seq",
        "600",
        "--positions",
        "600",
        "--batch",
        "1",
        "--steps",
        "1",
        "--methods",
        "eager",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    r = bench(*TINY, "--ablation", "--ablation-seqs", "128,1024")
    assert r.returncode == 2 and "sequence length 1024 exceeds" in r.stderr


def test_budget_too_small_says_how_much_a_step_needs():
    r = bench(*TINY, "--methods", "eager", "--budget", "1MiB")
    assert r.returncode == 1
    assert "too small for batch 1" in r.stderr and "a step needs" in r.stderr
    assert "the budget (1.00 MiB)" in r.stderr and " MiB (" in r.stderr and "0.00 GiB" not in r.stderr, r.stderr
