"""tempo.auto(model, make_batch, budget): Auto-Tempo. Decides under a memory budget whether
(fast) or where (fine) to apply tempo: by tempo.plan where the plan covers the model (a
transformers language model fed token ids of one length: no step runs), else by measurement.

Measured, each candidate is applied to the model (tempo.optimize), its largest batch under the
budget is found by running training steps (forward and backward) until a real out-of-memory error
(torch.OutOfMemoryError: on CUDA from the allocator under the budget's memory fraction, on CPU
from tempo's counting allocator under the budget), and its throughput at that batch is the
median of timed steps after a warm-up. Planned, each candidate's largest batch is tempo.plan's
(with SGD, which keeps no state) and the one with the largest wins. The winner is left applied;
the others are undone.

The budget covers the model's parameters and buffers, their gradients and everything a step
allocates; an optimizer's state is not part of the step, so leave room for it in the budget
(on CUDA the default, the device's free memory, already excludes state that exists).
"""

import argparse
import gc
import math
import numbers
import statistics
import time

import torch

from . import memory
from ._measure import free, sync, budget_enforced, heap_frozen, largest_batch, parse_bytes
from .hf import TECHNIQUES, AttentionNotComputed, optimize, restore
from .hf.attention import transformers_models, uses_attention_registry
from .hf.rules import rules_for


class AutoReport:
    """What tempo.auto measured and chose. `rows`: (candidate, largest batch, samples/s,
    tokens/s) per candidate; `choice`; `why`. Prints as a table."""

    def __init__(self, method, budget, rows, choice, why, notes=()):
        self.method, self.budget, self.rows, self.choice, self.why = method, budget, rows, choice, why
        self.notes = list(notes)  # what was not a candidate, and why

    def __str__(self):
        lines = [
            "tempo.auto (%s) under %.2f GiB" % (self.method, self.budget / 2**30),
            "%-34s %10s %12s %12s" % ("candidate", "max batch", "samples/s", "tokens/s"),
        ]
        for name, mb, sps, tps in self.rows:
            mark = " <- chosen" if name == self.choice else ""
            lines.append(
                "%-34s %10s %12s %12s%s"
                % (
                    name,
                    mb if mb is not None else "OOM at 1",
                    "%.1f" % sps if sps else "-",
                    "%.0f" % tps if tps else "-",
                    mark,
                )
            )
        lines.append("choice: %s (%s)" % (self.choice, self.why))
        lines += ["note: " + n for n in self.notes]
        return "\n".join(lines)

    __repr__ = __str__


def _device_of(model):
    p = next(model.parameters(), None)
    if p is None:
        raise ValueError("tempo.auto: the model has no parameters")
    return p.device


def _loss(out):
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, torch.Tensor):
        loss = out if out.dim() == 0 else out.float().pow(2).mean()
    if loss is None:
        raise ValueError(
            "tempo.auto: the model's output has no .loss; make_batch should include labels, or pass loss_fn"
        )
    return loss


def _tokens(batch, batch_size):
    """Tokens in a batch: its input_ids, else its first integer tensor (token ids passed
    positionally); the batch size if it has none (then tokens/s is samples/s)."""
    if isinstance(batch, dict):
        values = [batch["input_ids"]] if isinstance(batch.get("input_ids"), torch.Tensor) else []
    else:
        values = list(batch) if isinstance(batch, (tuple, list)) else [batch]
    ids = next(
        (
            v
            for v in values
            if isinstance(v, torch.Tensor)
            and not v.is_floating_point()
            and not v.is_complex()
            and v.dtype != torch.bool
        ),
        None,
    )
    return ids.numel() if ids is not None else batch_size


def _call(model, batch):
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _attention_refusal(model, make_batch):
    """Why tempo's attention cannot run on `model` (it passes its attention function something
    tempo's does not compute: T5's position bias, Gemma 2's soft-capping), found by one forward
    at batch 1 with it set; None if it runs."""
    optimize(model, techniques=[], attention="tempo")
    try:
        with torch.no_grad():
            _call(model, make_batch(1))
    except AttentionNotComputed as e:
        return e.reason
    finally:
        restore(model)
    return None


def _candidates(model, method, transformers_model):
    """(name, techniques, attention, module filter, further optimize arguments) per candidate,
    baseline first."""
    # "auto": tempo's attention only where it keeps less than the model's own (sdpa without dropout keeps no S x S)
    attention = "auto" if transformers_model else "keep"
    out = [("baseline (as given)", None, None, None, {}), ("tempo: all", "all", attention, None, {})]
    if method == "fast":
        return out
    if any(rules_for(m, {"gated_mlp"}) for m in model.modules()):  # longer batches for one or two GEMMs
        for what in ("up", "gate_up"):
            out.append(
                ("tempo: all, gated MLPs recomputing %s" % what, "all", attention, None, {"mlp_recompute": what})
            )
    for t in TECHNIQUES:
        out.append(("tempo: %s only" % t, [t], "keep", None, {}))
    if transformers_model:
        out.append(("tempo: attention only", [], "auto", None, {}))
    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=None)
    if blocks is not None and len(blocks) >= 2:
        prefix = next(n for n, m in model.named_modules() if m is blocks)
        half = len(blocks) // 2
        keep = tuple("%s.%d." % (prefix, i) for i in range(half))
        out.append(
            (
                "tempo: all, first %d of %d layers" % (half, len(blocks)),
                "all",
                "keep",
                lambda path, keep=keep: (path + ".").startswith(keep),
                {},
            )
        )
    return out


def _by_plan(model, make_batch, budget, method, device, held_by_model, loss_fn, max_batch):
    """(AutoReport, None) decided by tempo.plan, or (None, why the plan does not cover the model)."""
    from . import methods, plan as planner
    from .plan.models import model_class

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        return None, "%s is not a transformers model" % type(model).__name__
    try:
        planned_class = model_class(config)[0]
    except planner.PlanError as e:
        return None, str(e)
    if type(model) is not planned_class:
        return None, "the plan builds %s from the config, not %s" % (planned_class.__name__, type(model).__name__)
    if loss_fn is not None:
        return None, "a loss_fn is given (the plan takes the model's own loss)"
    if not all(p.requires_grad for p in model.parameters()):
        return None, "some parameters are frozen (tempo.plan plans LoRA through its lora= argument)"
    if model.config._attn_implementation not in ("eager", "sdpa"):
        return None, "its attention is %r (the plan takes eager or sdpa)" % model.config._attn_implementation
    try:
        batch = make_batch(1)
    except Exception as e:  # noqa: BLE001  (the measurement would meet it too)
        return None, "make_batch(1) failed (%s)" % e
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or set(batch) - {"input_ids", "labels", "attention_mask"}:
        return None, "the batch is not token ids of one length (input_ids, labels)"
    seq = ids.shape[1]
    dtype = next(model.parameters()).dtype
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype)
    if precision is None:
        return None, "its weights are %s (the plan takes float32 or bfloat16)" % dtype
    own = "eager" if model.config._attn_implementation == "eager" else "sdpa"
    candidates = {"baseline (as given)": own, "tempo: all": "tempo"}
    if method == "fine" and any(rules_for(m, {"gated_mlp"}) for m in model.modules()):
        for what in ("up", "gate_up"):  # as measured, on tempo-sdpa (tempo.plan's and the frontier's)
            candidates["tempo: all, gated MLPs recomputing %s" % what] = "tempo+recompute-" + what
    try:
        result = planner.plan(
            config,
            batch=1,
            seq=seq,
            methods=list(dict.fromkeys(candidates.values())),
            device="cpu" if device.type == "cpu" else budget,
            precision=precision,
            optimizer="sgd",  # tempo.auto's budget leaves the optimizer's state out
            budget=budget,
            workers=1,
        )
    except planner.PlanError as e:
        return None, str(e)
    rows, best = [], None
    for name, m in candidates.items():
        row = result[m]
        if row.error:
            continue
        mb = row.max_batch if row.max_batch is None else min(row.max_batch, max_batch)
        rows.append((name, mb, None, None))
        if mb is not None and (best is None or mb > best[1]):
            best = (name, mb, m)
    if best is None:
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        raise ValueError(
            "tempo.auto: the model does not fit the budget (%.3f GiB) at batch 1, with or without tempo (by "
            "tempo.plan; its parameters, buffers and gradients alone take %.3f GiB)"
            % (budget / 2**30, (held_by_model + grads) / 2**30)
        )
    name, mb, m = best
    if m != own:  # the plan's method, applied as tempo.optimize(model, method=m) applies it
        methods.install(model, m)
    why = "decided by tempo.plan (no trial step): the largest batch under the budget, %d at %d tokens" % (mb, seq)
    return AutoReport(method, budget, rows, name, why, ["no throughput measured: the plan counts memory"]), None


def auto(model, make_batch, budget=None, method="fast", loss_fn=None, steps=3, max_batch=1 << 16, decide="auto"):
    """Applies tempo to `model` where the plan or measurement says it pays; returns an AutoReport.

    make_batch(batch_size) -> a training batch: a dict of model kwargs (with labels, so that
    the output has .loss), a tuple of positional args, or one tensor; loss_fn(output) -> loss
    if the output has no .loss. budget: bytes or a string ("11GiB"); on CUDA it defaults to
    the device's free memory, on CPU it is required. method: "fast" (apply everything if the
    larger batch it allows gives more throughput, else leave the model as it is) or "fine"
    (the candidate with the most throughput at its largest batch among: no change, all
    techniques, all with the gated MLPs recomputing up(x) or gate(x) and up(x) (mlp_recompute),
    each technique alone, attention alone, all techniques on half the layers).
    decide: "measure" (trial steps, as above), "plan" (tempo.plan's largest batch of each
    candidate under the budget, planned without a step: baseline, tempo and, fine, tempo with
    the gated MLPs recomputing; the one that fits the largest batch, the baseline on a tie; no
    throughput is measured) or "auto" (the plan where it covers the model: a transformers
    language model fed token ids of one length; else measurement). The report says which.
    """
    if decide not in ("auto", "plan", "measure"):
        raise ValueError("tempo.auto: decide must be 'auto', 'plan' or 'measure', got %r" % (decide,))
    if method not in ("fast", "fine"):
        raise ValueError("tempo.auto: method must be 'fast' or 'fine', got %r" % (method,))
    if not callable(make_batch):
        raise TypeError("tempo.auto: make_batch must be callable as make_batch(batch_size)")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError("tempo.auto: loss_fn must be None or callable as loss_fn(output) -> loss, got %r" % (loss_fn,))
    for arg, value in (("steps", steps), ("max_batch", max_batch)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError("tempo.auto: %s must be an integer >= 1, got %r" % (arg, value))
    if isinstance(budget, str):
        try:
            budget = parse_bytes(budget)
        except argparse.ArgumentTypeError as e:
            raise ValueError("tempo.auto: %s" % e) from None
    elif budget is not None and (isinstance(budget, bool) or not isinstance(budget, numbers.Real)):
        raise TypeError("tempo.auto: the budget is a number of bytes or a size such as '8GiB', got %r" % (budget,))
    elif budget is not None and not math.isfinite(budget):
        raise ValueError("tempo.auto: the budget must be a finite number of bytes, got %r" % (budget,))
    device = _device_of(model)
    if budget is None:
        if device.type != "cuda":
            raise ValueError("tempo.auto: on %s the budget is required (bytes or e.g. '8GiB')" % device.type)
        budget = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_allocated(device)
    if budget <= 0:
        raise ValueError("tempo.auto: the budget must be positive, got %r" % (budget,))
    budget = int(budget)
    if "_tempo_undo" in model.__dict__:
        raise ValueError("tempo.auto: the model is already patched by tempo.optimize; tempo.restore it first")

    loss_of = loss_fn or _loss
    # attention is a candidate only where it can be switched (a transformers model using the registry)
    transformers_model = any(uses_attention_registry(m) for _, m in transformers_models(model))
    was_training = model.training
    model.train()
    notes = []
    refusal = _attention_refusal(model, make_batch) if transformers_model else None
    if refusal is not None:  # the other techniques are still candidates, with the model's own attention
        transformers_model = False
        notes.append("attention kept: " + refusal)

    if device.type == "cpu":
        memory.track()
    held_by_model = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    if budget - held_by_model <= 0:
        raise ValueError(
            "tempo.auto: the budget (%.3f GiB) does not even hold the model's parameters and buffers "
            "(%.3f GiB)" % (budget / 2**30, held_by_model / 2**30)
        )
    if decide != "measure":
        planned, why_not = _by_plan(model, make_batch, budget, method, device, held_by_model, loss_fn, max_batch)
        if planned is not None:
            model.train(was_training)
            planned.notes[:0] = notes
            return planned
        if decide == "plan":
            raise ValueError("tempo.auto: decide='plan', but tempo.plan does not cover this model: %s" % why_not)
        notes.append("measured: tempo.plan does not cover this model (%s)" % why_not)

    def probe(batch_size):
        """One forward + backward at batch_size under the budget: its peak as the budget sees
        it (CPU: the bytes the step allocated on top of what was held, plus the model's
        parameters and buffers, which may predate tracking; CUDA: all allocated bytes), its
        time and tokens; None on a real out-of-memory error."""
        if batch_size > max_batch:
            return None
        model.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cpu":
            start = memory.stats(device)[0]
            memory.reset_peak(device)
            limit = memory.cpu_limit(start + budget - held_by_model)
        else:
            torch.cuda.reset_peak_memory_stats(device)
            limit = budget_enforced(device, budget)
        try:
            with limit:
                batch = make_batch(batch_size)
                sync(device)
                t0 = time.perf_counter()
                loss_of(_call(model, batch)).backward()
                sync(device)
                ms = (time.perf_counter() - t0) * 1e3
            peak = (
                memory.stats(device)[1] - start + held_by_model
                if device.type == "cpu"
                else torch.cuda.max_memory_allocated(device)
            )
            return {"peak_bytes": peak, "ms": ms, "tokens": _tokens(batch, batch_size)}
        except torch.OutOfMemoryError:
            return None
        finally:
            batch = None
            model.zero_grad(set_to_none=True)
            free(device)

    rows, results = [], {}
    try:
        with heap_frozen():
            for name, techniques, attention, modules, extra in _candidates(model, method, transformers_model):
                if techniques is not None:
                    try:
                        optimize(model, techniques=techniques, attention=attention, modules=modules, **extra)
                    except ValueError:  # nothing of this kind in the model (it is left unchanged)
                        continue
                try:
                    mb, _ = largest_batch(probe, budget)
                    sps = tps = None
                    if mb is not None:
                        ms, tokens = [], 0
                        for _ in range(steps):  # after the search's steps (the warm-up)
                            m = probe(mb)
                            if m is None:
                                break
                            ms.append(m["ms"])
                            tokens = m["tokens"]
                        if ms:
                            med = statistics.median(ms) / 1e3
                            sps, tps = mb / med, tokens / med
                    rows.append((name, mb, sps, tps))
                    results[name] = (techniques, attention, modules, extra, mb, tps or 0.0)
                finally:
                    if techniques is not None:
                        restore(model)
        base = results["baseline (as given)"]
        fitting = {k: v for k, v in results.items() if v[4] is not None}
        if not fitting:
            grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
            raise ValueError(
                "tempo.auto: the model does not fit the budget (%.3f GiB) at batch 1, with or without "
                "tempo (its parameters, buffers and gradients alone take %.3f GiB)"
                % (budget / 2**30, (held_by_model + grads) / 2**30)
            )
        if method == "fast":
            t = results.get("tempo: all")
            if t is not None and t[4] is not None and (base[4] is None or (t[4] > base[4] and t[5] > base[5])):
                choice = "tempo: all"
                why = (
                    "the baseline does not fit at batch 1"
                    if base[4] is None
                    else "batch %d -> %d raised throughput %.0f -> %.0f tokens/s" % (base[4], t[4], base[5], t[5])
                )
            else:
                choice = "baseline (as given)"
                why = (
                    "tempo allows no larger batch"
                    if t is None or t[4] is None or t[4] <= (base[4] or 0)
                    else "the larger batch (%d vs %d) did not raise throughput (%.0f vs %.0f tokens/s)"
                    % (t[4], base[4], t[5], base[5])
                )
        else:
            choice = max(fitting, key=lambda k: fitting[k][5])
            why = "the most tokens/s at its largest batch among %d candidates" % len(fitting)
        techniques, attention, modules, extra, _, _ = results[choice]
        if techniques is not None:
            optimize(model, techniques=techniques, attention=attention, modules=modules, **extra)
        return AutoReport(method, budget, rows, choice, why, notes)
    finally:
        model.train(was_training)
