"""From a trace (engine.Trace) to the events a device would see: the fake tensors' artefacts
cleaned out, and where the build and the planned step start. CUDA's caching allocator is
replayed over them by tempo::memory_plan_replay (csrc/torch/memory/replay.cpp: its rules,
default and with expandable segments)."""

import torch


def cleaned(trace):
    """The trace's events as a real device would see them, without the fake tensors' artefacts:
    - a fake tensor rebuilt from the fake-tensor cache as a view is allocated and at once given
      its base's storage (`set_`): neither happens on a device;
    - autograd sums two gradients of one tensor (a parameter used twice: tied embeddings; an
      activation read by two layers) in place into one of them, but out of place for a tensor
      subclass such as a fake tensor: there the sum is a new allocation and the gradient it
      would have been added into is freed; on a device neither happens."""
    ev = trace.events
    if len(ev) < 2:
        return ev[:, :4]
    set_ops = [i for i, o in enumerate(trace.ops) if o == "aten::set_"]
    nxt = ev[1:]
    phantom = (ev[:-1, 1] > 0) & (nxt[:, 1] == -ev[:-1, 1]) & (nxt[:, 0] == ev[:-1, 0])
    phantom &= torch.isin(nxt[:, 3], torch.tensor(set_ops, dtype=torch.long))
    keep = torch.ones(len(ev), dtype=torch.bool)
    keep[:-1] &= ~phantom
    keep[1:] &= ~phantom
    ev = ev[keep]
    if not bool((ev[:, 4] >= 0).any()):
        return ev[:, :4]
    out, alias, dropped, made = [], {}, set(), {}
    for ident, n, tag, op, target in ev.tolist():
        if n == 0 and target >= 0:  # a sum: on a device the operand `target` became it, in place
            if ident in made:
                out[made.pop(ident)] = None  # so the sum's allocation does not happen there
            alias[ident] = alias.get(target, target)
            dropped.add(target)  # nor the operand's own free
            continue
        if n < 0 and ident in dropped:
            dropped.discard(ident)
            continue
        if n > 0:
            made[ident] = len(out)
        out.append([alias.get(ident, ident), n, tag, op])
    out = [r for r in out if r is not None]
    return torch.tensor(out, dtype=torch.long).reshape(-1, 4)


def first(trace, events, which):
    """The index of the first event whose tag `which(tag)` accepts (len(events) if none)."""
    ids = torch.tensor([i for i, t in enumerate(trace.tags) if which(t)], dtype=torch.long)
    hit = torch.isin(events[:, 2], ids).nonzero()
    return int(hit[0, 0]) if len(hit) else len(events)


def step_start(trace, events, step):
    """The index of the first event of `step` (its tags start "step N")."""
    return first(trace, events, lambda t: t.startswith("step %d" % step))
