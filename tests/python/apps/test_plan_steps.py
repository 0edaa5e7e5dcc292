"""tempo.plan's steps at scale: a whole model's step made from a few blocks against the traced
whole model's, every preset planned under every default method (or a reason), host memory as a
limit of the offloading methods, the optimizers' temporaries against the CPU's count, the
predicted time's parts, the fastest method that fits applied by tempo.optimize, and the command
line's parallel planning with its progress lines."""

import os
import subprocess
import sys

import pytest
import torch

import tempo
from tempo.plan import DEFAULT_METHODS, PRESETS, blocks, models
from tempo.plan.validate import FAMILIES, measure_cpu

GPU = 1 << 31  # a GPU of 2 GiB: the plan's CUDA path (its allocator, sdpa's kernels, offloading)


def _llama(layers):
    c = FAMILIES["llama"]()
    c.num_hidden_layers = layers
    return c


@pytest.mark.parametrize(
    "method,optimizer",
    [
        ("sdpa+ckpt", "adamw"),
        ("tempo", "adamw-foreach"),
        ("trl", "adamw8bit"),
        ("hf-offload", "adamw"),
        ("tempo+ckpt-offload", "sgd"),
        ("trl-offload", "adamw"),
    ],
)
def test_a_step_made_from_a_few_blocks_is_the_traced_whole_models(method, optimizer):
    """16 blocks made from 3 (or, for TRL's offloading stash, which frees tensors of blocks five
    back, from 13) against the 16-block model traced whole: the same events, sizes, tags and
    pairing of allocations with frees, the same FLOPs, traffic and host bytes."""
    c = _llama(16)
    p = tempo.plan(c, batch=1, seq=128, device=GPU, precision="fp32", optimizer=optimizer, methods=[method], workers=1)
    job = p._job
    made = job.record(method, 1, 128)
    assert job.made[method], job.made
    traced = job._traced(method, 1, 128, traffic=True)
    assert blocks.same(made, traced)
    assert (made.flops, made.traffic, made.host, made.moved) == (
        traced.flops,
        traced.traffic,
        traced.host,
        traced.moved,
    )


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_plans_every_method_or_says_why(name):
    """Each preset's family (its own config at 2 blocks) under the default methods and PyTorch's
    chunked loss on a GPU: planned, or a reason (Gemma 2's soft-capped head, which PyTorch's
    chunked loss does not compute)."""
    c, _ = models.config_of(name)
    c.num_hidden_layers = 2
    if getattr(c, "layer_types", None):
        c.layer_types = c.layer_types[:2]
    methods = list(DEFAULT_METHODS) + ["sdpa+torch-lce"]
    p = tempo.plan(c, seq=128, device="H100-80GB", methods=methods, workers=1)
    errors = {m: p[m].error for m in p if p[m].error}
    expected = {"sdpa+torch-lce"} if name.startswith("Gemma-2") else set()
    assert set(errors) == expected, errors
    for m in errors:
        assert "soft-capping" in errors[m]
    for m in p:
        if not p[m].error:
            assert p[m].peak > 0 and p[m].time > 0 and p[m].fits


def test_host_memory_limits_the_offloading_methods():
    """An offloading method fits only when its host bytes fit the host's memory too; its row says
    so; plan[m].host is the most held at once (the checkpoints of every block for ckpt-offload)."""
    c = _llama(4)
    kw = dict(batch=1, seq=256, device=GPU, precision="fp32", methods=["tempo+ckpt", "tempo+ckpt-offload"], workers=1)
    roomy = tempo.plan(c, **kw)
    held = roomy["tempo+ckpt-offload"].host
    hidden = 256 * c.hidden_size * 4  # a block's checkpointed input, fp32
    assert held >= c.num_hidden_layers * hidden and roomy["tempo+ckpt"].host == 0
    assert roomy["tempo+ckpt-offload"].fits and roomy["tempo+ckpt-offload"].peak < roomy["tempo+ckpt"].peak
    tight = tempo.plan(c, host=held - 1, **kw)
    assert tight["tempo+ckpt"].fits and not tight["tempo+ckpt-offload"].fits
    assert any("host memory are more than the host's" in n for n in tight["tempo+ckpt-offload"].notes)
    assert roomy.on(GPU, host=held - 1)["tempo+ckpt-offload"].fits is False


@pytest.mark.parametrize("optimizer", ["adamw-foreach", "sgd", "adamw"])
def test_each_optimizer_is_the_cpus_count(optimizer):
    """torch's for-each AdamW (state in the weights' dtype, every sqrt(exp_avg_sq) alive at once),
    SGD and the fused AdamW against tempo.memory's count of torch's own optimizers on the CPU."""
    c = FAMILIES["qwen2"]()
    for method in ("sdpa", "tempo+recompute-gate_up"):
        p = tempo.plan(
            c, batch=2, seq=64, device="cpu", precision="fp32", methods=[method], optimizer=optimizer, workers=1
        )[method]
        real = measure_cpu(c, method, 2, 64, optimizer=optimizer)
        assert p.peak == real, (optimizer, method, p.peak, real)
        if optimizer == "adamw-foreach":
            assert p.where.startswith("step 2: optimizer")  # the temporaries make the step's peak


def test_time_is_its_parts_and_recomputation_costs():
    """A step's time is its matmuls' at the device's rate, its memory-bound operators' bytes at
    its bandwidth and its host copies; checkpointing recomputes (more FLOPs, more time), and
    transformers' checkpoints in host memory copy on the compute stream (their copies added)."""
    c = _llama(4)
    p = tempo.plan(c, batch=1, seq=512, device="H100-80GB", methods=["sdpa", "sdpa+ckpt", "hf-offload"], workers=1)
    d = tempo.plan.FIGURES["H100-80GB"]
    for m in p:
        parts = p[m].time_parts
        assert p[m].time == pytest.approx(sum(parts.values()))
        assert parts["matmul"] == pytest.approx(p[m].flops / (d.matmul * 0.65))
        assert parts["memory"] == pytest.approx(p[m].traffic / (d.bandwidth * 0.8))
    assert p["sdpa+ckpt"].flops > p["sdpa"].flops and p["sdpa+ckpt"].time > p["sdpa"].time
    copies = 2 * p._job.record("hf-offload", 1, 512).moved / d.link
    assert p["hf-offload"].time_parts["host"] == pytest.approx(copies) and copies > 0


def test_the_fastest_method_that_fits_is_what_optimize_applies():
    """plan.best: the fitting method with the shortest predicted step; tempo.optimize(model,
    method=plan.best) applies it whole, and the model then trains."""
    c = _llama(2)
    budget = tempo.plan(c, batch=1, seq=256, device="cpu", precision="fp32", methods=["sdpa"], workers=1)["sdpa"].peak
    p = tempo.plan(
        c,
        batch=1,
        seq=256,
        device="cpu",
        precision="fp32",
        methods=["sdpa", "tempo", "tempo+ckpt"],
        budget=budget - 1,
        workers=1,
    )
    assert not p["sdpa"].fits and p.best in ("tempo", "tempo+ckpt")
    assert p.ranked()[0] == p.best and all(p[m].fits for m in p.ranked())
    assert p[p.best].time == min(p[m].time for m in p.ranked())
    import transformers

    model = transformers.LlamaForCausalLM(c).train()
    tempo.optimize(model, method=p.best)
    ids = torch.randint(3, c.vocab_size, (1, 256))
    model(input_ids=ids, labels=ids).loss.backward()
    tempo.restore(model)


def test_the_command_line_plans_in_parallel_and_says_as_it_goes(tmp_path):
    """python -m tempo.plan on a config's folder: a progress line per method on stderr, the table
    (with the longest sequence each, under expandable segments by default) on stdout."""
    folder = tmp_path / "llama"
    _llama(2).save_pretrained(folder)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(tempo.__file__)))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tempo.plan",
            str(folder),
            "--seq",
            "256",
            "--device",
            str(GPU),
            "--precision",
            "fp32",
            "--methods",
            "sdpa,tempo,trl",
            "--workers",
            "2",
            "--seq-step",
            "256",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    progress = [line for line in r.stderr.splitlines() if line.startswith("tempo.plan: planned")]
    assert len(progress) == 3 and progress[-1].startswith("tempo.plan: planned 3/3")
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()[2:5]}
    assert set(rows) == {"sdpa", "tempo", "trl"}
    assert "expandable_segments:True" in r.stdout
    direct = tempo.plan(str(folder), seq=256, device=GPU, precision="fp32", methods=["tempo"], workers=1)
    assert int(rows["tempo"][8]) == direct["tempo"].max_seq
