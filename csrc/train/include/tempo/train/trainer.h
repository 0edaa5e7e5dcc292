// The trainer behind `tempo train`: a BERT/RoBERTa (masked LM) or GPT-2/LLaMA (causal LM) of
// a preset or a Hugging Face folder, under a method, on a real corpus; AdamW with
// weight decay (not on biases and norms), linear warm-up then linear decay, gradient
// accumulation and clipping; eval loss every N steps; a CSV log; checkpoints every N steps
// and exact resumption; data parallel over a Communicator.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tempo/train/distributed.h"  // Communicator

namespace tempo::train {

// A request to end a running train() early (`tempo train` makes one of SIGINT and SIGTERM):
// the step in progress finishes and is checkpointed (unless save_every is 0), and train()
// returns with TrainSummary::stopped set. A request on any rank stops every rank after the same
// step. `accepting` is true while train() runs its steps, the only time a request is acted on:
// a signal handler can fall back to the signal's default action outside them.
struct StopRequest {
  std::atomic<int> requested{0};  // non-zero: stop (the CLI stores the signal's number)
  std::atomic<bool> accepting{false};
};

struct TrainOptions {
  std::string model = "bert-base";  // a preset, or a Hugging Face folder (config.json + safetensors)
  int64_t hidden = 0, layers = 0, heads = 0, intermediate = 0, positions = 0;  // preset overrides (0: keep)
  double dropout = -1;    // hidden and attention dropout (< 0: the model's)
  std::string objective;  // mlm | clm (empty: the architecture's)
  std::string method = "tempo";
  std::string data;                 // a text file or directory, or pretokenized .safetensors
  std::string tokenizer = "train";  // "train" (SentencePiece on the corpus) or a .model file
  int64_t vocab = 8000;             // pieces of a trained tokenizer
  int64_t seq = 128, batch = 8, accum = 1, steps = 300, warmup = 30;
  double lr = 5e-4, weight_decay = 0.01, clip = 1.0;
  int64_t eval_every = 50, save_every = 100, eval_batches = 8;
  uint64_t seed = 0;
  std::string dtype = "fp32", device = "cpu";
  int64_t budget = 0;  // bytes on the device (0: none): a batch past it does not fit
  std::string out;
  bool resume = false;
  bool progress = false;  // a progress line on stderr
  // Data parallel: gradients summed in buckets of about this many bytes, each started from
  // inside the last backward of a step as soon as its gradients are final (overlap), or all
  // after it (no overlap).
  int64_t bucket_bytes = 25ll << 20;
  bool overlap = true;
  StopRequest* stop = nullptr;  // none: the run goes to `steps` (or fails)
};

struct TrainSummary {
  int64_t first_step = 0, last_step = 0;
  double first_loss = 0, last_loss = 0, first_eval = std::nan(""), last_eval = std::nan("");  // NaN: not evaluated
  double tokens_per_s = 0;
  int64_t peak_bytes = 0;
  bool stopped = false;            // ended early by a StopRequest, after last_step
  std::vector<std::string> notes;  // what happened beyond the steps (resumed from, skipped damaged checkpoints)
};

// Runs the training; user errors (missing data, an empty corpus, a sequence longer than the
// model's positions, a batch that does not fit, ...) throw std::invalid_argument with a clear
// message, before anything is written over a good checkpoint. The run's folder is locked while
// it runs: a second train() into the same `out` (another process) is refused.
TrainSummary train(const TrainOptions& options, Communicator& comm);

// The learning rate at `step` (1-based): linear warm-up to `lr`, then linear decay to 0 at `steps`.
double learning_rate(int64_t step, int64_t warmup, int64_t steps, double lr);

}  // namespace tempo::train
