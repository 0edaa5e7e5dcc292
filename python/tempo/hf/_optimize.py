"""tempo.optimize(model): apply tempo's layers to a model that is already built (a Hugging
Face BERT, RoBERTa, GPT-2 or LLaMA, or anything made of the same layer types), in place.

Modules are patched in place (their class changes, the object stays), and parameters stay the
same Parameter objects, so optimizers, state dicts (saved before or after), isinstance checks,
hooks and references to the modules are unaffected; modules keep their eps, dropout p,
train/eval mode, dtype and device. What is patched is declared in rules.RULES, one row per
layer type: which modules it matches, which technique it belongs to, and how it is patched.
"""

import sys
import warnings

import torch

from . import lm_head as _lm_head
from . import trl as _trl
from ..nn.gated_mlp import check_recompute
from .attention import (
    ATTENTION,
    AttentionRegistered,
    attention_configs,
    auto_attention,
    register_attention,
    set_attention,
    transformers_models,
    uses_attention_registry,
)
from .patching import is_patched, subclass
from .probes import Differs
from ._report import Report
from .rules import ABSORBS, FUSED_TECHNIQUES, LOOKS_PATCHABLE, OPTIONS, TECHNIQUES, rules_for


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
        warnings.warn(
            "tempo.optimize: transformers %s is older than %d.%d, the oldest release tempo is tested with; "
            "some patches may differ from the unpatched model (pip install 'transformers>=%d.%d')"
            % ((release,) + TESTED_TRANSFORMERS * 2),
            stacklevel=3,
        )


def optimize(
    model: torch.nn.Module,
    techniques="all",
    attention: str = "keep",
    modules=None,
    fused: bool = False,
    mlp_recompute: str = "product",
    method=None,
) -> torch.nn.Module:
    """Patches `model` in place with tempo's layers and returns it.

    method: a whole training method instead of the options below (tempo.methods: a spelling such
    as "tempo+ckpt", a peer's recipe such as "trl", a tempo.methods.Method, or what tempo.plan
    chose: tempo.plan(...).best): its attention, tempo's techniques where its base is tempo's,
    checkpointing, host offloading and its head, applied together, so that what was planned is
    what runs; tempo.restore undoes all of it.

    techniques: "all", or one or a list of "gelu", "silu", "layer_norm", "rms_norm", "dropout",
    "bias_dropout_add_layer_norm" (dense + dropout + residual + LayerNorm in one pass, BERT/RoBERTa's
    output blocks; "bdrln", its former name, is accepted with a DeprecationWarning),
    "gated_mlp" (LLaMA-style gated MLPs by tempo.gated_mlp: gate and up kept, their product recomputed),
    "lm_head" (a causal or masked LM's training loss from the hidden states by tempo.linear_cross_entropy:
    the logits never exist, and `logits` is None in the output of a training call with labels;
    tempo/hf/lm_head.py says which families and what it keeps).
    attention: "keep" (the model's own), "tempo" (output-only softmax, dropout recomputed from
    1-bit masks), "fused" (tempo.fused_attention: no S^2 tensor), "sdpa" (torch's), or "auto"
    (of the model's own, tempo's and sdpa, the one whose training forward keeps the fewest bytes
    for backward, measured on the model at patch time; the model's own on a tie; tempo.report
    gives the bytes); set through transformers' attention-function registry on a transformers model, or
    on each one inside `model` (a user's module around a BertModel, a SentenceTransformer).
    fused: also the Data Movement paper's bias fusions, "qkv_split" and "bias_gelu" (BERT and
    RoBERTa; see FUSED_TECHNIQUES), which may also be named in techniques.
    mlp_recompute: what the gated MLPs' backward recomputes: "product" (act(gate) * up only: no matmul
    recomputed), "up" (also up(x): one of the MLP's three forward GEMMs, for one intermediate-wide
    tensor fewer kept) or "gate_up" (two GEMMs; nothing intermediate-wide kept): for longer sequences
    in the same memory (tempo.gated_mlp; with wrapped projections, LoRA, the product only).
    modules: None (everywhere), a module path or a list of them (a module and everything under it,
    e.g. "bert.encoder.layer.0"), or a callable path -> bool; outside them nothing is patched
    (attention, set model-wide, is not limited by it).
    Layers not recognised are left exactly as they are (tempo.report lists them);
    tempo.restore undoes the patch. A second call patches only what the first did not.
    A TRL trainer (or any Trainer with a `model`) instead of a model: its model and reference
    model patched alike, and TRL's fused log-prob head computed by tempo's (tempo/hf/trl.py).
    """
    if method is not None:
        return _optimize_method(model, method, (techniques, attention, modules, fused, mlp_recompute))
    if _trl.is_trainer(model):
        return _trl.optimize_trainer(
            model,
            optimize,
            techniques=techniques,
            attention=attention,
            modules=modules,
            fused=fused,
            mlp_recompute=mlp_recompute,
        )
    _warn_on_untested_transformers()
    try:  # "all", one technique by name, or a list of them
        chosen = set(TECHNIQUES if techniques == "all" else [techniques] if isinstance(techniques, str) else techniques)
    except TypeError:
        raise TypeError(
            "tempo.optimize: techniques must be 'all', a technique's name or a list of them, got %r" % (techniques,)
        ) from None
    if "bdrln" in chosen:
        warnings.warn(
            'tempo.optimize: technique "bdrln" is now named "bias_dropout_add_layer_norm"',
            DeprecationWarning,
            stacklevel=2,
        )
        chosen = (chosen - {"bdrln"}) | {"bias_dropout_add_layer_norm"}
    if not isinstance(fused, bool):
        raise TypeError("tempo.optimize: fused must be True or False, got %r" % (fused,))
    if fused:
        chosen |= set(FUSED_TECHNIQUES)
    unknown = chosen - set(TECHNIQUES) - set(FUSED_TECHNIQUES)
    if unknown:
        raise ValueError(
            "tempo.optimize: unknown technique(s) %s; known: %s"
            % (sorted(unknown), ", ".join(TECHNIQUES + FUSED_TECHNIQUES))
        )
    check_recompute(mlp_recompute, "tempo.optimize: mlp_recompute")
    if attention != "keep" and attention not in ATTENTION:
        raise ValueError("tempo.optimize: unknown attention %r; known: keep, %s" % (attention, ", ".join(ATTENTION)))
    if not isinstance(model, torch.nn.Module):
        raise TypeError("tempo.optimize: expected a torch.nn.Module, got %s" % type(model).__name__)
    hf_models = transformers_models(model) if attention != "keep" else []
    if attention != "keep" and not hf_models:
        raise ValueError(
            "tempo.optimize: attention=%r needs a transformers model (its attention-function "
            "registry); %s is not one and has none inside it" % (attention, type(model).__name__)
        )
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
            raise TypeError(
                "tempo.optimize: modules must be None, a module path, a list of them or a callable "
                "path -> bool, got %r" % (modules,)
            )
        if not paths:
            raise ValueError("tempo.optimize: modules is empty")
        known = {n for n, _ in model.named_modules()}
        missing = [p for p in paths if p not in known]
        if missing:
            raise ValueError("tempo.optimize: no module named %s in %s" % (missing, type(model).__name__))

        def inside(path):
            return any(path == p or path.startswith(p + ".") for p in paths)

    undo = model.__dict__.setdefault("_tempo_undo", [])
    options = {"mlp_recompute": mlp_recompute}  # each technique's option (rules.OPTIONS)
    rows = []
    for path, hf in hf_models:
        if not uses_attention_registry(hf):
            why = (
                "kept: %s computes its attention itself, not through transformers' attention-function registry, "
                "so attention=%r cannot apply" % (type(hf).__name__, attention)
            )
            warnings.warn("tempo.optimize: " + why[len("kept: ") :], stacklevel=2)
            rows.append((path, type(hf).__name__, "attention", why))
            continue
        register_attention()
        before = attention_configs(hf)
        implementation, decided = ATTENTION[attention], ""
        if attention == "auto":
            implementation, decided = auto_attention(hf)
            decided = " (auto: %s)" % decided
            if implementation == hf.config._attn_implementation:
                rows.append((path, type(hf).__name__, "attention", "kept: %s%s" % (implementation, decided)))
                continue
        if not set_attention(hf, implementation):
            why = "kept: transformers did not let %s set its attention to %r" % (type(hf).__name__, implementation)
            warnings.warn("tempo.optimize: " + why[len("kept: ") :], stacklevel=2)
            rows.append((path, type(hf).__name__, "attention", why))
            continue
        undo.append(("attention", hf, before))
        hf.__dict__["_tempo_attention_marker"] = AttentionRegistered()
        rows.append((path, type(hf).__name__, "attention", "patched: %s%s" % (implementation, decided)))
    done = set()
    if "lm_head" in chosen:
        for path, m in model.named_modules():
            lm = None if is_patched(m) else _lm_head.kind(m)
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
            subclass(m, "Tempo", _lm_head.causal_lm_forward if lm == "causal" else _lm_head.masked_lm_forward)
            subclass(head, "Tempo", _lm_head._head_forward)
            done.add(id(head))
            rows.append(
                (
                    path or "(model)",
                    type(m)._tempo_patch[0].__name__,
                    "lm_head",
                    "patched: training loss by tempo.linear_cross_entropy (logits None when labels are given "
                    "in training)",
                )
            )

    def visit(parent, prefix):
        for name, child in list(parent.named_children()):
            path = prefix + name
            if id(child) in done:
                continue
            ours = is_patched(child)
            rules = [] if ours else rules_for(child, chosen)
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
                    except Differs as e:
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
                status = "patched"
                if rule[0] in OPTIONS:  # the technique's option, on the module its forward reads it from
                    option, default, word = OPTIONS[rule[0]]
                    if options[option] != default:
                        child.__dict__["_tempo_" + option] = options[option]
                        status = "patched (%s: %s)" % (word, options[option])
                rows.append((path, original_class.__name__, rule[0], status))
                absorbed, walk_under = ABSORBS.get(rule[0], ((), True))
                done.update(id(getattr(child, n)) for n in absorbed if hasattr(child, n))
                if not walk_under:
                    continue
            elif not ours:
                lname = type(child).__name__.lower()
                other = rules_for(child, set(TECHNIQUES))
                if other:
                    rows.append((path, type(child).__name__, other[0][0], "skipped: technique not chosen"))
                elif (
                    "attention" in lname
                    and not any("attention" in type(c).__name__.lower() for c in child.children())
                    and attention == "keep"
                ):
                    rows.append((path, type(child).__name__, "attention", "kept: attention='keep'"))
                elif any(k in lname for k in LOOKS_PATCHABLE) and not list(child.children()):
                    rows.append((path, type(child).__name__, "-", "skipped: not understood, left as it is"))
            visit(getattr(parent, name), path + ".")

    visit(model, "")
    model.__dict__["_tempo_report"] = Report(model.__dict__.get("_tempo_report", Report([])).rows + rows)
    # what tempo.optimize(trainer) patches a reference model with (a callable `modules` is not kept:
    # the model must pickle)
    model.__dict__.setdefault(
        "_tempo_options",
        dict(
            techniques=techniques,
            attention=attention,
            modules=None if callable(modules) else modules,
            fused=fused,
            mlp_recompute=mlp_recompute,
        ),
    )
    if not any(r[3].startswith("patched") for r in rows) and not undo:
        model.__dict__.pop("_tempo_undo", None)  # the model is as it was: not "patched"
        model.__dict__.pop("_tempo_report", None)
        model.__dict__.pop("_tempo_options", None)
        raise ValueError(
            "tempo.optimize: nothing to patch in %s (no layer of a known type for techniques %s)"
            % (type(model).__name__, sorted(chosen))
        )
    return model


def _optimize_method(model, method, options):
    """tempo.optimize(model_or_trainer, method=...)."""
    from .. import methods

    if options != ("all", "keep", None, False, "product"):
        raise ValueError(
            "tempo.optimize: method= sets the attention, the techniques and mlp_recompute itself; give either a "
            "method or those options"
        )
    try:
        m = methods.parse(method)
    except ValueError as e:
        raise ValueError(str(e).replace("tempo.methods:", "tempo.optimize:")) from None
    target = model.model if _trl.is_trainer(model) else model
    if not isinstance(target, torch.nn.Module) or not hasattr(target, "set_attn_implementation"):
        raise TypeError(
            "tempo.optimize: method= applies to a transformers model (or a trainer holding one), got %s"
            % type(target).__name__
        )
    if "_tempo_method" in target.__dict__ or "_tempo_undo" in target.__dict__:
        raise ValueError("tempo.optimize: %s is already patched; tempo.restore it first" % type(target).__name__)
    try:
        methods.install(target, m)
    except methods.Unavailable as e:
        raise ValueError("tempo.optimize: %s cannot run here: %s" % (m.name, e)) from None
    if _trl.is_trainer(model) and m.tempo:  # the reference model and TRL's head, as tempo.optimize(trainer) does
        _trl.optimize_trainer(model, optimize)
    return model


def report(model: torch.nn.Module) -> Report:
    """What tempo.optimize patched in `model` (a trainer: in its model), module by module, and
    what it left and why."""
    if _trl.is_trainer(model):
        model = model.model
    rep = model.__dict__.get("_tempo_report")
    if rep is None:
        raise ValueError("tempo.report: %s has not been through tempo.optimize" % type(model).__name__)
    return rep


def restore(model: torch.nn.Module) -> torch.nn.Module:
    """Undoes tempo.optimize exactly: the original modules and classes come back (the
    Parameters were never replaced); a trainer's models and TRL's head alike."""
    if _trl.is_trainer(model):
        return _trl.restore_trainer(model, restore)
    from .. import methods

    if methods.uninstall(model):  # tempo.optimize(model, method=...): everything the method did
        return model
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
            module.__dict__.pop("_tempo_mlp_recompute", None)
    model.__dict__.pop("_tempo_report", None)
    model.__dict__.pop("_tempo_options", None)
    return model
