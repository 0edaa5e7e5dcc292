// The op layer's API for LibTorch programs (target Tempo::tempo_torch): the ops (tempo/ops.h:
// each unit's tempo/ops/<unit>.h), the memory tracker and the core's build information.
// Modules: tempo/nn.h (Tempo::tempo_nn); models: tempo/models.h (Tempo::tempo_models).
#pragma once

#include "tempo/common.h"
#include "tempo/memory.h"
#include "tempo/ops.h"  // every op's C++ API: generated from csrc/ops.json by the build
