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

from .apply import Applied, applied, apply, install, uninstall
from .parts import (
    attention_of,
    enable_checkpointing,
    liger_function,
    planned_attention,
    sdpa_attention,
    torch_chunked_lce,
)
from .table import BASES, PARTS, RECIPES, TABLE, Entry, Method, Unavailable, describe, parse

__all__ = [
    "Method",
    "Entry",
    "Unavailable",
    "Applied",
    "parse",
    "apply",
    "applied",
    "install",
    "uninstall",
    "describe",
    "TABLE",
    "BASES",
    "PARTS",
    "RECIPES",
    "enable_checkpointing",
    "attention_of",
    "sdpa_attention",
    "planned_attention",
    "torch_chunked_lce",
    "liger_function",
]
