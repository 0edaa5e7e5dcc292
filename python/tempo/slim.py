"""SLiM (NeurIPS 2021): training causal linear-attention Transformers in memory that does not
grow with the sequence length, with exact gradients (docs/slim.md).

`loss_and_backward(model, tokens, chunk)` runs the sequence in chunks twice: a forward without
a graph that carries each layer's prefix-sum state up to the last chunk, then a backward over
the chunks in reverse. For each chunk it rebuilds every layer's state before the chunk by
subtracting the chunk's own contribution from the state after it, recomputes the chunk with
autograd from those states (leaves), and back-propagates the chunk's loss plus the surrogate
sum_r <G_r, state_r after the chunk>, where G_r is the gradient that flowed into that state
from later chunks. The parameters' gradients accumulate exactly as full backpropagation's
would; memory is one chunk's activations and one state per layer.

`PerformerLM` is the model it trains: a GPT-2-style pre-LN stack of tempo's
CausalLinearAttention, LayerNorm and GELU over a byte vocabulary.
"""

import numbers

import torch

from .nn import GELU, CausalLinearAttention, LayerNorm

# (L, d_model, layers, FFN, heads) of the SLiM paper's reference configurations (byte vocabulary, sqr features).
PRESETS = {"copy": (512, 256, 1, 1024, 4), "ptb": (1024, 512, 3, 2048, 8), "enwik8": (4096, 1024, 3, 4096, 16)}


class PerformerBlock(torch.nn.Module):
    def __init__(self, d_model, heads, ffn, feature_map="sqr", mode="iterative"):
        super().__init__()
        self.ln1 = LayerNorm(d_model)
        self.attn = CausalLinearAttention(d_model, heads, feature_map=feature_map, mode=mode)
        self.ln2 = LayerNorm(d_model)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d_model, ffn), GELU(), torch.nn.Linear(ffn, d_model))

    def forward(self, x, state=None):
        a, state = self.attn(self.ln1(x), state)
        x = x + a
        return x + self.mlp(self.ln2(x)), state

    def forward_rebuilding(self, x, state_after):
        """The block from the state before x, rebuilt from the state after it (a leaf):
        (output, state after, state before)."""
        a, state, before = self.attn.forward_rebuilding(self.ln1(x), state_after)
        x = x + a
        return x + self.mlp(self.ln2(x)), state, before


class PerformerLM(torch.nn.Module):
    """A causal linear-attention language model over bytes (vocabulary 256 by default) with
    fixed sinusoidal positions up to `max_len` (no parameters that grow with the length, and a
    chunk computes its own). `forward_chunk(tokens, offset, states)` runs
    positions offset .. offset + C - 1 from the layers' states and returns (logits, states)."""

    def __init__(
        self, d_model=256, layers=1, ffn=1024, heads=4, max_len=512, vocab=256, feature_map="sqr", mode="iterative"
    ):
        super().__init__()
        self.vocab, self.max_len = vocab, max_len
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.d_model = d_model
        self.blocks = torch.nn.ModuleList(PerformerBlock(d_model, heads, ffn, feature_map, mode) for _ in range(layers))
        self.ln = LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)

    @classmethod
    def preset(cls, name, **overrides):
        if name not in PRESETS:
            raise ValueError("tempo.slim: unknown preset %r; known: %s" % (name, ", ".join(PRESETS)))
        L, d, n, f, h = PRESETS[name]
        return cls(**{"d_model": d, "layers": n, "ffn": f, "heads": h, "max_len": L, **overrides})

    def positions(self, offset, length, device, dtype):
        """Sinusoidal encodings of positions offset .. offset + length - 1 (Vaswani et al.)."""
        pos = torch.arange(offset, offset + length, device=device, dtype=torch.float64).unsqueeze(1)
        freq = torch.exp(
            torch.arange(0, self.d_model, 2, device=device, dtype=torch.float64)
            * (-torch.log(torch.tensor(10000.0, dtype=torch.float64)) / self.d_model)
        )
        enc = torch.zeros(length, self.d_model, device=device, dtype=torch.float64)
        enc[:, 0::2] = torch.sin(pos * freq)
        enc[:, 1::2] = torch.cos(pos * freq)[:, : self.d_model // 2]
        return enc.to(dtype)

    def embed_chunk(self, tokens, offset):
        x = self.embed(tokens)
        return x + self.positions(offset, tokens.shape[1], tokens.device, x.dtype)

    def forward_chunk(self, tokens, offset=0, states=None):
        x = self.embed_chunk(tokens, offset)
        states = states or [None] * len(self.blocks)
        new = []
        for block, s in zip(self.blocks, states):
            x, s = block(x, s)
            new.append(s)
        return self.head(self.ln(x)), new

    def forward(self, tokens):
        return self.forward_chunk(tokens)[0]


def _check(model, tokens, chunk):
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError("tempo.slim: tokens must be an integer tensor [batch, length]")
    if tokens.shape[0] == 0:
        raise ValueError("tempo.slim: the batch is empty (tokens of shape %s)" % (tuple(tokens.shape),))
    if tokens.shape[1] < 2:
        raise ValueError(
            "tempo.slim: the sequence needs at least 2 tokens (an input and a target), got %d" % tokens.shape[1]
        )
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= model.vocab):
        raise ValueError(
            "tempo.slim: token ids must be in [0, %d), got [%d, %d]"
            % (model.vocab, int(tokens.min()), int(tokens.max()))
        )
    if tokens.shape[1] - 1 > model.max_len:
        raise ValueError("tempo.slim: %d input positions exceed the model's %d" % (tokens.shape[1] - 1, model.max_len))
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk <= 0):
        raise ValueError(
            "tempo.slim: chunk must be a positive integer (or None: the whole sequence), got %r" % (chunk,)
        )
    return None if chunk is None else int(chunk)


def _chunk_loss(model, logits, targets, weight):
    """Summed cross-entropy of the chunk's targets (weight 0 drops a position)."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return (ce * weight.flatten().to(ce.dtype)).sum()


def full_loss_and_backward(model, tokens, loss_weight=None):
    """The reference: one forward and backward over the whole sequence."""
    _check(model, tokens, None)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    weight = _weights(loss_weight, targets)
    logits, _ = model.forward_chunk(inputs)
    loss = _chunk_loss(model, logits, targets, weight) / weight.sum().clamp_min(1)
    loss.backward()
    return loss.detach()


def _weights(loss_weight, targets):
    if loss_weight is None:
        return torch.ones(targets.shape, dtype=torch.float32, device=targets.device)
    w = loss_weight.to(torch.float32)
    if w.shape != targets.shape:
        raise ValueError(
            "tempo.slim: loss_weight must be [batch, length - 1] (one per target), got %s" % (tuple(w.shape),)
        )
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):  # else a NaN or a negative loss, silently
        raise ValueError(
            "tempo.slim: loss_weight must be finite and >= 0 (0 drops a target), got values in [%g, %g]"
            % (float(w.min()), float(w.max()))
        )
    return w


def loss_and_backward(model, tokens, chunk, loss_weight=None):
    """The mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1] (weighted by
    loss_weight [batch, length - 1] if given), with its gradient accumulated into the
    parameters' .grad, computed in chunks of `chunk` positions (None: one chunk) in memory
    that does not grow with the length. Returns the loss (a detached scalar)."""
    chunk = _check(model, tokens, chunk)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    weight = _weights(loss_weight, targets)
    L = inputs.shape[1]
    chunk = L if chunk is None else min(chunk, L)
    total = weight.sum().clamp_min(1)
    starts = list(range(0, L, chunk))
    # Forward without a graph up to the last chunk: each layer's state before it, and the loss
    # so far (the last chunk's forward is the backward's first recomputation).
    states, loss = [None] * len(model.blocks), torch.zeros((), dtype=torch.float64, device=tokens.device)
    with torch.no_grad():
        for s in starts[:-1]:
            logits, states = model.forward_chunk(inputs[:, s : s + chunk], s, states)
            loss += _chunk_loss(model, logits, targets[:, s : s + chunk], weight[:, s : s + chunk]).double()
    # Backward over the chunks in reverse, carrying the states and their gradients.
    grads = [None] * len(model.blocks)
    params = [p for p in model.parameters() if p.requires_grad]
    # bf16/fp16 parameters: each chunk's gradient is summed in float32 and rounded into .grad
    # once at the end, as full backpropagation rounds each parameter's gradient once (summed in
    # .grad's own dtype, one rounding per chunk: 6.8x full backprop's error at chunk 1).
    low = any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
    sums = (
        [
            torch.zeros(p.shape, dtype=torch.float32 if p.dtype != torch.float64 else p.dtype, device=p.device)
            for p in params
        ]
        if low
        else None
    )
    for s in reversed(starts):
        x = model.embed_chunk(inputs[:, s : s + chunk], s)
        before, after = [], []
        last = s == starts[-1]
        for r, block in enumerate(model.blocks):
            if s == 0:  # the first chunk starts from zeros: no state, nothing to rebuild
                x, out_state = block(x)
                prev_leaf = None
            elif last:  # the forward stopped before this chunk: its state is the one before
                prev_leaf = (states[r][0].detach().requires_grad_(), states[r][1].detach().requires_grad_())
                x, out_state = block(x, prev_leaf)
            else:  # the state before the chunk: after minus the chunk's own sums
                x, out_state, prev_leaf = block.forward_rebuilding(x, states[r])
            before.append(prev_leaf)
            after.append(out_state)
            states[r] = None if prev_leaf is None else (prev_leaf[0].detach(), prev_leaf[1].detach())
        logits = model.head(model.ln(x))
        chunk_loss = _chunk_loss(model, logits, targets[:, s : s + chunk], weight[:, s : s + chunk])
        if last:
            loss += chunk_loss.detach().double()
        phi = chunk_loss / total
        for r in range(len(model.blocks)):  # the surrogate: <G_r, state_r after the chunk>
            if grads[r] is not None:
                phi = phi + (after[r][0] * grads[r][0]).sum() + (after[r][1] * grads[r][1]).sum()
        leaves = [t for b in before if b is not None for t in b]
        if low:
            got = torch.autograd.grad(phi, params + leaves, allow_unused=True)
            for acc, g in zip(sums, got[: len(params)]):
                if g is not None:
                    acc += g
            it = iter(got[len(params) :])
            grads = [None if b is None else (next(it), next(it)) for b in before]
        else:
            # Accumulates into the parameters' .grad (as full backprop would) and the leaves' .grad.
            phi.backward(inputs=params + leaves)
            grads = [None if b is None else (b[0].grad, b[1].grad) for b in before]
    if low:
        for p, acc in zip(params, sums):
            p.grad = (acc if p.grad is None else acc + p.grad).to(p.dtype)
    return (loss / total).to(model.head.weight.dtype)


def gradient_discrepancy(model, tokens, chunk, loss_weight=None):
    """Relative L2 distance between the parameters' gradients from loss_and_backward and from
    full backpropagation, and the two losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    full = full_loss_and_backward(model, tokens, loss_weight)
    ref = torch.cat([p.grad.flatten().double() for p in params])
    model.zero_grad(set_to_none=True)
    chunked = loss_and_backward(model, tokens, chunk, loss_weight)
    got = torch.cat([p.grad.flatten().double() for p in params])
    model.zero_grad(set_to_none=True)
    return ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item(), float(full), float(chunked)


__all__ = [
    "PerformerLM",
    "PerformerBlock",
    "PRESETS",
    "loss_and_backward",
    "full_loss_and_backward",
    "gradient_discrepancy",
]


if __name__ == "__main__":  # python -m tempo.slim: the measurement, an application (tempo/apps/slim.py)
    import sys

    from tempo.apps.slim import main

    sys.exit(main())
