#!/usr/bin/env python3
"""Trains tempo.slim's PerformerLM on the copying task (0 w 0 w, loss on the second w) twice
from the same weights and batches: with SLiM's chunked backward (chunk C) and with full
backpropagation, and prints the two loss curves side by side.

    .venv/bin/python examples/python/slim_copy.py [--seq 128] [--chunk 16] [--steps 600] [--batch 16]
"""
import argparse
import copy

import torch

import tempo.slim as slim


def batch(n, seq, symbols, gen):
    half = seq // 2
    w = torch.randint(1, symbols + 1, (n, half - 1), generator=gen)
    zero = torch.zeros(n, 1, dtype=torch.long)
    tokens = torch.cat([zero, w, zero, w], dim=1)  # length 2 * half
    weight = torch.zeros(n, tokens.shape[1] - 1)
    weight[:, half:] = 1  # predict the second w
    return tokens, weight


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--symbols", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--every", type=int, default=50)
    a = p.parse_args()
    torch.manual_seed(0)
    chunked = slim.PerformerLM.preset("copy", max_len=a.seq)
    full = copy.deepcopy(chunked)
    opts = [torch.optim.Adam(m.parameters(), lr=a.lr) for m in (chunked, full)]
    gen = torch.Generator().manual_seed(1)
    print("copying task, L = %d, %d symbols: second-half loss, SLiM chunk %d vs full backprop" % (a.seq, a.symbols, a.chunk))
    print("%6s %12s %12s %10s" % ("step", "chunk %d" % a.chunk, "full", "rel diff"))
    for step in range(1, a.steps + 1):
        tokens, weight = batch(a.batch, a.seq, a.symbols, gen)
        losses = []
        for m, opt, c in ((chunked, opts[0], a.chunk), (full, opts[1], None)):
            opt.zero_grad(set_to_none=True)
            if c is None:
                losses.append(float(slim.full_loss_and_backward(m, tokens, weight)))
            else:
                losses.append(float(slim.loss_and_backward(m, tokens, c, weight)))
            opt.step()
        if step % a.every == 0 or step == 1:
            print("%6d %12.4f %12.4f %9.2e" % (step, losses[0], losses[1], abs(losses[0] - losses[1]) / losses[1]),
                  flush=True)


if __name__ == "__main__":
    main()
