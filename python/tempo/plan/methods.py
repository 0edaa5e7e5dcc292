"""The training methods tempo.plan plans, by the frontier's names, each applied to a model of
fake tensors: what it changes in the model, and what a method cannot do on a family or device
(raised as Unavailable with the reason)."""

import contextlib

import torch

from .._method import Unavailable, enable_checkpointing
from ..hf import optimize
from .engine import cuda_attention

METHODS = (
    "eager",
    "sdpa",
    "sdpa+ckpt",
    "sdpa+ckpt+offload",
    "sdpa+torch-lce",
    "sdpa+trl-head",
    "tempo",
    "tempo-sdpa",
    "tempo+recompute-up",
    "tempo+recompute-gate_up",
    "tempo+ckpt",
    "tempo+offload",
)
# What a plan makes by default: every method whose kept tensors differ.
DEFAULT_METHODS = (
    "sdpa",
    "sdpa+ckpt",
    "sdpa+torch-lce",
    "sdpa+trl-head",
    "tempo",
    "tempo+recompute-up",
    "tempo+recompute-gate_up",
    "tempo+ckpt",
)
# Methods of the frontier the plan does not trace, and why.
NOT_TRACED = {
    "compile": "torch.compile's kept tensors are chosen by its partitioner inside the compiler (inductor), "
    "which needs a real device to run; the plan cannot trace it",
    "liger": "Liger-Kernel's kernels are Triton, which does not run on fake tensors; not modelled yet",
}


def attention_of(config):
    """The attention implementation the sdpa methods use: sdpa, or eager where transformers
    refuses sdpa for the family (Gemma 2's soft-capped attention logits), with why."""
    if getattr(config, "attn_logit_softcapping", None):
        return "eager", "its attention logits are soft-capped, which transformers' sdpa refuses: eager attention"
    return "sdpa", None


# where a config keeps its attention-probability dropout, by family
_ATTENTION_DROPOUT = ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop", "attn_dropout")


def tempo_attention_of(config, device_kind):
    """The attention of the method "tempo" (tempo.optimize(attention="auto"), the frontier's
    name): tempo's own where it keeps fewer bytes than torch's sdpa, which is on the CPU with
    attention dropout (sdpa falls back to its math path there, probabilities and mask kept);
    elsewhere sdpa keeps no S x S tensor, tempo's attention one, so sdpa (or eager, as
    attention_of says). The other tempo methods are tempo-sdpa's, as the frontier's are."""
    implementation, _ = attention_of(config)
    dropout = max((float(getattr(config, k, 0) or 0) for k in _ATTENTION_DROPOUT), default=0.0)
    if device_kind == "cpu" and dropout > 0 and implementation == "sdpa":
        return "tempo"
    return implementation


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """What saved-tensor offloading does to the device's memory (torch's save_on_cpu, TRL's
    activation_offloading): each saved tensor of 1 KiB or more that is not a parameter leaves
    the device in the forward (its storage freed when nothing else holds it; `host` counts the
    bytes) and comes back, as a new tensor, when the backward unpacks it."""

    def __init__(self, params):
        self.host = 0
        ids = {id(p) for p in params}

        def pack(t):
            n = t.numel() * t.element_size()
            if id(t) in ids or n < 1024:
                return (True, t)
            self.host += n
            return (False, (t.shape, t.dtype))

        def unpack(packed):
            kept, t = packed
            return t if kept else torch.empty(t[0], dtype=t[1])

        super().__init__(pack, unpack)


def apply(method, model, config, causal, device_kind, stack, planning=True):
    """Applies `method` to `model` inside `stack` (an ExitStack: what the method keeps on for
    the run); returns (the callable that trains, notes, the offloader or None). planning=False:
    for a real run on the device (validate.measure_cuda), without the plan's emulations of the
    GPU's kernels (sdpa's dispatch, TRL's Triton fold) and with torch's own save_on_cpu."""
    if method.endswith("+trl-head") and not causal:
        raise Unavailable("TRL's head is a causal language model's, and %s is a masked one" % type(model).__name__)
    if method not in METHODS:
        why = next((w for k, w in NOT_TRACED.items() if k in method), None)
        raise Unavailable(why or "unknown method %r; known: %s" % (method, ", ".join(METHODS)))
    notes = []
    implementation, why = attention_of(config)
    if method == "eager":
        implementation = "eager"
    elif why:
        notes.append(why)
    model.set_attn_implementation(implementation)
    if device_kind == "cuda" and implementation == "sdpa" and planning:
        stack.enter_context(cuda_attention())
    run = model
    if method.startswith("tempo"):
        recompute = method.split("+recompute-", 1)[1] if "+recompute-" in method else "product"
        attention = tempo_attention_of(config, device_kind) if method == "tempo" else implementation
        optimize(model, attention=attention, mlp_recompute=recompute)
    if method.endswith("+torch-lce"):
        from ..apps.frontier_methods import torch_chunked_lce
        from ..hf.lm_head import set_head_loss

        optimize(model, techniques="lm_head")
        set_head_loss(model, torch_chunked_lce)
    if method.endswith("+trl-head"):
        run = _trl_head(model, device_kind if planning else "real", stack)
    if "+ckpt" in method and not enable_checkpointing(model):
        raise Unavailable("%s does not support gradient checkpointing" % type(model).__name__)
    offload = None
    if method.endswith("+offload"):
        if device_kind != "cuda":
            raise Unavailable("offloading to host memory is for a GPU (on the CPU it is the same memory)")
        if planning:
            offload = HostOffload(model.parameters())
            stack.enter_context(offload)
        else:
            stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=True))
    return run, notes, offload


def _trl_head(model, device_kind, stack):
    """TRL's fused log-prob head (trl.trainer.utils.add_fused_lm_head, which TRL's trainers
    install), the model called as they call it. On a GPU its tiles are folded by a Triton kernel
    in place: there the plan keeps TRL's GEMMs and buffers and takes the fold as allocating
    nothing (as the kernel does)."""
    try:
        import trl.kernels.chunked_logprob as trl_kernels
        import trl.trainer.utils as trl_utils
    except ImportError as e:
        raise Unavailable("TRL is not installed (%s)" % e) from None
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    if device_kind == "cuda":
        # the fold allocates nothing; the labelled rows are gathered into a tensor of their own
        # (compact mode: hidden_states[mask], with every label valid here), which the plan makes
        # as a copy of the rows (the gather's size is the mask's values', which fake tensors lack)
        head = trl_utils._ChunkedLogProbFunction

        class Compact:
            @staticmethod
            def apply(hidden, *args):
                return head.apply(hidden.clone() if hidden._is_view() else hidden, *args)

        stack.enter_context(_patched(trl_utils, "_ChunkedLogProbFunction", Compact))
        stack.enter_context(_patched(trl_kernels, "_use_triton", lambda device: False))
        stack.enter_context(_patched(trl_kernels, "_forward_tile", lambda *a, **k: None))
        stack.enter_context(_patched(trl_kernels, "_backward_tile", lambda *a, **k: None))

    def run(**batch):
        return model(**batch, fused_lm_head=True)

    return run


@contextlib.contextmanager
def _patched(owner, name, value):
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)
