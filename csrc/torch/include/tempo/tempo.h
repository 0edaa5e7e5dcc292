// Everything a LibTorch program needs from Tempo: ops and modules.
#pragma once

#include "tempo/common.h"
#include "tempo/memory.h"
#include "tempo/models/transformer.h"
#include "tempo/nn/activation.h"
#include "tempo/nn/attention.h"
#include "tempo/nn/checkpoint.h"
#include "tempo/nn/dropout.h"
#include "tempo/nn/norm.h"
#include "tempo/ops/activation.h"
#include "tempo/ops/attention.h"
#include "tempo/ops/dropout.h"
#include "tempo/ops/norm.h"
