// The op layer's API for LibTorch programs (target Tempo::tempo_torch): the ops, the memory
// tracker and the core's build information. Modules: tempo/nn.h (Tempo::tempo_nn); models:
// tempo/models.h (Tempo::tempo_models).
#pragma once

#include "tempo/common.h"
#include "tempo/memory.h"
#include "tempo/ops/activation.h"
#include "tempo/ops/attention.h"
#include "tempo/ops/dropout.h"
#include "tempo/ops/fused_attention.h"
#include "tempo/ops/gated_mlp.h"
#include "tempo/ops/linear_attention.h"
#include "tempo/ops/linear_cross_entropy.h"
#include "tempo/ops/norm.h"
#include "tempo/ops/qkv_split.h"
#include "tempo/ops/rope.h"
