"""The runner tempo's applications share (python -m tempo.bench, python -m tempo.frontier):
the model presets (random weights from a config, or a local folder), synthetic batches, the
peers' pieces (Liger-Kernel's patch, activation checkpointing) and one measured training step."""

import contextlib
import math
import os
import sys
import time

import torch

from .. import memory
from .._measure import free, sync
from ..methods import Unavailable, enable_checkpointing, liger_function  # noqa: F401  (the apps import them from here)

SIZES = {  # (hidden, layers, heads, intermediate, positions, vocab): the C++ presets' sizes
    "bert": {"base": (768, 12, 12, 3072, 512, 30522), "large": (1024, 24, 16, 4096, 512, 30522)},
    "roberta": {"base": (768, 12, 12, 3072, 514, 50265), "large": (1024, 24, 16, 4096, 514, 50265)},
    "gpt2": {
        "base": (768, 12, 12, 3072, 1024, 50257),
        "medium": (1024, 24, 16, 4096, 1024, 50257),
        "large": (1280, 36, 20, 5120, 1024, 50257),
    },
    "llama": {
        "small": (512, 8, 8, 1376, 2048, 32000),
        "tiny": (256, 2, 4, 688, 4096, 32000),
        "1b": (2048, 16, 32, 8192, 8192, 128256),
    },
    "qwen2": {"tiny": (256, 2, 4, 688, 4096, 151936), "0.5b": (896, 24, 14, 4864, 32768, 151936)},
    "gemma": {"tiny": (256, 2, 4, 688, 4096, 256000)},
}
# The published shapes' key-value heads and tied embeddings (Llama-3.2-1B, Qwen2.5-0.5B); the
# tiny presets have half the heads as KV heads, the others as many as heads; the configs'
# default tying otherwise
KV_HEADS = {("llama", "1b"): 8, ("qwen2", "0.5b"): 2}
TIED = {("llama", "1b"), ("qwen2", "0.5b")}
CAUSAL = ("gpt2", "llama", "qwen2", "gemma")
# LLaMA-style families: config class, model class
LLAMA_STYLE = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
}


def build_model(family, size="base", path=None, vocab=None):
    """A Hugging Face LM (masked for bert/roberta, causal for gpt2 and the LLaMA-style ones) in
    train mode: from `path` (a local folder, offline) or from the preset sizes with random
    weights (vocab: the vocabulary, instead of the preset's)."""
    import transformers as tf

    if path is not None:
        from transformers.models.auto import modeling_auto

        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
        # the head transformers has for it: masked LM where there is one (BERT, RoBERTa, ...), else causal
        causal = config.model_type not in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
        if causal and config.model_type not in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ValueError(
                "tempo.bench: %s holds a %s model, for which transformers has neither a masked-LM nor a "
                "causal-LM class; tempo.bench trains those" % (path, config.model_type)
            )
        cls = tf.AutoModelForCausalLM if causal else tf.AutoModelForMaskedLM
        model = cls.from_pretrained(path, local_files_only=True, attn_implementation="eager")
        return model.train(), os.path.basename(os.path.normpath(path)), causal
    if family not in SIZES:
        raise ValueError("tempo.bench: unknown model %r; known: %s, or a folder" % (family, ", ".join(SIZES)))
    if size not in SIZES[family]:
        raise ValueError("tempo.bench: %s has sizes %s, not %r" % (family, ", ".join(SIZES[family]), size))
    h, n, a, i, p, v = SIZES[family][size]
    v = vocab or v
    if family in ("bert", "roberta"):
        cls = tf.BertConfig if family == "bert" else tf.RobertaConfig
        extra = {"pad_token_id": 1} if family == "roberta" else {}
        config = cls(
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=a,
            intermediate_size=i,
            max_position_embeddings=p,
            vocab_size=v,
            **extra,
        )
        model = (tf.BertForMaskedLM if family == "bert" else tf.RobertaForMaskedLM)(config)
    elif family == "gpt2":
        config = tf.GPT2Config(n_embd=h, n_layer=n, n_head=a, n_inner=i, n_positions=p, vocab_size=v)
        model = tf.GPT2LMHeadModel(config)
    else:
        config_class, model_class = LLAMA_STYLE[family]
        kv = {"num_key_value_heads": KV_HEADS.get((family, size), max(1, a // 2) if size == "tiny" else a)}
        if family == "gemma":
            kv["head_dim"] = h // a
        if (family, size) in TIED:
            kv["tie_word_embeddings"] = True
        config = getattr(tf, config_class)(
            hidden_size=h,
            num_hidden_layers=n,
            num_attention_heads=a,
            intermediate_size=i,
            max_position_embeddings=p,
            vocab_size=v,
            rms_norm_eps=1e-6,
            **kv,
        )
        model = getattr(tf, model_class)(config)
    model.set_attn_implementation("eager")
    name = "%s-%s" % (family, size) + ("-v%d" % v if vocab else "")
    return model.train(), name, family in CAUSAL


def synthetic_batch(model, batch, seq, causal, seed, device):
    """Token ids and labels (causal: the ids; masked: 15% of positions, the rest -100)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(4, vocab, (batch, seq), generator=g)
    if causal:
        labels = ids.clone()
    else:
        labels = torch.where(torch.rand(batch, seq, generator=g) < 0.15, ids, torch.full_like(ids, -100))
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def train_step(run, opt, batch, device, autocast=contextlib.nullcontext):
    """One full step (forward under `autocast()`, backward, the optimizer's step) with its
    memory and time: activation bytes held after the forward and the peaks beyond what was
    held before the step (forward + backward; the optimizer step), the absolute peak,
    milliseconds and the loss."""
    opt.zero_grad(set_to_none=True)
    free(device)
    sync(device)
    base = memory.stats(device)[0]
    memory.reset_peak(device)
    t0 = time.perf_counter()
    with autocast():
        loss = run(**batch).loss
    sync(device)
    activation = memory.stats(device)[0] - base
    loss.backward()
    sync(device)
    train_abs = memory.stats(device)[1]
    memory.reset_peak(device)
    opt.step()
    sync(device)
    ms = (time.perf_counter() - t0) * 1e3
    opt_abs = memory.stats(device)[1]
    value = loss.detach().float().item()
    if not math.isfinite(value):
        raise RuntimeError("tempo: the loss is not finite (%r)" % value)
    return {
        "activation_bytes": activation,
        "train_peak_bytes": train_abs - base,
        "optimizer_peak_bytes": opt_abs - base,
        "peak_bytes": max(train_abs, opt_abs),
        "step_ms": ms,
        "loss": value,
    }


def chosen(parser, text, known, what, deprecated=None):
    """The comma-separated names in `text`, each one of `known` (names, or a predicate that takes
    a name); else the parser's usage error naming them (what: "method"). A name of `deprecated`
    (earlier spelling -> now) is taken as its new spelling, with a warning on stderr."""
    names = [s for s in text.split(",") if s]
    for i, name in enumerate(names):
        if name in (deprecated or {}):
            print(
                "%s: the %s %r is deprecated; it is spelled %r" % (parser.prog, what, name, deprecated[name]),
                file=sys.stderr,
            )
            names[i] = deprecated[name]
    accepts = known if callable(known) else (lambda s: s in known)
    bad = [s for s in names if not accepts(s)]
    if bad or not names:
        listed = "tempo.methods' spellings, e.g. sdpa, trl, tempo+ckpt" if callable(known) else ", ".join(known)
        parser.error("unknown %s %s; known: %s" % (what, bad, listed))
    return names


def dropout_mask_bytes(model, batch):
    """Bytes of dropout masks the eager model keeps for backward, by saved-tensor hooks: float
    tensors whose values are all 0 or 1/(1-p) for a dropout p of the model (PyTorch's CPU
    dropout keeps such a 4-byte mask; its CUDA dropout a 1-byte one)."""
    scales = {1.0 / (1.0 - m.p) for m in model.modules() if isinstance(m, torch.nn.Dropout) and 0 < m.p < 1}
    attn_p = getattr(model.config, "attention_probs_dropout_prob", None) or getattr(model.config, "attn_pdrop", None)
    if attn_p and 0 < attn_p < 1:
        scales.add(1.0 / (1.0 - attn_p))
    seen, alive, total = set(), [], 0

    def pack(t):
        nonlocal total
        alive.append(t.detach())  # held until the count is done, so that no address is reused
        if t.is_floating_point() and t.numel() > 0 and t.data_ptr() not in seen:
            for s in scales:
                if bool(((t == 0) | (t == s)).all()) and bool((t == s).any()):
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
                    break
        # The graph keeps nothing (this forward has no backward). Returning t, or holding t
        # rather than a detached alias, ties each saved output to its own graph in a cycle
        # through C++ that the collector cannot free: 27 MB left behind per call on a 2-layer
        # BERT at seq 512.

    def unpack(_):
        raise RuntimeError("tempo.bench: the mask-counting forward has no backward")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        model(**batch).loss
    return total
