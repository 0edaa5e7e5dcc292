"""python -m tempo.frontier: the memory-vs-throughput frontier of a Hugging Face model. For each
memory budget, each training method's largest batch under it and its tokens/s at that batch:
the choice a user who runs out of memory actually makes, Tempo beside what they would pick
instead.

Methods (each on a fresh model from the same seed, one after the other in this process):

  eager           transformers' eager attention
  sdpa            torch's scaled_dot_product_attention (transformers' default)
  sdpa+ckpt       sdpa with activation checkpointing of every layer (use_reentrant=False)
  compile         sdpa under torch.compile (the min-cut partitioner at its default budget)
  compile-mem0.5  the same with torch._functorch.config.activation_memory_budget = 0.5
  compile-mem0.2  ... = 0.2 (the partitioner recomputes more to keep less)
  liger           sdpa with Liger-Kernel's patch of the family (RMSNorm, SwiGLU/GEGLU, RoPE,
                  fused linear cross entropy), where Liger has one
  tempo-sdpa      tempo.optimize(attention="sdpa"): every technique, the LM head's included
  tempo           tempo.optimize(attention="auto"): the attention that keeps the fewest bytes
  tempo+compile   tempo-sdpa under torch.compile
  tempo+liger     Liger's RoPE and SwiGLU/GEGLU with tempo's norms, LM head and attention="auto"
                  (the two never patch the same module)
  tempo-auto      Auto-Tempo (tempo.auto, method "fast") decides under each budget

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
import inspect
import itertools
import json
import math
import os
import statistics
import sys
import time

import torch

from . import memory
from ._measure import check_outputs, fits, format_bytes, free, heap_frozen, largest_batch, parse_bytes
from .bench import SIZES, Unavailable, build_model, enable_checkpointing, liger_function, synthetic_batch, train_step
from .hf import optimize, restore

METHODS = ("eager", "sdpa", "sdpa+ckpt", "compile", "compile-mem0.5", "compile-mem0.2", "liger",
           "tempo-sdpa", "tempo", "tempo+compile", "tempo+liger", "tempo-auto")
# The compile methods' activation_memory_budget (None: torch's default)
COMPILE_BUDGET = {"compile": None, "compile-mem0.5": 0.5, "compile-mem0.2": 0.2, "tempo+compile": None}
PRECISIONS = ("autocast-bf16", "bf16", "fp32")
FIELDS = ("model", "seq", "precision", "device", "method", "budget", "budget_bytes", "max_batch", "tokens_per_s",
          "step_ms", "spread", "peak_bytes", "activations_b1", "loss_mean", "choice", "optimizer", "error")


def is_tempo(method):
    return method.startswith("tempo")


@contextlib.contextmanager
def _modeling_namespace_restored(model):
    """Liger patches the family's modeling module (its RMSNorm and MLP classes, its RoPE
    function) and may patch classes' forwards: both are put back afterwards, so that the
    methods measured later in this process see transformers' own."""
    module = sys.modules[type(model).__module__]
    names = dict(vars(module))
    forwards = {cls: cls.__dict__.get("forward") for cls in names.values()
                if isinstance(cls, type) and cls.__module__ == module.__name__}
    try:
        yield
    finally:
        for k in set(vars(module)) - set(names):
            delattr(module, k)
        for k, v in names.items():
            if vars(module).get(k) is not v:
                setattr(module, k, v)
        for cls, fwd in forwards.items():
            if fwd is not None and cls.__dict__.get("forward") is not fwd:
                cls.forward = fwd


def _apply_liger(fn, model, with_tempo):
    params = inspect.signature(fn).parameters
    kwargs = {"model": model}
    if with_tempo:  # only what tempo does not patch: RoPE and the gated MLP
        kwargs.update({k: False for k in ("rms_norm", "layer_norm", "cross_entropy", "fused_linear_cross_entropy")
                       if k in params})
    fn(**kwargs)


@contextlib.contextmanager
def method_applied(name, model, compile_backend):
    """`model` (fresh, train mode) under method `name` for as long as the block runs; yields
    the callable that trains (the compiled module for the compile methods)."""
    with contextlib.ExitStack() as stack:
        model.set_attn_implementation("eager" if name == "eager" else "sdpa")
        if "liger" in name:
            fn = liger_function(model)  # Unavailable before anything is patched
            stack.enter_context(_modeling_namespace_restored(model))
            _apply_liger(fn, model, with_tempo=is_tempo(name))
        if name == "sdpa+ckpt" and not enable_checkpointing(model):
            raise Unavailable("%s does not support gradient checkpointing" % type(model).__name__)
        if is_tempo(name) and name != "tempo-auto":  # tempo-auto decides under each budget
            optimize(model, attention="sdpa" if name in ("tempo-sdpa", "tempo+compile") else "auto")
        if name in COMPILE_BUDGET:
            if COMPILE_BUDGET[name] is not None:
                stack.enter_context(torch._functorch.config.patch(activation_memory_budget=COMPILE_BUDGET[name]))
            stack.callback(torch._dynamo.reset)
            yield torch.compile(model, backend=compile_backend)
        else:
            yield model


def _optimizer(model):
    """AdamW, fused where this torch has it for these parameters; (optimizer, its name)."""
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return opt, "AdamW (fused)"
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True), "AdamW (foreach)"


def budgets_of(text, device):
    """'8GiB,16GiB,all' -> [(label, bytes)] in ascending order; 'all' is the whole CUDA device."""
    out = []
    for part in [s for s in text.split(",") if s]:
        if part == "all":
            if device.type != "cuda":
                raise ValueError("tempo.frontier: the budget 'all' (the whole device) is for CUDA; on %s give sizes"
                                 % device.type)
            out.append(("all", torch.cuda.get_device_properties(device).total_memory))
        else:
            try:
                out.append((part, parse_bytes(part)))
            except argparse.ArgumentTypeError as e:
                raise ValueError("tempo.frontier: %s" % e) from None
    if not out:
        raise ValueError("tempo.frontier: no budget given")
    return sorted(out, key=lambda b: b[1])


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
        return {"model": name, "seq": self.args.seq, "precision": self.args.precision, "device": self.device.type,
                "method": method, "budget": label, "budget_bytes": nbytes, "max_batch": None, "tokens_per_s": None,
                "step_ms": None, "spread": None, "peak_bytes": None, "activations_b1": None, "loss_mean": None,
                "choice": None, "optimizer": None, "error": None}

    def method(self, method, budgets):
        """Every budget's row for one method: a fresh model, its loss curve (--loss-steps), the
        activation bytes at batch 1, then the largest batch and its throughput per budget.
        Everything it made is freed before the next method is measured (a patched model is a
        reference cycle: only the collector frees it, after the frames that name it are gone)."""
        self._method(method, budgets)
        free(self.device)

    def _method(self, method, budgets):
        args, device = self.args, self.device
        name = os.path.basename(os.path.normpath(args.model)) if os.path.isdir(args.model) else \
            "%s-%s" % (args.model, args.size) + ("-v%d" % args.vocab if args.vocab else "")
        rows = [self.base_row(name, method, b) for b in budgets]
        if self.out_of_time():
            for r in rows:
                self.emit(dict(r, error="not measured: the time limit (%g s) was reached" % args.time_limit))
            return
        try:
            torch.manual_seed(0)
            # made on the device (a 1B model's random initialisation takes seconds on the host per method)
            with torch.device(device):
                model, _, causal = build_model(args.model, args.size,
                                               args.model if os.path.isdir(args.model) else None, args.vocab)
            model.to(device=device, dtype=self.param_dtype)
            opt, opt_name = _optimizer(model)
            seeds = itertools.count(1)

            with method_applied(method, model, args.compile_backend) as run:
                def step(batch):
                    data = synthetic_batch(model, batch, args.seq, causal, next(seeds), device)
                    return train_step(run, opt, data, device, self.autocast)

                losses = []
                for i in range(args.loss_steps):  # the same data for every method: seeds from 10^6
                    data = synthetic_batch(model, args.loss_batch, args.seq, causal, 10**6 + i, device)
                    losses.append(train_step(run, opt, data, device, self.autocast)["loss"])
                if losses:
                    self.losses[method] = losses
                step(1)  # warm-up (compiles; creates the optimizer's state), no budget
                b1 = step(1)["activation_bytes"]
                common = {"activations_b1": b1, "optimizer": opt_name,
                          "loss_mean": statistics.fmean(losses[-10:]) if losses else None}
                seen = {}  # batch -> measurements, every step seen to fit (under a smaller budget)
                for row, budget in zip(rows, budgets):
                    row.update(common)
                    if self.out_of_time():
                        self.emit(dict(row, error="not measured: the time limit (%g s) was reached" % args.time_limit))
                        continue
                    if method == "tempo-auto":
                        row["choice"] = self.auto_choice(model, opt, budget[1], make_batch=lambda b: synthetic_batch(
                            model, b, args.seq, causal, next(seeds), device))
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
                    self.emit(dict(r, error="failed: %s: %s" % (type(e).__name__, str(e).splitlines()[0][:300]
                                                              if str(e) else "")))

    def measure(self, row, step, budget, seen):
        args, device = self.args, self.device

        def probe(batch):
            if batch > args.max_batch:
                return None
            m = fits(step, batch, device, budget)
            if m is not None:
                seen[batch] = m
            return m

        fitted = [(b, seen[b]) for b in (min(seen), max(seen))] if seen else []
        mb, at = largest_batch(probe, budget, fitted)
        if mb is None:
            row.update(max_batch=0)
            return
        times = []
        for i in range(args.steps + 1):  # the first: a warm-up (a compiled model may recompile for the shape)
            m = fits(step, mb, device, budget)
            if m is None:
                row.update(max_batch=mb, error="batch %d fitted once, then ran out of memory" % mb)
                return
            if i:
                times.append(m["step_ms"])
        ms = statistics.median(times)
        row.update(max_batch=mb, step_ms=ms, tokens_per_s=mb * args.seq / (ms / 1e3),
                   spread=max(times) / min(times) - 1.0, peak_bytes=at["peak_bytes"])

    def auto_choice(self, model, opt, budget, make_batch):
        """Auto-Tempo's choice under `budget`: tempo.auto measures forward + backward, so the
        optimizer's state, which exists by now, is left out of what it is given."""
        from .auto import auto

        if "_tempo_undo" in model.__dict__:
            restore(model)
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor))
        given = budget if self.device.type == "cuda" else budget - state  # on CPU tempo.auto counts from what is held
        with self.autocast():
            report = auto(model, make_batch, budget=max(given, 1), method="fast")
        return report.choice


def say(row):
    if not sys.stderr.isatty():
        return
    what = row["error"] or ("batch %s, %s tokens/s" % (row["max_batch"], "%.1f" % row["tokens_per_s"]
                                                       if row["tokens_per_s"] else "-"))
    print("%-15s %-8s %s" % (row["method"], row["budget"], what), file=sys.stderr, flush=True)


def summary(rows, losses):
    """Lines: per budget, tempo's best tokens/s against the best peer's; at batch 1, tempo's
    fewest activation bytes against sdpa's; the loss curves against sdpa's."""
    lines = []
    for label in dict.fromkeys(r["budget"] for r in rows):
        at = [r for r in rows if r["budget"] == label and r["tokens_per_s"]]
        ours = max((r for r in at if is_tempo(r["method"])), key=lambda r: r["tokens_per_s"], default=None)
        peer = max((r for r in at if not is_tempo(r["method"])), key=lambda r: r["tokens_per_s"], default=None)
        if ours is None and peer is None:
            lines.append("budget %s: no method fits batch 1" % label)
        elif ours is None:
            lines.append("budget %s: tempo fits no batch; best peer %s %.1f tokens/s (batch %d)"
                         % (label, peer["method"], peer["tokens_per_s"], peer["max_batch"]))
        elif peer is None:
            lines.append("budget %s: tempo's best %s %.1f tokens/s (batch %d); no peer fits batch 1"
                         % (label, ours["method"], ours["tokens_per_s"], ours["max_batch"]))
        else:
            lines.append("budget %s: tempo's best %s %.1f tokens/s (batch %d) vs best peer %s %.1f (batch %d): %.2fx"
                         % (label, ours["method"], ours["tokens_per_s"], ours["max_batch"], peer["method"],
                            peer["tokens_per_s"], peer["max_batch"], ours["tokens_per_s"] / peer["tokens_per_s"]))
    b1 = {r["method"]: r["activations_b1"] for r in rows if r["activations_b1"]}
    ours = min((m for m in b1 if is_tempo(m)), key=b1.get, default=None)
    if ours is not None and "sdpa" in b1:
        lines.append("activations at batch 1: tempo's fewest (%s) %s, sdpa %s: %.3fx"
                     % (ours, format_bytes(b1[ours]), format_bytes(b1["sdpa"]), b1[ours] / b1["sdpa"]))
    if "sdpa" in losses:
        ref = statistics.fmean(losses["sdpa"][-10:])
        for m, curve in losses.items():
            if m != "sdpa":
                mean = statistics.fmean(curve[-10:])
                lines.append("loss over %d steps, mean of the last %d: %s %.6f vs sdpa %.6f (%+.4f%%)"
                             % (len(curve), min(10, len(curve)), m, mean, ref, 100 * (mean / ref - 1)))
    return lines


def print_table(rows):
    r0 = rows[0]
    print("%s, seq %d, %s, %s" % (r0["model"], r0["seq"], r0["precision"], r0["device"]))
    print("%-15s %-9s %9s %12s %8s %14s %14s" % ("method", "budget", "max batch", "tokens/s", "spread", "peak",
                                                 "acts @ b1"))
    for r in rows:
        if r["error"] and not r["max_batch"]:
            print("%-15s %-9s %s" % (r["method"], r["budget"], r["error"]))
            continue
        print("%-15s %-9s %9s %12s %8s %14s %14s%s" % (
            r["method"], r["budget"], r["max_batch"], "%.1f" % r["tokens_per_s"] if r["tokens_per_s"] else "-",
            "%.1f%%" % (100 * r["spread"]) if r["spread"] is not None else "-",
            format_bytes(r["peak_bytes"]) if r["peak_bytes"] else "-",
            format_bytes(r["activations_b1"]) if r["activations_b1"] else "-",
            ("  (" + r["choice"] + ")") if r["choice"] else ""))


def write_svg(path, rows):
    """tokens/s at the largest batch against the budget (log scale), one line per method."""
    budgets = sorted({(r["budget_bytes"], r["budget"]) for r in rows if r["budget_bytes"]})
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if any(
        r["tokens_per_s"] for r in rows if r["method"] == m)]
    W, H, left, right, top, bottom = 860, 480, 80, 190, 50, 60
    ymax = max([r["tokens_per_s"] or 0 for r in rows] + [1.0]) * 1.08
    lo, hi = math.log2(budgets[0][0]), math.log2(budgets[-1][0])

    def x(nbytes):
        return left + (W - left - right) * (0.5 if hi == lo else (math.log2(nbytes) - lo) / (hi - lo))

    def y(v):
        return top + (H - top - bottom) * (1 - v / ymax)

    r0 = rows[0]
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">'
           % (W, H), '<rect width="100%" height="100%" fill="white"/>',
           '<text x="20" y="26" font-size="16" font-weight="bold">tempo.frontier: %s, seq %d, %s, %s</text>'
           % (r0["model"], r0["seq"], r0["precision"], r0["device"]),
           '<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (left, H - bottom, W - right, H - bottom),
           '<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (left, top, left, H - bottom),
           '<text x="%d" y="%d" text-anchor="middle">memory budget</text>' % ((left + W - right) / 2, H - 18),
           '<text x="18" y="%d" transform="rotate(-90 18 %d)" text-anchor="middle">tokens/s at the largest batch'
           '</text>' % ((top + H - bottom) / 2, (top + H - bottom) / 2)]
    for nbytes, label in budgets:
        out.append('<text x="%.1f" y="%d" text-anchor="middle">%s</text>' % (x(nbytes), H - bottom + 18, label))
    for i in range(5):
        v = ymax * i / 4
        out.append('<text x="%d" y="%.1f" text-anchor="end">%.0f</text>' % (left - 6, y(v) + 4, v))
    colors = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
              "#bab0ac", "#1b9e77", "#d95f02")
    for i, m in enumerate(methods):
        pts = [(x(r["budget_bytes"]), y(r["tokens_per_s"] or 0)) for r in rows
               if r["method"] == m and r["budget_bytes"]]
        c, dash = colors[i % len(colors)], "" if is_tempo(m) else ' stroke-dasharray="5,3"'
        out.append('<polyline fill="none" stroke="%s" stroke-width="2"%s points="%s"/>'
                   % (c, dash, " ".join("%.1f,%.1f" % p for p in pts)))
        out += ['<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>' % (px, py, c) for px, py in pts]
        ly = top + 16 * i
        out.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>'
                   % (W - right + 14, ly, W - right + 40, ly, c, dash))
        out.append('<text x="%d" y="%d">%s</text>' % (W - right + 46, ly + 4, m))
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def parser():
    p = argparse.ArgumentParser(prog="python -m tempo.frontier", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama", help="a tempo.bench preset family (%s) or a local model folder"
                   % ", ".join(SIZES))
    p.add_argument("--size", default=None, help="the family's size (tempo.bench's presets; e.g. llama 1b, qwen2 0.5b)")
    p.add_argument("--vocab", type=int, default=None, help="the vocabulary, instead of the preset's")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--budgets", default="8GiB,16GiB,32GiB,64GiB,all",
                   help="comma-separated sizes (e.g. 8GiB), 'all' for the whole CUDA device")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, run in this order: "
                   + ", ".join(METHODS))
    p.add_argument("--precision", choices=PRECISIONS, default="autocast-bf16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=3, help="timed steps at each largest batch (median; at least 3 for "
                   "a spread that means something)")
    p.add_argument("--loss-steps", type=int, default=0, help="before the frontier, train this many steps on the same "
                   "data under each method and compare the loss with sdpa's")
    p.add_argument("--loss-batch", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=4096, help="no batch beyond this is tried")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend (aot_eager: the same "
                   "partitioner without code generation)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds: no (method, budget) is started after "
                   "this; their rows say so")
    p.add_argument("--jsonl", default=None, help="one JSON line per row, written as measured")
    p.add_argument("--csv", default=None)
    p.add_argument("--plot", default=None, help="an .svg file")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    args.methods = [s for s in args.methods.split(",") if s]
    bad = [s for s in args.methods if s not in METHODS]
    if bad or not args.methods:
        parser().error("unknown method %s; known: %s" % (bad, ", ".join(METHODS)))
    if args.seq < 2 or args.steps < 1 or args.loss_steps < 0 or args.loss_batch < 1 or args.max_batch < 1:
        parser().error("--seq must be at least 2, --steps, --loss-batch and --max-batch at least 1, --loss-steps >= 0")
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
