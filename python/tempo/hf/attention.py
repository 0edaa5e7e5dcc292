"""Attention through transformers' attention-function registry: tempo's attention ops
registered as "tempo" and "tempo_fused", the model-wide switch (every config a model holds),
the weights for a call that asks for them, and attention="auto" (the attention whose training
forward keeps the fewest bytes, measured on the model)."""

import sys

import torch
import torch.nn.functional as F

from .. import ops
from .probes import hooks_suspended


ATTENTION = {"tempo": "tempo", "fused": "tempo_fused", "sdpa": "sdpa", "auto": None}  # auto: auto_attention

# attention="auto" measures, for each of these and the model's own, the bytes a training forward
# keeps for backward, and takes the least (the model's own on a tie). tempo_fused is not among
# them: it keeps least, but its own CUDA kernel (used with a mask or dropout) is not fast yet.
AUTO_CANDIDATES = ("tempo", "sdpa")
AUTO_PROBE_TOKENS = 128  # the probe's sequence length (at most the model's max_position_embeddings)


def _kept_by_forward(model, tokens):
    """Bytes one training forward of `model` (batch 1, `tokens` random ids) saves for backward
    with the attention it has set, parameters (and views of them) not counted; each storage once."""
    p = next(model.parameters())
    own = {q.untyped_storage().data_ptr() for q in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[(storage.data_ptr(), t.device)] = storage.nbytes()
        # a detached alias: the storage stays alive with the graph (no address reused while counting), and no
        # saved output holds its own grad_fn, a cycle through C++ the collector cannot free (tempo.apps.runner's
        # dropout_mask_bytes says the same)
        return t.detach()

    def unpack(_):
        raise RuntimeError("tempo.optimize: the attention probe's forward has no backward")

    vocab = getattr(model.config, "vocab_size", None) or 2
    g = torch.Generator(device="cpu").manual_seed(0)  # the ids on the CPU whatever the default device, then moved
    ids = torch.randint(0, vocab, (1, tokens), generator=g, device="cpu").to(p.device)
    kwargs = {"input_ids": ids}
    if getattr(model.config, "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = ids
    devices = [p.device] if p.device.type == "cuda" else []
    training = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        with (
            torch.random.fork_rng(devices=devices),
            hooks_suspended(model),
            torch.enable_grad(),
            torch.device(p.device),
            torch.autograd.graph.saved_tensors_hooks(pack, unpack),
        ):
            model(**kwargs)
    finally:
        for m, mode in training:
            m.training = mode
    return sum(seen.values())


def auto_attention(model):
    """attention="auto" for one transformers model: (implementation, why). Measured on the model
    itself (_kept_by_forward per candidate), since what an attention keeps depends on the device
    and the model: torch's sdpa keeps no S x S tensor on CUDA, or on the CPU without dropout,
    but falls back to the math path (probabilities and mask kept) on the CPU with dropout."""
    current = model.config._attn_implementation
    p = next(model.parameters(), None)
    if p is None or p.device.type == "meta" or getattr(model, "main_input_name", "input_ids") != "input_ids":
        return current, "not measured (%s), so the model's own is kept" % (
            "no storage" if p is not None and p.device.type == "meta" else "no token ids to probe with"
        )
    tokens = min(AUTO_PROBE_TOKENS, getattr(model.config, "max_position_embeddings", None) or AUTO_PROBE_TOKENS)
    kept, skipped = {}, []
    try:
        for candidate in (current,) + tuple(c for c in AUTO_CANDIDATES if c != current):
            try:
                if not set_attention(model, candidate):
                    skipped.append(candidate)
                    continue
            except (ValueError, ImportError) as e:  # a model without sdpa support, say
                skipped.append("%s (%s)" % (candidate, str(e).split("\n")[0][:80]))
                continue
            try:
                kept[candidate] = _kept_by_forward(model, tokens)
            except AttentionNotComputed as e:
                skipped.append("%s (%s)" % (candidate, e.reason))
            except Exception as e:  # a model whose forward needs more than token ids (the finally sets it back)
                return current, "not measured (a forward from token ids failed: %s: %s), so the model's own is kept" % (
                    type(e).__name__,
                    str(e).split("\n")[0][:120],
                )
    finally:
        set_attention(model, current)
    best = min(kept, key=lambda c: (kept[c], c != current))
    if current in kept and kept[best] >= kept[current]:
        best = current
    why = "kept for backward by a training forward at batch 1, %d tokens: %s" % (
        tokens,
        ", ".join("%s %.2f MiB" % (c, kept[c] / 2**20) for c in kept),
    )
    if skipped:
        why += "; not a candidate: " + ", ".join(skipped)
    return best, why


def _repeat_kv(module, key, value):
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    return key, value


def _causal(module, attention_mask, query, is_causal):
    if is_causal is None:
        is_causal = getattr(module, "is_causal", False)
    return attention_mask is None and bool(is_causal) and query.shape[-2] > 1


# What some models pass to their attention function that tempo's attention does not compute:
# refused by name rather than ignored (sdpa refuses softcap the same way).
_NOT_COMPUTED = {
    "softcap": "attention-logit soft-capping",
    "s_aux": "attention sinks",
    "position_bias": "a relative position bias added to the logits",
}


class AttentionNotComputed(ValueError):
    """A model passes its attention function something tempo's attention does not compute (T5's
    relative position bias, Gemma 2's logit soft-capping): raised at the forward, naming it.
    `reason` says what was passed, without the advice."""

    def __init__(self, op, reason):
        super().__init__(
            "tempo.%s (tempo.optimize's attention): %s; optimize this model with attention='keep'" % (op, reason)
        )
        self.reason = reason


def _attention_function(op):
    """transformers' attention-function signature over a tempo attention op: q, k, v
    [B, H, S, D], an additive (or boolean) mask broadcastable to [B, H, Sq, Sk]; returns
    ([B, S, H, D], None)."""

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None, **kwargs):
        for name, what in _NOT_COMPUTED.items():
            if kwargs.get(name) is not None:
                raise AttentionNotComputed(
                    op.__name__,
                    "%s passes `%s` (%s), which tempo's attention does not "
                    "compute" % (type(module).__name__, name, what),
                )
        if kwargs.get("output_attentions") or _attentions_recorded():
            return _with_weights(module, query, key, value, attention_mask, scaling, dropout, is_causal, kwargs)
        key, value = _repeat_kv(module, key, value)
        mask = attention_mask[..., : key.shape[-2]] if attention_mask is not None else None
        out = op(
            query, key, value, mask, dropout_p=dropout, causal=_causal(module, mask, query, is_causal), scale=scaling
        )
        return out.transpose(1, 2).contiguous(), None

    return forward


def _attentions_recorded():
    """Whether the running forward records attention weights: transformers' output capturing
    (output_attentions=True, or the config's) collects them from the attention modules' outputs,
    and some models (GPT-2) do not pass the flag on to their attention function."""
    if _COLLECTOR[0] is None:  # a transformers without output capturing (5.0) passes output_attentions instead
        return False
    collected = _COLLECTOR[0].get()
    return bool(collected) and any(k.endswith("attentions") for k in collected)


# transformers' output-capturing collector, looked up by register_attention (outside any compiled
# forward: torch.compile cannot trace the failed import of a transformers without one).
_COLLECTOR = [None]


def _with_weights(module, query, key, value, attention_mask, scaling, dropout, is_causal, kwargs):
    """A call with output_attentions=True: the caller asks for the [B, H, Sq, Sk] probabilities,
    which tempo's attention neither returns nor (fused) forms, and which are then held anyway.
    It runs the model's own eager attention (its modeling module's eager_attention_forward, as
    attn_implementation="eager" would), or the same math in torch ops for a model without one."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    mask = attention_mask
    if mask is None and _causal(module, None, query, is_causal):  # eager functions take the causal mask as a mask
        sq, sk = query.shape[-2], key.shape[-2]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(sk - sq)
        mask = torch.zeros(sq, sk, dtype=query.dtype, device=query.device)
        mask = mask.masked_fill(~keep, torch.finfo(query.dtype).min)
    if eager is not None:
        return eager(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    key, value = _repeat_kv(module, key, value)
    scores = torch.matmul(query, key.transpose(-1, -2)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if mask is not None:
        mask = mask[..., : key.shape[-2]]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    weights = F.dropout(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), dropout, module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


_tempo_attention = _attention_function(ops.attention)
_tempo_fused_attention = _attention_function(ops.fused_attention)  # no S^2 tensor kept


def register_attention():
    import transformers
    from transformers import masking_utils

    try:
        from transformers.utils.output_capturing import _active_collector

        _COLLECTOR[0] = _active_collector
    except ImportError:
        pass

    if "tempo" not in transformers.AttentionInterface._global_mapping:
        transformers.AttentionInterface.register("tempo", _tempo_attention)
        transformers.AttentionInterface.register("tempo_fused", _tempo_fused_attention)
        eager_mask = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["eager"]  # additive masks, as eager attention
        masking_utils.AttentionMaskInterface.register("tempo", eager_mask)
        masking_utils.AttentionMaskInterface.register("tempo_fused", eager_mask)


def transformers_models(model):
    """(path, module) of each outermost transformers model in `model` (the model itself, or
    those a user's module wraps: a classifier around a BertModel, a SentenceTransformer):
    where attention= is set."""
    found = []

    def walk(m, path):
        if hasattr(m, "set_attn_implementation") and getattr(m, "config", None) is not None:
            found.append((path, m))
            return
        for name, child in m.named_children():
            walk(child, path + "." + name if path else name)

    walk(model, "")
    return found


def uses_attention_registry(model):
    """Whether the model's attention layers call transformers' attention-function registry (where
    attention="tempo" takes effect): some module defining one of its layers imports it. Models
    that compute attention themselves (BLOOM, DeBERTa-v2; Falcon before transformers 5.25) would
    ignore the setting."""
    names = {type(m).__module__ for m in model.modules()}
    return any("ALL_ATTENTION_FUNCTIONS" in vars(sys.modules[n]) for n in names if n in sys.modules)


def attention_configs(model):
    """(config, its attention implementation) for the model's own config first, then every other
    config its modules hold (T5's encoder and decoder stacks hold copies of it)."""
    seen, out = set(), []
    for config in [model.config] + [getattr(m, "config", None) for m in model.modules()]:
        if config is not None and id(config) not in seen and hasattr(config, "_attn_implementation"):
            seen.add(id(config))
            out.append((config, config._attn_implementation))
    return out


def set_attention(model, implementation):
    """model.set_attn_implementation, then the same on every config a module of it holds:
    transformers 5.17 leaves the copies of T5's config (its encoder's and decoder's) as they
    were, so the model would still run its old attention while reporting the new one. False
    where transformers refuses the setting (5.0 does for T5)."""
    model.set_attn_implementation(implementation)
    if model.config._attn_implementation != implementation:  # refused (transformers logs why)
        return False
    for config, current in attention_configs(model):
        if current != implementation:
            config._attn_implementation = implementation
    return True


class AttentionRegistered:
    """Kept in a model whose attention tempo.optimize set: unpickling the model (torch.load in
    a fresh process) registers tempo's attention functions with transformers again, which
    the model's config names."""

    def __reduce__(self):
        return _attention_registered, ()


def _attention_registered():
    register_attention()
