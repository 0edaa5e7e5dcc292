// The model layer (target Tempo::tempo_models): BERT, RoBERTa, GPT-2 and LLaMA-style models
// under methods, the PerformerLM and its SLiM chunked trainer, with everything of
// tempo/nn.h.
#pragma once

#include "tempo/models/config.h"
#include "tempo/models/performer.h"
#include "tempo/models/pretrained.h"
#include "tempo/models/slim.h"
#include "tempo/models/transformer.h"
#include "tempo/nn.h"
