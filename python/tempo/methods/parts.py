"""The pieces tempo.methods' parts apply: checkpointing through transformers, the attention a
base takes, the peers' heads (TRL's, PyTorch's chunked loss), Liger-Kernel's patch, host
offloading around the forward."""

import contextlib
import functools
import inspect
import sys

import torch
import torch.nn.functional as F

from .table import Unavailable


def enable_checkpointing(model, function=None):
    """Activation checkpointing of every layer (use_reentrant=False), through `function`
    (transformers' gradient_checkpointing_func) when given; False, changing nothing, where the
    model does not support it."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return False
    kwargs = {"use_reentrant": False}
    if function is not None:
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=function)
        if getattr(model, "main_input_name", None) == "input_ids":
            model.enable_input_require_grads()
        return True
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x's name
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return True


def disable_checkpointing(model):
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    disable()
    getattr(model, "disable_input_require_grads", lambda: None)()


def attention_of(config):
    """The attention implementation the sdpa bases use: sdpa, or eager where transformers refuses
    sdpa for the family (Gemma 2's soft-capped attention logits), with why."""
    if getattr(config, "attn_logit_softcapping", None):
        return "eager", "its attention logits are soft-capped, which transformers' sdpa refuses: eager attention"
    return "sdpa", None


# where a config keeps its attention-probability dropout, by family
_ATTENTION_DROPOUT = ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop", "attn_dropout")


def _attention_dropout(config):
    return max((float(getattr(config, k, 0) or 0) for k in _ATTENTION_DROPOUT), default=0.0)


def sdpa_attention(config, device_kind, implementation="sdpa"):
    """The base tempo-sdpa's attention (tempo.optimize's attention= name): torch's sdpa, except
    where torch has no fused kernel for it, the CPU with attention dropout (sdpa's math path keeps
    the probabilities and the mask), where tempo.fused_attention keeps no S x S tensor either
    (as the C++ models' tempo-sdpa); the model's own where sdpa is refused (eager)."""
    if implementation == "eager":
        return "keep"
    return "fused" if device_kind == "cpu" and _attention_dropout(config) > 0 else "sdpa"


def planned_attention(config, device_kind):
    """The base tempo's attention="auto" as a rule, for a model that cannot be measured (the
    plan's fake tensors): tempo's own where it keeps fewer bytes than torch's sdpa, which is on
    the CPU with attention dropout (sdpa falls back to its math path there, probabilities and
    mask kept); elsewhere sdpa keeps no S x S tensor and tempo's attention one: sdpa (or eager,
    as attention_of says)."""
    implementation, _ = attention_of(config)
    if device_kind == "cpu" and _attention_dropout(config) > 0 and implementation == "sdpa":
        return "tempo"
    return implementation


def is_causal_lm(model):
    """Whether `model` is a causal language model (TRL's head applies to those)."""
    from transformers.models.auto import modeling_auto

    names = set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(cls.__name__ in names for cls in type(model).__mro__)


def torch_chunked_lce(hidden, weight, bias, labels, ignore_index=-100, reduction="mean", softcap=None):
    """PyTorch's chunked F.linear_cross_entropy in tempo's head-loss signature
    (hf.lm_head.set_head_loss). It has no logit soft-capping: a soft-capped head is refused."""
    if softcap is not None:
        raise Unavailable("PyTorch's chunked linear cross-entropy has no logit soft-capping")
    return F.linear_cross_entropy(
        hidden,
        weight,
        labels,
        linear_bias=bias,
        ignore_index=ignore_index,
        reduction=reduction,
        options=torch.nn.LinearCrossEntropyOptions(),
    )


def liger_function(model):
    """Liger-Kernel's apply function for the model's family (MODEL_TYPE_TO_APPLY_LIGER_FN, or
    apply_liger_kernel_to_<model type>), or Unavailable naming why there is none here."""
    try:
        import liger_kernel.transformers as liger
    except ImportError as e:
        raise Unavailable("Liger-Kernel is not installed (%s)" % e) from None
    if next(model.parameters()).device.type != "cuda":
        raise Unavailable("Liger-Kernel's kernels are Triton, which needs CUDA")
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN as table
    except ImportError:
        table = {}
    fn = table.get(model.config.model_type) or getattr(
        liger, "apply_liger_kernel_to_%s" % model.config.model_type, None
    )
    if fn is None:
        raise Unavailable(
            "Liger-Kernel has no patch for %s (model type %r)" % (type(model).__name__, model.config.model_type)
        )
    return fn


def apply_liger(model, stack, only_what_tempo_leaves):
    """Liger-Kernel's patch of the model's family (only RoPE and the gated MLP beside tempo's
    layers), its modeling module put back when `stack` closes."""
    fn = liger_function(model)  # Unavailable before anything is patched
    stack.enter_context(_modeling_namespace_restored(model))
    kwargs = {"model": model}
    if only_what_tempo_leaves:
        params = inspect.signature(fn).parameters
        skip = ("rms_norm", "layer_norm", "cross_entropy", "fused_linear_cross_entropy")
        kwargs.update({k: False for k in skip if k in params})
    fn(**kwargs)


@contextlib.contextmanager
def _modeling_namespace_restored(model):
    """Liger patches the family's modeling module (its RMSNorm and MLP classes, its RoPE
    function) and may patch classes' forwards: both are put back afterwards, so that the
    methods measured later in this process see transformers' own."""
    module = sys.modules[type(model).__module__]
    names = dict(vars(module))
    forwards = {
        cls: cls.__dict__.get("forward")
        for cls in names.values()
        if isinstance(cls, type) and cls.__module__ == module.__name__
    }
    try:
        yield
    finally:
        for k in set(vars(module)) - set(names):
            delattr(module, k)
        for k, v in names.items():
            if vars(module).get(k) is not v:
                setattr(module, k, v)
        for cls, fwd in forwards.items():
            if fwd is not None and cls.__dict__.get("forward") is not fwd:
                cls.forward = fwd


def wrap_forward(model, stack, around):
    """model.forward runs inside around() (a context manager factory) from now until `stack`
    closes (an instance attribute, so that model(...) and everything wrapping it see it)."""

    def make(inner):
        @functools.wraps(inner)
        def forward(*args, **kwargs):
            with around():
                return inner(*args, **kwargs)

        return forward

    replace_forward(model, stack, make)


def replace_forward(module, stack, make):
    """module.forward is make(its forward) from now until `stack` closes, as an instance
    attribute (a forward the instance had of its own is put back)."""
    had = "forward" in module.__dict__
    before = module.__dict__.get("forward")
    module.forward = make(module.forward)

    def undo():
        if had:
            module.forward = before
        else:
            module.__dict__.pop("forward", None)

    stack.callback(undo)


def device_kind(model):
    p = next(model.parameters(), None)
    return "cpu" if p is None else p.device.type


def checkpoint_inside(hooks, function, *args, checkpoint=None, **kwargs):
    """transformers' checkpoint with offload=True, its save_on_cpu replaced by `hooks()`;
    `checkpoint`: the checkpoint function (torch's non-reentrant one by default)."""
    if checkpoint is None:
        from torch.utils.checkpoint import checkpoint as torch_checkpoint

        checkpoint = functools.partial(torch_checkpoint, use_reentrant=False)
    with hooks():
        return checkpoint(function, *args, **kwargs)


def pinned_host_hooks():
    """Saved tensors in pinned host memory (torch's save_on_cpu), as transformers' offloaded
    checkpoints hold them."""
    return torch.autograd.graph.save_on_cpu(pin_memory=True)


def check_tiles(model):
    """Unavailable where the tiles' attention cannot run the model's layers as they are."""
    config = model.config.get_text_config()
    layers = [m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "gradient_checkpointing")]
    if not layers:
        raise Unavailable(
            "tiles need transformers decoder layers with a self_attn (%s has none)" % type(model).__name__
        )
    if getattr(config, "attn_logit_softcapping", None):
        raise Unavailable("tiles: soft-capped attention logits are not supported")
    if _attention_dropout(config) > 0:
        raise Unavailable("tiles: attention dropout is not supported")
    if getattr(model.config, "is_encoder_decoder", False) or not is_causal_lm(model):
        raise Unavailable("tiles are for causal language models (keys and values up to each tile's end)")


def offloader(model):
    """What `offload` runs the forward under on a GPU: TRL's OffloadActivations (side stream,
    pinned memory) where TRL is installed, else torch's save_on_cpu(pin_memory=True)."""
    try:
        from trl.models.activation_offloading import get_act_offloading_ctx_manager
    except ImportError:
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    ctx = get_act_offloading_ctx_manager(model, warn_if_no_head=False)
    return lambda: ctx


def trl_head(model, stack, planned):
    """TRL's chunked log-prob head (trl.trainer.utils.add_fused_lm_head, which TRL's trainers
    install), the model called as they call it (fused_lm_head=True); a planned GPU's fold of
    the tiles by `planned`."""
    try:
        import trl.trainer.utils as trl_utils
    except ImportError as e:
        raise Unavailable("TRL is not installed (%s)" % e) from None
    had = "forward" in model.__dict__
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    fused = model.forward
    if planned is not None:
        planned.trl_head(stack)

    def forward(*args, **kwargs):
        if kwargs.get("labels") is not None and model.training and torch.is_grad_enabled():
            kwargs.setdefault("fused_lm_head", True)
        return fused(*args, **kwargs)

    model.forward = forward
    stack.callback(lambda: model.__dict__.pop("forward", None) if not had else None)
