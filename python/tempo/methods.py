"""tempo.methods: a training method as one record of orthogonal parts, parsed from one spelling,
and applied to a transformers model by one function, for the plan, the frontier, the bench,
tempo.auto, the command lines and users alike.

A method is spelled ``<base>[+<part>]...`` (the parts in any order, each at most once), or is a
peer's recipe by name, which expands to such a spelling:

    bases   eager        transformers' eager attention; nothing of tempo's
            sdpa         transformers' sdpa attention (torch's fused kernels where they apply)
            tempo        tempo.optimize: every technique, the LM head's included (the logits never
                         formed); its attention the one whose training forward keeps the fewest
                         bytes (attention="auto": sdpa on a GPU, tempo's own on the CPU with
                         attention dropout, where sdpa falls back to its math path)
            tempo-sdpa   tempo.optimize with torch's sdpa attention (tempo.fused_attention where
                         torch has no fused kernel: the CPU with attention dropout)
    parts   recompute-up, recompute-gate_up
                         the gated MLPs' backward recomputes up(x), or gate(x) and up(x)
                         (tempo.optimize(mlp_recompute=...); a tempo base)
            ckpt         activation checkpointing of every layer (use_reentrant=False)
            ckpt-offload checkpointing, each checkpointed layer's input held in host memory
            offload      every saved tensor of 1 KiB or more held in host memory
            trl-head     TRL's chunked log-prob head (its trainers install it; causal LMs)
            torch-lce    PyTorch's chunked F.linear_cross_entropy as the LM head and loss
            compile, compile-mem<F>
                         torch.compile (activation_memory_budget F for its partitioner)
            liger        Liger-Kernel's patch of the family (Triton: CUDA only)
    recipes trl          TRL's trainers with gradient_checkpointing: sdpa+ckpt+trl-head
            trl-offload  ... with TRL's activation_offloading: sdpa+ckpt+offload+trl-head
            hf-offload   transformers' activation_checkpointing_enable(offload=True):
                         sdpa+ckpt-offload

    import tempo
    m = tempo.methods.parse("tempo+ckpt")         # or a Method; m.parts, m.recompute, ...
    tempo.optimize(model, method=m)               # applied whole; tempo.restore(model) undoes it
    with tempo.methods.applied(m, model) as a:    # for as long as the block runs
        a.run(**batch).loss.backward()

A combination that cannot run raises ValueError naming why (two heads, recompute-* on a base
that has no tempo MLP); a method that cannot run here (Liger without CUDA, offloading on the
CPU, TRL's head on a masked LM) raises Unavailable with the reason, which tables print in its
row.
"""

import contextlib
import dataclasses
import functools
import inspect
import re
import sys
import warnings

import torch
import torch.nn.functional as F


class Unavailable(Exception):
    """A method that cannot run here (Liger-Kernel without CUDA, a family Liger has no patch for,
    a model without gradient checkpointing, offloading on the CPU): its row says why."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row of the method table: a base, a part or a recipe."""

    name: str
    kind: str  # "base", "part" or "recipe"
    summary: str
    group: str = ""  # parts of one group exclude each other
    expands: str = ""  # a recipe's spelling
    source: str = ""  # a recipe's source


TABLE = (
    Entry("eager", "base", "transformers' eager attention; nothing of tempo's"),
    Entry("sdpa", "base", "transformers' sdpa attention (torch's fused kernels where they apply)"),
    Entry(
        "tempo",
        "base",
        "tempo.optimize: every technique, the LM head's included; the attention that keeps the fewest bytes "
        "(attention='auto')",
    ),
    Entry(
        "tempo-sdpa",
        "base",
        "tempo.optimize with torch's sdpa attention (tempo.fused_attention where torch has no fused kernel: the "
        "CPU with attention dropout)",
    ),
    Entry("recompute-up", "part", "the gated MLPs' backward recomputes up(x) (one GEMM)", group="recompute"),
    Entry(
        "recompute-gate_up",
        "part",
        "the gated MLPs' backward recomputes gate(x) and up(x) (two GEMMs)",
        group="recompute",
    ),
    Entry("ckpt", "part", "activation checkpointing of every layer (use_reentrant=False)", group="ckpt"),
    Entry(
        "ckpt-offload",
        "part",
        "checkpointing of every layer, each layer's checkpointed input held in host memory",
        group="ckpt",
    ),
    Entry("offload", "part", "every saved tensor of 1 KiB or more held in host memory", group="offload"),
    Entry("trl-head", "part", "TRL's chunked log-prob head, which TRL's trainers install", group="head"),
    Entry("torch-lce", "part", "PyTorch's chunked F.linear_cross_entropy as the LM head and loss", group="head"),
    Entry("compile", "part", "torch.compile (its partitioner at the default budget)", group="compile"),
    Entry(
        "compile-mem<F>",
        "part",
        "torch.compile with torch._functorch.config.activation_memory_budget = F",
        group="compile",
    ),
    Entry("liger", "part", "Liger-Kernel's patch of the family (Triton kernels: CUDA only)", group="liger"),
    Entry(
        "trl",
        "recipe",
        "TRL's trainers (SFT, DPO, GRPO, ...) with gradient_checkpointing=True",
        expands="sdpa+ckpt+trl-head",
        source="TRL 1.16: every trainer installs its chunked head (trl/trainer/utils.py: add_fused_lm_head); "
        "gradient_checkpointing from transformers' TrainingArguments",
    ),
    Entry(
        "trl-offload",
        "recipe",
        "TRL's trainers with gradient_checkpointing=True and activation_offloading=True",
        expands="sdpa+ckpt+offload+trl-head",
        source="TRL 1.16: trl/models/activation_offloading.py (saved tensors of 1 KiB or more to pinned host "
        "memory on a side stream)",
    ),
    Entry(
        "hf-offload",
        "recipe",
        "transformers' Trainer with checkpoints in host memory",
        expands="sdpa+ckpt-offload",
        source="transformers 5.25: PreTrainedModel.activation_checkpointing_enable(offload=True) (save_on_cpu "
        "around each checkpoint, copies on the compute stream)",
    ),
)
BASES = tuple(e.name for e in TABLE if e.kind == "base")
PARTS = tuple(e.name for e in TABLE if e.kind == "part")
RECIPES = {e.name: e for e in TABLE if e.kind == "recipe"}
_GROUP = {e.name: e.group for e in TABLE if e.kind == "part"}
_COMPILE_MEM = re.compile(r"^compile-mem(\d*\.?\d+)$")
# Spellings of earlier versions (the frontier's and the bench's), and what they are now.
ALIASES = {"tempo-auto": None}  # the frontier's Auto-Tempo row: tempo.auto decides per budget, not a method
_BARE_PARTS = ("compile", "liger")  # "compile", "compile-mem0.5", "liger" alone: on sdpa, as the frontier ran them


@dataclasses.dataclass(frozen=True)
class Method:
    """A parsed method: its base and parts (in the table's order), the recipe it came from (or
    None) and its name (the recipe's, else the spelling with the parts in the table's order)."""

    base: str
    parts: tuple = ()
    recipe: str = None
    memory_budget: float = None  # compile-mem<F>'s F

    @property
    def name(self):
        return self.recipe or self.spelling

    @property
    def spelling(self):
        return "+".join((self.base,) + self.parts)

    def __str__(self):
        return self.name

    def has(self, part):
        return part in self.parts or (part == "compile" and self.compile)

    @property
    def tempo(self):
        return self.base in ("tempo", "tempo-sdpa")

    @property
    def recompute(self):
        """What the gated MLPs' backward recomputes (tempo.optimize's mlp_recompute)."""
        for p in self.parts:
            if p.startswith("recompute-"):
                return p[len("recompute-") :]
        return "product"

    @property
    def checkpoint(self):
        """None, "device" (ckpt) or "host" (ckpt-offload)."""
        return "host" if "ckpt-offload" in self.parts else ("device" if "ckpt" in self.parts else None)

    @property
    def offload(self):
        return "offload" in self.parts

    @property
    def head(self):
        """Whose head computes the loss: "tempo" (a tempo base), "trl", "torch-lce" or None (the
        model's own, which forms the logits)."""
        if self.tempo:
            return "tempo"
        return "trl" if "trl-head" in self.parts else ("torch-lce" if "torch-lce" in self.parts else None)

    @property
    def compile(self):
        return any(p == "compile" or p.startswith("compile-mem") for p in self.parts)

    @property
    def liger(self):
        return "liger" in self.parts

    @property
    def recomputes_matmuls(self):
        """Whether the backward recomputes matmuls: checkpointing, the MLP's projections, or the
        compiler under an activation budget."""
        return self.checkpoint is not None or self.recompute != "product" or self.memory_budget is not None

    @property
    def host_memory(self):
        """Whether the method holds tensors in host memory (a GPU's method)."""
        return self.offload or self.checkpoint == "host"

    def traced(self):
        """None where tempo.plan traces the method, else why it cannot."""
        if self.compile:
            return (
                "torch.compile's kept tensors are chosen by its partitioner inside the compiler (inductor), "
                "which needs a real device to run; the plan cannot trace it"
            )
        if self.liger:
            return "Liger-Kernel's kernels are Triton, which does not run on fake tensors; not modelled yet"
        return None

    def without_host(self):
        """The same method with its tensors on the device: what tempo.optimize's probes run."""
        return Method(self.base, tuple(p for p in self.parts if p.startswith("recompute-")))


def parse(method):
    """A Method from its spelling (a Method is returned as it is); ValueError naming what is wrong."""
    if isinstance(method, Method):
        return method
    if not isinstance(method, str) or not method:
        raise ValueError("tempo.methods: a method is a spelling such as 'tempo+ckpt', got %r" % (method,))
    if method in RECIPES:
        parsed = parse(RECIPES[method].expands)
        return dataclasses.replace(parsed, recipe=method)
    if method in ALIASES:
        raise ValueError(
            "tempo.methods: %r is not a method: tempo.auto (the frontier's tempo-auto row) decides one per "
            "budget" % method
        )
    tokens = method.split("+")
    if tokens[0] in RECIPES:  # a recipe with more parts: its spelling and theirs
        return parse("+".join([RECIPES[tokens[0]].expands] + tokens[1:]))
    if tokens[0] in _BARE_PARTS or _COMPILE_MEM.match(tokens[0]):
        tokens = ["sdpa"] + tokens  # the frontier's "compile", "liger": on sdpa
    base, parts = tokens[0], tokens[1:]
    known = "bases: %s; parts: %s; recipes: %s" % (", ".join(BASES), ", ".join(PARTS), ", ".join(RECIPES))
    if base not in BASES:
        raise ValueError("tempo.methods: unknown base %r in %r (%s)" % (base, method, known))
    seen, budget = {}, None
    for part in parts:
        m = _COMPILE_MEM.match(part)
        if m:
            budget = float(m.group(1))
            if not 0.0 <= budget <= 1.0:
                raise ValueError("tempo.methods: compile-mem<F> takes F in [0, 1], got %r in %r" % (part, method))
            group = "compile"
        elif part in _GROUP and part != "compile-mem<F>":
            group = _GROUP[part]
        else:
            raise ValueError("tempo.methods: unknown part %r in %r (%s)" % (part, method, known))
        if part in seen.values():
            raise ValueError("tempo.methods: the part %r is given twice in %r" % (part, method))
        if group in seen:
            raise ValueError(
                "tempo.methods: %r and %r both set the %s in %r; give one" % (seen[group], part, _WHAT[group], method)
            )
        seen[group] = part
    order = {p: i for i, p in enumerate(PARTS)}
    ordered = tuple(sorted(parts, key=lambda p: order.get(p, order["compile-mem<F>"])))
    out = Method(base, ordered, memory_budget=budget)
    _check(out, method)
    return out


_WHAT = {
    "recompute": "gated MLP's recomputation",
    "ckpt": "checkpointing",
    "offload": "offloading",
    "head": "LM head",
    "compile": "compiler",
    "liger": "Liger patch",
}


def _check(m, spelled):
    """Combinations that cannot run, refused with why."""
    why = None
    if m.recompute != "product" and not m.tempo:
        why = "recompute-%s is tempo's gated MLP's; it needs a tempo base (tempo, tempo-sdpa)" % m.recompute
    elif m.tempo and ("trl-head" in m.parts or "torch-lce" in m.parts):
        why = (
            "a tempo base computes the loss without logits with its own head (tempo.linear_cross_entropy); "
            "trl-head and torch-lce are heads for the eager and sdpa bases"
        )
    elif m.offload and m.checkpoint == "host":
        why = "offload already holds every saved tensor, checkpoints included, in host memory; give one of the two"
    elif m.liger and m.head is not None and m.head != "tempo":
        why = "liger brings its own fused linear cross-entropy as the head; give no other head"
    elif m.liger and m.recompute != "product":
        why = "liger's SwiGLU/GeGLU replaces tempo's gated MLP, so recompute-%s cannot apply" % m.recompute
    if why:
        raise ValueError("tempo.methods: %r cannot run: %s" % (spelled, why))


def describe():
    """The method table: (name, kind, summary, expands, source) per row."""
    return [(e.name, e.kind, e.summary, e.expands, e.source) for e in TABLE]


# ---- applying a method ---------------------------------------------------------------------------


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


def _disable_checkpointing(model):
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


def _wrap_forward(model, stack, around):
    """model.forward runs inside around() (a context manager factory) from now until `stack`
    closes (an instance attribute, so that model(...) and everything wrapping it see it)."""
    had = "forward" in model.__dict__
    before = model.__dict__.get("forward")
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with around():
            return inner(*args, **kwargs)

    model.forward = forward

    def undo():
        if had:
            model.forward = before
        else:
            model.__dict__.pop("forward", None)

    stack.callback(undo)


def _device_kind(model):
    p = next(model.parameters(), None)
    return "cpu" if p is None else p.device.type


def apply(method, model, stack, *, planned=None, compile_backend="inductor", compiled=None, attention=None):
    """Applies `method` to `model` (a transformers model in train mode) until `stack` (an
    ExitStack) closes; returns an Applied. planned: tempo.plan's stand-ins and rules for the
    device it plans (plan.engine.FakeDevice: what sdpa's CUDA kernels keep, TRL's Triton fold, the
    host memory offloading fills as a count, the base tempo's attention by rule instead of
    measured); None for a real run. compiled: a dict in which a compiled module is kept
    by method name across applications (the bench switches one model between methods at every
    step), and dynamo is not reset on closing. attention: a tempo base's attention as decided
    before (Applied.attention of an earlier application), instead of deciding again."""
    from .hf import optimize, restore
    from .hf.lm_head import set_head_loss

    m = parse(method)
    if (m.tempo or m.head == "torch-lce") and "_tempo_undo" in model.__dict__:
        raise ValueError(
            "tempo.methods: %s is already patched by tempo.optimize; tempo.restore it before applying %r"
            % (type(model).__name__, m.name)
        )
    config = model.config
    kind = planned.kind if planned is not None else _device_kind(model)
    if planned is not None and m.traced():
        raise Unavailable(m.traced())
    if m.head == "trl" and not is_causal_lm(model):
        raise Unavailable("TRL's head is a causal language model's, and %s is a masked one" % type(model).__name__)
    if m.host_memory and kind != "cuda":
        raise Unavailable("offloading to host memory is for a GPU (on the CPU it is the same memory)")
    if m.checkpoint and not getattr(model, "supports_gradient_checkpointing", False):
        raise Unavailable("%s does not support gradient checkpointing" % type(model).__name__)
    if m.head == "torch-lce":
        if not hasattr(F, "linear_cross_entropy"):
            raise Unavailable("this torch (%s) has no F.linear_cross_entropy (2.13 and later)" % torch.__version__)
        if getattr(config.get_text_config(), "final_logit_softcapping", None):
            raise Unavailable(
                "PyTorch's chunked linear cross-entropy has no logit soft-capping, which %s's head applies"
                % type(model).__name__
            )
    notes = []
    implementation, why = attention_of(config)
    if m.base == "eager":
        implementation = "eager"
    elif why:
        notes.append(why)
    before = config._attn_implementation
    model.set_attn_implementation(implementation)
    stack.callback(lambda: model.set_attn_implementation(before))
    if planned is not None:
        planned.attention(stack, implementation)
    run = model
    if m.liger:
        fn = liger_function(model)  # Unavailable before anything is patched
        stack.enter_context(_modeling_namespace_restored(model))
        kwargs = {"model": model}
        if m.tempo:  # only what tempo does not patch: RoPE and the gated MLP
            params = inspect.signature(fn).parameters
            kwargs.update(
                {k: False for k in ("rms_norm", "layer_norm", "cross_entropy", "fused_linear_cross_entropy") if k in params}
            )
        fn(**kwargs)
    if m.head == "torch-lce":
        optimize(model, techniques="lm_head")
        set_head_loss(model, torch_chunked_lce)
    decided = None
    if m.tempo:
        if attention is not None:
            pass
        elif m.base == "tempo-sdpa":
            attention = sdpa_attention(config, kind, implementation)
        elif planned is not None:
            attention = planned_attention(config, kind)
            attention = "keep" if attention in ("eager", implementation) else attention
        else:
            attention = "auto"
        optimize(model, attention=attention, mlp_recompute=m.recompute)
        from .hf.attention import ATTENTION

        now = config._attn_implementation
        decided = next((k for k, v in ATTENTION.items() if v == now and v is not None), "keep")
    if "_tempo_undo" in model.__dict__:
        stack.callback(lambda: restore(model) if "_tempo_undo" in model.__dict__ else None)
    if m.head == "trl":
        _trl_head(model, stack, planned)
    host = None
    if m.checkpoint == "device":
        enable_checkpointing(model)
        stack.callback(_disable_checkpointing, model)
    elif m.checkpoint == "host":
        if planned is not None:
            host = planned.host_hooks(model.parameters())
            enable_checkpointing(model, functools.partial(_checkpoint_inside, lambda: host))
        elif hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, offload=True)
        else:
            raise Unavailable("this transformers has no activation_checkpointing_enable(offload=True) (5.2x and later)")
        stack.callback(_disable_checkpointing, model)
    if m.offload:
        if planned is not None:
            host = planned.host_hooks(model.parameters(), stash=5)  # TRL's OffloadActivations' stash
            _wrap_forward(model, stack, lambda: host)
        else:
            _wrap_forward(model, stack, _offloader(model))
    if m.compile:
        key = m.name
        if compiled is not None and key in compiled:
            run = compiled[key]
        else:
            if m.memory_budget is not None:
                stack.enter_context(torch._functorch.config.patch(activation_memory_budget=m.memory_budget))
            if compiled is None:
                stack.callback(torch._dynamo.reset)
            run = torch.compile(model, backend=compile_backend)
            if compiled is not None:
                compiled[key] = run
    return Applied(m, model, run, notes, host, decided)


def _checkpoint_inside(hooks, function, *args, **kwargs):
    """transformers' checkpoint with offload=True, its save_on_cpu replaced by `hooks()`."""
    from torch.utils.checkpoint import checkpoint

    with hooks():
        return checkpoint(function, *args, use_reentrant=False, **kwargs)


def _offloader(model):
    """What `offload` runs the forward under on a GPU: TRL's OffloadActivations (side stream,
    pinned memory) where TRL is installed, else torch's save_on_cpu(pin_memory=True)."""
    try:
        from trl.models.activation_offloading import get_act_offloading_ctx_manager
    except ImportError:
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    ctx = get_act_offloading_ctx_manager(model, warn_if_no_head=False)
    return lambda: ctx


def _trl_head(model, stack, planned):
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


@contextlib.contextmanager
def applied(method, model, **kwargs):
    """`model` under `method` for as long as the block runs (apply's arguments); yields the
    Applied. What Liger patches stays patched in the model's instance."""
    with contextlib.ExitStack() as stack:
        yield apply(method, model, stack, **kwargs)


def install(model, method):
    """Applies `method` to `model` for good (tempo.optimize(model, method=...)): what it changes
    is undone by tempo.restore(model). Returns the Applied."""
    from .hf._report import Report

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


__all__ = [
    "Method",
    "Unavailable",
    "parse",
    "apply",
    "applied",
    "describe",
    "TABLE",
    "BASES",
    "PARTS",
    "RECIPES",
    "enable_checkpointing",
    "attention_of",
    "planned_attention",
    "torch_chunked_lce",
    "liger_function",
]
