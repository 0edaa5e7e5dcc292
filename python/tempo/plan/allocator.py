"""From a trace (engine.Trace) to what a device would report: the CPU's counting allocator holds
exactly the bytes each storage asks for; CUDA's caching allocator rounds and pools them, and
`torch.cuda.max_memory_allocated()` counts the blocks it hands out (CachingAllocator below
replays the trace through a model of it). Also: the peak's place and what is alive there."""

import bisect

import torch

MIB = 1 << 20
# c10/cuda/CUDACachingAllocator.cpp (the default configuration: no expandable segments, no
# max_split_size, no rounding to powers of two)
K_MIN_BLOCK = 512  # every request rounds up to a multiple of this
K_SMALL = MIB  # requests up to this size come from the small pool
K_SMALL_BUFFER = 2 * MIB  # the small pool's segments
K_MIN_LARGE_ALLOC = 10 * MIB  # larger requests below this get a segment of K_LARGE_BUFFER
K_LARGE_BUFFER = 20 * MIB
K_ROUND_LARGE = 2 * MIB  # segments for requests of K_MIN_LARGE_ALLOC and more round up to this


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


def round_size(n):
    return K_MIN_BLOCK if n < K_MIN_BLOCK else K_MIN_BLOCK * ((n + K_MIN_BLOCK - 1) // K_MIN_BLOCK)


def segment_size(n):
    if n <= K_SMALL:
        return K_SMALL_BUFFER
    if n < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((n + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class CachingAllocator:
    """A replay of CUDA's caching allocator on one stream: requests rounded to 512 bytes; up to 1
    MiB from 2 MiB segments, larger from 20 MiB segments (or their own, rounded to 2 MiB, from 10
    MiB); the smallest cached free block that fits is taken (best fit, lowest address on a
    tie), split when what remains is worth keeping (512 bytes in the small pool, more than 1 MiB
    in the large); a freed block merges with free neighbours of its segment. `allocated` counts
    the blocks handed out (max_memory_allocated), `reserved` the segments
    (max_memory_reserved). Segments are never given back (no empty_cache, no out-of-memory
    retry)."""

    def __init__(self):
        self.free = {True: [], False: []}  # pool (small?) -> sorted [(size, address)]
        self.blocks = {}  # address -> [size, segment, allocated?]
        self.segments = {}  # segment -> (start, size)
        self.starts = {}  # segment -> sorted addresses of its blocks
        self.by_id = {}
        self.next_address = 0
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0

    def reset_peak(self):
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def _take_free(self, small, size):
        pool = self.free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        _, address = pool.pop(i)
        return address

    def _insert_free(self, small, address):
        bisect.insort(self.free[small], (self.blocks[address][0], address))

    def alloc(self, ident, nbytes):
        size = round_size(nbytes)
        small = size <= K_SMALL
        address = self._take_free(small, size)
        if address is None:
            seg = segment_size(size)
            address = self.next_address
            self.next_address += seg + K_SMALL_BUFFER  # a gap: segments never merge
            self.segments[address] = (address, seg)
            self.starts[address] = [address]
            self.blocks[address] = [seg, address, False]
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        block = self.blocks[address]
        remaining = block[0] - size
        if remaining >= K_MIN_BLOCK if small else remaining > K_SMALL:
            self.blocks[address + size] = [remaining, block[1], False]
            bisect.insort(self.starts[block[1]], address + size)
            self._insert_free(small, address + size)
            block[0] = size
        block[2] = True
        self.allocated += block[0]
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.by_id[ident] = (address, small)

    def release(self, ident):
        entry = self.by_id.pop(ident, None)
        if entry is None:
            return
        address, small = entry
        block = self.blocks[address]
        block[2] = False
        self.allocated -= block[0]
        start, seg = self.segments[block[1]]
        # merge with the free block after it, then before it, within the segment
        after = address + block[0]
        starts = self.starts[block[1]]
        if after < start + seg and not self.blocks[after][2]:
            self._remove_free(small, after)
            block[0] += self.blocks.pop(after)[0]
            starts.pop(bisect.bisect_left(starts, after))
        i = bisect.bisect_left(starts, address)
        before = starts[i - 1] if i > 0 else None
        if before is not None and not self.blocks[before][2]:
            self._remove_free(small, before)
            self.blocks[before][0] += block[0]
            del self.blocks[address]
            starts.pop(i)
            address = before
        self._insert_free(small, address)

    def _remove_free(self, small, address):
        pool = self.free[small]
        pool.pop(bisect.bisect_left(pool, (self.blocks[address][0], address)))


def replay_cuda(events, mark, build_end):
    """(max allocated over the events from `mark` on, max reserved, the allocated bytes after
    each event) as CUDA's caching allocator would report them. The build (events before
    `build_end`) is replayed as a model loaded onto the device is: its surviving tensors, in
    order, without the temporaries of initialisation."""
    cache = CachingAllocator()
    build = events[:build_end]
    freed = set(int(i) for i in build[build[:, 1] < 0, 0].tolist())
    for ident, nbytes in build[:, :2].tolist():
        if nbytes > 0 and ident not in freed:
            cache.alloc(ident, nbytes)
    after = []
    for k, (ident, nbytes) in enumerate(events[build_end:, :2].tolist()):
        if build_end + k == mark:
            cache.reset_peak()
        if nbytes > 0:
            cache.alloc(ident, nbytes)
        else:
            cache.release(ident)
        after.append(cache.allocated)
    if mark >= len(events):
        cache.reset_peak()
    return cache.peak_allocated, cache.peak_reserved, after
