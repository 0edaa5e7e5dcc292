#!/usr/bin/env python3
"""TRL's trainers (SFT, DPO, GRPO; with and without LoRA) on a LLaMA-shaped model where the
activations dominate, unpatched against tempo.optimize(trainer) with TRL's head kept ("layers")
and with tempo's head in its place ("all"): the bytes the backbone's training forward leaves held
and the step's peak beyond what the run began with (tempo's counting allocator, exact), and the
bytes TRL's activation offloading would move a step (each way) over the same model. CPU, fp32,
Python's documentation as text, the pretrained MiniLM's tokenizer (tests/python/trl_runs.py).

    python benchmarks/trl_memory.py --hidden 512 --layers 4 --tokens 1024 --json docs/results/trl-cpu.json
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))

import torch  # noqa: E402

import trl_runs as R  # noqa: E402

import tempo  # noqa: E402

MODES = (None, "layers", "all")


def offloaded_bytes(folder, tokens, patched):
    """What TRL's offloading copies out during one training forward of `tokens` tokens (batch 2)."""
    import transformers as T
    from test_trl import _offloader

    model = T.LlamaForCausalLM.from_pretrained(folder).train()
    if patched:
        tempo.optimize(model)
    ids = torch.randint(4, model.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(0))
    off = _offloader()
    off.update_model_params(model)
    with off:
        loss = model(input_ids=ids, labels=ids).loss
    moved = sum(v[0].numel() * v[0].element_size() for v in off.tracker.values() if v[1])
    loss.backward()
    return moved


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024, help="tokens a sequence (SFT packs to it)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--trainers", default=",".join(R.TRAINERS))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    tok = R.tokenizer()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = R.save_base(
            os.path.join(tmp, "base"),
            tok,
            hidden=a.hidden,
            layers=a.layers,
            intermediate=a.hidden * 11 // 4 // 8 * 8,
            heads=a.hidden // 64,
            positions=2 * a.tokens + 64,
        )
        for kind in a.trainers.split(","):
            for lora in (False, True):
                # SFT: 2 sequences packed to `tokens`; DPO: 2 pairs of ~`tokens` tokens; GRPO: 4
                # completions of 32 tokens to prompts of ~`tokens` tokens
                shape = dict(
                    sft=dict(batch=2, chars=a.tokens * 5, max_length=a.tokens, packing=True, rows=8),
                    dpo=dict(batch=2, chars=a.tokens * 5, max_length=a.tokens, rows=4),
                    grpo=dict(batch=4, chars=a.tokens * 4, completion=32, rows=2),
                )[kind]
                for mode in MODES:
                    history, figures, trainer = R.run(
                        kind, folder, tempo_mode=mode, lora=lora, memory=True, steps=a.steps, **shape
                    )
                    del trainer
                    row = dict(
                        trainer=kind,
                        lora=lora,
                        tempo=mode or "none",
                        held_after_backbone=figures.held,
                        step_peak=figures.peak,
                        losses=[h["loss"] for h in history],
                    )
                    rows.append(row)
                    print(
                        "%-5s %-5s %-7s held %12d  peak %13d  losses %s"
                        % (kind, "lora" if lora else "full", row["tempo"], figures.held, figures.peak, row["losses"]),
                        flush=True,
                    )
        moved = {patched: offloaded_bytes(folder, a.tokens, patched) for patched in (False, True)}
        print("TRL activation offloading, bytes a step each way: unpatched %d, tempo %d" % (moved[False], moved[True]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "offloaded": {"unpatched": moved[False], "tempo": moved[True]}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
