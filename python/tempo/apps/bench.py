"""python -m tempo.bench: memory, largest batch and throughput of a Hugging Face model per
method, with the measurements and output fields of the C++ `tempo bench`. Models are built from
configs (random weights, nothing downloaded) or loaded from a local folder (--model PATH). One
model serves every method, switched between steps, so that the timed steps of all methods can
be interleaved (drift on a shared machine hits each alike) and one copy of the weights and the
optimizer state is held:

  eager         transformers' eager attention      sdpa          torch's fused attention
  eager+ckpt    eager + gradient_checkpointing     sdpa+compile  torch.compile of the sdpa model
  tempo         tempo.optimize(attention="auto")   tempo-sdpa    tempo.optimize(attention="sdpa")
  sdpa+liger    Liger-Kernel's apply_liger_kernel_to_<family>

or any other spelling tempo.methods takes (tempo+ckpt, trl, ...). Every tempo method applies all
of tempo's techniques, the LM head's included (a training forward with labels never forms the
logits); tempo's attention is decided (measured) at its first step and kept. liger needs
Liger-Kernel and CUDA (its kernels are Triton); elsewhere it is a row that says why it did not
run.

Memory is counted exactly: on CPU by tempo's counting allocator (tempo.memory), which with
--budget also enforces the budget (an allocation past it raises torch.OutOfMemoryError, as
on a GPU); on CUDA by the caching allocator's statistics.
"""

import argparse
import contextlib
import csv
import json
import os
import statistics
import sys

import torch

from .. import memory, methods
from .._measure import check_outputs, fits, format_bytes, heap_frozen, largest_batch, parse_bytes
from ..hf import AttentionNotComputed
from .runner import (
    dropout_mask_bytes,
    SIZES,
    Unavailable,
    build_model,
    chosen,
    liger_function,
    synthetic_batch,
    train_step,
)

METHODS = ("eager", "sdpa", "eager+ckpt", "sdpa+compile", "tempo", "tempo-sdpa", "sdpa+liger")
# Earlier spellings: tempo-auto is what tempo means now (attention="auto"); compile and liger
# were on eager and on sdpa (tempo.methods' bare compile and liger run on sdpa).
DEPRECATED = {"checkpoint": "eager+ckpt", "tempo-auto": "tempo", "compile": "sdpa+compile", "liger": "sdpa+liger"}
FIELDS = (
    "model",
    "seq",
    "dtype",
    "device",
    "method",
    "batch",
    "activation_bytes",
    "peak_bytes",
    "train_peak_bytes",
    "optimizer_peak_bytes",
    "step_ms",
    "tokens_per_s",
    "max_batch",
    "max_batch_tokens_per_s",
    "max_batch_spread",
    "skipped",
)


class Methods:
    """Switches one model between the methods (tempo.methods' spellings); `use(name)` is a
    context manager giving the callable to run (the compiled module under compile, compiled
    once and kept across steps)."""

    def __init__(self, model):
        self.model = model
        self.compiled = {}
        self.attention = {}  # a tempo base's attention="auto", decided at its first step

    @contextlib.contextmanager
    def use(self, name):
        with methods.applied(name, self.model, compiled=self.compiled, attention=self.attention.get(name)) as done:
            if done.attention is not None:
                self.attention.setdefault(name, done.attention)
            yield done.run

    def liger(self):
        """Raises Unavailable, naming why, where Liger-Kernel cannot run."""
        try:
            liger_function(self.model)
        except Unavailable as e:
            raise Unavailable("liger: %s" % e) from None


def run(args):
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tempo.bench: --device cuda but no CUDA device is available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # what the model's tensors will name
    if device.type == "cpu":
        memory.track()  # before the model: weights and optimizer state are counted too
    torch.manual_seed(0)
    model, name, causal = build_model(
        args.model, args.size, args.model if os.path.isdir(args.model) else None, args.vocab
    )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model.to(device=device, dtype=dtype)
    positions = getattr(model.config, "max_position_embeddings", None)  # None: not bounded by a table
    limit = positions - (model.config.pad_token_id + 1 if "roberta" in name else 0) if positions else None
    if limit is not None and args.seq > limit:
        raise SystemExit("tempo.bench: --seq %d exceeds %s's %d positions" % (args.seq, name, limit))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    switch = Methods(model)
    seed = [0]

    def step_of(method):
        def step(batch):
            seed[0] += 1
            b = synthetic_batch(model, batch, args.seq, causal, seed[0], device)
            with switch.use(method) as callable_model:
                try:
                    return train_step(callable_model, opt, b, device)
                except AttentionNotComputed as e:
                    raise ValueError(
                        "tempo.bench: method %s cannot run on %s: %s; leave it out of --methods"
                        % (method, name, e.reason)
                    ) from None

        return step

    results = {
        p: {
            "model": name,
            "seq": args.seq,
            "dtype": args.dtype,
            "device": device.type,
            "method": p,
            "batch": args.batch,
        }
        for p in args.methods
    }
    skipped = {}
    for p in args.methods:
        if methods.parse(p).liger:
            try:
                switch.liger()
            except Unavailable as e:
                skipped[p] = str(e)
    chosen_methods = [p for p in args.methods if p not in skipped]
    if not chosen_methods:
        raise ValueError("tempo.bench: no method can run: %s" % "; ".join(skipped.values()))
    if sys.stderr.isatty():
        say = lambda s: print("\r\033[K" + s, end="", file=sys.stderr, flush=True)
    else:
        say = lambda s: None

    def measure(group):
        # Equal batch: a warm-up step per method (compile compiles here), then rounds of one step
        # per method; memory from the first round, time the median over the rounds.
        times = {p: [] for p in group}
        for p in group:
            say("warm-up: %s" % p)
            step_of(p)(args.batch)
        for r in range(args.steps):
            for p in group:
                say("step %d/%d: %s" % (r + 1, args.steps, p))
                m = step_of(p)(args.batch)
                if r == 0:
                    results[p].update(
                        {
                            k: m[k]
                            for k in ("activation_bytes", "peak_bytes", "train_peak_bytes", "optimizer_peak_bytes")
                        }
                    )
                times[p].append(m["step_ms"])
        for p in group:
            results[p]["step_ms"] = statistics.median(times[p])
            results[p]["tokens_per_s"] = args.batch * args.seq / (results[p]["step_ms"] / 1e3)
        if args.budget is not None:
            for p in group:
                say("largest batch: %s" % p)
                step = step_of(p)
                mb, _ = largest_batch(lambda b: fits(step, b, device, args.budget), args.budget)
                results[p]["max_batch"] = mb or 0  # 0: not even batch 1 fits under this method
            fitting = [p for p in group if results[p]["max_batch"]]
            at_max = {p: [] for p in fitting}
            for r in range(max(args.steps, 3)):  # the verifying steps were the warm-up
                for p in fitting:
                    say("throughput at batch %d, step %d: %s" % (results[p]["max_batch"], r + 1, p))
                    at_max[p].append(step_of(p)(results[p]["max_batch"])["step_ms"])
            for p in group:
                ms = sorted(at_max.get(p, []))
                tokens = results[p]["max_batch"] * args.seq
                results[p]["max_batch_tokens_per_s"] = tokens / (statistics.median(ms) / 1e3) if ms else 0.0
                results[p]["max_batch_spread"] = ms[-1] / ms[0] - 1.0 if ms else None

    # Liger's patch cannot be undone: it is measured after the others, each on its own
    measure([p for p in chosen_methods if not methods.parse(p).liger])
    for p in chosen_methods:
        if methods.parse(p).liger:
            measure([p])
    if args.budget is not None and not any(results[p]["max_batch"] for p in chosen_methods):
        raise SystemExit(
            "tempo.bench: the budget (%s) is too small for batch 1 under every method" % format_bytes(args.budget)
        )
    say("")
    for p, why in skipped.items():
        results[p]["skipped"] = why
    rows = [results[p] for p in args.methods]
    masks = None
    if device.type == "cpu" and "eager" in args.methods:
        masks = dropout_mask_bytes(model, synthetic_batch(model, args.batch, args.seq, causal, 1, device))
        model.zero_grad(set_to_none=True)
    return rows, masks


def print_table(rows, masks, budget):
    r0 = rows[0]
    print("%s, seq %d, batch %d, %s, %s" % (r0["model"], r0["seq"], r0["batch"], r0["dtype"], r0["device"]))
    # Ratios are to eager's row; without one, "-" (as the C++ bench prints), not ratios to
    # whichever method came first under a "vs eager" heading.
    eager = next((r for r in rows if r["method"] == "eager" and not r.get("skipped")), None)

    def ratio(num, den):
        return "%8s" % "-" if num is None or not den else "%7.2fx" % (num / den)

    def of(row, key):
        return None if row is None else row[key]

    head = "%-12s %14s %8s %14s %10s %11s %8s" % (
        "method",
        "activations",
        "vs eager",
        "fwd+bwd peak",
        "step ms",
        "tokens/s",
        "vs eager",
    )
    if budget is not None:
        head += " %9s %8s %14s %8s %7s" % ("max batch", "vs eager", "tokens/s @max", "vs eager", "spread")
    print(head)
    base = eager if eager is not None and eager.get("max_batch") else None  # no ratio to a baseline that does not fit
    for r in rows:
        if r.get("skipped"):
            print("%-12s did not run: %s" % (r["method"], r["skipped"]))
            continue
        line = "%-12s %10.1f MiB %s %10.1f MiB %10.1f %11.1f %s" % (
            r["method"],
            r["activation_bytes"] / 2**20,
            ratio(of(eager, "activation_bytes"), max(r["activation_bytes"], 1)),
            r["train_peak_bytes"] / 2**20,
            r["step_ms"],
            r["tokens_per_s"],
            ratio(r["tokens_per_s"], of(eager, "tokens_per_s")),
        )
        if budget is not None:
            if not r["max_batch"]:
                line += " %9s %8s %14s %8s %7s" % ("0", "-", "does not fit", "-", "-")
            else:
                line += " %9d %s %14.1f %s %6.1f%%" % (
                    r["max_batch"],
                    ratio(r["max_batch"], of(base, "max_batch")),
                    r["max_batch_tokens_per_s"],
                    ratio(r["max_batch_tokens_per_s"], of(base, "max_batch_tokens_per_s")),
                    100 * r["max_batch_spread"],
                )
        print(line)
    if masks:  # a model without dropout (LLaMA) keeps none
        bool_eager = eager["activation_bytes"] - masks * 3 // 4
        print(
            "dropout masks: the CPU eager baseline keeps 4-byte float masks (%s of its activations); with 1-byte "
            "bool masks, as CUDA's dropout keeps, eager would hold %s:"
            % (format_bytes(masks), format_bytes(bool_eager))
        )
        for r in rows:
            if r["method"] != "eager" and not r.get("skipped"):
                print("  %-12s holds %7.2fx less than that" % (r["method"], bool_eager / max(r["activation_bytes"], 1)))


@contextlib.contextmanager
def writing(what):
    """A write that fails (a full disk, a folder taken away during the run): one line and exit 1."""
    try:
        yield
    except OSError as e:
        raise SystemExit("tempo.bench: writing %s failed: %s" % (what, e.strerror or e))


def write_outputs(args, rows, masks):
    if args.json:
        print(json.dumps([dict(r, eager_dropout_mask_bytes=masks) for r in rows], indent=1))
    else:
        print_table(rows, masks, args.budget)
    if args.csv:
        new = not os.path.exists(args.csv)
        with writing(args.csv), open(args.csv, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(FIELDS)
            for r in rows:
                w.writerow([r.get(k, "") for k in FIELDS])
    if args.plot:
        with writing(args.plot):
            write_svg(args.plot, rows)


def write_svg(path, rows):
    """Two bar charts: activation MiB per method; tokens/s (at the largest batch if known).
    Methods that did not run are left out."""
    rows = [r for r in rows if not r.get("skipped")]
    W, bar, gap, left = 760, 22, 8, 130
    charts = [
        ("activation memory after forward (MiB, lower is better)", [r["activation_bytes"] / 2**20 for r in rows]),
        (
            "tokens/s%s (higher is better)" % (" at the largest batch" if "max_batch" in rows[0] else ""),
            [r.get("max_batch_tokens_per_s", r["tokens_per_s"]) for r in rows],
        ),
    ]
    H = 60 + len(charts) * (40 + len(rows) * (bar + gap))
    out = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" '
        'font-size="13">' % (W, H),
        '<rect width="100%" height="100%" fill="white"/>',
        '<text x="20" y="28" font-size="17" font-weight="bold">tempo.bench: %s, seq %d, %s, %s</text>'
        % (rows[0]["model"], rows[0]["seq"], rows[0]["dtype"], rows[0]["device"]),
    ]
    y = 60
    colors = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948")
    for title, values in charts:
        out.append('<text x="20" y="%d" font-weight="bold">%s</text>' % (y + 14, title))
        y += 30
        top = max(values) or 1
        for i, (r, v) in enumerate(zip(rows, values)):
            w = max(1, int((W - left - 120) * v / top))
            out.append('<text x="%d" y="%d" text-anchor="end">%s</text>' % (left - 8, y + bar * 0.7, r["method"]))
            out.append('<rect x="%d" y="%d" width="%d" height="%d" fill="%s"/>' % (left, y, w, bar, colors[i % 6]))
            out.append('<text x="%d" y="%d">%.1f</text>' % (left + w + 6, y + bar * 0.7, v))
            y += bar + gap
        y += 10
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def _known(name):
    try:
        methods.parse(name)
    except ValueError:
        return False
    return True


def parser():
    p = argparse.ArgumentParser(prog="python -m tempo.bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="bert", help="bert | roberta | gpt2 | llama | qwen2 | gemma, or a local model folder"
    )
    p.add_argument("--size", default=None, help="base | large | medium | small | tiny (per family)")
    p.add_argument("--vocab", type=int, default=None, help="the vocabulary, instead of the preset's")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--methods",
        default="eager,sdpa,eager+ckpt,tempo,tempo-sdpa",
        help="comma-separated tempo.methods spellings, e.g. " + ", ".join(METHODS),
    )
    p.add_argument("--policies", default=None, help=argparse.SUPPRESS)  # the earlier spelling of --methods
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--budget", type=parse_bytes, default=None, help="e.g. 11GiB: find each method's largest batch")
    p.add_argument("--steps", type=int, default=3, help="timed steps per method (median)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--csv", default=None)
    p.add_argument("--plot", default=None, help="an .svg file")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.policies is not None:
        print("tempo.bench: --policies is deprecated; it is spelled --methods", file=sys.stderr)
    args.methods = chosen(parser(), args.policies or args.methods, _known, "method", DEPRECATED)
    if args.vocab is not None and (args.vocab < 2 or os.path.isdir(args.model)):
        parser().error("--vocab must be at least 2, and applies to a preset, not a folder")
    if args.seq < 2 or args.batch < 1 or args.steps < 1:
        parser().error("--seq must be at least 2, --batch and --steps at least 1")
    check_outputs(parser(), args.plot, [("--csv", args.csv)])
    if not os.path.isdir(args.model):
        args.size = args.size or next(iter(SIZES.get(args.model, {"base": 0})))
    try:
        with heap_frozen():  # each step's collection scans what the bench made, not all of transformers
            rows, masks = run(args)
    except ValueError as e:
        raise SystemExit(str(e))
    write_outputs(args, rows, masks)
    with writing("the output"):  # stdout redirected to a file: its failure too, here rather than at exit
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
