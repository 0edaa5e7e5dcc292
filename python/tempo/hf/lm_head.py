"""tempo.optimize's "lm_head" technique: a causal or masked LM's training loss from the last
hidden state and the head's weight by tempo.linear_cross_entropy, so the logits (the largest
activation of a language model: batch x sequence x vocabulary) never exist.

It uses transformers' own extension points rather than a forward per model: the model's
`loss_function` (the attribute transformers' causal LMs call with the logits, labels and the
loss kwargs) and its output embedding (`get_output_embeddings()`, the head). A patched model's
forward, when it is training, needs gradients and is given labels, runs the model's own forward
with the head passing the hidden states through and the loss function replaced by one that
applies the head inside tempo.linear_cross_entropy: the model's own label shift (or the
caller's shift_labels), ignore_index, num_items_in_batch (the gradient-accumulation
normalisation the HF Trainer passes) and logits_to_keep (the model slices the hidden states
before the head) are kept. The output is the model's usual type with `loss` set and `logits`
None. Eval, generation, calls without labels and return_dict=False run the model unchanged.

Masked LMs (BERT, RoBERTa, XLM-R, DistilBERT, ELECTRA, ALBERT: MASKED_FAMILIES) compute their
loss in the forward with a CrossEntropyLoss of their own, not through a loss function: the
patched forward runs the model's own forward without the labels, the head passing through the
states its prediction transform made (BERT's dense, GELU and LayerNorm run as before), and then
takes the loss by tempo.linear_cross_entropy with the head's weight and bias, as the model's
CrossEntropyLoss() would (mean over the labels not -100, no shift).

Families in the tables are the ones whose forward applies the head and then only the loss, or
one of the logit transforms tempo.linear_cross_entropy computes (Gemma 2/3's
final_logit_softcapping, PaliGemma's from its text config, Cohere's logit_scale, Granite's
logits_scaling); a language model not
in a table is refused by name (its forward may transform the logits otherwise), as is a masked
LM with such a transform and a causal LM whose loss function a user replaced.
"""

import contextlib
import dataclasses
import functools
import inspect

import torch
import torch.nn.functional as F

from .. import ops

try:  # the error a config that validates its fields (a strict dataclass: Gemma 3n's) raises
    from huggingface_hub.errors import StrictDataclassError

    _STRICT = (StrictDataclassError,)
except ImportError:
    _STRICT = ()

# Causal-LM classes whose forward is head -> loss_function, checked by tests/python/hf/test_lm_head.py; some
# transform the logits between the two (_LOGIT_TRANSFORMS), and the mixtures of experts add their router's
# auxiliary loss to the loss function's after it (unchanged).
FAMILIES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GemmaForCausalLM",
    "Phi3ForCausalLM",
    "GPT2LMHeadModel",
    "GPTNeoXForCausalLM",
    "OPTForCausalLM",
    "FalconForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "CohereForCausalLM",
    "Cohere2ForCausalLM",
    "GraniteForCausalLM",
    "GraniteMoeForCausalLM",
    "Olmo2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "OlmoForCausalLM",
    "Glm4ForCausalLM",
    "SmolLM3ForCausalLM",
    "MllamaForCausalLM",
    "Olmo3ForCausalLM",
    "Llama4ForCausalLM",
    "GptOssForCausalLM",
    "Qwen3NextForCausalLM",
    "Glm4MoeForCausalLM",
    "FalconH1ForCausalLM",
    "Gemma3nForCausalLM",
    "HunYuanDenseV1ForCausalLM",
    "HunYuanMoEV1ForCausalLM",
    "Exaone4ForCausalLM",
    # multimodal: the text model's hidden states, its head, its loss function (images go in before)
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "LlavaForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "PaliGemmaForConditionalGeneration",
    "MllamaForConditionalGeneration",
    "InternVLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Glm4vForConditionalGeneration",
    "SmolVLMForConditionalGeneration",
    "Glm4vMoeForConditionalGeneration",
    "Llama4ForConditionalGeneration",
)
# Masked-LM classes whose forward is transform -> head -> CrossEntropyLoss()(logits.view(-1, V), labels.view(-1)).
MASKED_FAMILIES = (
    "BertForMaskedLM",
    "RobertaForMaskedLM",
    "XLMRobertaForMaskedLM",
    "DistilBertForMaskedLM",
    "ElectraForMaskedLM",
    "AlbertForMaskedLM",
)
# Config fields that transform the logits between the head and the loss: (name, the value that does
# nothing). A scale (Cohere's logit_scale, Granite's 1 / logits_scaling, Falcon-H1's lm_head_multiplier)
# the model applies to what the head passes through, the hidden states, which is the same; the
# soft-capping (Gemma 2/3) is not linear, so the patched forward turns it off in the model for the call
# and tempo.linear_cross_entropy applies it.
_LOGIT_TRANSFORMS = (("final_logit_softcapping", None), ("logit_scale", 1.0), ("logits_scaling", 1.0))
_SOFTCAP = "final_logit_softcapping"
# Multimodal classes whose forward soft-caps with their text config's value (Gemma 3's multimodal
# model does not cap at all, whatever its text config holds).
_TEXT_SOFTCAP = ("PaliGemmaForConditionalGeneration",)


def _softcap_config(m):
    """The config whose final_logit_softcapping `m`'s forward applies."""
    return m.config.get_text_config() if type(m).__name__ in _TEXT_SOFTCAP else m.config


class Refused(ValueError):
    """The model is a language model that the technique cannot compute; the message says why."""


def kind(m):
    """ "causal" for what looks like a transformers causal LM (a head and a loss function),
    "masked" for a masked LM (a head), else None."""
    name = type(m).__name__
    if not hasattr(m, "get_output_embeddings") or getattr(m, "config", None) is None:
        return None
    if name.endswith("ForMaskedLM"):
        return "masked"
    if name in FAMILIES and hasattr(type(m), "loss_function"):  # a multimodal model's causal LM
        return "causal"
    if (name.endswith("ForCausalLM") or name.endswith("LMHeadModel")) and hasattr(type(m), "loss_function"):
        return "causal"
    return None


def check(m):
    """Raises Refused with the reason when the technique cannot apply to the language model `m`."""
    name = type(m).__name__
    cfg = getattr(m, "config", None)
    masked = kind(m) == "masked"
    if masked or name not in FAMILIES:  # a family not in the table is refused below; these transforms by name
        for field, neutral in _LOGIT_TRANSFORMS:
            value = getattr(cfg, field, neutral)
            if value is not None and value != neutral:
                raise Refused("%s has %s=%r, which tempo's lm_head does not know it to apply" % (name, field, value))
    if name not in (MASKED_FAMILIES if masked else FAMILIES):
        raise Refused(
            "%s is not in the lm_head table (tempo/hf/lm_head.py %s): its forward may transform the logits "
            "before the loss" % (name, "MASKED_FAMILIES" if masked else "FAMILIES")
        )
    head = m.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise Refused("%s's output embedding is %s, not a Linear" % (name, type(head).__name__))
    if masked:
        return
    if "_loss_function" in m.__dict__:
        raise Refused("%s has a loss function of its own (loss_function was set)" % name)
    loss_type = getattr(m, "loss_type", None) or getattr(getattr(m, "config", None), "loss_type", None)
    if loss_type not in (None, "ForCausalLM", "ForConditionalGeneration"):  # the latter maps to the causal LM's loss
        raise Refused("%s's loss_type is %r, not ForCausalLM" % (name, loss_type))


def _head_forward(self, x):
    """The head (output embedding), patched: passes the hidden states through during a
    tempo-loss forward (the loss applies the head), else the Linear as it was."""
    if self.__dict__.get("_tempo_pass_hidden"):
        return x
    return torch.nn.Linear.forward(self, x)


@contextlib.contextmanager
def _passing_hidden(head):
    """The head passes the hidden states through for the duration (_head_forward)."""
    head.__dict__["_tempo_pass_hidden"] = True
    try:
        yield
    finally:
        head.__dict__.pop("_tempo_pass_hidden", None)


def _loss(
    head,
    logits,
    labels,
    vocab_size=None,
    num_items_in_batch=None,
    ignore_index=-100,
    shift_labels=None,
    head_fn=ops.linear_cross_entropy,
    **kwargs,
):
    """transformers' ForCausalLMLoss with `logits` the hidden states before the head (a masked
    LM passes its labels as shift_labels: no shift). `head_fn`: the fused head's function,
    (hidden, weight, bias, labels, ignore_index=, reduction=) -> loss: tempo's, or another one a
    benchmark puts beside it (head_loss)."""
    hidden = logits
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    h = hidden.reshape(-1, hidden.shape[-1])
    lab = shift_labels.reshape(-1).to(h.device)
    w, b = head.weight, head.bias
    autocast = h.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(h.device.type)
    if not autocast and h.dtype != w.dtype:  # a model that upcast the "logits" (its hidden states)
        h = h.to(w.dtype)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    value = head_fn(h, w, b, lab, ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(value.device)
        value = value / num_items_in_batch
    return value


def head_loss(model):
    """The function a patched LM's head computes its loss with: tempo.linear_cross_entropy, or
    the one set_head_loss gave it."""
    return model.__dict__.get("_tempo_head_loss", ops.linear_cross_entropy)


def set_head_loss(model, fn):
    """Makes the patched LM `model` compute its training loss with `fn` (hidden, weight, bias,
    labels, ignore_index=, reduction=) instead of tempo.linear_cross_entropy: tempo.frontier puts
    PyTorch's chunked F.linear_cross_entropy in the peers' heads this way."""
    model.__dict__["_tempo_head_loss"] = fn


def _bound(self, args, kwargs):
    """The call's arguments bound to the model's own forward, or None where the patch does not
    apply (eval, no grad, no labels, return_dict=False: the model's own forward runs)."""
    if not (self.training and torch.is_grad_enabled()):
        return None
    signature = inspect.signature(type(self)._tempo_patch[0].forward)
    bound = signature.bind_partial(self, *args, **kwargs)
    extra = next(
        (
            bound.arguments[p.name]
            for p in signature.parameters.values()
            if p.kind is inspect.Parameter.VAR_KEYWORD and p.name in bound.arguments
        ),
        {},
    )
    if bound.arguments.get("labels") is None or bound.arguments.get("return_dict", extra.get("return_dict")) is False:
        return None
    return bound


def _without_logits(out, loss):
    """The model's output type with `loss` and logits None (the hidden states stood in for
    them), its fields in the type's order (out[0] is the loss, as in the model's output)."""
    new = type(out)(loss=loss)
    for f in dataclasses.fields(out):
        value = None if f.name == "logits" else getattr(out, f.name)
        if f.name != "loss" and (value is not None or f.name == "logits"):
            new[f.name] = value
    return new


def masked_lm_forward(self, *args, **kwargs):
    """A patched masked LM's forward (see the module's docstring)."""
    original = type(self)._tempo_patch[0].forward
    bound = _bound(self, args, kwargs)
    if bound is None:
        return original(self, *args, **kwargs)
    labels = bound.arguments["labels"]
    bound.arguments["labels"] = None
    head = self.get_output_embeddings()
    with _passing_hidden(head):
        out = original(*bound.args, **bound.kwargs)
    return _without_logits(out, _loss(head, out["logits"], None, shift_labels=labels, head_fn=head_loss(self)))


def causal_lm_forward(self, *args, **kwargs):
    """A patched causal LM's forward (see the module's docstring)."""
    original = type(self)._tempo_patch[0].forward
    if _bound(self, args, kwargs) is None:
        return original(self, *args, **kwargs)
    head = self.get_output_embeddings()
    saved = self.__dict__.get("_loss_function", _MISSING)
    fn = head_loss(self)
    cap_config = _softcap_config(self)
    cap = getattr(cap_config, _SOFTCAP, None)
    if cap is not None:  # the model would cap the hidden states the head passes through: the loss caps the logits
        fn = functools.partial(fn, softcap=cap)
    self.__dict__["_loss_function"] = lambda *a, **k: _loss(head, *a, head_fn=fn, **k)
    try:
        with _passing_hidden(head), _config_set(cap_config, _SOFTCAP, None if cap is not None else _MISSING):
            out = original(self, *args, **kwargs)
    finally:
        if saved is _MISSING:
            self.__dict__.pop("_loss_function", None)
        else:
            self.__dict__["_loss_function"] = saved
    return _without_logits(out, out["loss"])


@contextlib.contextmanager
def _config_set(config, field, value):
    """config.field = value for the duration (nothing when value is _MISSING)."""
    if value is _MISSING:
        yield
        return
    before = getattr(config, field)
    _set(config, field, value)
    try:
        yield
    finally:
        _set(config, field, before)


def _set(config, field, value):
    """config.field = value, past a config class that validates its fields (Gemma 3n's takes no
    None for final_logit_softcapping: the patched call turns it off all the same)."""
    try:
        setattr(config, field, value)
    except (TypeError, ValueError, *_STRICT):
        object.__setattr__(config, field, value)


_MISSING = object()


# Both forwards take the model's own arguments: its patched class shows the model's signature
# (tempo.optimize's subclass_of), as the HF Trainer reads it.
masked_lm_forward.keeps_signature = causal_lm_forward.keeps_signature = True
