"""tempo.optimize(model): apply tempo's layers to a model that is already built (a Hugging
Face BERT, RoBERTa, GPT-2 or LLaMA, or anything made of the same layer types), in place.

Modules are patched in place (their class changes, the object stays), and parameters stay the
same Parameter objects, so optimizers, state dicts (saved before or after), isinstance checks,
hooks and references to the modules are unaffected; modules keep their eps, dropout p,
train/eval mode, dtype and device. What is patched is declared in RULES, one row per layer
type: which modules it matches, which technique it belongs to, and how it is patched.
"""
import contextlib
import copy
import functools
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _nn_module

from . import lm_head as _lm_head
from . import nn as tnn
from . import ops

TECHNIQUES = ("gelu", "silu", "layer_norm", "rms_norm", "dropout", "bdrln", "lm_head")
# The Data Movement paper's bias fusions, added by fused=True (or named in techniques):
# "qkv_split" (BERT/RoBERTa self-attention: one GEMM for q, k, v without the bias add, then
# tempo.qkv_split adds the bias and writes the head layout in one pass), "bias_gelu"
# (BERT/RoBERTa intermediate blocks: the dense layer without its bias add, the bias added
# inside tempo.gelu's pass, its gradient summed in the backward's pass).
FUSED_TECHNIQUES = ("qkv_split", "bias_gelu")


def _subclass(module, prefix, forward):
    """Turns `module` into an instance of a subclass of its class with `forward` (state,
    parameters and isinstance checks unchanged)."""
    module.__class__ = _subclass_of(type(module), prefix, forward)
    return module


def _subclass_of(cls, prefix, forward):
    key = (cls, prefix, forward)
    if key not in _SUBCLASSES:
        method = forward
        if getattr(forward, "keeps_signature", False):
            # a forward taking (*args, **kwargs) for the model's own: it shows the model's signature, which the
            # HF Trainer reads (the dataset columns it passes, whether the forward takes num_items_in_batch)
            def method(self, *args, **kwargs):
                return forward(self, *args, **kwargs)
            functools.update_wrapper(method, cls.forward)
        _SUBCLASSES[key] = type(prefix + cls.__name__, (cls,), {
            "forward": method, "__module__": __name__, "_tempo_patch": (cls, prefix, forward),
            "__reduce_ex__": _reduce_patched})
    return _SUBCLASSES[key]


_SUBCLASSES = {}


def _reduce_patched(self, protocol):
    # The subclass is made at run time, so pickle cannot find it by name: it is pickled as the
    # recipe that makes it (the original class, which pickle finds, and a module-level forward),
    # so torch.save(model) / torch.load and copy.deepcopy work on a patched model.
    return _new_patched, self._tempo_patch, self.__getstate__()


def _new_patched(cls, prefix, forward):
    return object.__new__(_subclass_of(cls, prefix, forward))


# ---- the replacements ----------------------------------------------------------------------

def _retype(cls):
    """A rule's replace for a torch module: re-class it in place as tempo's subclass of its class
    (same object, parameters, state dict, hooks, and every reference the user holds to it)."""
    def replace(m):
        m.__class__ = cls
        return m
    return replace


class _Differs(Exception):
    """A module matched a rule by its structure, but its forward computes something else than
    the fused op would (probed at patch time): it is left as it is, and the report says why."""


def _probe(m, forward, *shapes):
    """Runs the module's own forward and `forward` (the replacement, with the module as self)
    on the same random inputs, in eval mode without grad, and raises _Differs unless they
    agree to within a few units of the module's dtype. Matching HF layers by name and
    attributes alone would patch, say, Gemma's RMSNorm (x-hat * (1 + w)) as Llama's (x-hat * w)."""
    p = next(m.parameters(), None)
    if p is None:
        raise _Differs("its forward cannot be probed (no parameters)")
    g = torch.Generator().manual_seed(0)
    if p.device.type == "meta":  # a model built without storage (to be loaded later, e.g. under FSDP): what the
        # forward computes does not depend on the values, so a CPU copy with random ones is probed instead
        m = _randomised(m, g)
    xs = [torch.randn(s, generator=g) for s in shapes]
    want = _compare(m, forward, xs)
    if want == 0:  # its weights make every output 0 (a norm's gammas all 0): any form would agree, so the
        _compare(_randomised(m, g), forward, xs)  # form is told apart on a copy with random weights


def _randomised(m, g):
    """A copy of `m` with random parameters and buffers (on the CPU when `m` has no storage)."""
    m = copy.deepcopy(m)
    if next(m.parameters()).device.type == "meta":
        m = m.to_empty(device="cpu")
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g))
    return m


def _compare(m, forward, xs):
    """_probe's comparison on inputs `xs`; returns the largest magnitude of the module's output."""
    p = next(m.parameters())
    xs = [x.to(p.device, p.dtype) for x in xs]
    modes = [(x, x.training) for x in m.modules()]
    m.eval()
    try:
        with torch.no_grad(), _hooks_suspended(m):
            want = type(m).forward(m, *xs)
            got = forward(m, *xs)
    except Exception as e:  # a forward with other arguments or other outputs than the rule's
        raise _Differs("its forward could not be probed as the rule's (%s: %s)" % (type(e).__name__, e)) from None
    finally:
        for x, training in modes:
            x.training = training
    if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and want.shape == got.shape):
        raise _Differs("its forward returns something else than the rule's")
    want, got = want.double(), got.double()
    scale = want.abs().max().item()
    err = (got - want).abs().max().item() / max(scale, 1e-300)
    tol = 1e-4 if p.dtype in (torch.float32, torch.float64) else 2.0**-6
    if not err <= tol:
        raise _Differs("its forward computes something else (probed: relative difference %.2g)" % err)
    return scale


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


@contextlib.contextmanager
def _hooks_suspended(m):
    """The user's hooks (on `m`'s modules, and torch's global module hooks) do not see a probe's
    random inputs: the probe is tempo's check, not a forward of the model."""
    saved = [(x, name, getattr(x, name)) for x in m.modules() for name in _HOOKS]
    saved += [(_nn_module, "_global" + name, getattr(_nn_module, "_global" + name)) for name in _HOOKS]
    for owner, name, _ in saved:
        setattr(owner, name, type(getattr(owner, name))())
    try:
        yield
    finally:
        for owner, name, hooks in saved:
            setattr(owner, name, hooks)


def _probed(forward, shapes):
    """A rule's replace: subclass the module with `forward` if the probe agrees."""
    def replace(m):
        _probe(m, forward, *shapes(m))
        return _subclass(m, "Tempo", forward)
    return replace


def _norm_eps(self):
    return getattr(self, "variance_epsilon", getattr(self, "eps", None))


def _norm_bias(self):
    b = getattr(self, "bias", None)
    return b if isinstance(b, torch.nn.Parameter) else None


def _hf_rms_norm_forward(self, hidden_states):  # x-hat * w (Llama, Mistral, Qwen2/3, T5's LayerNorm, ...)
    return ops.rms_norm(hidden_states, hidden_states.shape[-1], self.weight, _norm_eps(self))


def _hf_rms_norm_offset_forward(self, hidden_states):  # x-hat * (1 + w) (Gemma, Qwen3-Next, ...)
    return ops.rms_norm(hidden_states, hidden_states.shape[-1], 1.0 + self.weight, _norm_eps(self))


def _hf_layer_norm_forward(self, hidden_states):  # (x - mean) / std * w (+ b) (Cohere, DeBERTa, ...)
    return ops.layer_norm(hidden_states, hidden_states.shape[-1], self.weight, _norm_bias(self), _norm_eps(self))


def _rms_norm(m):
    if type(m) is torch.nn.RMSNorm:
        return _retype(tnn.RMSNorm)(m)
    shape = (2, 3, m.weight.shape[0])
    try:
        _probe(m, _hf_rms_norm_forward, shape)
        return _subclass(m, "Tempo", _hf_rms_norm_forward)
    except _Differs:
        pass
    try:
        _probe(m, _hf_rms_norm_offset_forward, shape)
    except _Differs as e:
        raise _Differs(str(e) + "; neither x-hat * w nor x-hat * (1 + w)") from None
    return _subclass(m, "Tempo", _hf_rms_norm_offset_forward)


def _is_named_norm(m, suffix):
    """A norm class of a model's own (transformers' or a user's), found by its name and its
    state: a vector of weights and an eps. What its forward computes is probed at patch time."""
    w = getattr(m, "weight", None)
    return (type(m).__name__.endswith(suffix) and isinstance(w, torch.nn.Parameter) and w.dim() == 1
            and isinstance(_norm_eps(m), float))


def _hf_gelu_forward(self, input):  # transformers' GELUActivation
    return ops.gelu(input, "none")


def _hf_gelu_tanh_forward(self, input):  # NewGELUActivation, GELUTanh, PytorchGELUTanh
    return ops.gelu(input, "tanh")


def _hf_silu_forward(self, input):  # transformers' SiLUActivation
    return ops.silu(input)


def _plain(module, *classes):
    """`module` is exactly one of `classes` (torch.nn.Linear; torch's or tempo's LayerNorm,
    Dropout) with no hooks: its parameters are all it computes with, so a fused forward may
    read them instead of calling it. A module wrapped or replaced after tempo.optimize (peft's
    LoRA layers, parametrizations, quantized layers) is not, and is called as it is; so is one
    with a hook that calling it would run: its own forward or backward hooks (Opacus's
    per-sample gradients, Captum), or hooks on every module (torch.nn.modules.module's
    register_module_*_hook, as module trackers use)."""
    return type(module) in classes and not _hooked(module)


def _hooked(module):
    # the condition under which torch.nn.Module.__call__ runs hooks rather than forward alone
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _nn_module._global_forward_hooks
                or _nn_module._global_forward_pre_hooks or _nn_module._global_backward_hooks
                or _nn_module._global_backward_pre_hooks)


def _original_forward(self, *args, **kwargs):
    return type(self).__mro__[1].forward(self, *args, **kwargs)


def _bdrln_forward(self, hidden_states, input_tensor):
    # dense -> dropout -> LayerNorm(+ residual), as BertSelfOutput / BertOutput, in one pass.
    ln = self.LayerNorm
    if not (_plain(self.dropout, torch.nn.Dropout, tnn.Dropout) and _plain(ln, torch.nn.LayerNorm, tnn.LayerNorm)):
        return _original_forward(self, hidden_states, input_tensor)
    if _plain(self.dense, torch.nn.Linear):
        h, bias = F.linear(hidden_states, self.dense.weight), self.dense.bias
    else:  # e.g. LoRA on dense: dense runs as it is, dropout + residual + LayerNorm stay fused
        h, bias = self.dense(hidden_states), None
    return ops.bias_dropout_add_layer_norm(h, bias, input_tensor, self.dropout.p, ln.weight, ln.bias,
                                           ln.eps, training=self.training)


def _is_bdrln(m):
    return (type(m).__name__.endswith("Output") and isinstance(getattr(m, "dense", None), torch.nn.Linear)
            and isinstance(getattr(m, "dropout", None), torch.nn.Dropout)
            and isinstance(getattr(m, "LayerNorm", None), torch.nn.LayerNorm)
            and len(m.LayerNorm.normalized_shape) == 1)


_GELU_APPROXIMATE = {"GELUActivation": "none", "NewGELUActivation": "tanh", "GELUTanh": "tanh",
                     "PytorchGELUTanh": "tanh"}


def _gelu_approximate(act):
    cls = type(act)
    if cls in (torch.nn.GELU, tnn.GELU):
        return act.approximate
    cls = cls.__dict__.get("_tempo_patch", (cls,))[0]  # transformers' activation, re-classed by tempo.optimize
    if cls.__module__.startswith("transformers."):
        return _GELU_APPROXIMATE.get(cls.__name__)
    return None


def _is_bias_gelu(m):
    # BertIntermediate / RobertaIntermediate: dense then a GELU
    return (type(m).__name__.endswith("Intermediate") and isinstance(getattr(m, "dense", None), torch.nn.Linear)
            and m.dense.bias is not None and _gelu_approximate(getattr(m, "intermediate_act_fn", None)) is not None)


def _bias_gelu_forward(self, hidden_states):
    approximate = _gelu_approximate(self.intermediate_act_fn)
    if approximate is None or _hooked(self.intermediate_act_fn):  # replaced after tempo.optimize, or hooked
        return _original_forward(self, hidden_states)
    if not _plain(self.dense, torch.nn.Linear):  # e.g. LoRA on dense: called as it is, then tempo's GELU
        return ops.gelu(self.dense(hidden_states), approximate)
    return ops.gelu(F.linear(hidden_states, self.dense.weight), approximate, bias=self.dense.bias)


def _is_qkv_split(m):
    # BertSelfAttention / RobertaSelfAttention: query, key, value Linears with biases
    lin = [getattr(m, n, None) for n in ("query", "key", "value")]
    return (type(m).__name__ in ("BertSelfAttention", "RobertaSelfAttention")
            and type(m).__module__.startswith("transformers.")
            and all(isinstance(x, torch.nn.Linear) and x.bias is not None for x in lin)
            and hasattr(m, "num_attention_heads") and hasattr(m, "scaling"))


def _qkv_split_forward(self, hidden_states, attention_mask=None, *args, **kwargs):
    # The original's third argument is its cache, named `cache` (transformers 5.24 on) or
    # `past_key_values` (5.17): passed on as it came when tempo does not compute this call.
    caches = list(args[:1]) + [kwargs.get(n) for n in ("cache", "past_key_values")]
    if (any(c is not None for c in caches)  # decoding with a cache
            or not all(_plain(x, torch.nn.Linear) for x in (self.query, self.key, self.value))):  # e.g. LoRA
        return _original_forward(self, hidden_states, attention_mask, *args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.bert.modeling_bert import eager_attention_forward
    w = torch.cat([self.query.weight, self.key.weight, self.value.weight])
    b = torch.cat([self.query.bias, self.key.bias, self.value.bias])
    q, k, v = ops.qkv_split(F.linear(hidden_states, w), b, self.num_attention_heads)
    name = self.config._attn_implementation
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)
    else:  # transformers 5.0: "eager" is the modeling module's own function, not in the registry
        interface = eager_attention_forward if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]
    out, weights = interface(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.dropout.p,
                             scaling=self.scaling, **kwargs)
    return out.reshape(*hidden_states.shape[:-1], -1).contiguous(), weights


def _is_functional_gelu_layer(m):
    # torch's own TransformerEncoderLayer / TransformerDecoderLayer with activation="gelu":
    # its activation is the function F.gelu, an attribute rather than a child module
    return (type(m) in (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)
            and getattr(m, "activation", None) is F.gelu)


def _functional_gelu(m):
    m.activation = tnn.GELU("none")  # a child module now; restore puts the function back
    m.__dict__["_tempo_replaced_attribute"] = ("activation", F.gelu)
    return m


def _act_class(*names):
    def match(m):
        return type(m).__name__ in names and type(m).__module__.startswith("transformers.")
    return match


# (technique, match, replace); the first matching row whose replace does not refuse (a probe
# that finds another computation) applies. `replace` patches the module in place (its class,
# or for a function held as an attribute, a child module in its place) and returns it.
RULES = [
    ("qkv_split", _is_qkv_split, lambda m: _subclass(m, "Tempo", _qkv_split_forward)),  # transformers' classes only
    ("bias_gelu", _is_bias_gelu, _probed(_bias_gelu_forward, lambda m: [(1, 3, m.dense.in_features)])),
    ("bdrln", _is_bdrln,
     _probed(_bdrln_forward, lambda m: [(1, 3, m.dense.in_features), (1, 3, m.dense.out_features)])),
    ("layer_norm", lambda m: type(m) is torch.nn.LayerNorm, _retype(tnn.LayerNorm)),
    ("rms_norm", lambda m: type(m) is torch.nn.RMSNorm or _is_named_norm(m, "RMSNorm"), _rms_norm),
    # classes named LayerNorm that are not torch's: T5's (and MT5's, UMT5's, LongT5's, ...) is an
    # RMSNorm; Cohere's, DeBERTa's and torch.nn.LayerNorm subclasses subtract the mean. Each row
    # probes its form; a module whose forward is neither is left, and the report says why.
    ("rms_norm", lambda m: _is_named_norm(m, "LayerNorm") and _norm_bias(m) is None, _rms_norm),
    ("layer_norm", lambda m: _is_named_norm(m, "LayerNorm"),
     _probed(_hf_layer_norm_forward, lambda m: [(2, 3, m.weight.shape[0])])),
    ("gelu", lambda m: type(m) is torch.nn.GELU and m.approximate in ("none", "tanh"), _retype(tnn.GELU)),
    ("gelu", _is_functional_gelu_layer, _functional_gelu),
    ("gelu", _act_class("GELUActivation"), lambda m: _subclass(m, "Tempo", _hf_gelu_forward)),
    ("gelu", _act_class("NewGELUActivation", "GELUTanh", "PytorchGELUTanh"),
     lambda m: _subclass(m, "Tempo", _hf_gelu_tanh_forward)),
    ("silu", lambda m: type(m) is torch.nn.SiLU, _retype(tnn.SiLU)),
    ("silu", _act_class("SiLUActivation"), lambda m: _subclass(m, "Tempo", _hf_silu_forward)),
    ("dropout", lambda m: type(m) is torch.nn.Dropout, _retype(tnn.Dropout)),
]


# ---- attention, through transformers' attention-function registry --------------------------

ATTENTION = {"tempo": "tempo", "fused": "tempo_fused", "sdpa": "sdpa", "auto": None}  # auto: _auto_attention

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
        # saved output holds its own grad_fn, a cycle through C++ the collector cannot free (tempo.bench's
        # dropout_mask_bytes says the same)
        return t.detach()

    def unpack(_):
        raise RuntimeError("tempo.optimize: the attention probe's forward has no backward")

    vocab = getattr(model.config, "vocab_size", None) or 2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens), generator=g).to(p.device)
    kwargs = {"input_ids": ids}
    if getattr(model.config, "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = ids
    devices = [p.device] if p.device.type == "cuda" else []
    training = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        with torch.random.fork_rng(devices=devices), _hooks_suspended(model), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            model(**kwargs)
    finally:
        for m, mode in training:
            m.training = mode
    return sum(seen.values())


def _auto_attention(model):
    """attention="auto" for one transformers model: (implementation, why). Measured on the model
    itself (_kept_by_forward per candidate), since what an attention keeps depends on the device
    and the model: torch's sdpa keeps no S x S tensor on CUDA, or on the CPU without dropout,
    but falls back to the math path (probabilities and mask kept) on the CPU with dropout."""
    current = model.config._attn_implementation
    p = next(model.parameters(), None)
    if p is None or p.device.type == "meta" or getattr(model, "main_input_name", "input_ids") != "input_ids":
        return current, "not measured (%s), so the model's own is kept" % (
            "no storage" if p is not None and p.device.type == "meta" else "no token ids to probe with")
    tokens = min(AUTO_PROBE_TOKENS, getattr(model.config, "max_position_embeddings", None) or AUTO_PROBE_TOKENS)
    kept, skipped = {}, []
    try:
        for candidate in (current,) + tuple(c for c in AUTO_CANDIDATES if c != current):
            try:
                if not _set_attention(model, candidate):
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
                return current, "not measured (a forward from token ids failed: %s: %s), so the model's own is " \
                    "kept" % (type(e).__name__, str(e).split("\n")[0][:120])
    finally:
        _set_attention(model, current)
    best = min(kept, key=lambda c: (kept[c], c != current))
    if current in kept and kept[best] >= kept[current]:
        best = current
    why = "kept for backward by a training forward at batch 1, %d tokens: %s" % (
        tokens, ", ".join("%s %.2f MiB" % (c, kept[c] / 2**20) for c in kept))
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
_NOT_COMPUTED = {"softcap": "attention-logit soft-capping", "s_aux": "attention sinks",
                 "position_bias": "a relative position bias added to the logits"}


class AttentionNotComputed(ValueError):
    """A model passes its attention function something tempo's attention does not compute (T5's
    relative position bias, Gemma 2's logit soft-capping): raised at the forward, naming it.
    `reason` says what was passed, without the advice."""

    def __init__(self, op, reason):
        super().__init__("tempo.%s (tempo.optimize's attention): %s; optimize this model with attention='keep'"
                         % (op, reason))
        self.reason = reason


def _attention_function(op):
    """transformers' attention-function signature over a tempo attention op: q, k, v
    [B, H, S, D], an additive (or boolean) mask broadcastable to [B, H, Sq, Sk]; returns
    ([B, S, H, D], None)."""
    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None, **kwargs):
        for name, what in _NOT_COMPUTED.items():
            if kwargs.get(name) is not None:
                raise AttentionNotComputed(op.__name__, "%s passes `%s` (%s), which tempo's attention does not "
                                           "compute" % (type(module).__name__, name, what))
        if kwargs.get("output_attentions") or _attentions_recorded():
            return _with_weights(module, query, key, value, attention_mask, scaling, dropout, is_causal, kwargs)
        key, value = _repeat_kv(module, key, value)
        mask = attention_mask[..., : key.shape[-2]] if attention_mask is not None else None
        out = op(query, key, value, mask, dropout_p=dropout, causal=_causal(module, mask, query, is_causal),
                 scale=scaling)
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


# transformers' output-capturing collector, looked up by _register_attention (outside any compiled
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


def _register_attention():
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


def _transformers_models(model):
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


def _uses_attention_registry(model):
    """Whether the model's attention layers call transformers' attention-function registry (where
    attention="tempo" takes effect): some module defining one of its layers imports it. Models
    that compute attention themselves (BLOOM, DeBERTa-v2; Falcon before transformers 5.25) would
    ignore the setting."""
    names = {type(m).__module__ for m in model.modules()}
    return any("ALL_ATTENTION_FUNCTIONS" in vars(sys.modules[n]) for n in names if n in sys.modules)


# The transformers releases the tests pass with: 5.17 (the GPU machine's) to 5.25 (the newest
# CI installed). Older 5.x releases differ (5.0: T5 refuses a new attention, GPT-2's attention
# weights are recorded differently), so an older one is named, once, rather than refused.
TESTED_TRANSFORMERS = (5, 17)
_warned_transformers = []


def _transformers_version():
    module = sys.modules.get("transformers")  # not imported: the model is not a transformers one
    return getattr(module, "__version__", None)


def _warn_on_untested_transformers():
    release = _transformers_version()
    if release is None or _warned_transformers:
        return
    _warned_transformers.append(True)
    try:
        version = tuple(int(x) for x in release.split(".")[:2])
    except ValueError:
        return
    if version < TESTED_TRANSFORMERS:
        warnings.warn("tempo.optimize: transformers %s is older than %d.%d, the oldest release tempo is tested with; "
                      "some patches may differ from the unpatched model (pip install 'transformers>=%d.%d')"
                      % ((release,) + TESTED_TRANSFORMERS * 2), stacklevel=3)


def _attention_configs(model):
    """(config, its attention implementation) for the model's own config first, then every other
    config its modules hold (T5's encoder and decoder stacks hold copies of it)."""
    seen, out = set(), []
    for config in [model.config] + [getattr(m, "config", None) for m in model.modules()]:
        if config is not None and id(config) not in seen and hasattr(config, "_attn_implementation"):
            seen.add(id(config))
            out.append((config, config._attn_implementation))
    return out


def _set_attention(model, implementation):
    """model.set_attn_implementation, then the same on every config a module of it holds:
    transformers 5.17 leaves the copies of T5's config (its encoder's and decoder's) as they
    were, so the model would still run its old attention while reporting the new one. False
    where transformers refuses the setting (5.0 does for T5)."""
    model.set_attn_implementation(implementation)
    if model.config._attn_implementation != implementation:  # refused (transformers logs why)
        return False
    for config, current in _attention_configs(model):
        if current != implementation:
            config._attn_implementation = implementation
    return True


class _AttentionRegistered:
    """Kept in a model whose attention tempo.optimize set: unpickling the model (torch.load in
    a fresh process) registers tempo's attention functions with transformers again, which
    the model's config names."""

    def __reduce__(self):
        return _attention_registered, ()


def _attention_registered():
    _register_attention()
    return _AttentionRegistered()


class Report:
    """What tempo.optimize did: one row per module it patched or looked at and left, with
    why. Prints as a table; `rows` is a list of (path, class, technique, action)."""

    def __init__(self, rows):
        self.rows = rows

    @property
    def patched(self):
        return [r for r in self.rows if r[3].startswith("patched")]

    def __str__(self):
        if not self.rows:
            return "tempo.optimize: nothing recorded"
        w = [max(len(str(r[i])) for r in self.rows + [("module", "class", "technique", "action")]) for i in range(4)]
        lines = ["%-*s  %-*s  %-*s  %s" % (w[0], "module", w[1], "class", w[2], "technique", "action")]
        lines += ["%-*s  %-*s  %-*s  %s" % (w[0], r[0], w[1], r[1], w[2], r[2], r[3]) for r in self.rows]
        return "\n".join(lines)

    __repr__ = __str__


_LOOKS_PATCHABLE = ("norm", "gelu", "silu", "swish", "act", "dropout")


def _rules_for(module, chosen):
    return [r for r in RULES if r[0] in chosen and r[1](module)]


def optimize(model: torch.nn.Module, techniques="all", attention: str = "keep", modules=None,
             fused: bool = False) -> torch.nn.Module:
    """Patches `model` in place with tempo's layers and returns it.

    techniques: "all", or one or a list of "gelu", "silu", "layer_norm", "rms_norm", "dropout",
    "bdrln" (dense + dropout + residual + LayerNorm in one pass, BERT/RoBERTa's output blocks),
    "lm_head" (a causal or masked LM's training loss from the hidden states by tempo.linear_cross_entropy:
    the logits never exist, and `logits` is None in the output of a training call with labels;
    tempo/lm_head.py says which families and what it keeps).
    attention: "keep" (the model's own), "tempo" (output-only softmax, dropout recomputed from
    1-bit masks), "fused" (tempo.fused_attention: no S^2 tensor), "sdpa" (torch's), or "auto"
    (of the model's own, tempo's and sdpa, the one whose training forward keeps the fewest bytes
    for backward, measured on the model at patch time; the model's own on a tie; tempo.report
    gives the bytes); set through transformers' attention-function registry on a transformers model, or
    on each one inside `model` (a user's module around a BertModel, a SentenceTransformer).
    fused: also the Data Movement paper's bias fusions, "qkv_split" and "bias_gelu" (BERT and
    RoBERTa; see FUSED_TECHNIQUES), which may also be named in techniques.
    modules: None (everywhere), a module path or a list of them (a module and everything under it,
    e.g. "bert.encoder.layer.0"), or a callable path -> bool; outside them nothing is patched
    (attention, set model-wide, is not limited by it).
    Layers not recognised are left exactly as they are (tempo.report lists them);
    tempo.restore undoes the patch. A second call patches only what the first did not.
    """
    _warn_on_untested_transformers()
    try:  # "all", one technique by name, or a list of them
        chosen = set(TECHNIQUES if techniques == "all" else [techniques] if isinstance(techniques, str) else techniques)
    except TypeError:
        raise TypeError("tempo.optimize: techniques must be 'all', a technique's name or a list of them, got %r"
                        % (techniques,)) from None
    if not isinstance(fused, bool):
        raise TypeError("tempo.optimize: fused must be True or False, got %r" % (fused,))
    if fused:
        chosen |= set(FUSED_TECHNIQUES)
    unknown = chosen - set(TECHNIQUES) - set(FUSED_TECHNIQUES)
    if unknown:
        raise ValueError("tempo.optimize: unknown technique(s) %s; known: %s" % (
            sorted(unknown), ", ".join(TECHNIQUES + FUSED_TECHNIQUES)))
    if attention != "keep" and attention not in ATTENTION:
        raise ValueError("tempo.optimize: unknown attention %r; known: keep, %s" % (attention, ", ".join(ATTENTION)))
    if not isinstance(model, torch.nn.Module):
        raise TypeError("tempo.optimize: expected a torch.nn.Module, got %s" % type(model).__name__)
    hf_models = _transformers_models(model) if attention != "keep" else []
    if attention != "keep" and not hf_models:
        raise ValueError("tempo.optimize: attention=%r needs a transformers model (its attention-function "
                         "registry); %s is not one and has none inside it" % (attention, type(model).__name__))
    if modules is None:
        inside = None
    elif callable(modules):
        inside = modules
    else:
        try:  # one module's path, or a list of them
            paths = [modules] if isinstance(modules, str) else list(modules)
        except TypeError:
            paths = None
        if paths is None or not all(isinstance(p, str) for p in paths):
            raise TypeError("tempo.optimize: modules must be None, a module path, a list of them or a callable "
                            "path -> bool, got %r" % (modules,))
        if not paths:
            raise ValueError("tempo.optimize: modules is empty")
        known = {n for n, _ in model.named_modules()}
        missing = [p for p in paths if p not in known]
        if missing:
            raise ValueError("tempo.optimize: no module named %s in %s" % (missing, type(model).__name__))

        def inside(path):
            return any(path == p or path.startswith(p + ".") for p in paths)
    undo = model.__dict__.setdefault("_tempo_undo", [])
    rows = []
    for path, hf in hf_models:
        if not _uses_attention_registry(hf):
            why = ("kept: %s computes its attention itself, not through transformers' attention-function registry, "
                   "so attention=%r cannot apply" % (type(hf).__name__, attention))
            warnings.warn("tempo.optimize: " + why[len("kept: "):], stacklevel=2)
            rows.append((path, type(hf).__name__, "attention", why))
            continue
        _register_attention()
        before = _attention_configs(hf)
        implementation, decided = ATTENTION[attention], ""
        if attention == "auto":
            implementation, decided = _auto_attention(hf)
            decided = " (auto: %s)" % decided
            if implementation == hf.config._attn_implementation:
                rows.append((path, type(hf).__name__, "attention", "kept: %s%s" % (implementation, decided)))
                continue
        if not _set_attention(hf, implementation):
            why = ("kept: transformers did not let %s set its attention to %r" % (type(hf).__name__, implementation))
            warnings.warn("tempo.optimize: " + why[len("kept: "):], stacklevel=2)
            rows.append((path, type(hf).__name__, "attention", why))
            continue
        undo.append(("attention", hf, before))
        hf.__dict__["_tempo_attention_marker"] = _AttentionRegistered()
        rows.append((path, type(hf).__name__, "attention", "patched: %s%s" % (implementation, decided)))
    done = set()
    if "lm_head" in chosen:
        for path, m in model.named_modules():
            lm = None if type(m).__module__.startswith("tempo.") else _lm_head.kind(m)
            if lm is None:
                continue
            if inside is not None and not inside(path):
                rows.append((path or "(model)", type(m).__name__, "lm_head", "skipped: outside modules"))
                continue
            try:
                _lm_head.check(m)
            except _lm_head.Refused as e:
                rows.append((path or "(model)", type(m).__name__, "lm_head", "skipped: %s" % e))
                continue
            head = m.get_output_embeddings()
            undo.append(("class", m, type(m)))
            undo.append(("class", head, type(head)))
            _subclass(m, "Tempo", _lm_head.causal_lm_forward if lm == "causal" else _lm_head.masked_lm_forward)
            _subclass(head, "Tempo", _lm_head._head_forward)
            done.add(id(head))
            rows.append((path or "(model)", type(m)._tempo_patch[0].__name__, "lm_head",
                         "patched: training loss by tempo.linear_cross_entropy (logits None when labels are given "
                         "in training)"))

    def visit(parent, prefix):
        for name, child in list(parent.named_children()):
            path = prefix + name
            if id(child) in done:
                continue
            ours = type(child).__module__.startswith("tempo.")  # already patched
            rules = [] if ours else _rules_for(child, chosen)
            if rules and inside is not None and not inside(path):
                rows.append((path, type(child).__name__, rules[0][0], "skipped: outside modules"))
                visit(child, path + ".")
                continue
            if rules:
                original_class = type(child)
                refused = []
                for rule in rules:
                    try:
                        rule[2](child)  # in place: the same object, re-classed
                        break
                    except _Differs as e:
                        refused.append(("as %s: %s" % (rule[0], e)) if len(rules) > 1 else str(e))
                else:
                    rows.append((path, original_class.__name__, rules[0][0], "skipped: " + "; ".join(refused)))
                    visit(child, path + ".")
                    continue
                done.add(id(child))
                if "_tempo_replaced_attribute" in child.__dict__:
                    undo.append(("attribute", child, *child.__dict__.pop("_tempo_replaced_attribute")))
                else:
                    undo.append(("class", child, original_class))
                rows.append((path, original_class.__name__, rule[0], "patched"))
                if rule[0] == "bdrln":  # its LayerNorm and dropout are used through the fused op
                    done.update({id(child.LayerNorm), id(child.dropout)})
                    continue
                if rule[0] == "bias_gelu":  # its activation runs inside the fused op
                    done.add(id(child.intermediate_act_fn))
                    continue
            elif not ours:
                lname = type(child).__name__.lower()
                other = _rules_for(child, set(TECHNIQUES))
                if other:
                    rows.append((path, type(child).__name__, other[0][0], "skipped: technique not chosen"))
                elif ("attention" in lname and not any("attention" in type(c).__name__.lower() for c in child.children())
                      and attention == "keep"):
                    rows.append((path, type(child).__name__, "attention", "kept: attention='keep'"))
                elif any(k in lname for k in _LOOKS_PATCHABLE) and not list(child.children()):
                    rows.append((path, type(child).__name__, "-", "skipped: not understood, left as it is"))
            visit(getattr(parent, name), path + ".")

    visit(model, "")
    model.__dict__["_tempo_report"] = Report(model.__dict__.get("_tempo_report", Report([])).rows + rows)
    if not any(r[3].startswith("patched") for r in rows) and not undo:
        model.__dict__.pop("_tempo_undo", None)  # the model is as it was: not "patched"
        model.__dict__.pop("_tempo_report", None)
        raise ValueError("tempo.optimize: nothing to patch in %s (no layer of a known type for techniques %s)"
                         % (type(model).__name__, sorted(chosen)))
    return model


def report(model: torch.nn.Module) -> Report:
    """What tempo.optimize patched in `model`, module by module, and what it left and why."""
    rep = model.__dict__.get("_tempo_report")
    if rep is None:
        raise ValueError("tempo.report: %s has not been through tempo.optimize" % type(model).__name__)
    return rep


def restore(model: torch.nn.Module) -> torch.nn.Module:
    """Undoes tempo.optimize exactly: the original modules and classes come back (the
    Parameters were never replaced)."""
    undo = model.__dict__.pop("_tempo_undo", None)
    if undo is None:
        raise ValueError("tempo.restore: %s has not been through tempo.optimize" % type(model).__name__)
    for entry in reversed(undo):
        if entry[0] == "attention":
            _, root, configs = entry
            root.set_attn_implementation(configs[0][1])
            for config, implementation in configs:
                config._attn_implementation = implementation
            root.__dict__.pop("_tempo_attention_marker", None)
        elif entry[0] == "attribute":
            _, module, name, value = entry
            module._modules.pop(name, None)
            setattr(module, name, value)
        else:
            _, module, cls = entry
            module.__class__ = cls
    model.__dict__.pop("_tempo_report", None)
    return model
