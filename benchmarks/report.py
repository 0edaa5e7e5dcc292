"""Output helpers shared by the accuracy scripts: CSV rows and a Markdown table written
between two markers of a document."""

import csv
import os


def write_csv(path, rows):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def replace_between(path, marker, lines):
    """Replace the text between <!-- MARKER:begin --> and <!-- MARKER:end --> with `lines`."""
    with open(path) as f:
        text = f.read()
    begin, end = "<!-- %s:begin -->" % marker, "<!-- %s:end -->" % marker
    a, b = text.index(begin) + len(begin), text.index(end)
    with open(path, "w") as f:
        f.write(text[:a] + "\n" + "\n".join(lines) + "\n" + text[b:])
