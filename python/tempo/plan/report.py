"""tempo.plan's table, JSON and chart."""

GIB = 1 << 30


def _gib(n):
    return "-" if n is None else "%.2f" % (n / GIB)


def _tflop(f):
    return "-" if f is None else "%.1f" % (f / 1e12)


def table(plan):
    s = plan.setup
    lora = "" if not s["lora"] else ", LoRA r=%d on a %d-bit base" % (s["lora"]["r"], s["lora"]["bits"])
    head = "%s: batch %d x seq %d, %s, %s, %s%s%s; budget %s GiB" % (
        s["model"],
        s["batch"],
        s["seq"],
        s["device"],
        s["precision"],
        s["optimizer"],
        lora,
        ", FSDP over %d GPUs" % s["gpus"] if s["gpus"] > 1 else "",
        _gib(s["budget"]),
    )
    cols = ("method", "peak GiB", "fits", "activations", "act/layer", "TFLOPs", "max seq", "max batch", "peak at")
    lines = [head, "%-26s %9s %5s %11s %10s %8s %8s %9s  %s" % cols]
    for m in plan:
        r = plan[m]
        if r.error:
            lines.append("%-26s %s" % (m, r.error))
            continue
        per = max(r.activations_per_layer) if r.activations_per_layer else None
        lines.append(
            "%-26s %9s %5s %11s %10s %8s %8s %9s  %s"
            % (
                m,
                _gib(r.peak),
                "-" if r.fits is None else ("yes" if r.fits else "no"),
                _gib(r.activations),
                _gib(per),
                _tflop(r.flops),
                r.max_seq if r.max_seq is not None else "-",
                r.max_batch if r.max_batch is not None else "-",
                r.where,
            )
        )
    return "\n".join(lines)
