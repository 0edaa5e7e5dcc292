"""tempo.report's table: what tempo.optimize patched, module by module, and what it left
and why."""


class Report:
    """What tempo.optimize did: one row per module it patched or looked at and left, with
    why. Prints as a table; `rows` is a list of (path, class, technique, action)."""

    def __init__(self, rows):
        self.rows = rows

    @property
    def patched(self):
        return [r for r in self.rows if r[3].startswith("patched")]

    def __str__(self):
        if not self.rows:
            return "tempo.optimize: nothing recorded"
        w = [max(len(str(r[i])) for r in self.rows + [("module", "class", "technique", "action")]) for i in range(4)]
        lines = ["%-*s  %-*s  %-*s  %s" % (w[0], "module", w[1], "class", w[2], "technique", "action")]
        lines += ["%-*s  %-*s  %-*s  %s" % (w[0], r[0], w[1], r[1], w[2], r[2], r[3]) for r in self.rows]
        return "\n".join(lines)

    __repr__ = __str__
