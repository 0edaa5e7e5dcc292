#!/usr/bin/env python3
"""Trains tempo.slim's PerformerLM twice from the same weights on the same batches, once with
SLiM's chunked backward (chunk C) and once with full backpropagation, and prints the two loss
curves side by side. Tasks:
  copy  the copying task (0 w 0 w over a few symbols; the loss on the second w), the SLiM
        paper's first experiment;
  text  a byte-level language model on real English prose: by default the reStructuredText
        sources of Python's documentation (Debian's python3-doc, PSF licence; `make setup`
        installs it), or any file or directory given with --data. The last 5% of the bytes
        are held out; the eval loss is in bits per byte.

    .venv/bin/python examples/python/slim_train.py --task copy [--seq 512] [--chunk 64] [--steps 600]
    .venv/bin/python examples/python/slim_train.py --task text [--data DIR] [--seq 1024] [--chunk 128]

--checkpoint FILE saves both models, both optimisers and the batch generator every --save-every
steps (atomically: a temporary file, then a rename) and, when FILE exists, resumes from it, so a
long run can be stopped and continued with the same command; the resumed run sees the same
batches as one never stopped.

--decay-after N keeps the learning rate at --lr up to step N and then lowers it linearly to
--lr-min at --steps (both models get the same schedule), so a run that has plateaued at a
constant rate can be continued with a decay.
"""

import argparse
import copy
import math
import os
import sys
import time

import torch

import tempo.slim as slim

DEFAULT_TEXT = "/usr/share/doc/python3/html/_sources"


def copy_batch(n, seq, symbols, gen):
    half = seq // 2
    w = torch.randint(1, symbols + 1, (n, half - 1), generator=gen)
    zero = torch.zeros(n, 1, dtype=torch.long)
    tokens = torch.cat([zero, w, zero, w], dim=1)  # length 2 * half
    weight = torch.zeros(n, tokens.shape[1] - 1)
    weight[:, half:] = 1  # predict the second w
    return tokens, weight


def read_corpus(path):
    """All bytes of a file, or of the files under a directory in sorted order."""
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
    else:
        raise SystemExit(
            "slim_train: no such file or directory: %s%s"
            % (path, " (install Debian's python3-doc, or give --data)" if path == DEFAULT_TEXT else "")
        )
    data = b"".join(open(f, "rb").read() for f in files)
    if not data:
        raise SystemExit("slim_train: %s holds no text" % path)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def text_batch(data, n, seq, gen):
    starts = torch.randint(0, data.numel() - seq - 1, (n,), generator=gen)
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()]), None


@torch.no_grad()
def eval_copy(model, seq, symbols, batches=4, n=16):
    """Second-half loss and the share of second-half symbols predicted right (argmax), over
    `batches` fixed batches the training never sees (their own generator)."""
    gen = torch.Generator().manual_seed(12345)
    total, right, count = 0.0, 0, 0
    for _ in range(batches):
        tokens, weight = copy_batch(n, seq, symbols, gen)
        logits, _ = model.forward_chunk(tokens[:, :-1])
        keep = weight.bool()
        ce = torch.nn.functional.cross_entropy(logits[keep].float(), tokens[:, 1:][keep], reduction="sum")
        total += ce.item()
        right += int((logits[keep].argmax(-1) == tokens[:, 1:][keep]).sum())
        count += int(keep.sum())
    return total / count, right / count


@torch.no_grad()
def eval_bits_per_byte(model, data, seq, windows=8):
    """Mean next-byte cross-entropy (bits) over `windows` evenly spaced held-out windows."""
    step = max((data.numel() - seq - 1) // windows, 1)
    tokens = torch.stack([data[i * step : i * step + seq + 1] for i in range(windows)])
    logits, _ = model.forward_chunk(tokens[:, :-1])
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    return ce.item() / math.log(2)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=("copy", "text"), default="copy")
    p.add_argument("--data", default=DEFAULT_TEXT, help="text: a file or a directory of text files")
    p.add_argument("--seq", type=int, default=None, help="default: 512 (copy), 1024 (text)")
    p.add_argument("--chunk", type=int, default=None, help="default: 64 (copy), 128 (text)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--layers", type=int, default=None, help="default: the copy preset's (1) for copy, 2 for text")
    p.add_argument("--symbols", type=int, default=10, help="copy: alphabet size")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--decay-after",
        type=int,
        default=None,
        help="constant --lr up to this step, then linear decay to --lr-min at --steps",
    )
    p.add_argument("--lr-min", type=float, default=None, help="default: --lr / 20")
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--checkpoint", default=None, help="save here every --save-every steps; resume if it exists")
    p.add_argument("--save-every", type=int, default=100)
    a = p.parse_args()
    seq = a.seq or (512 if a.task == "copy" else 1024)
    chunk = a.chunk or (64 if a.task == "copy" else 128)
    layers = a.layers or (1 if a.task == "copy" else 2)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    chunked = slim.PerformerLM.preset("copy", max_len=seq, layers=layers)
    full = copy.deepcopy(chunked)
    opts = [torch.optim.Adam(m.parameters(), lr=a.lr) for m in (chunked, full)]
    gen = torch.Generator().manual_seed(1)
    if a.task == "text":
        data = read_corpus(a.data)
        cut = int(data.numel() * 0.95)
        train, held_out = data[:cut], data[cut:]
        if held_out.numel() < seq + 2:
            sys.exit("slim_train: the corpus (%d bytes) is too small for --seq %d" % (data.numel(), seq))
        print(
            "byte-level LM on %s (%.1f MB; last 5%% held out), L = %d, %d layers, batch %d: SLiM chunk %d vs full "
            "backprop" % (a.data, data.numel() / 1e6, seq, layers, a.batch, chunk)
        )
        make = lambda: text_batch(train, a.batch, seq, gen)
    else:
        print(
            "copying task, L = %d, %d symbols, %d layer(s), batch %d: second-half loss, SLiM chunk %d vs full "
            "backprop" % (seq, a.symbols, layers, a.batch, chunk)
        )
        make = lambda: copy_batch(a.batch, seq, a.symbols, gen)
    head = "%6s %12s %12s %10s" % ("step", "chunk %d" % chunk, "full", "rel diff")
    if a.task == "text":
        head += " %16s %16s" % ("eval bpb chunk", "eval bpb full")
    print(head + " %8s" % "s/step")
    first = 1
    if a.checkpoint and os.path.exists(a.checkpoint):
        state = torch.load(a.checkpoint, weights_only=False)
        if state["args"] != key_args(a):
            sys.exit("slim_train: %s was written by a run with other settings: %s" % (a.checkpoint, state["args"]))
        for m, s in zip((chunked, full), state["models"]):
            m.load_state_dict(s)
        for o, s in zip(opts, state["opts"]):
            o.load_state_dict(s)
        gen.set_state(state["gen"])
        first = state["step"] + 1
        print("resumed from %s after step %d" % (a.checkpoint, state["step"]))
    t0 = time.perf_counter()
    for step in range(first, a.steps + 1):
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = learning_rate(a, step)
        tokens, weight = make()
        losses = []
        for m, opt, c in ((chunked, opts[0], chunk), (full, opts[1], None)):
            opt.zero_grad(set_to_none=True)
            if c is None:
                losses.append(float(slim.full_loss_and_backward(m, tokens, weight)))
            else:
                losses.append(float(slim.loss_and_backward(m, tokens, c, weight)))
            opt.step()
        if step % a.every == 0 or step == 1 or step == a.steps:
            line = "%6d %12.4f %12.4f %9.2e" % (step, losses[0], losses[1], abs(losses[0] - losses[1]) / losses[1])
            if a.task == "text":
                line += " %16.4f %16.4f" % (
                    eval_bits_per_byte(chunked, held_out, seq),
                    eval_bits_per_byte(full, held_out, seq),
                )
            print(line + " %8.2f" % ((time.perf_counter() - t0) / (step - first + 1)), flush=True)
        if a.checkpoint and (step % a.save_every == 0 or step == a.steps):
            tmp = a.checkpoint + ".tmp"
            torch.save(
                {
                    "args": key_args(a),
                    "step": step,
                    "gen": gen.get_state(),
                    "models": [chunked.state_dict(), full.state_dict()],
                    "opts": [o.state_dict() for o in opts],
                },
                tmp,
            )
            os.replace(tmp, a.checkpoint)
    if a.task == "copy":
        (lc, ac), (lf, af) = (eval_copy(m, seq, a.symbols) for m in (chunked, full))
        print(
            "held-out copy batches (4 x 16): second-half loss %.4f (chunk %d) vs %.4f (full), symbols right "
            "%.2f%% vs %.2f%%" % (lc, chunk, lf, 100 * ac, 100 * af)
        )


def learning_rate(a, step):
    """--lr, or after --decay-after a linear decay to --lr-min at the last step."""
    if a.decay_after is None or step <= a.decay_after or a.steps <= a.decay_after:
        return a.lr
    low = a.lr / 20 if a.lr_min is None else a.lr_min
    return a.lr + (low - a.lr) * (step - a.decay_after) / (a.steps - a.decay_after)


def key_args(a):
    """The settings a resumed run must share with the run that wrote the checkpoint."""
    return {k: getattr(a, k) for k in ("task", "data", "seq", "chunk", "batch", "layers", "symbols", "lr")}


if __name__ == "__main__":
    main()
