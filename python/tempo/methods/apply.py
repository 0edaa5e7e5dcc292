"""tempo.methods.apply: a method applied to a transformers model, part by part, for a block
(applied), for a measurement (apply with an ExitStack) or for good (install: tempo.optimize(model,
method=...), undone by tempo.restore)."""

import contextlib
import dataclasses
import functools
import warnings

import torch

from . import parts, tiled_mlp
from .table import Method, Unavailable, parse


@dataclasses.dataclass
class Applied:
    """A method applied to a model: `run` is what to call as the model is called (the compiled
    module under compile; the model itself otherwise); notes say what was decided; `host` counts
    the bytes the planner's stand-in held in host memory (tempo.plan; else None)."""

    method: Method
    model: torch.nn.Module
    run: object
    notes: list
    host: object = None
    attention: str = None  # a tempo base's attention, as tempo.optimize's attention= names it


def apply(method, model, stack, *, planned=None, compile_backend="inductor", compiled=None, attention=None):
    """Applies `method` to `model` (a transformers model in train mode) until `stack` (an
    ExitStack) closes; returns an Applied. planned: tempo.plan's stand-ins and rules for the
    device it plans (plan.engine.FakeDevice: what sdpa's CUDA kernels keep, TRL's Triton fold, the
    host memory offloading fills as a count, the base tempo's attention by rule instead of
    measured); None for a real run. compiled: a dict in which a compiled module is kept by
    method name across applications (the bench switches one model between methods at every
    step), and dynamo is not reset on closing. attention: a tempo base's attention as decided
    before (Applied.attention of an earlier application), instead of deciding again."""
    m = parse(method)
    kind = planned.kind if planned is not None else parts.device_kind(model)
    _refuse(m, model, kind, planned)
    done = Applied(m, model, model, [])
    implementation = _attention(m, model, stack, planned, done.notes)
    if m.liger:
        parts.apply_liger(model, stack, only_what_tempo_leaves=m.tempo)
    if m.head == "torch-lce":
        from ..hf import optimize
        from ..hf.lm_head import set_head_loss

        optimize(model, techniques="lm_head")
        set_head_loss(model, parts.torch_chunked_lce)
    if m.tempo:
        done.attention = _tempo(m, model, kind, implementation, planned, attention)
    if "_tempo_undo" in model.__dict__:
        from ..hf import restore

        stack.callback(lambda: restore(model) if "_tempo_undo" in model.__dict__ else None)
    if m.head == "trl":
        parts.trl_head(model, stack, planned)
    if m.tiled_mlp and not tiled_mlp.apply(model, stack):
        raise Unavailable("%s has no decoder layers with an mlp beside a self_attn to tile" % type(model).__name__)
    done.host = _checkpoint_and_offload(m, model, stack, planned)
    if m.compile:
        done.run = _compiled(m, model, stack, compile_backend, compiled)
    return done


def _refuse(m, model, kind, planned):
    """Unavailable (or ValueError) before anything is changed, for what cannot run here."""
    if (m.tempo or m.head == "torch-lce") and "_tempo_undo" in model.__dict__:
        raise ValueError(
            "tempo.methods: %s is already patched by tempo.optimize; tempo.restore it before applying %r"
            % (type(model).__name__, m.name)
        )
    if planned is not None and m.traced():
        raise Unavailable(m.traced())
    if m.head == "trl" and not parts.is_causal_lm(model):
        raise Unavailable("TRL's head is a causal language model's, and %s is a masked one" % type(model).__name__)
    if m.host_memory and kind != "cuda":
        raise Unavailable("offloading to host memory is for a GPU (on the CPU it is the same memory)")
    if m.checkpoint and not getattr(model, "supports_gradient_checkpointing", False):
        raise Unavailable("%s does not support gradient checkpointing" % type(model).__name__)
    if m.tiles:
        parts.check_tiles(model)
    if m.head == "torch-lce":
        if not hasattr(torch.nn.functional, "linear_cross_entropy"):
            raise Unavailable("this torch (%s) has no F.linear_cross_entropy (2.13 and later)" % torch.__version__)
        if getattr(model.config.get_text_config(), "final_logit_softcapping", None):
            raise Unavailable(
                "PyTorch's chunked linear cross-entropy has no logit soft-capping, which %s's head applies"
                % type(model).__name__
            )


def _attention(m, model, stack, planned, notes):
    """The base's transformers attention set on the model (sdpa, or eager where the family
    refuses sdpa, noted); the one set."""
    implementation, why = parts.attention_of(model.config)
    if m.base == "eager":
        implementation = "eager"
    elif why:
        notes.append(why)
    before = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    stack.callback(lambda: model.set_attn_implementation(before))
    if planned is not None:
        planned.attention(stack, implementation)
    return implementation


def _tempo(m, model, kind, implementation, planned, attention):
    """tempo.optimize with the base's attention and the part's recomputation; the attention as
    tempo.optimize's attention= names it."""
    from ..hf import optimize
    from ..hf.attention import ATTENTION

    if attention is None and m.tiles:
        attention = "keep"  # the tiles' own attention; the model's sdpa builds no mask without padding
    if attention is None:
        if m.base == "tempo-sdpa":
            attention = parts.sdpa_attention(model.config, kind, implementation)
        elif planned is not None:
            attention = parts.planned_attention(model.config, kind)
            attention = "keep" if attention in ("eager", implementation) else attention
        else:
            attention = "auto"
    optimize(model, attention=attention, mlp_recompute=m.recompute)
    now = model.config._attn_implementation
    return next((k for k, v in ATTENTION.items() if v == now and v is not None), "keep")


def _checkpoint_and_offload(m, model, stack, planned):
    """Checkpointing (its inputs in host memory for ckpt-offload) and offloading; the planner's
    host count (planned) or None."""
    host = None
    tiled = None  # the checkpoint function of tiles (hf.tiles); None: torch's
    if m.tiles:
        from ..hf.tiles import tiled_checkpoint as tiled
    if m.checkpoint == "device":
        parts.enable_checkpointing(model, tiled)
        stack.callback(parts.disable_checkpointing, model)
    elif m.checkpoint == "host":
        if planned is not None:
            host = planned.host_hooks(model.parameters())
            parts.enable_checkpointing(
                model, functools.partial(parts.checkpoint_inside, lambda: host, checkpoint=tiled)
            )
        elif tiled is not None:
            parts.enable_checkpointing(
                model, functools.partial(parts.checkpoint_inside, parts.pinned_host_hooks, checkpoint=tiled)
            )
        elif hasattr(model, "activation_checkpointing_enable"):
            kwargs = {"use_reentrant": False}
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, offload=True)
        else:
            raise Unavailable("this transformers has no activation_checkpointing_enable(offload=True) (5.2x and later)")
        stack.callback(parts.disable_checkpointing, model)
    if m.offload:
        if planned is not None:
            host = planned.host_hooks(model.parameters(), stash=5)  # TRL's OffloadActivations' stash
            parts.wrap_forward(model, stack, lambda: host)
        else:
            parts.wrap_forward(model, stack, parts.offloader(model))
    return host


def _compiled(m, model, stack, backend, compiled):
    """torch.compile of the model (kept in `compiled` by method name where given)."""
    if compiled is not None and m.name in compiled:
        return compiled[m.name]
    if m.memory_budget is not None:
        stack.enter_context(torch._functorch.config.patch(activation_memory_budget=m.memory_budget))
    if compiled is None:
        stack.callback(torch._dynamo.reset)
    run = torch.compile(model, backend=backend)
    if compiled is not None:
        compiled[m.name] = run
    return run


@contextlib.contextmanager
def applied(method, model, **kwargs):
    """`model` under `method` for as long as the block runs (apply's arguments); yields the
    Applied. What Liger patches stays patched in the model's instance."""
    with contextlib.ExitStack() as stack:
        yield apply(method, model, stack, **kwargs)


def install(model, method):
    """Applies `method` to `model` for good (tempo.optimize(model, method=...)): what it changes
    is undone by tempo.restore(model). Returns the Applied."""
    from ..hf._report import Report

    m = parse(method)
    if m.compile:
        raise ValueError(
            "tempo.optimize: %r compiles, which tempo.optimize does not do in place; apply %r and call "
            "model.compile() yourself" % (m.name, Method(m.base, tuple(p for p in m.parts if "compile" not in p)).name)
        )
    stack = contextlib.ExitStack()
    try:
        done = apply(m, model, stack)
    except BaseException:
        stack.close()
        raise
    undo = stack.pop_all()
    model.__dict__["_tempo_method"] = (m, undo)
    rows = model.__dict__.get("_tempo_report", Report([])).rows
    parts = [p for p in m.parts if not p.startswith("recompute-")]
    if parts or not m.tempo:
        rows = rows + [("(model)", type(model).__name__, "method", "applied: %s (%s)" % (m.name, m.spelling))]
    model.__dict__["_tempo_report"] = Report(rows)
    for note in done.notes:
        warnings.warn("tempo.optimize: " + note, stacklevel=3)
    return done


def uninstall(model):
    """Undoes install(model, ...); False where nothing was installed."""
    entry = model.__dict__.pop("_tempo_method", None)
    if entry is None:
        return False
    entry[1].close()
    model.__dict__.pop("_tempo_report", None)
    return True
