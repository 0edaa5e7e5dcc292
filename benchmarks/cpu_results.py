#!/usr/bin/env python3
"""Renders the JSON written by benchmarks/cpu_results.sh into docs/results/cpu.md.

The page's title and opening paragraph, and the "## " sections this script owns (OWNED), are
rewritten from the results in the folder: an owned section with no result there yet is left out,
and the opening paragraph names the commit each result was made at (its NAME.commit stamp). Any
other "## " section on the page (a hand-written measurement with its own command and date) is kept
where it stands. An owned section the page does not have yet goes at its end."""

import datetime
import json
import os
import platform
import sys


BUDGET = "## bert-large: activations at batch 1 and the largest batch under a budget"
EQUAL = "## Equal batch: bert-base shape with 4 layers, seq 128, batch 8"
ABLATION = "## Ablation: per-layer activation bytes of each technique (bert-large)"
OWNED = (BUDGET, EQUAL, ABLATION)


def load(path):
    with open(path) as f:
        return json.load(f)


def commit_of(path):
    """The commit cpu_results.sh stamped a result with (NAME.commit beside it)."""
    try:
        with open(path + ".commit") as f:
            return f.read().strip()
    except FileNotFoundError:
        return "an unrecorded commit"


def commits_line(made):
    """'commit A' when every result shown comes from one commit, else each commit with its results."""
    by = {}
    for what, commit in made:
        by.setdefault(commit, []).append(what)
    if len(by) <= 1:
        return "commit " + next(iter(by), "(no results yet)")
    return "commits " + "; ".join("%s (%s)" % (c, ", ".join(w)) for c, w in by.items())


def mib(b):
    return b / 1048576.0


def read_sections(md):
    """The "## " sections of the page as it stands, each as (title, lines) ending in one blank line."""
    if not os.path.exists(md):
        return []
    sections = []
    in_code = False
    with open(md) as f:
        for line in f.read().rstrip("\n").split("\n"):
            if line.startswith("```"):
                in_code = not in_code
            if line.startswith("## ") and not in_code:
                sections.append((line, [line]))
            elif sections:
                sections[-1][1].append(line)
    for _, lines in sections:
        while not lines[-1].strip():
            lines.pop()
        lines.append("")
    return sections


def merge(header, generated, existing):
    """The header, then the page's sections in their order, each owned one replaced by this run's text
    (or left out), then this run's sections the page did not have yet."""
    made = {lines[0]: lines for lines in generated}
    out = list(header)
    for title, lines in existing:
        out += made.pop(title, []) if title in OWNED else lines
    for lines in generated:
        if lines[0] in made:
            out += lines
    return out


def main(out, md):
    made = []  # (what, commit) of each result shown
    sections = []  # each a list of lines, the first its title, in the order this script makes them
    lines = [
        BUDGET,
        "",
        "| seq | budget | policy | activations, batch 1 | vs eager | peak, batch 1 | max batch | vs eager "
        "| tokens/s at max batch | spread |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    missing = []
    runs = [(s, b) for s in (128, 512) for b in ("11GiB", "16GiB")]
    for s, b in runs:
        path = os.path.join(out, "bert-large-s%d-%s.json" % (s, b))
        budget = b.replace("GiB", " GiB")
        if not os.path.exists(path):
            missing.append("S=%d under %s" % (s, budget))
            continue
        rows = load(path)
        made.append(("S=%d under %s" % (s, budget), commit_of(path)))
        eager = next(r for r in rows if r["method"] == "eager")
        for r in rows:
            lines.append(
                "| %d | %s | %s | %.1f MiB | %.2fx | %.1f MiB | %d | %.2fx | %.1f | %.1f%% |"
                % (
                    s,
                    budget,
                    r["method"],
                    mib(r["activation_bytes"]),
                    r["activation_bytes"] / eager["activation_bytes"],
                    mib(r["peak_bytes"]),
                    r["max_batch"],
                    r["max_batch"] / eager["max_batch"],
                    r["max_batch_tokens_per_s"],
                    100 * r["max_batch_spread"],
                )
            )
    lines += [
        "",
        "Command: `build/tempo bench --model bert-large --seq S --batch 1 --steps 1 --methods "
        "eager,tempo,tempo-sdpa --budget 11GiB|16GiB --json`. Each largest batch was verified by running a "
        "step at it under the tracker (its peak within the budget). The tokens/s column is the median of 3 "
        'steps at that batch after the verifying step (their warm-up); "spread" is the slowest over the '
        "fastest of the 3, minus one. The script runs these with "
        "MALLOC_MMAP_THRESHOLD_=131072 (glibc returns freed blocks at once, so the resident size stays near "
        "the tracked bytes).",
        "",
    ]
    if missing:
        lines += [
            "Not measured yet: %s (the script runs them last; each takes tens of minutes on 2 cores, and "
            "the 16 GiB runs need well over 16 GiB of RAM, since the process's resident size exceeds the "
            "tracked bytes by the allocator's caches)." % ", ".join(missing),
            "",
        ]
    if len(missing) < len(runs):
        sections.append(lines)
    path = os.path.join(out, "bert-base-l4-s128.json")
    if os.path.exists(path):
        rows = load(path)
        made.append(("equal batch", commit_of(path)))
        eager = next(r for r in rows if r["method"] == "eager")
        lines = [
            EQUAL,
            "",
            "| policy | activations | vs eager | peak | step ms | vs eager | tokens/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                "| %s | %.1f MiB | %.2fx | %.1f MiB | %.1f | %.3f | %.1f |"
                % (
                    r["method"],
                    mib(r["activation_bytes"]),
                    r["activation_bytes"] / eager["activation_bytes"],
                    mib(r["peak_bytes"]),
                    r["step_ms"],
                    r["step_ms"] / eager["step_ms"],
                    r["tokens_per_s"],
                )
            )
        lines += [
            "",
            "Command: `build/tempo bench --model bert-base --layers 4 --seq 128 --batch 8 --steps 5 "
            "--methods eager,eager+ckpt,sdpa,tempo,tempo-sdpa --json` (median of 5 steps after a warm-up).",
            "",
        ]
        sections.append(lines)
    path = os.path.join(out, "ablation.txt")
    if os.path.exists(path):
        made.append(("ablation", commit_of(path)))
        with open(path) as f:
            text = f.read().rstrip()
        sections.append(
            [
                ABLATION,
                "",
                "Command: `build/tempo bench --model bert-large --ablation --ablation-seqs 128,256,512`",
                "",
                "```",
                text,
                "```",
                "",
            ]
        )
    header = [
        "# `tempo bench` on CPU",
        "",
        "Generated by `benchmarks/cpu_results.sh` on %s, %s. Machine: %s, %d cores visible, torch %s CPU "
        "wheel; fp32, AdamW, dropout 0.1 (attention and hidden). Memory figures are exact byte counts of the "
        'counting CPU allocator (`tempo::memory`); "activations" is what is held after the forward beyond what '
        'was held before it, "peak" everything held at the step\'s peak (weights, gradients, Adam state, '
        "activations). Times are medians of a few steps on a shared 2-core machine: read them as rough."
        % (
            datetime.date.today().isoformat(),
            commits_line(made),
            platform.processor() or platform.machine(),
            os.cpu_count(),
            __import__("torch").__version__,
        ),
        "",
    ]
    text = "\n".join(merge(header, sections, read_sections(md))) + "\n"
    with open(md + ".tmp", "w") as f:
        f.write(text)
    os.replace(md + ".tmp", md)
    print("wrote", md)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
