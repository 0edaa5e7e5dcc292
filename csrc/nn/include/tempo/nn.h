// The module layer (target Tempo::tempo_nn): torch::nn-style modules over the ops, and
// activation checkpointing, with everything of tempo/tempo.h.
#pragma once

#include "tempo/nn/activation.h"
#include "tempo/nn/attention.h"
#include "tempo/nn/checkpoint.h"
#include "tempo/nn/dropout.h"
#include "tempo/nn/gated_mlp.h"
#include "tempo/nn/linear_attention.h"
#include "tempo/nn/norm.h"
#include "tempo/tempo.h"
