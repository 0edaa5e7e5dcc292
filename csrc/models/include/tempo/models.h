// The model layer (target Tempo::tempo_models): BERT, RoBERTa, GPT-2 and LLaMA-style models
// under memory policies, with everything of tempo/nn.h.
#pragma once

#include "tempo/models/config.h"
#include "tempo/models/transformer.h"
#include "tempo/nn.h"
