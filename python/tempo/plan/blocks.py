"""A whole model's traced step made from the step of a model of a few blocks: the blocks of a
model are identical, so an n-block step is the small one with its middle block's events (its
parameters in the build, its forward, its backward, its optimizer work, its gradients' frees:
every event tagged with its layer) repeated. Each copy's allocations are its own; what it frees
that another block made is that block's counterpart as far from the copy (the previous block's
output in the forward, the next block's gradient in the backward, an offloading stash's tensor
several blocks back), and what a block beside the middle frees of the middle block's is the
adjacent copy's. A tracer checks the rule once per method against a traced step of one more
block before it relies on it: a model of 3 blocks, or of 5, 7 and 9 where what a block frees
reaches further."""

import re

import torch

from .trace import Record

_LAYER = re.compile(r"layer (\d+)")


def _layer(tag):
    m = _LAYER.search(tag)
    return int(m.group(1)) if m else None


class Unmade(Exception):
    """The events do not follow the rule (the caller traces the whole model instead)."""


def made(small, blocks):
    """The Record of a model of `blocks` blocks from that of a model of m (odd) blocks, `small`,
    or Unmade: its middle block c = m // 2 (every event tagged with layer c: its build, forward,
    backward, gradients' frees and optimizer work) repeated blocks - m + 1 times, the blocks after
    it renumbered. A copy frees what its block freed of another block d places away as that
    block's counterpart d places from the copy (the same place among the allocations of the same
    tag); a block before the middle uses the first copy's tensors, one after it the last copy's;
    what an event of no block frees of the middle block's is every copy's where such events free
    that tensor of every block (the head dropping what every block kept), else the copy's next to
    it."""
    ev = small.events.tolist()
    layer_of_tag = [_layer(t) for t in small.tags]
    lay = [layer_of_tag[tag] for _, _, tag, _ in ev]
    m = 1 + max((i for i in lay if i is not None), default=0)  # the tag list may hold others' tags
    c = m // 2
    copies = blocks - m + 1
    if m % 2 == 0 or copies < 1:
        raise Unmade("a model of %d blocks makes none of %d" % (m, blocks))
    inserted = [i == c for i in lay]
    chunks, k = [], 0
    while k < len(ev):
        if inserted[k]:
            start = k
            while k < len(ev) and inserted[k]:
                k += 1
            chunks.append((start, k))
        else:
            k += 1
    born = {ident: k for k, (ident, nbytes, _, _) in enumerate(ev) if nbytes > 0}
    tags = list(small.tags)
    tag_ids = {t: i for i, t in enumerate(tags)}

    def renamed(t, layer):
        found = _LAYER.search(t)
        return t[: found.start()] + "layer %d" % layer + t[found.end() :]

    def tag_of(index, layer):
        t = renamed(small.tags[index], layer)
        if t not in tag_ids:
            tag_ids[t] = len(tags)
            tags.append(t)
        return tag_ids[t]

    by_tag = {}
    for k, (_, nbytes, tag, _) in enumerate(ev):
        if nbytes > 0:
            by_tag.setdefault(tag, []).append(k)

    def counterpart(k, layer):
        """The allocation of block `layer` (of the small model) that is, in its block, what k is
        in its own: the same place among the allocations of the same tag."""
        t = small.tags[ev[k][2]]
        other = tag_ids.get(renamed(t, layer))
        mine, theirs = by_tag.get(ev[k][2], []), by_tag.get(other, [])
        if len(mine) != len(theirs):
            raise Unmade("the blocks allocate differently under %r and block %d's" % (t, layer))
        return ev[theirs[mine.index(k)]][0]

    shift = copies - 1

    def new_id(ident, j):
        return ident * (copies + 1) + j + 1

    def entity(a, target):
        """The id, in the made step, of what allocation a is in its block, in block `target`."""
        if target < c:
            return counterpart(a, target) * (copies + 1)
        if target < c + copies:
            return new_id(counterpart(a, c), target - c)
        return counterpart(a, target - shift) * (copies + 1)

    def adjacent(a, k):
        """The copy whose tensor (allocated at a, in the middle block) an event of no block at k
        uses: the copy made last where the event comes after the middle block's events, else the
        first (the copies run in ascending order, in the backward descending)."""
        backward = "backward" in small.tags[ev[a][2]]
        last = 0 if backward else copies - 1
        return last if k > a else copies - 1 - last

    def ref(k, placed):
        """The id event k refers to, the event placed in block `placed` of the made step (None:
        in no block): what it refers to in the block as far from it as in the small model."""
        ident = ev[k][0]
        a = born.get(ident)
        if a is None:
            raise Unmade("a free of a tensor the step did not make")
        u, v = lay[a], lay[k]
        if u is None:
            return ident * (copies + 1)
        if v is None:
            if u == c:
                return new_id(ident, adjacent(a, k))
            return ident * (copies + 1)
        return entity(a, placed - (v - u))

    # the tensors freed by events of no block, by the freeing event's tag
    dropped = {}
    for k, (ident, nbytes, tag, _) in enumerate(ev):
        if nbytes < 0 and lay[k] is None and ident in born:
            dropped.setdefault(tag, set()).add(ident)

    def every(k, a):
        """Whether events of no block under k's tag free this tensor of every block."""
        try:
            return all(counterpart(a, layer) in dropped.get(ev[k][2], ()) for layer in range(m))
        except Unmade:
            return False

    out = []
    starts = {b0: b1 for b0, b1 in chunks}
    # runs of frees of no block that drop the middle block's tensors, each dropping every block's
    dropping = [
        not inserted[k]
        and lay[k] is None
        and nb < 0
        and born.get(i) is not None
        and inserted[born[i]]
        and every(k, born[i])
        for k, (i, nb, _, _) in enumerate(ev)
    ]
    freed_at = {ident: k for k, (ident, nbytes, _, _) in enumerate(ev) if nbytes < 0}
    k = 0
    while k < len(ev):
        ident, nbytes, tag, op = ev[k]
        if dropping[k]:
            end = k
            while end < len(ev) and dropping[end]:
                end += 1
            # the copies in the order the small model drops its blocks' (the block after the
            # middle's first: descending)
            after = freed_at.get(counterpart(born[ident], c + 1), len(ev)) if c + 1 < m else len(ev)
            order = range(copies - 1, -1, -1) if after < k else range(copies)
            for j in order:
                out.extend([new_id(ev[q][0], j), ev[q][1], ev[q][2], ev[q][3]] for q in range(k, end))
            k = end
            continue
        if not inserted[k]:
            v = lay[k]
            placed = None if v is None else (v if v < c else v + shift)
            out.append([ref(k, placed), nbytes, tag if v is None or v < c else tag_of(tag, placed), op])
            k += 1
            continue
        if k not in starts:
            k += 1
            continue
        end = starts[k]
        order = range(copies - 1, -1, -1) if "backward" in small.tags[ev[k][2]] else range(copies)
        for j in order:
            for q in range(k, end):
                out.append([ref(q, c + j), ev[q][1], tag_of(ev[q][2], c + j), ev[q][3]])
        k = end
    events = torch.tensor(out, dtype=torch.long).reshape(-1, 4)
    return _record_like(small, events, tags)


def _record_like(base, events, tags):
    from . import allocator

    probe = Record(events, tags, base.ops, 0, 0, None, None, None, None, base.notes)
    build_end = allocator.first(probe, events, lambda t: not t.startswith("build"))
    mark = allocator.step_start(probe, events, 2)
    return Record(events, tags, base.ops, build_end, mark, None, None, None, None, list(base.notes))


def same(a, b):
    """Whether two records are one step: the same events (sizes, tags, operators) and the same
    pairing of allocations with frees, whatever their ids."""
    if len(a.events) != len(b.events):
        return False
    if not torch.equal(a.events[:, 1], b.events[:, 1]) or not torch.equal(a.events[:, 3], b.events[:, 3]):
        return False
    if [a.tags[t] for t in a.events[:, 2].tolist()] != [b.tags[t] for t in b.events[:, 2].tolist()]:
        return False
    _, pa = torch.unique(a.events[:, 0], return_inverse=True)
    _, pb = torch.unique(b.events[:, 0], return_inverse=True)
    first_a = torch.full((int(pa.max()) + 1,), len(pa), dtype=torch.long).scatter_reduce(
        0, pa, torch.arange(len(pa)), "amin"
    )
    first_b = torch.full((int(pb.max()) + 1,), len(pb), dtype=torch.long).scatter_reduce(
        0, pb, torch.arange(len(pb)), "amin"
    )
    return torch.equal(first_a[pa], first_b[pb])
