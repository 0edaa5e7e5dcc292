"""tempo.plan's table, JSON and chart."""

import math

GIB = 1 << 30


def _gib(n):
    return "-" if n is None else "%.2f" % (n / GIB)


def _tflop(f):
    return "-" if f is None else "%.1f" % (f / 1e12)


def table(plan):
    s = plan.setup
    lora = "" if not s["lora"] else ", LoRA r=%d on a %d-bit base" % (s["lora"]["r"], s["lora"]["bits"])
    head = "%s: batch %d x seq %d, %s, %s, %s%s%s; budget %s GiB%s%s" % (
        s["model"],
        s["batch"],
        s["seq"],
        s["device"],
        s["precision"],
        s["optimizer"],
        lora,
        ", FSDP over %d GPUs" % s["gpus"] if s["gpus"] > 1 else "",
        _gib(s["budget"]),
        ", host %s GiB" % _gib(s["host"]) if s.get("host") else "",
        ", expandable segments" if s.get("allocator") == "expandable" and s["kind"] == "cuda" else "",
    )
    cols = (
        "method",
        "peak GiB",
        "reserved",
        "fits",
        "host GiB",
        "act/layer",
        "TFLOPs",
        "time s",
        "max seq",
        "max batch",
    )
    fmt = "%-26s %9s %9s %5s %8s %10s %8s %8s %8s %9s  %s"
    lines = [head, fmt % (cols + ("peak at",))]
    for m in plan:
        r = plan[m]
        if r.error:
            lines.append("%-26s %s" % (m, r.error))
            continue
        per = max(r.activations_per_layer) if r.activations_per_layer else None
        lines.append(
            fmt
            % (
                m,
                _gib(r.peak),
                _gib(r.reserved),
                "-" if r.fits is None else ("yes" if r.fits else "no"),
                _gib(r.host) if r.host else "-",
                _gib(per),
                _tflop(r.flops),
                "-" if r.time is None else "%.3f" % r.time,
                r.max_seq if r.max_seq is not None else "-",
                r.max_batch if r.max_batch is not None else "-",
                r.where,
            )
        )
    ranked = plan.ranked()
    if ranked:
        lines.append("fastest that fits: %s" % ", ".join(ranked[:3]) + (" ..." if len(ranked) > 3 else ""))
    for m in plan:
        for note in plan[m].notes:
            lines.append("note (%s): %s" % (m, note))
    if s["kind"] == "cuda":
        if s.get("allocator") == "expandable":
            lines.append("planned with expandable segments: run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        lines.append(NOT_MODELLED)
    return "\n".join(lines)


# What a GPU plan leaves out, said under its table.
NOT_MODELLED = (
    "peak: max_memory_allocated's; reserved: the caching allocator's segments as its rules make them under the "
    "budget (cached segments given back before running out), the low end of what max_memory_reserved shows: not "
    "modelled are the CUDA context (768 MiB taken off the budget), cuBLAS/cuBLASLt workspaces (up to tens of MiB "
    "a stream) and other streams' blocks; time: datasheet rates at the efficiencies docs/plan.md states"
)


COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")


def seqs_for(plan):
    """The sequence lengths a chart plots: powers of two from 512 to the model's positions (at most
    131,072), and the plan's own."""
    top = min(plan.setup["positions"] or 131072, 131072)
    seqs, s = [], 512
    while s <= top:
        seqs.append(s)
        s *= 2
    return sorted(set(seqs + [plan.setup["seq"]]))


def plot(plan, path, seqs=None):
    """The peak against the sequence length at the plan's batch (log2 x), one line per method, the
    budget as a line: an SVG file at `path`. Returns {method: [(seq, peak)]}."""
    seqs = seqs or seqs_for(plan)
    curves = {m: [(s, plan._job.peak_of(m, plan.setup["batch"], s)) for s in seqs] for m in plan if not plan[m].error}
    s = plan.setup
    W, H, left, right, top, bottom = 900, 500, 80, 220, 50, 60
    peaks = [p for c in curves.values() for _, p in c]
    ymax = max(peaks + [s["budget"] or 0]) * 1.08
    lo, hi = math.log2(seqs[0]), math.log2(seqs[-1])

    def x(v):
        return left + (W - left - right) * (0.5 if hi == lo else (math.log2(v) - lo) / (hi - lo))

    def y(v):
        return top + (H - top - bottom) * (1 - v / ymax)

    out = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">'
        % (W, H),
        '<rect width="100%" height="100%" fill="white"/>',
        '<text x="20" y="26" font-size="16" font-weight="bold">tempo.plan: %s, batch %d, %s, %s, %s</text>'
        % (s["model"], s["batch"], s["precision"], s["optimizer"], s["device"]),
        '<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (left, H - bottom, W - right, H - bottom),
        '<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (left, top, left, H - bottom),
        '<text x="%d" y="%d" text-anchor="middle">sequence length (tokens)</text>' % ((left + W - right) / 2, H - 18),
        '<text x="18" y="%d" transform="rotate(-90 18 %d)" text-anchor="middle">peak of a training step (GiB)</text>'
        % ((top + H - bottom) / 2, (top + H - bottom) / 2),
    ]
    for v in seqs:
        out.append('<text x="%.1f" y="%d" text-anchor="middle">%d</text>' % (x(v), H - bottom + 18, v))
    for i in range(6):
        v = ymax * i / 5
        out.append('<text x="%d" y="%.1f" text-anchor="end">%.0f</text>' % (left - 6, y(v) + 4, v / GIB))
    if s["budget"]:
        out.append(
            '<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="black" stroke-dasharray="6,4"/>'
            % (left, y(s["budget"]), W - right, y(s["budget"]))
        )
        out.append(
            '<text x="%d" y="%.1f">budget %.1f GiB</text>' % (W - right + 6, y(s["budget"]) + 4, s["budget"] / GIB)
        )
    for i, (m, pts) in enumerate(curves.items()):
        c = COLORS[i % len(COLORS)]
        dash = "" if m.startswith("tempo") else ' stroke-dasharray="5,3"'
        xy = [(x(a), y(b)) for a, b in pts]
        out.append(
            '<polyline fill="none" stroke="%s" stroke-width="2"%s points="%s"/>'
            % (c, dash, " ".join("%.1f,%.1f" % p for p in xy))
        )
        out += ['<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>' % (px, py, c) for px, py in xy]
        ly = top + 18 * i + 20
        out.append(
            '<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>'
            % (W - right + 6, ly, W - right + 30, ly, c, dash)
        )
        out.append('<text x="%d" y="%d">%s</text>' % (W - right + 36, ly + 4, m))
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return curves
