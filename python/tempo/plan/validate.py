"""A plan's figure against the device's own count: the same training (two steps, the second
measured) run for real on the CPU under tempo's counting allocator, built and patched as the
plan builds it, with torch's fused AdamW (the optimizer the plan's "adamw" is)."""

import contextlib
import gc

import torch
import transformers

from .. import memory, methods
from . import engine, models

# Small models of each family the plan is validated on (tests/python/apps/test_plan.py and
# benchmarks/plan_results.py, which writes docs/results/plan-cpu.md): configs, made on call.
# The decoders share one shape: hidden 128, 2 layers, 4 heads, MLP 352, vocabulary 2,048.
_DECODER = dict(
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2048,
    max_position_embeddings=4096,
)


def _decoder(cls, **changes):
    return lambda: cls(**dict(_DECODER, **changes))


FAMILIES = {
    "llama": _decoder(transformers.LlamaConfig),
    "qwen2": _decoder(transformers.Qwen2Config),
    "gemma": _decoder(transformers.GemmaConfig, head_dim=32),
    "phi3": _decoder(transformers.Phi3Config, num_key_value_heads=4, pad_token_id=0),
    "mixtral": _decoder(transformers.MixtralConfig, num_local_experts=4, num_experts_per_tok=2),
    "gpt2": lambda: transformers.GPT2Config(
        n_embd=128, n_layer=2, n_head=4, n_inner=512, vocab_size=2048, n_positions=1024
    ),
    "bert": lambda: transformers.BertConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=512,
        vocab_size=2048,
        max_position_embeddings=512,
    ),
}
GATED = ("llama", "qwen2", "gemma", "phi3", "mixtral")


def methods_for(family):
    """The traced methods that apply to a family of FAMILIES (or "bert" for a masked LM)."""
    out = ["sdpa", "tempo", "sdpa+ckpt", "tempo+ckpt", "sdpa+torch-lce"]
    if family in GATED:
        out.append("tempo+recompute-gate_up")
    if family not in ("bert",):
        out.append("sdpa+trl-head")
    return out


def _optimizer(params, kind):
    """torch's SGD without momentum (no state: the plan's "sgd"), its fused AdamW ("adamw") or its
    for-each AdamW ("adamw-foreach", as torch.optim.AdamW(params) runs on a GPU)."""
    params = [p for p in params if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-5)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-5, fused=True)
    if kind == "adamw-foreach":
        return torch.optim.AdamW(params, lr=1e-5, foreach=True)
    raise ValueError("measure: the optimizer is 'sgd', 'adamw' or 'adamw-foreach', got %r" % (kind,))


def measure_cpu(
    model_or_config, method, batch, seq, precision="fp32", seed=0, record=False, lora=None, optimizer="adamw"
):
    """The peak tempo.memory counts over the second of two training steps of `method` (weights,
    gradients and optimizer state included: everything allocated since the model was built), on
    random weights. record: also the CPU's allocations as a trace (engine.Trace), tagged as the
    plan's are (peak, trace). lora: a rank: peft's LoRA as the plan puts it (every linear layer of
    the blocks; the optimizer over the adapters)."""
    config, _ = models.config_of(model_or_config)
    cls, causal = models.model_class(config)
    memory.track()
    gc.collect()
    start = memory.stats()[0]
    torch.manual_seed(seed)
    weights = torch.float32 if precision in ("fp32", "bf16-autocast") else torch.bfloat16
    autocast = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        if precision == "bf16-autocast"
        else contextlib.nullcontext
    )
    with contextlib.ExitStack() as stack:
        if record:
            torch.ops.tempo.memory_plan_start("cpu", True)
            stack.callback(lambda: traced.append(engine.Trace(*torch.ops.tempo.memory_plan_stop())))
            engine.tag("build")
        traced = []
        model = cls._from_config(config, dtype=weights).train()
        run = methods.apply(method, model, stack, planned=engine.FakeDevice("cpu")).run
        if lora:
            import peft

            model = peft.get_peft_model(
                model,
                peft.LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear", lora_dropout=0.0),
            )
        engine.tag("inputs")
        ids = torch.randint(4, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
        data = {"input_ids": ids, "labels": ids.clone()}
        opt = _optimizer(model.parameters(), optimizer)

        def on_step(step):
            if step == 2:
                memory.reset_peak()

        engine.train(model, run, data, opt, autocast, on_step=on_step)
        peak = memory.stats()[1] - start
        del model, run, opt, data
    gc.collect()
    return (peak, traced[0]) if record else peak


def measure_cuda(model_or_config, method, batch, seq, precision="bf16", optimizer="sgd", seed=0):
    """(max_memory_allocated, max_memory_reserved) over the second of two training steps of
    `method` run for real on the current CUDA device, random weights, built and patched as the
    plan builds it (for real: tempo.methods.apply without the plan's stand-ins). optimizer: "sgd"
    (torch's SGD, no momentum: no state) or "adamw" (torch's fused AdamW; its state takes the
    weights' dtype, so plan a 16-bit model's AdamW with precision "fp32" or "bf16-autocast" to
    compare). Nothing may be allocated on the device when it starts."""
    config, _ = models.config_of(model_or_config)
    cls, causal = models.model_class(config)
    gc.collect()
    torch.cuda.empty_cache()
    if torch.cuda.memory_allocated() != 0:
        raise RuntimeError("measure_cuda: %d bytes already allocated on the device" % torch.cuda.memory_allocated())
    torch.manual_seed(seed)
    weights = torch.float32 if precision in ("fp32", "bf16-autocast") else torch.bfloat16
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if precision == "bf16-autocast"
        else contextlib.nullcontext
    )
    with contextlib.ExitStack() as stack:
        with torch.device("cuda"):
            model = cls._from_config(config, dtype=weights).train()
        run = methods.apply(method, model, stack).run
        ids = torch.randint(4, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
        data = {"input_ids": ids.cuda(), "labels": ids.cuda()}
        opt = _optimizer(model.parameters(), optimizer)

        def on_step(step):
            if step == 2:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()

        engine.train(model, run, data, opt, autocast, on_step=on_step)
        torch.cuda.synchronize()
        out = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        del model, run, opt, data
    gc.collect()
    torch.cuda.empty_cache()
    return out
