"""SLiM (NeurIPS 2021): training causal linear-attention Transformers in memory that does not
grow with the sequence length, with exact gradients (design notes: TECHNIQUES.md section 8).

`loss_and_backward(model, tokens, chunk)` runs the sequence in chunks twice: a forward without
a graph that carries each layer's prefix-sum state to the end, then a backward over the
chunks in reverse. For each chunk it rebuilds every layer's state before the chunk by
subtracting the chunk's own contribution from the state after it, recomputes the chunk with
autograd from those states (leaves), and back-propagates the chunk's loss plus the surrogate
sum_r <G_r, state_r after the chunk>, where G_r is the gradient that flowed into that state
from later chunks. The parameters' gradients accumulate exactly as full backpropagation's
would; memory is one chunk's activations and one state per layer.

`PerformerLM` is the model it trains: a GPT-2-style pre-LN stack of tempo's
CausalLinearAttention, LayerNorm and GELU over a byte vocabulary.
"""
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

    def state_increment(self, x):
        """What this chunk adds to the layer's state: the attention's sums over the chunk."""
        return self.attn.kv_sums(self.ln1(x))

    def forward(self, x, state=None):
        a, state = self.attn(self.ln1(x), state)
        x = x + a
        return x + self.mlp(self.ln2(x)), state


class PerformerLM(torch.nn.Module):
    """A causal linear-attention language model over bytes (vocabulary 256 by default) with
    learned absolute positions up to `max_len`. `forward_chunk(tokens, offset, states)` runs
    positions offset .. offset + C - 1 from the layers' states and returns (logits, states)."""

    def __init__(self, d_model=256, layers=1, ffn=1024, heads=4, max_len=512, vocab=256, feature_map="sqr",
                 mode="iterative"):
        super().__init__()
        self.vocab, self.max_len = vocab, max_len
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(max_len, d_model)
        self.blocks = torch.nn.ModuleList(PerformerBlock(d_model, heads, ffn, feature_map, mode) for _ in range(layers))
        self.ln = LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)

    @classmethod
    def preset(cls, name, **overrides):
        if name not in PRESETS:
            raise ValueError("tempo.slim: unknown preset %r; known: %s" % (name, ", ".join(PRESETS)))
        L, d, n, f, h = PRESETS[name]
        return cls(**{"d_model": d, "layers": n, "ffn": f, "heads": h, "max_len": L, **overrides})

    def embed_chunk(self, tokens, offset):
        positions = torch.arange(offset, offset + tokens.shape[1], device=tokens.device)
        return self.embed(tokens) + self.pos(positions)

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
    if tokens.shape[1] < 2:
        raise ValueError("tempo.slim: the sequence needs at least 2 tokens (an input and a target), got %d"
                         % tokens.shape[1])
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= model.vocab):
        raise ValueError("tempo.slim: token ids must be in [0, %d), got [%d, %d]"
                         % (model.vocab, int(tokens.min()), int(tokens.max())))
    if tokens.shape[1] - 1 > model.max_len:
        raise ValueError("tempo.slim: %d input positions exceed the model's %d" % (tokens.shape[1] - 1, model.max_len))
    if chunk is not None and (not isinstance(chunk, int) or chunk <= 0):
        raise ValueError("tempo.slim: chunk must be a positive integer (or None: the whole sequence), got %r"
                         % (chunk,))


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
        raise ValueError("tempo.slim: loss_weight must be [batch, length - 1] (one per target), got %s" % (tuple(w.shape),))
    return w


def loss_and_backward(model, tokens, chunk, loss_weight=None):
    """The mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1] (weighted by
    loss_weight [batch, length - 1] if given), with its gradient accumulated into the
    parameters' .grad, computed in chunks of `chunk` positions (None: one chunk) in memory
    that does not grow with the length. Returns the loss (a detached scalar)."""
    _check(model, tokens, chunk)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    weight = _weights(loss_weight, targets)
    L = inputs.shape[1]
    chunk = L if chunk is None else min(chunk, L)
    total = weight.sum().clamp_min(1)
    starts = list(range(0, L, chunk))
    # Forward without a graph: each layer's state after the last chunk, and the loss.
    states, loss = [None] * len(model.blocks), torch.zeros((), dtype=torch.float64, device=tokens.device)
    with torch.no_grad():
        for s in starts:
            logits, states = model.forward_chunk(inputs[:, s:s + chunk], s, states)
            loss += _chunk_loss(model, logits, targets[:, s:s + chunk], weight[:, s:s + chunk]).double()
    # Backward over the chunks in reverse, carrying the states and their gradients.
    grads = [None] * len(model.blocks)
    for s in reversed(starts):
        x = model.embed_chunk(inputs[:, s:s + chunk], s)
        before, after = [], []
        for r, block in enumerate(model.blocks):
            with torch.no_grad():  # the state before the chunk: after minus the chunk's own sums
                num_inc, den_inc = block.state_increment(x.detach())
                prev = (states[r][0] - num_inc.to(states[r][0].dtype), states[r][1] - den_inc.to(states[r][1].dtype))
            if s == 0:  # the first chunk starts from zeros: no state, nothing to rebuild
                prev_leaf = None
            else:
                prev_leaf = (prev[0].requires_grad_(), prev[1].requires_grad_())
            x, out_state = block(x, prev_leaf)
            before.append(prev_leaf)
            after.append(out_state)
            states[r] = prev
        logits = model.head(model.ln(x))
        phi = _chunk_loss(model, logits, targets[:, s:s + chunk], weight[:, s:s + chunk]) / total
        for r in range(len(model.blocks)):  # the surrogate: <G_r, state_r after the chunk>
            if grads[r] is not None:
                phi = phi + (after[r][0] * grads[r][0]).sum() + (after[r][1] * grads[r][1]).sum()
        leaves = [t for b in before if b is not None for t in b]
        params = [p for p in model.parameters() if p.requires_grad]
        got = torch.autograd.grad(phi, params + leaves, allow_unused=True)
        for p, g in zip(params, got[:len(params)]):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        it = iter(got[len(params):])
        grads = [None if b is None else (next(it), next(it)) for b in before]
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


__all__ = ["PerformerLM", "PerformerBlock", "PRESETS", "loss_and_backward", "full_loss_and_backward",
           "gradient_discrepancy"]
