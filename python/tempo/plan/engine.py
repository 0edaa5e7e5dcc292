"""Counting a training step without a device: the model is built from its config under
PyTorch's FakeTensorMode (tensors with shapes, dtypes and a device, but no data: each one a meta
storage underneath), two full training steps run on it (forward, backward, the optimizer's step;
the second is the one planned, after the first has made the optimizer's state), and tempo's
planner count (csrc/torch/memory/plan.cpp) records every storage allocated and freed, in order,
with the phase and layer the planner was in and the operator running. The fake tensors are CPU
tensors, so every layer, PyTorch's CPU dispatch (scaled_dot_product_attention's choice of kernel,
autocast) and tempo's ops run as on the CPU; for a GPU, what differs there is put in: torch's
attention kernel on CUDA (flash or memory-efficient, with the tensors those keep), and tempo's
kernels decide as on CUDA (the planned device)."""

import collections
import contextlib
import math

import torch
import torch.nn.functional as F

from .. import memory  # noqa: F401  (loads the library's memory ops)


class Trace:
    """The planner's record of one run: `events` [N, 4] int64 (allocation id, +bytes or -bytes,
    tag index, operator index), the tag and operator names, the matmul FLOPs by tag."""

    def __init__(self, events, tags, ops, flops):
        self.events, self.tags, self.ops = events, list(tags), list(ops)
        self.flops = {tag: f for tag, f in zip(self.tags, flops.tolist()) if f}

    def first(self, prefix):
        """The index of the first event whose tag starts with `prefix` (len(events) if none)."""
        ids = [i for i, t in enumerate(self.tags) if t.startswith(prefix)]
        if not ids:
            return len(self.events)
        hit = torch.isin(self.events[:, 2], torch.tensor(ids)).nonzero()
        return int(hit[0, 0]) if len(hit) else len(self.events)

    def flops_of(self, prefix):
        return sum(f for tag, f in self.flops.items() if tag.startswith(prefix))


# The phase the planner is in (its last tag), and whether a traffic count follows the tags.
CURRENT = {"tag": "", "traffic": False}


def tag(text):
    torch.ops.tempo.memory_plan_tag(text)
    CURRENT["tag"] = text
    if CURRENT["traffic"]:
        torch.ops.tempo.memory_traffic_phase(text)


@contextlib.contextmanager
def recording(device):
    """Inside: every meta storage counted, tagged; on exit `holder[0]` is the Trace."""
    holder = []
    torch.ops.tempo.memory_plan_start(device)
    try:
        yield holder
    finally:
        holder.append(Trace(*torch.ops.tempo.memory_plan_stop()))


# ---- torch's attention kernel on CUDA --------------------------------------------------------


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as torch's CUDA dispatch runs it (sdp_utils): the flash
    kernel for 16-bit data without a mask and head dims up to 256 (grouped-query attention
    native: k and v keep their own heads), else the memory-efficient kernel (fp32, or a mask;
    k and v repeated to the query's heads for grouped-query attention), each called on the fake
    tensors through its own autograd formula, so that what it keeps for backward (q, k, v, the
    output, the log-sum-exp, the RNG state) is what the CUDA kernel keeps."""
    d = query.shape[-1]
    flash = query.dtype in (torch.float16, torch.bfloat16) and attn_mask is None and d <= 256 and d % 8 == 0
    if flash:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    if enable_gqa and key.shape[1] != query.shape[1]:
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # the kernel takes an additive bias
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, -math.inf)
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
    )[0]


@contextlib.contextmanager
def cuda_attention():
    """Inside: F.scaled_dot_product_attention runs as on CUDA (cuda_sdpa), also where autograd
    reruns a checkpointed forward in the backward."""
    before = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = cuda_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = before


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """What holding saved tensors in host memory does to the device's memory (the parts offload
    and ckpt-offload): each saved tensor of 1 KiB or more that is not a parameter leaves the
    device when it is saved (its storage freed when nothing else holds it) and comes back, as a
    new tensor, when the backward unpacks it; `host` is the most bytes held in host memory at
    once (a copy is held from its save to its unpack). stash: how many of the latest offloaded
    tensors stay on the device until later ones are offloaded or the backward takes them back:
    TRL's OffloadActivations keeps 5 while its side stream copies, and a tensor whose storage is
    among them is not offloaded again but kept on the device; torch's save_on_cpu (transformers'
    checkpoints in host memory) copies each saved tensor at once: 0."""

    def __init__(self, params, stash=0):
        self.host = self.held = self.moved = 0
        self.moved_by_tag = {}
        ids = {id(p) for p in params}
        kept = collections.OrderedDict()  # number -> (tensor, its storage)
        sizes = {}  # number -> bytes, while held in host memory
        count = [0]

        def pack(t):
            n = t.numel() * t.element_size()
            if id(t) in ids or n < 1024:
                return (True, t)
            storage = t.untyped_storage()._cdata
            if stash and any(s == storage for _, s in kept.values()):
                return (True, t)
            count[0] += 1
            sizes[count[0]] = n
            self.held += n
            self.moved += n
            layer = CURRENT["tag"]
            self.moved_by_tag[layer] = self.moved_by_tag.get(layer, 0) + n
            self.host = max(self.host, self.held)
            if stash:
                kept[count[0]] = (t, storage)
                while len(kept) > stash:
                    kept.popitem(last=False)
            return (False, (count[0], t.shape, t.dtype))

        def unpack(packed):
            on_device, t = packed
            if on_device:
                return t
            key, shape, dtype = t
            self.held -= sizes.pop(key, 0)
            if key in kept:
                return kept.pop(key)[0]
            return torch.empty(shape, dtype=dtype)

        super().__init__(pack, unpack)


class FakeDevice:
    """tempo.methods.apply's stand-ins for the planned device, on the plan's fake tensors: torch's
    attention kernel as CUDA dispatches it, host memory as a count (HostOffload), TRL's Triton
    fold of its head's tiles as the kernel allocates (nothing)."""

    def __init__(self, kind):
        self.kind = kind

    def attention(self, stack, implementation):
        if self.kind == "cuda" and implementation == "sdpa":
            stack.enter_context(cuda_attention())
        if self.kind == "cuda":  # the tiles' attention as on CUDA (the fake tensors are CPU tensors)
            from ..hf.tiles import as_on_cuda

            stack.enter_context(as_on_cuda())

    def host_hooks(self, params, stash=0):
        return HostOffload(params, stash)

    def trl_head(self, stack):
        """On a GPU TRL's head folds its tiles by a Triton kernel in place: the plan keeps TRL's
        GEMMs and buffers and takes the fold as allocating nothing (as the kernel does). The
        labelled rows are gathered into a tensor of their own (compact mode: hidden_states[mask],
        with every label valid here), which the plan makes as a copy of the rows (the gather's
        size is the mask's values', which fake tensors lack)."""
        if self.kind != "cuda":
            return
        import trl.kernels.chunked_logprob as trl_kernels
        import trl.trainer.utils as trl_utils

        head = trl_utils._ChunkedLogProbFunction

        class Compact:
            @staticmethod
            def apply(hidden, *args):
                return head.apply(hidden.clone() if hidden._is_view() else hidden, *args)

        stack.enter_context(_patched(trl_utils, "_ChunkedLogProbFunction", Compact))
        stack.enter_context(_patched(trl_kernels, "_use_triton", lambda device: False))
        stack.enter_context(_patched(trl_kernels, "_forward_tile", lambda *a, **k: None))
        stack.enter_context(_patched(trl_kernels, "_backward_tile", lambda *a, **k: None))


@contextlib.contextmanager
def _patched(owner, name, value):
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


@contextlib.contextmanager
def custom_ops_run_through():
    """Inside: PyTorch's own Python custom ops that a method calls (the chunked
    F.linear_cross_entropy's) run their implementation on the fake tensors instead of their fake
    kernel (which makes the outputs alone), so that what they allocate inside (the chunks) is
    counted."""
    ops = []
    try:
        import torch.nn.modules.linear_cross_entropy as lce

        ops = [
            getattr(lce, name)
            for name in ("_linear_cross_entropy_batch_chunked", "_linear_cross_entropy_batch_chunked_no_reduction")
            if hasattr(getattr(lce, name, None), "_abstract_fn")
        ]
    except ImportError:  # a torch without it
        pass
    saved = [op._abstract_fn for op in ops]
    try:
        for op in ops:
            op._abstract_fn = op._init_fn
        yield
    finally:
        for op, fn in zip(ops, saved):
            op._abstract_fn = fn


@contextlib.contextmanager
def not_tracing():
    """Inside: transformers does not take the plan's fake tensors for a graph being traced (it
    would build the explicit causal mask that torch.compile and export need, where a real run
    passes none and lets sdpa mask)."""
    try:
        import transformers.masking_utils as masking
        import transformers.utils.import_utils as hf_utils
    except ImportError:
        yield
        return
    is_fake, find_packed = hf_utils.is_fake_tensor, masking.find_packed_sequence_indices

    def unpacked(position_ids):
        # the check for packed sequences reads the positions: the plan's are one sequence a row
        # (arange); it makes the check's tensors as the real run does, and answers as it does
        hf_utils.is_fake_tensor = is_fake
        try:
            find_packed(position_ids)
        finally:
            hf_utils.is_fake_tensor = lambda tensor: False
        return None

    hf_utils.is_fake_tensor = lambda tensor: False
    masking.find_packed_sequence_indices = unpacked
    try:
        yield
    finally:
        hf_utils.is_fake_tensor, masking.find_packed_sequence_indices = is_fake, find_packed


@contextlib.contextmanager
def grouped_mm_any_dtype():
    """Inside: torch._grouped_mm's meta kernel takes any floating dtype, as its CPU kernel does (the
    meta kernel checks for bfloat16, which CUDA's needs): the mixture-of-experts layers of a
    float32 plan run."""
    import torch._meta_registrations as meta

    common = meta._meta_grouped_mm_common

    def any_dtype(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, *args, **kwargs):
        if scale_a is not None or scale_b is not None:
            return common(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, *args, **kwargs)
        return meta._create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)

    meta._meta_grouped_mm_common = any_dtype
    try:
        yield
    finally:
        meta._meta_grouped_mm_common = common


# ---- one traced training ---------------------------------------------------------------------


def layers_of(model):
    """The model's stack of blocks (the ModuleList with the most parameters), or []."""
    best, size = [], 0
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > 1:
            n = sum(p.numel() for p in m.parameters())
            if n > size:
                best, size = list(m), n
    return best


class _Phases:
    """Tags the trace with the phase, the layer and what runs in it: forward pre-hooks and hooks
    on each block, and a hook on each block's output gradient (the start of its backward)."""

    def __init__(self, layers):
        self.step = 0
        self.backward = False
        self.handles = []
        self.layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre(i)))
            self.handles.append(layer.register_forward_hook(self._post(i, len(layers))))

    def set(self, what):
        tag("step %d: %s" % (self.step, what))

    def _pre(self, i):
        def hook(module, args):
            self.set("backward, layer %d (recomputed forward)" % i if self.backward else "forward, layer %d" % i)

        return hook

    def _post(self, i, count):
        def hook(module, args, out):
            if self.backward:
                self.set("backward, layer %d" % i)
                return
            self.set("head and loss" if i == count - 1 else "forward, after layer %d" % i)
            t = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g: self.set("backward, layer %d" % i))

        return hook

    def per_parameter(self, what):
        """A function that tags what follows with `what` and the layer of the parameter it is
        given (the optimizer's work and the gradients' frees, parameter by parameter)."""

        def tag_for(p):
            i = self.layer_of.get(id(p))
            self.set(what if i is None else "%s, layer %d" % (what, i))

        return tag_for

    def remove(self):
        for h in self.handles:
            h.remove()


def train(model, run, batch, optimizer, autocast, steps=2, on_step=None):
    """`steps` training steps of `model` (called as `run(**batch)`), tagged; the planned step is
    the last. on_step(step) runs as each step begins (a measurement resets its peak there)."""
    phases = _Phases(layers_of(model))
    try:
        for step in range(1, steps + 1):
            phases.step, phases.backward = step, False
            if on_step is not None:
                on_step(step)
            phases.set("zero_grad")
            if hasattr(optimizer, "tag_for"):  # the plan's: its work tagged with each parameter's layer
                optimizer.tag_for = phases.per_parameter("zero_grad")
            optimizer.zero_grad(set_to_none=True)
            phases.set("forward")
            with autocast():
                loss = run(**batch).loss
            phases.backward = True
            phases.set("backward, head")
            loss.backward()
            phases.set("optimizer")
            if hasattr(optimizer, "tag_for"):
                optimizer.tag_for = phases.per_parameter("optimizer")
            optimizer.step()
            del loss
    finally:
        phases.remove()
