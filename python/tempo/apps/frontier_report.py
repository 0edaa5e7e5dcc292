"""tempo.frontier's output: the table, the summary lines and the SVG plot of its rows."""

import math
import statistics

from .. import methods
from .._measure import format_bytes


def _parsed(method):
    return None if method == "tempo-auto" else methods.parse(method)


def is_tempo(method):
    """tempo's rows: a tempo base, or Auto-Tempo (tempo-auto)."""
    m = _parsed(method)
    return m is None or m.tempo


def recomputes_matmuls(method):
    """Whether the method recomputes matmuls in its backward: checkpointing, the compiler under
    an activation budget (at its default budget the partitioner recomputes none), and tempo's
    gated MLPs with mlp_recompute (one or two of the MLP's projections)."""
    m = _parsed(method)
    return m is not None and m.recomputes_matmuls


def seq_summary(rows):
    """--axis seq: per budget, tempo's longest sequence against the longest of the methods that
    recompute no matmul, tempo recomputing its gated MLPs' projections (mlp_recompute) against the
    same, and tempo + checkpointing against the peers' checkpointing."""
    lines = []
    for label in dict.fromkeys(r["budget"] for r in rows):
        at = {r["method"]: r["max_seq"] or 0 for r in rows if r["budget"] == label}

        def best(pick):
            chosen = [m for m in at if pick(m)]
            return max(chosen, key=at.get) if chosen else None

        ours = best(lambda m: is_tempo(m) and not recomputes_matmuls(m))
        peer = best(lambda m: not is_tempo(m) and not recomputes_matmuls(m))
        ours_mlp = best(lambda m: _parsed(m) is not None and _parsed(m).recompute != "product")
        ours_ckpt = best(lambda m: is_tempo(m) and _parsed(m) is not None and _parsed(m).checkpoint is not None)
        peer_ckpt = best(lambda m: not is_tempo(m) and _parsed(m).checkpoint is not None)
        parts = []
        for name, a, b in (
            ("without recomputing a matmul", ours, peer),
            ("recomputing the gated MLP's projections alone", ours_mlp, peer),
            ("with checkpointing", ours_ckpt, peer_ckpt),
        ):
            if a and b:
                parts.append(
                    "%s: tempo's %s %d tokens vs %s %d (%s)"
                    % (name, a, at[a], b, at[b], "%.2fx" % (at[a] / at[b]) if at[b] else "the peer fits none")
                )
        lines.append("budget %s, longest sequence at batch 1: %s" % (label, "; ".join(parts) or "not measured"))
    return lines


def summary(rows, losses):
    """Lines: per budget, tempo's best tokens/s against the best peer's; at batch 1, tempo's
    fewest activation bytes against sdpa's; the loss curves against sdpa's."""
    lines = seq_summary(rows) if rows and rows[0].get("axis") == "seq" else []
    for label in dict.fromkeys(r["budget"] for r in rows):
        at = [r for r in rows if r["budget"] == label and r["tokens_per_s"]]
        ours = max((r for r in at if is_tempo(r["method"])), key=lambda r: r["tokens_per_s"], default=None)
        peer = max((r for r in at if not is_tempo(r["method"])), key=lambda r: r["tokens_per_s"], default=None)
        if ours is None and peer is None:
            lines.append("budget %s: no method fits batch 1" % label)
        elif ours is None:
            lines.append(
                "budget %s: tempo fits no batch; best peer %s %.1f tokens/s (batch %d)"
                % (label, peer["method"], peer["tokens_per_s"], peer["max_batch"])
            )
        elif peer is None:
            lines.append(
                "budget %s: tempo's best %s %.1f tokens/s (batch %d); no peer fits batch 1"
                % (label, ours["method"], ours["tokens_per_s"], ours["max_batch"])
            )
        else:
            lines.append(
                "budget %s: tempo's best %s %.1f tokens/s (batch %d) vs best peer %s %.1f (batch %d): %.2fx"
                % (
                    label,
                    ours["method"],
                    ours["tokens_per_s"],
                    ours["max_batch"],
                    peer["method"],
                    peer["tokens_per_s"],
                    peer["max_batch"],
                    ours["tokens_per_s"] / peer["tokens_per_s"],
                )
            )
    b1 = {r["method"]: r["activations_b1"] for r in rows if r["activations_b1"]}
    ours = min((m for m in b1 if is_tempo(m)), key=b1.get, default=None)
    if ours is not None and "sdpa" in b1:
        lines.append(
            "activations at batch 1: tempo's fewest (%s) %s, sdpa %s: %.3fx"
            % (ours, format_bytes(b1[ours]), format_bytes(b1["sdpa"]), b1[ours] / b1["sdpa"])
        )
    if "sdpa" in losses:
        ref = statistics.fmean(losses["sdpa"][-10:])
        for m, curve in losses.items():
            if m != "sdpa":
                mean = statistics.fmean(curve[-10:])
                lines.append(
                    "loss over %d steps, mean of the last %d: %s %.6f vs sdpa %.6f (%+.4f%%)"
                    % (len(curve), min(10, len(curve)), m, mean, ref, 100 * (mean / ref - 1))
                )
    return lines


def print_table(rows):
    r0 = rows[0]
    seq = r0.get("axis") == "seq"
    print("%s, %s, %s, %s" % (r0["model"], "batch 1" if seq else "seq %d" % r0["seq"], r0["precision"], r0["device"]))
    print(
        "%-27s %-9s %9s %12s %8s %14s %14s"
        % ("method", "budget", "max seq" if seq else "max batch", "tokens/s", "spread", "peak", "acts @ b1")
    )
    for r in rows:
        if r["error"] and not r["max_batch"]:
            print("%-27s %-9s %s" % (r["method"], r["budget"], r["error"]))
            continue
        print(
            "%-27s %-9s %9s %12s %8s %14s %14s%s"
            % (
                r["method"],
                r["budget"],
                r["max_seq"] if seq else r["max_batch"],
                "%.1f" % r["tokens_per_s"] if r["tokens_per_s"] else "-",
                "%.1f%%" % (100 * r["spread"]) if r["spread"] is not None else "-",
                format_bytes(r["peak_bytes"]) if r["peak_bytes"] else "-",
                format_bytes(r["activations_b1"]) if r["activations_b1"] else "-",
                ("  (" + r["choice"] + ")") if r["choice"] else "",
            )
        )


def write_svg(path, rows):
    """tokens/s at the largest batch against the budget (log scale), one line per method."""
    budgets = sorted({(r["budget_bytes"], r["budget"]) for r in rows if r["budget_bytes"]})
    methods = [
        m for m in dict.fromkeys(r["method"] for r in rows) if any(r["tokens_per_s"] for r in rows if r["method"] == m)
    ]
    W, H, left, right, top, bottom = 860, 480, 80, 190, 50, 60
    ymax = max([r["tokens_per_s"] or 0 for r in rows] + [1.0]) * 1.08
    lo, hi = math.log2(budgets[0][0]), math.log2(budgets[-1][0])

    def x(nbytes):
        return left + (W - left - right) * (0.5 if hi == lo else (math.log2(nbytes) - lo) / (hi - lo))

    def y(v):
        return top + (H - top - bottom) * (1 - v / ymax)

    r0 = rows[0]
    out = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">'
        % (W, H),
        '<rect width="100%" height="100%" fill="white"/>',
        '<text x="20" y="26" font-size="16" font-weight="bold">tempo.frontier: %s, seq %d, %s, %s</text>'
        % (r0["model"], r0["seq"], r0["precision"], r0["device"]),
        '<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (left, H - bottom, W - right, H - bottom),
        '<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (left, top, left, H - bottom),
        '<text x="%d" y="%d" text-anchor="middle">memory budget</text>' % ((left + W - right) / 2, H - 18),
        '<text x="18" y="%d" transform="rotate(-90 18 %d)" text-anchor="middle">tokens/s at the largest batch'
        "</text>" % ((top + H - bottom) / 2, (top + H - bottom) / 2),
    ]
    for nbytes, label in budgets:
        out.append('<text x="%.1f" y="%d" text-anchor="middle">%s</text>' % (x(nbytes), H - bottom + 18, label))
    for i in range(5):
        v = ymax * i / 4
        out.append('<text x="%d" y="%.1f" text-anchor="end">%.0f</text>' % (left - 6, y(v) + 4, v))
    colors = (
        "#4e79a7",
        "#f28e2b",
        "#e15759",
        "#76b7b2",
        "#59a14f",
        "#edc948",
        "#b07aa1",
        "#ff9da7",
        "#9c755f",
        "#bab0ac",
        "#1b9e77",
        "#d95f02",
    )
    for i, m in enumerate(methods):
        pts = [
            (x(r["budget_bytes"]), y(r["tokens_per_s"] or 0)) for r in rows if r["method"] == m and r["budget_bytes"]
        ]
        c, dash = colors[i % len(colors)], "" if is_tempo(m) else ' stroke-dasharray="5,3"'
        out.append(
            '<polyline fill="none" stroke="%s" stroke-width="2"%s points="%s"/>'
            % (c, dash, " ".join("%.1f,%.1f" % p for p in pts))
        )
        out += ['<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>' % (px, py, c) for px, py in pts]
        ly = top + 16 * i
        out.append(
            '<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>'
            % (W - right + 14, ly, W - right + 40, ly, c, dash)
        )
        out.append('<text x="%d" y="%d">%s</text>' % (W - right + 46, ly + 4, m))
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
