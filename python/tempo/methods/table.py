"""The method table and its parser (tempo.methods' docstring gives the spelling)."""

import dataclasses
import re


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
    Entry(
        "tiles",
        "part",
        "each checkpointed layer run and recomputed in tiles of query rows, its keys and values whole "
        "(with ckpt or ckpt-offload)",
        group="tiles",
    ),
    Entry(
        "tiled-mlp",
        "part",
        "the peers' tiled MLP (ALST's: DeepSpeed's TiledMLP, re-implemented): each layer's MLP run in "
        "ceil(seq / hidden) sequence shards, only its input kept, recomputed shard by shard in the backward",
        group="mlp",
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
    def tiles(self):
        return "tiles" in self.parts

    @property
    def tiled_mlp(self):
        return "tiled-mlp" in self.parts

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
    "tiles": "tiling",
    "mlp": "MLP's tiling",
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
    elif m.tiles and m.checkpoint is None:
        why = "tiles tile the checkpointed layers' recomputation; add ckpt or ckpt-offload"
    elif m.tiled_mlp and (m.tempo or m.tiles):
        why = (
            "tiled-mlp is the peers' tiled MLP (ALST's); tempo's gated MLP runs in row blocks itself and its tiles "
            "(+tiles) hold one tile's MLP at a time"
        )
    elif m.tiles and m.recompute != "product":
        why = (
            "tiles hold the gated MLPs' intermediates one tile at a time already; recompute-%s would only add "
            "GEMMs" % m.recompute
        )
    elif m.tiles and (m.compile or m.liger):
        why = "tiles run the layer through tempo's tile attention, which %s does not" % (
            "torch.compile's graph" if m.compile else "Liger's patch"
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
