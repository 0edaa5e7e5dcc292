"""tempo.optimize(trainer) for TRL's trainers (SFT, DPO, GRPO, ...), after the trainer is built:

- the trainer's model and its reference model (`ref_model`, which TRL loads itself from the
  policy's folder when none is given) are patched alike, so that at step 0 the policy and the
  reference compute the same log-probabilities bitwise (DPO's rewards 0 and loss ln 2, GRPO's
  KL 0), as without tempo; a policy the user patched before building the trainer gives the
  reference its options;
- with the "lm_head" technique, TRL's fused log-prob head (the chunked head its trainers install
  with trl.trainer.utils.add_fused_lm_head) is computed by tempo.linear_cross_entropy for these
  models: the per-token log-probabilities with their gradient, and entropy, top-1 and mean
  logit (what TRL's trainers log or mask with, no gradient) from tempo.linear_cross_entropy_stats.
  TRL's own head stays where tempo's cannot stand in, per call: the WPO weights
  (log_sum_sq_probs), a temperature together with soft-capping, and GRPO's entropy bonus (which
  differentiates the entropy): the report says which.

tempo.restore(trainer) undoes both.
"""

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import ops

# The head weights (Parameters) of the models whose TRL head tempo computes.
_HEADS = WeakIdKeyDictionary()
_TRL_HEAD = []  # TRL's head function, while tempo's stands in for it


def is_trainer(obj):
    """A Trainer-like object: not a module itself, with a module as its `model`."""
    return not isinstance(obj, torch.nn.Module) and isinstance(getattr(obj, "model", None), torch.nn.Module)


def _models(trainer):
    out = [("model", trainer.model)]
    ref = getattr(trainer, "ref_model", None)
    if isinstance(ref, torch.nn.Module) and ref is not trainer.model:
        out.append(("ref_model", ref))
    return out


def _base(model):
    """The model TRL gave its fused head: a PEFT model's base model."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _is_trl(trainer):
    """One of TRL's trainers, which give their models TRL's fused head (add_fused_lm_head): its
    calls are recognised by the head's weight, whatever wraps the model's forward since
    (accelerate's prepare_model does)."""
    return type(trainer).__module__.split(".")[0] == "trl"


def optimize_trainer(trainer, optimize, **options):
    """tempo.optimize(trainer): see the module's docstring. `optimize` is tempo.optimize."""
    models = _models(trainer)
    given = models[0][1].__dict__.get("_tempo_options", options)
    for name, model in models:
        if "_tempo_undo" not in model.__dict__:
            optimize(model, **given)
    techniques = given.get("techniques", "all")
    wants_head = techniques == "all" or "lm_head" in ([techniques] if isinstance(techniques, str) else techniques)
    why_not = None
    if getattr(trainer, "_entropy_bonus_enabled", False):
        why_not = "kept TRL's: GRPO's entropy bonus differentiates the entropy, which tempo's head gives without one"
    elif _is_trl(trainer) and not hasattr(_trl_utils(), "_ChunkedLogProbFunction"):
        why_not = "kept TRL's: this TRL (%s) computes its head otherwise than 1.16, which tempo stands in for" % (
            __import__("trl").__version__
        )
    for name, model in models:
        if not wants_head or not _is_trl(trainer):
            continue
        head = _base(model).get_output_embeddings()
        rows = model.__dict__["_tempo_report"].rows
        if why_not:
            rows.append(("(%s)" % name, "TRL fused head", "lm_head", why_not))
            continue
        _install()
        _HEADS[head.weight] = True
        model.__dict__["_tempo_trl_head"] = head.weight
        rows.append(
            (
                "(%s)" % name,
                "TRL fused head",
                "lm_head",
                "patched: TRL's per-token log-probs by tempo.linear_cross_entropy",
            )
        )
    trainer.__dict__["_tempo_trainer"] = True
    return trainer


def restore_trainer(trainer, restore):
    if not trainer.__dict__.pop("_tempo_trainer", False):
        raise ValueError("tempo.restore: %s has not been through tempo.optimize" % type(trainer).__name__)
    for _, model in _models(trainer):
        weight = model.__dict__.pop("_tempo_trl_head", None)
        if weight is not None:
            _HEADS.pop(weight, None)
        if "_tempo_undo" in model.__dict__ or "_tempo_method" in model.__dict__:
            restore(model)
    return trainer


def _trl_utils():
    import trl.trainer.utils

    return trl.trainer.utils


def _install():
    if _TRL_HEAD:
        return
    trl_utils = _trl_utils()
    _TRL_HEAD.append(trl_utils._ChunkedLogProbFunction)
    trl_utils._ChunkedLogProbFunction = TempoLogProbHead


class TempoLogProbHead:
    """Stands in for trl.kernels.ChunkedLogProbFunction (the same `apply` and outputs: log_probs,
    entropy, log_sum_sq_probs, mean_logits, is_top1) for the heads tempo.optimize(trainer)
    registered; any other head, and what tempo's cannot compute, goes to TRL's."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0, outputs=()):
        trl_head = _TRL_HEAD[0]
        args = (hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs)
        if weight not in _HEADS or "log_sum_sq_probs" in outputs or (softcap is not None and temperature != 1.0):
            return trl_head.apply(*args)
        # TRL's logits: softcap * tanh(logit_scale * z / softcap) / temperature; without soft-capping
        # the temperature folds into the scale
        scale = logit_scale / temperature if softcap is None else logit_scale
        log_probs = -ops.linear_cross_entropy(
            hidden, weight, bias, targets, reduction="none", logit_scale=scale, softcap=softcap, dtype=torch.float32
        )
        entropy = is_top1 = mean_logits = None
        if "entropy" in outputs or "is_top1" in outputs:
            with torch.no_grad():
                stats = ops.linear_cross_entropy_stats(
                    hidden.detach(),
                    weight.detach(),
                    None if bias is None else bias.detach(),
                    targets,
                    temperature=temperature,
                    logit_scale=logit_scale,
                    softcap=softcap,
                )
            entropy = stats["entropy"] if "entropy" in outputs else None
            is_top1 = stats["accuracy"] if "is_top1" in outputs else None
        if "mean_logits" in outputs:
            if softcap is not None:
                return trl_head.apply(*args)
            with torch.no_grad():  # the mean over the vocabulary of a linear map: one column of it
                w = weight.detach().float().mean(0)
                mean_logits = hidden.detach().float() @ w
                if bias is not None:
                    mean_logits += bias.detach().float().mean()
                mean_logits *= scale
        return log_probs, entropy, None, mean_logits, is_top1
