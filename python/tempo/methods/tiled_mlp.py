"""The peers' tiled MLP (the method part `tiled-mlp`): ALST's recipe (Arctic Long Sequence
Training) runs each layer's MLP through DeepSpeed's TiledMLP, which this module re-implements as
its source describes it (deepspeed/runtime/sequence_parallel/ulysses_sp.py, 0.19.8), so that it
runs where DeepSpeed is not installed and on tempo.plan's fake tensors: the MLP's input is cut
into ceil(seq / hidden) shards along the sequence; the forward runs the MLP shard by shard
without a graph and keeps only the input; the backward runs each shard's forward again with a
graph and its backward at once, the parameters' gradients summed into .grad. Under
checkpointing the MLP's forward thus runs three times a step."""

import math

import torch


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward, x, shards):
        ctx.forward, ctx.shards = forward, shards
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([forward(part) for part in torch.chunk(x, shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1])
        grads = grad.reshape(-1, x.shape[-1])
        dx = torch.zeros_like(rows)
        start = 0
        for part in torch.chunk(rows.detach(), ctx.shards, dim=0):
            n = part.shape[0]
            leaf = part.requires_grad_(x.requires_grad)
            with torch.enable_grad():
                out = ctx.forward(leaf)
            torch.autograd.backward(out, grads[start : start + n])
            if x.requires_grad:
                dx[start : start + n] = leaf.grad
            start += n
        return None, dx.view(x.shape), None


def shards_of(x):
    """DeepSpeed's example's count: the sequence over the hidden size, rounded up."""
    return max(1, math.ceil(x.shape[-2] / x.shape[-1]))


def apply(model, stack):
    """Every decoder layer's dense MLP (a module named `mlp` with a down_proj, beside a
    `self_attn`; mixture-of-experts blocks are left as they are, as DeepSpeed's example tiles the
    dense MLP) through the tiled MLP until `stack` closes; the number of MLPs wrapped."""
    from .parts import replace_forward

    def make(inner):
        def forward(x):
            if not torch.is_grad_enabled():
                return inner(x)
            return _TiledMLP.apply(inner, x, shards_of(x))

        return forward

    wrapped = 0
    for layer in model.modules():
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(layer, "self_attn") and hasattr(mlp, "down_proj"):
            replace_forward(mlp, stack, make)
            wrapped += 1
    return wrapped
