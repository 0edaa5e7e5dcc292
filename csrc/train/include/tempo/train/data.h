// Training data: a corpus of token ids split deterministically into train and eval, cut into
// windows of the sequence length, read in a seeded order that a step number alone locates
// (so a resumed or data-parallel run reads exactly the windows an uninterrupted single
// process would), and BERT's masked-LM corruption (15%, 80/10/10), seeded per window.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "tempo/models/transformer.h"
#include "tempo/train/tokenizer.h"

namespace tempo::train {

struct Corpus {
  at::Tensor train, eval;  // int64 ids, 1-D
  int64_t vocab_size = 0, mask_id = -1, pad_id = 0;
  std::string source;
};

// A file, or the regular files under a directory in sorted order; clear errors for a missing
// path, a device or pipe, or one with no text files. A file with a NUL byte in its first 8 KiB
// is binary: refused when given alone, left out of a folder's files and listed in `skipped`.
std::vector<std::string> text_files(const std::string& path, std::vector<std::string>* skipped = nullptr);
// Each file's text tokenized, files separated by the end-of-text id; the last `eval_share` of
// the ids (at least `min_eval` of them) held out for evaluation.
Corpus tokenize_corpus(const std::vector<std::string>& files, const Tokenizer& tokenizer, double eval_share,
                       int64_t min_eval);
// Ids tokenized ahead of time (`python -m tempo.pretokenize`): a safetensors file with a 1-D
// "ids" tensor and the metadata vocab_size, mask_id and pad_id.
Corpus load_pretokenized(const std::string& path, double eval_share, int64_t min_eval);
bool is_pretokenized(const std::string& path);  // a .safetensors file

// Non-overlapping windows of `seq` ids; window g of the endless stream is window
// perm_e[g mod count] of epoch e = g / count, perm_e a permutation seeded by (seed, e) (the
// identity without shuffling).
class Windows {
 public:
  Windows(at::Tensor ids, int64_t seq, uint64_t seed, bool shuffle);
  int64_t count() const { return count_; }
  // Windows first .. first + n - 1 of the stream, stacked [n, seq].
  at::Tensor batch(int64_t first, int64_t n);

 private:
  at::Tensor ids_;
  int64_t seq_, count_;
  uint64_t seed_;
  bool shuffle_;
  int64_t epoch_ = -1;
  at::Tensor perm_;
};

// The batch of windows for the objective: masked LM (labels at the corrupted positions, -100
// elsewhere; the corruption of window g seeded by (seed, g)) or causal LM (the model shifts).
tempo::models::Batch make_batch(const at::Tensor& windows, int64_t first_window, bool mlm, uint64_t seed,
                                int64_t mask_id, int64_t vocab_size);

}  // namespace tempo::train
