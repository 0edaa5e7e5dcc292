"""Floating-point operation counts of tempo's ops that hold matmuls, for torch.utils.flop_counter
and through it for torch.compile's partitioner: under an activation_memory_budget it weighs
what recomputing an op in the backward costs by its counted flops, and an op it cannot count is
taken as free (an op of three GEMMs recomputed for nothing). Elementwise and row ops count 0,
as torch's own pointwise ops do. Each count: 2 multiply-adds per product term."""

import math

import torch
from torch.utils.flop_counter import register_flop_formula


def _rows(shape):
    return math.prod(shape[:-1])


@register_flop_formula(torch.ops.tempo.gated_mlp_forward)
def _gated_mlp(x, gate_weight, up_weight, down_weight, *args, out_shape=None, **kwargs):
    n, h = _rows(x), x[-1]
    projections = gate_weight[0] + (up_weight[0] if up_weight is not None else 0)  # [2 I] rows when fused
    return 2 * n * h * projections + 2 * n * down_weight[1] * down_weight[0]


@register_flop_formula(torch.ops.tempo.linear_cross_entropy_forward)
def _linear_cross_entropy(hidden, weight, *args, out_shape=None, **kwargs):
    return 2 * _rows(hidden) * hidden[-1] * weight[0]


@register_flop_formula([torch.ops.tempo.attention_forward, torch.ops.tempo.fused_attention_forward])
def _attention(q, k, v, *args, out_shape=None, **kwargs):
    # q k^T and P v: [..., Sq, D] x [..., Sk, D] and [..., Sq, Sk] x [..., Sk, Dv]
    return 2 * _rows(q) * k[-2] * (q[-1] + v[-1])
