"""A plan's figure against the device's own count: the same training (two steps, the second
measured) run for real on the CPU under tempo's counting allocator, built and patched as the
plan builds it, with torch's fused AdamW (the optimizer the plan's "adamw" is)."""

import contextlib
import gc

import torch

from .. import memory
from . import engine, methods as methods_module, models


def measure_cpu(model_or_config, method, batch, seq, precision="fp32", seed=0, record=False, lora=None):
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
        run, _, _ = methods_module.apply(method, model, config, causal, "cpu", stack)
        if lora:
            import peft

            model = peft.get_peft_model(
                model,
                peft.LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear", lora_dropout=0.0),
            )
        engine.tag("inputs")
        ids = torch.randint(4, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
        data = {"input_ids": ids, "labels": ids.clone()}
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
        peak = []

        def on_step(step):
            if step == 2:
                memory.reset_peak()

        engine.train(model, run, data, opt, autocast, on_step=on_step)
        peak = memory.stats()[1] - start
        del model, run, opt, data
    gc.collect()
    return (peak, traced[0]) if record else peak
