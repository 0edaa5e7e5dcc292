"""python -m tempo.frontier: the memory-vs-throughput frontier of a Hugging Face model. For each
memory budget, each training method's largest batch under it and its tokens/s at that batch:
the choice a user who runs out of memory actually makes, Tempo beside what they would pick
instead.

Methods (each on a fresh model from the same seed, one after the other in this process):

  eager              transformers' eager attention
  sdpa               torch's scaled_dot_product_attention (transformers' default)
  sdpa+ckpt          sdpa with activation checkpointing of every layer (use_reentrant=False)
  sdpa+ckpt+offload  the same with what checkpointing saves moved to pinned host memory
                     (torch.autograd.graph.save_on_cpu; CUDA only), long-context trainers' tool
  compile            sdpa under torch.compile (the min-cut partitioner at its default budget)
  compile-mem0.5     the same with torch._functorch.config.activation_memory_budget = 0.5
  compile-mem0.2     ... = 0.2 (the partitioner recomputes more to keep less)
  <peer>+torch-lce   each of the above with PyTorch's own chunked F.linear_cross_entropy
                     (LinearCrossEntropyOptions()) as its LM head and loss: no peer forms logits
  liger              sdpa with Liger-Kernel's patch of the family (RMSNorm, SwiGLU/GEGLU, RoPE,
                     fused linear cross entropy), where Liger has one
  tempo-sdpa         tempo.optimize(attention="sdpa"): every technique, the LM head's included
  tempo              tempo.optimize(attention="auto"): the attention that keeps the fewest bytes
  tempo+compile      tempo-sdpa under torch.compile; -mem0.5 / -mem0.2 with those budgets
  tempo+ckpt         tempo-sdpa with activation checkpointing of every layer
  tempo+recompute-up tempo-sdpa with tempo.optimize(mlp_recompute="up"): gated MLPs recompute up(x);
                     tempo+recompute-gate_up: gate(x) and up(x), nothing intermediate-wide kept
  tempo+liger        Liger's RoPE and SwiGLU/GEGLU with tempo's norms, LM head and attention="auto"
                     (the two never patch the same module)
  tempo-auto         Auto-Tempo (tempo.auto, method "fast") decides under each budget

--axis batch (the default): each method's largest batch at --seq; --axis seq: at batch 1, each
method's longest sequence (a multiple of --seq-step, at most --max-seq and, for a model that learns
its position embeddings, their number).

A step is forward, backward and AdamW (fused where torch has it). Precision: autocast-bf16
(fp32 master weights, bf16 autocast), bf16 (the weights and AdamW's state in bf16) or fp32;
on CUDA TF32 matmuls are on in every mode. The budget covers everything the process
allocates, weights, gradients and optimizer state included: on CUDA the caching allocator's
per-process fraction, on CPU tempo's counting allocator (an allocation past it raises
torch.OutOfMemoryError, as on a GPU). Each largest batch ran a full step under the budget next
to one that did not; its throughput is the median of --steps timed steps after a warm-up
step, with the spread (slowest / fastest - 1).

Output: one JSON line per (model, method, budget), written and flushed as soon as it is
measured (a run cut off by a time limit keeps the rows done), a table, CSV, an SVG plot of
tokens/s against budget (one line per method), and per budget a summary line: tempo's best
against the best peer. A method that fails on a model is a row with its error, not a crash.
"""

import argparse
import contextlib
import csv
import itertools
import json
import os
import statistics
import sys
import time

import torch

from .. import memory
from .._measure import check_outputs, fits, free, heap_frozen, largest_batch
from ..hf import restore
from .frontier_report import print_table, summary, write_svg
from .runner import (
    SIZES,
    Unavailable,
    build_model,
    chosen,
    synthetic_batch,
    train_step,
)

from .frontier_methods import (  # noqa: F401  (the names tempo.frontier has always had)
    PEERS,
    TORCH_LCE,
    METHODS,
    PRECISIONS,
    FIELDS,
    known,
    learned_positions,
    method_applied,
    _optimizer,
    budgets_of,
)


class Run:
    """One frontier run: the settings, the rows so far and where they are written."""

    def __init__(self, args, device):
        self.args, self.device = args, device
        self.rows, self.losses = [], {}
        self.started = time.perf_counter()
        self.jsonl = open(args.jsonl, "a") if args.jsonl else None
        dtype = torch.bfloat16
        if args.precision == "autocast-bf16":
            self.autocast = lambda: torch.autocast(device.type, dtype=dtype)
        else:
            self.autocast = contextlib.nullcontext
        self.param_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    def out_of_time(self):
        return self.args.time_limit is not None and time.perf_counter() - self.started > self.args.time_limit

    def emit(self, row):
        self.rows.append(row)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
        say(row)

    def base_row(self, name, method, budget):
        label, nbytes = budget
        return {
            "model": name,
            "axis": self.args.axis,
            "seq": self.args.seq,
            "precision": self.args.precision,
            "device": self.device.type,
            "method": method,
            "budget": label,
            "budget_bytes": nbytes,
            "max_batch": None,
            "max_seq": None,
            "tokens_per_s": None,
            "step_ms": None,
            "spread": None,
            "peak_bytes": None,
            "activations_b1": None,
            "loss_mean": None,
            "choice": None,
            "optimizer": None,
            "error": None,
        }

    def method(self, method, budgets):
        """Every budget's row for one method: a fresh model, its loss curve (--loss-steps), the
        activation bytes at batch 1, then the largest batch and its throughput per budget.
        Everything it made is freed before the next method is measured (a patched model is a
        reference cycle: only the collector frees it, after the frames that name it are gone)."""
        self._method(method, budgets)
        free(self.device)

    def _method(self, method, budgets):
        args, device = self.args, self.device
        name = (
            os.path.basename(os.path.normpath(args.model))
            if os.path.isdir(args.model)
            else "%s-%s" % (args.model, args.size) + ("-v%d" % args.vocab if args.vocab else "")
        )
        rows = [self.base_row(name, method, b) for b in budgets]
        if self.out_of_time():
            for r in rows:
                self.emit(dict(r, error="not measured: the time limit (%g s) was reached" % args.time_limit))
            return
        try:
            torch.manual_seed(0)
            # made on the device (a 1B model's random initialisation takes seconds on the host per method)
            with torch.device(device):
                model, _, causal = build_model(
                    args.model, args.size, args.model if os.path.isdir(args.model) else None, args.vocab
                )
            model.to(device=device, dtype=self.param_dtype)
            opt, opt_name = _optimizer(model)
            seeds = itertools.count(1)

            # the longest sequence tried: --max-seq, at most the positions of a model that learns them (rotary
            # models take any length)
            self.seq_cap = min(args.max_seq, learned_positions(model) or args.max_seq) // args.seq_step

            with method_applied(method, model, args.compile_backend) as run:

                def step(n):  # n: the batch (--axis batch), or the sequence in units of --seq-step at batch 1
                    batch, seq = (n, args.seq) if args.axis == "batch" else (1, n * args.seq_step)
                    data = synthetic_batch(model, batch, seq, causal, next(seeds), device)
                    return train_step(run, opt, data, device, self.autocast)

                losses = []
                for i in range(args.loss_steps):  # the same data for every method: seeds from 10^6
                    data = synthetic_batch(model, args.loss_batch, args.seq, causal, 10**6 + i, device)
                    losses.append(train_step(run, opt, data, device, self.autocast)["loss"])
                if losses:
                    self.losses[method] = losses
                step(1)  # warm-up (compiles; creates the optimizer's state), no budget
                b1 = step(1)["activation_bytes"]
                common = {
                    "activations_b1": b1,
                    "optimizer": opt_name,
                    "loss_mean": statistics.fmean(losses[-10:]) if losses else None,
                }
                seen = {}  # batch -> measurements, every step seen to fit (under a smaller budget)
                for row, budget in zip(rows, budgets):
                    row.update(common)
                    if self.out_of_time():
                        self.emit(dict(row, error="not measured: the time limit (%g s) was reached" % args.time_limit))
                        continue
                    if method == "tempo-auto":
                        row["choice"] = self.auto_choice(
                            model,
                            opt,
                            budget[1],
                            make_batch=lambda b: synthetic_batch(model, b, args.seq, causal, next(seeds), device),
                        )
                        seen = {}  # the choice may differ from the last budget's
                    self.measure(row, step, budget[1], seen)
                    self.emit(row)
        except Unavailable as e:
            for r in rows:
                self.emit(dict(r, error="did not run: %s" % e))
        except Exception as e:  # a method that fails on this model is a row, not a crash
            done = {id(r) for r in self.rows}
            for r in rows:
                if id(r) not in done:
                    self.emit(
                        dict(
                            r,
                            error="failed: %s: %s" % (type(e).__name__, str(e).splitlines()[0][:300] if str(e) else ""),
                        )
                    )

    def measure(self, row, step, budget, seen):
        args, device = self.args, self.device

        cap = args.max_batch if args.axis == "batch" else self.seq_cap

        def probe(n):
            if n > cap:
                return None
            m = fits(step, n, device, budget)
            if m is not None:
                seen[n] = m
            return m

        fitted = [(b, seen[b]) for b in (min(seen), max(seen))] if seen else []
        mb, at = largest_batch(probe, budget, fitted)
        if mb is None:
            row.update(max_batch=0, max_seq=0 if args.axis == "seq" else None)
            return
        times = []
        for i in range(args.steps + 1):  # the first: a warm-up (a compiled model may recompile for the shape)
            m = fits(step, mb, device, budget)
            if m is None:
                what = "batch %d" % mb if args.axis == "batch" else "sequence %d" % (mb * args.seq_step)
                row.update(
                    max_batch=mb if args.axis == "batch" else 1,
                    max_seq=None if args.axis == "batch" else mb * args.seq_step,
                    error="%s fitted once, then ran out of memory" % what,
                )
                return
            if i:
                times.append(m["step_ms"])
        ms = statistics.median(times)
        batch, seq = (mb, args.seq) if args.axis == "batch" else (1, mb * args.seq_step)
        row.update(
            max_batch=batch,
            max_seq=seq if args.axis == "seq" else None,
            step_ms=ms,
            tokens_per_s=batch * seq / (ms / 1e3),
            spread=max(times) / min(times) - 1.0,
            peak_bytes=at["peak_bytes"],
        )
        if mb == cap:
            row["error"] = "reached the longest %s tried (%d); more may fit" % (
                "batch" if args.axis == "batch" else "sequence",
                batch if args.axis == "batch" else seq,
            )

    def auto_choice(self, model, opt, budget, make_batch):
        """Auto-Tempo's choice under `budget`: tempo.auto measures forward + backward, so the
        optimizer's state, which exists by now, is left out of what it is given."""
        from .._auto import auto

        if "_tempo_undo" in model.__dict__:
            restore(model)
        state = sum(
            t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        )
        given = budget if self.device.type == "cuda" else budget - state  # on CPU tempo.auto counts from what is held
        with self.autocast():
            report = auto(model, make_batch, budget=max(given, 1), method="fast")
        return report.choice


def say(row):
    if not sys.stderr.isatty():
        return
    what = row["error"] or (
        "batch %s, %s tokens/s" % (row["max_batch"], "%.1f" % row["tokens_per_s"] if row["tokens_per_s"] else "-")
    )
    print("%-15s %-8s %s" % (row["method"], row["budget"], what), file=sys.stderr, flush=True)


def parser():
    p = argparse.ArgumentParser(prog="python -m tempo.frontier", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="llama", help="a tempo.bench preset family (%s) or a local model folder" % ", ".join(SIZES)
    )
    p.add_argument("--size", default=None, help="the family's size (tempo.bench's presets; e.g. llama 1b, qwen2 0.5b)")
    p.add_argument("--vocab", type=int, default=None, help="the vocabulary, instead of the preset's")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument(
        "--budgets",
        default="8GiB,16GiB,32GiB,64GiB,all",
        help="comma-separated sizes (e.g. 8GiB), 'all' for the whole CUDA device",
    )
    p.add_argument(
        "--methods", default=",".join(METHODS), help="comma-separated, run in this order: " + ", ".join(METHODS)
    )
    p.add_argument("--precision", choices=PRECISIONS, default="autocast-bf16")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--steps",
        type=int,
        default=3,
        help="timed steps at each largest batch (median; at least 3 for a spread that means something)",
    )
    p.add_argument(
        "--loss-steps",
        type=int,
        default=0,
        help="before the frontier, train this many steps on the same "
        "data under each method and compare the loss with sdpa's",
    )
    p.add_argument("--loss-batch", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=4096, help="no batch beyond this is tried")
    p.add_argument(
        "--axis",
        choices=("batch", "seq"),
        default="batch",
        help="what grows to fill a budget: the batch at --seq, or the sequence at batch 1",
    )
    p.add_argument("--seq-step", type=int, default=64, help="--axis seq: sequences are multiples of this")
    p.add_argument(
        "--max-seq",
        type=int,
        default=1 << 20,
        help="--axis seq: no sequence beyond this (nor beyond "
        "the learned position embeddings of a BERT or GPT-2) is tried",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile's backend (aot_eager: the same partitioner without code generation)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds: no (method, budget) is started after this; their rows say so",
    )
    p.add_argument("--jsonl", default=None, help="one JSON line per row, written as measured")
    p.add_argument("--csv", default=None)
    p.add_argument("--plot", default=None, help="an .svg file")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    args.methods = chosen(parser(), args.methods, known, "method")
    if args.seq < 2 or args.steps < 1 or args.loss_steps < 0 or args.loss_batch < 1 or args.max_batch < 1:
        parser().error("--seq must be at least 2, --steps, --loss-batch and --max-batch at least 1, --loss-steps >= 0")
    if args.seq_step < 2 or args.max_seq < args.seq_step:
        parser().error("--seq-step must be at least 2 and --max-seq at least --seq-step")
    check_outputs(parser(), args.plot, [("--jsonl", args.jsonl), ("--csv", args.csv)])
    if not os.path.isdir(args.model):
        if args.model not in SIZES:
            parser().error("unknown model %r; known: %s, or a folder" % (args.model, ", ".join(SIZES)))
        args.size = args.size or next(iter(SIZES[args.model]))
        if args.size not in SIZES[args.model]:
            parser().error("%s has sizes %s, not %r" % (args.model, ", ".join(SIZES[args.model]), args.size))
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("tempo.frontier: --device cuda but no CUDA device is available")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    elif device.type == "cpu":
        memory.track()  # before any model: weights and optimizer state count against the budget too
    try:
        budgets = budgets_of(args.budgets, device)
    except ValueError as e:
        raise SystemExit(str(e))
    run = Run(args, device)
    with heap_frozen():
        for m in args.methods:
            run.method(m, budgets)
    if run.jsonl is not None:
        run.jsonl.close()
    print_table(run.rows)
    lines = summary(run.rows, run.losses)
    for line in lines:
        print(line)
    if args.csv:
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(FIELDS)
            for r in run.rows:
                w.writerow(["" if r.get(k) is None else r[k] for k in FIELDS])
    if args.plot:
        write_svg(args.plot, run.rows)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
