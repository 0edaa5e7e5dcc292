"""python -m tempo.plan MODEL [--batch B] [--seq S] [--device D] [--precision P] [--optimizer O]
[--lora R[:BITS]] [--gpus G] [--allocator A] [--host BYTES] [--methods m1,m2] [--json] [--plot
FILE.svg]: tempo.plan's table (or JSON) for a preset or a transformers config's folder, each
method's longest sequence and largest batch searched in parallel processes, a line on stderr as
each method is done; --plot draws the peak against the sequence length, one line per method,
with the device's capacity."""

import argparse
import sys
import time

from . import ALLOCATORS, DEFAULT_METHODS, DEVICES, METHODS, OPTIMIZERS, PRECISIONS, PRESETS, PlanError, plan


def _device(text):
    if text.isdigit():
        return int(text)
    return text


def _lora(text):
    if text is None:
        return None
    rank, _, bits = text.partition(":")
    try:
        return {"r": int(rank), "bits": int(bits) if bits else 16}
    except ValueError:
        raise argparse.ArgumentTypeError("--lora takes RANK or RANK:BITS (16 or 4), got %r" % text)


def parser():
    p = argparse.ArgumentParser(prog="python -m tempo.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a preset (%s) or a folder with a config.json" % ", ".join(PRESETS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--device", type=_device, default="H100-80GB", help="%s, bytes, or cpu" % ", ".join(DEVICES))
    p.add_argument("--precision", default="bf16", choices=PRECISIONS)
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--lora", type=_lora, default=None, help="RANK or RANK:BITS: LoRA on a frozen 16- or 4-bit base")
    p.add_argument("--gpus", type=int, default=1, help="FSDP2 full sharding over this many GPUs")
    p.add_argument("--budget", type=int, default=None, help="bytes to fit in (default: the device's, less its context)")
    p.add_argument("--host", type=int, default=None, help="bytes of host memory the offloading methods may fill")
    p.add_argument(
        "--allocator",
        default="expandable",
        choices=ALLOCATORS,
        help="expandable (run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or PyTorch's default",
    )
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="comma-separated tempo.methods spellings (any base+parts, or a recipe), e.g. " + ", ".join(METHODS),
    )
    p.add_argument(
        "--seq-step",
        type=int,
        default=1024,
        help="the granularity of the longest sequence (tempo.plan's own default: 256)",
    )
    p.add_argument("--no-search", action="store_true", help="leave out the longest sequence and the largest batch")
    p.add_argument("--workers", type=int, default=None, help="planning processes (default: one a core)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--plot", default=None, help="an .svg file: the peak against the sequence length, per method")
    return p


def main(argv=None):
    p = parser()
    a = p.parse_args(argv)
    if a.plot and not a.plot.endswith(".svg"):
        p.error("--plot writes SVG; give a file name ending in .svg")
    started = time.perf_counter()

    def progress(line):
        print("tempo.plan: %s, %.0f s" % (line, time.perf_counter() - started), file=sys.stderr, flush=True)

    try:
        result = plan(
            a.model,
            batch=a.batch,
            seq=a.seq,
            methods=[m for m in a.methods.split(",") if m],
            device=a.device,
            precision=a.precision,
            optimizer=a.optimizer,
            lora=a.lora,
            gpus=a.gpus,
            budget=a.budget,
            host=a.host,
            allocator=a.allocator,
            seq_step=a.seq_step,
            workers=a.workers,
            search=not a.no_search,
            progress=progress,
        )
        if a.no_search:
            for m in result:
                result[m]._search = None
        if a.json:
            print(result.to_json())
        else:
            print(result)
        if a.plot:
            result.plot(a.plot)
            if not a.json:
                print("plot written to %s" % a.plot)
    except PlanError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
