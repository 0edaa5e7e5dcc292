"""A decoder layer checkpointed and recomputed in sequence tiles (the method part `tiles`).

Checkpointing keeps a layer's input and recomputes the whole layer in the backward: for that
layer, every activation of the whole sequence lives at once (q, the attention output, the norms,
the MLP's intermediates: about 95 KB a token for Llama-3.1-8B in bf16 under tempo). In a causal
layer only the keys and values are needed for the whole sequence at once; the rest can live one
tile of query rows at a time. `tiled_checkpoint` is a checkpoint function for transformers'
decoder layers (model._set_gradient_checkpointing(gradient_checkpointing_func=...)) that does so:

- forward (no graph kept): the layer runs tile by tile in order, each tile's keys and values
  appended to whole-sequence buffers that the next tiles' queries attend to; only the input is
  saved (ctx.save_for_backward: in host memory under a saved-tensor hook, +ckpt-offload);
- backward: pass A recomputes the keys and values of the whole sequence, tile by tile, without a
  graph (each tile's layer run up to its attention call); pass B runs the tiles last to first,
  each tile's layer with a graph from its input slice: its queries attend to the prefix's keys and
  values (leaves of their own, whose gradients are summed into float32 accumulators) and to the
  tile's own (in its graph, their gradients from the later tiles' queries added by a hook), and
  the tile's backward leaves its input's gradient and the parameters' gradients (summed into
  .grad, as reentrant checkpointing does).

What lives at once in a layer's backward: the input, its gradient, the output's gradient (three
hidden-wide tensors), the keys and values and their float32 gradient sums (for Llama-3.1-8B:
8 KV heads of 128, so 4 KB and 8 KB a token), and one tile's activations. Recomputation: the
layer's forward once more per tile (as checkpointing) plus its norm and q/k/v projections once
(pass A). Exact: the same operations as the untiled layer on the same rows, the attention
computed by torch's sdpa over the tile's rows against the keys up to the tile's end (causal,
aligned bottom-right), the gradients summed over tiles.

The tiled attention call supports what the layers pass it in training: a causal mask (or the
boolean or additive mask the model built, sliced to the tile), grouped-query heads, the scale.
It refuses attention dropout, sliding windows shorter than the sequence and soft-capped logits,
saying so."""

import contextlib
import threading

import torch
import torch.nn.functional as F

TILE_BYTES = 256 << 20  # a tile's budget for its layer's activations, by default
MAX_TILES = 32  # at most this many tiles a layer: longer sequences take longer tiles
_IMPLEMENTATION = "tempo_tiles"
_state = threading.local()


class _Stop(Exception):
    """Raised by the attention call in pass A, once the tile's keys and values are taken."""


def tile_tokens(x, tile_bytes=None):
    """Query rows per tile: the budget over an estimate of a token's activation bytes in the
    layer (16 hidden-wide tensors' worth: the attention's q, output and norms, and the gated
    MLP's intermediates, about 3.5 hidden wide each), at least 16, and at least the sequence over
    MAX_TILES (each tile re-runs the layer's small operators and re-reads its weights, so their
    number is bounded: at 524,288 tokens a tile is 16,384 rows, 2 GiB of a Llama-3.1-8B layer's
    activations in bf16 against the 18 GiB its whole-sequence tensors take then)."""
    budget = TILE_BYTES if tile_bytes is None else tile_bytes
    per_token = 16 * x.shape[-1] * x.element_size() * max(1, x.shape[0])
    return max(16, int(budget // per_token), -(-x.shape[1] // MAX_TILES))


def register():
    """tempo's tile attention in transformers' attention registry (once a process)."""
    import transformers

    if _IMPLEMENTATION not in transformers.AttentionInterface._global_mapping:
        transformers.AttentionInterface.register(_IMPLEMENTATION, _tile_attention)


class _Tile:
    """One tile's pass: mode "keys" (pass A: take the keys and values, stop), "forward" (take
    them, attend to the buffers up to the tile's end) or "grad" (pass B); rows [start, end) of
    `length`; the whole sequence's key and value buffers (made by the first tile that sees
    them); pass B's prefix leaves and the tile's keys' gradient from later tiles."""

    def __init__(self, mode, start, end, length, keys=None, values=None):
        self.mode, self.start, self.end, self.length = mode, start, end, length
        self.keys, self.values = keys, values
        self.key_prefix = self.value_prefix = self.key_grad = self.value_grad = None

    def take(self, key, value):
        if self.keys is None:
            B, H, _, D = key.shape
            self.keys = key.new_empty(B, H, self.length, D)
            self.values = value.new_empty(B, value.shape[1], self.length, value.shape[-1])
        self.keys[:, :, self.start : self.end] = key
        self.values[:, :, self.start : self.end] = value


def _check(t, dropout, kwargs):
    if dropout:
        raise ValueError("tempo tiles: attention dropout (%g) is not supported in tiled layers" % dropout)
    if kwargs.get("softcap"):
        raise ValueError("tempo tiles: soft-capped attention logits are not supported in tiled layers")
    window = kwargs.get("sliding_window")
    if window is not None and window < t.length:
        raise ValueError(
            "tempo tiles: a sliding window of %d tokens over %d is not supported in tiled layers" % (window, t.length)
        )


def _tile_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention of one tile's queries [B, Hq, T, D] against the keys up to the tile's end
    (the buffers' prefix, then the tile's own `key` and `value`), as the tile's pass asks."""
    t = _state.tile
    _check(t, dropout, kwargs)
    if t.mode == "keys":
        t.take(key.detach(), value.detach())
        raise _Stop()
    if t.mode == "forward":
        t.take(key, value)
        keys, values = t.keys[:, :, : t.end], t.values[:, :, : t.end]
    else:  # "grad": the prefix as leaves of their own, the tile's own in its graph
        if t.key_grad is not None:
            key.register_hook(lambda g, s=t: g + s.key_grad.to(g.dtype))
            value.register_hook(lambda g, s=t: g + s.value_grad.to(g.dtype))
        keys = torch.cat([t.key_prefix, key], dim=2) if t.start else key
        values = torch.cat([t.value_prefix, value], dim=2) if t.start else value
    mask = None if attention_mask is None else attention_mask[..., t.start : t.end, : t.end]
    return attend(query, keys, values, mask, scaling).transpose(1, 2).contiguous(), None


def attend(query, keys, values, mask=None, scale=None):
    """softmax(scale q kᵀ + mask) v for a tile's queries [B, Hq, T, D] against the keys up to its
    end [B, Hkv, E, D] (E >= T; Hq a multiple of Hkv). Without a mask: causal, aligned
    bottom-right (query i sees keys up to E - T + i). On CUDA in 16 bits: torch's flash kernel,
    whose causal mask is aligned bottom-right and which takes grouped keys as they are (no S x S
    tensor); elsewhere torch's sdpa with the boolean mask (T x E bytes) or the one given."""
    T, E = query.shape[2], keys.shape[2]
    d = query.shape[-1]
    cuda = query.is_cuda or _as_on_cuda[0]
    if mask is None and cuda and query.dtype in (torch.float16, torch.bfloat16) and d <= 256 and d % 8 == 0:
        return torch.ops.aten._scaled_dot_product_flash_attention(query, keys, values, 0.0, True, False, scale=scale)[0]
    if mask is None:
        mask = torch.ones(T, E, dtype=torch.bool, device=query.device).tril(E - T)
    return F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != keys.shape[1]
    )


_as_on_cuda = [False]


@contextlib.contextmanager
def as_on_cuda():
    """Inside: the tiles' attention runs as on CUDA (tempo.plan's GPU plans, whose fake tensors
    are CPU tensors)."""
    before = _as_on_cuda[0]
    _as_on_cuda[0] = True
    try:
        yield
    finally:
        _as_on_cuda[0] = before


@contextlib.contextmanager
def _tile(layer, tile):
    """The layer's attention calls tile attention while the block runs."""
    attn = getattr(layer, "self_attn", None)
    config = getattr(attn, "config", None)
    if config is None:
        raise ValueError(
            "tempo tiles: %s has no self_attn with a config (a transformers decoder layer's)" % type(layer).__name__
        )
    before = config._attn_implementation_internal
    _state.tile = tile
    config._attn_implementation_internal = _IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation_internal = before
        _state.tile = None


def _sliced(kwargs, start, end, length):
    """The layer's keyword arguments for rows [start, end): those that run along the sequence
    sliced (the mask is sliced by the tile's attention call); another such argument refused."""
    out = dict(kwargs)
    for name, value in kwargs.items():
        if value is None or name == "attention_mask":
            continue
        if name == "position_embeddings":
            out[name] = tuple(v[:, start:end] for v in value)
        elif name == "position_ids":
            out[name] = value[..., start:end]
        elif name == "cache_position":
            out[name] = value[start:end]
        elif torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == length:
            raise ValueError("tempo tiles: the layer's argument %r runs along the sequence; not tiled" % name)
    return out


def _call(fn, t, rows):
    """The layer on `rows` (rows [t.start, t.end) of its input) under tile `t`."""
    layer = fn.args[0]
    with _tile(layer, t):
        return fn.func(layer, rows, **_sliced(fn.keywords, t.start, t.end, t.length))


class _TiledLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, tile):
        ctx.fn, ctx.tile = fn, tile
        ctx.save_for_backward(x)
        S = x.shape[1]
        y = torch.empty_like(x)
        keys = values = None
        for start in range(0, S, tile):
            t = _Tile("forward", start, min(S, start + tile), S, keys, values)
            y[:, t.start : t.end] = _call(fn, t, x[:, t.start : t.end])
            keys, values = t.keys, t.values
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        fn, tile = ctx.fn, ctx.tile
        S = x.shape[1]
        starts = list(range(0, S, tile))
        keys = values = None
        with torch.no_grad():  # pass A: the whole sequence's keys and values
            for start in starts:
                t = _Tile("keys", start, min(S, start + tile), S, keys, values)
                with contextlib.suppress(_Stop):
                    _call(fn, t, x[:, start : t.end])
                keys, values = t.keys, t.values
        key_grad = torch.zeros(keys.shape, dtype=torch.float32, device=keys.device)
        value_grad = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        for start in reversed(starts):  # pass B: the last tile first
            t = _Tile("grad", start, min(S, start + tile), S)
            if start:
                t.key_prefix = keys[:, :, :start].detach().requires_grad_()
                t.value_prefix = values[:, :, :start].detach().requires_grad_()
            if t.end < S:
                t.key_grad, t.value_grad = key_grad[:, :, start : t.end], value_grad[:, :, start : t.end]
            xt = x[:, start : t.end].detach().requires_grad_(dx is not None)
            with torch.enable_grad():
                yt = _call(fn, t, xt)
            # every leaf the tile reaches: its rows, the prefix, the layer's parameters (.grad
            # summed, as reentrant checkpointing does)
            torch.autograd.backward(yt, dy[:, start : t.end])
            if dx is not None:
                dx[:, start : t.end] = xt.grad
            if start:
                key_grad[:, :, :start] += t.key_prefix.grad
                value_grad[:, :, :start] += t.value_prefix.grad
            del yt, t, xt
        return dx, None, None


def tiled_checkpoint(function, hidden_states, *args, tile_bytes=None, **kwargs):
    """transformers' gradient_checkpointing_func: `function` is partial(the layer's forward
    function, layer, **its keyword arguments), called as function(hidden_states)."""
    if args or kwargs:
        raise ValueError("tempo tiles: the layer's inputs besides hidden_states must be keyword arguments")
    if not torch.is_grad_enabled():
        return function(hidden_states)
    register()
    return _TiledLayer.apply(hidden_states, function, tile_tokens(hidden_states, tile_bytes))
