#include "tempo/train/data.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tempo/models/pretrained.h"

namespace tempo::train {

namespace {
namespace fs = std::filesystem;
const char* kOp = "tempo::train";

uint64_t mix(uint64_t seed, uint64_t x) {  // splitmix64 of the pair: independent streams per (seed, x)
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + x + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

Corpus split(at::Tensor ids, double share, int64_t min_eval, Corpus c) {
  const int64_t n = ids.numel();
  const int64_t held = std::max<int64_t>(static_cast<int64_t>(n * share), min_eval);
  TORCH_CHECK(n > held + min_eval, kOp, ": the corpus ", c.source, " has ", n, " tokens: too few to hold out ", held,
              " for evaluation and train on at least one sequence");
  c.train = ids.narrow(0, 0, n - held);
  c.eval = ids.narrow(0, n - held, held);
  return c;
}
}  // namespace

namespace {
// A NUL byte in the first 8 KiB: not text (what grep and git call binary).
bool is_binary(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  char buf[8192];
  in.read(buf, sizeof buf);
  return std::find(buf, buf + in.gcount(), '\0') != buf + in.gcount();
}
}  // namespace

std::vector<std::string> text_files(const std::string& path, std::vector<std::string>* skipped) {
  TORCH_CHECK(!path.empty(), kOp, ": no --data given");
  std::error_code ec;
  TORCH_CHECK(fs::exists(path, ec), kOp, ": --data ", path, " does not exist");
  std::vector<std::string> files;
  if (fs::is_regular_file(path, ec)) {
    TORCH_CHECK(!is_binary(path), kOp, ": --data ", path, " is not text (it holds NUL bytes)");
    files.push_back(path);
  } else {
    // A device or a pipe cannot be read twice (the tokenizer's training, then the corpus).
    TORCH_CHECK(fs::is_directory(path, ec), kOp, ": --data ", path, " is neither a file nor a folder");
    fs::recursive_directory_iterator it(path, fs::directory_options::skip_permission_denied, ec), end;
    TORCH_CHECK(!ec, kOp, ": cannot read the folder --data ", path, ": ", ec.message());
    for (; it != end; it.increment(ec)) {
      TORCH_CHECK(!ec, kOp, ": reading the folder --data ", path, " failed: ", ec.message());
      if (!it->is_regular_file(ec)) continue;
      if (is_binary(it->path())) {
        if (skipped) skipped->push_back(it->path().string());
      } else {
        files.push_back(it->path().string());
      }
    }
    std::sort(files.begin(), files.end());
    if (skipped) std::sort(skipped->begin(), skipped->end());
  }
  TORCH_CHECK(!files.empty(), kOp, ": --data ", path, " holds no text files");
  return files;
}

Corpus tokenize_corpus(const std::vector<std::string>& files, const Tokenizer& tok, double share, int64_t min_eval) {
  std::vector<int64_t> ids;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    TORCH_CHECK(in.good(), kOp, ": cannot read ", f);
    std::stringstream text;
    text << in.rdbuf();
    // Paragraph by paragraph (SentencePiece treats a newline as a space).
    const std::string s = text.str();
    size_t i = 0;
    bool any = false;
    while (i < s.size()) {
      size_t j = s.find("\n\n", i);
      if (j == std::string::npos) j = s.size();
      if (j > i) {
        for (int id : tok.encode(s.substr(i, j - i))) ids.push_back(id);
        any = true;
      }
      i = j + 2;
    }
    if (any) ids.push_back(tok.eos_id());
  }
  Corpus c;
  c.vocab_size = tok.vocab_size();
  c.mask_id = tok.mask_id();
  c.pad_id = tok.pad_id();
  c.source = files.size() == 1 ? files[0] : std::to_string(files.size()) + " files";
  TORCH_CHECK(!ids.empty(), kOp, ": the corpus (", c.source, ") is empty");
  return split(at::tensor(ids, at::kLong), share, min_eval, c);
}

bool is_pretokenized(const std::string& path) {
  return path.size() > 12 && path.compare(path.size() - 12, 12, ".safetensors") == 0 && fs::is_regular_file(path);
}

Corpus load_pretokenized(const std::string& path, double share, int64_t min_eval) {
  auto t = tempo::models::read_safetensors(path);
  TORCH_CHECK(t.count("ids") && t.at("ids").dim() == 1 && !at::isFloatingType(t.at("ids").scalar_type()), kOp, ": ",
              path, " has no 1-D integer tensor 'ids' (write it with python -m tempo.pretokenize)");
  TORCH_CHECK(t.count("meta") && t.at("meta").numel() == 3, kOp, ": ", path,
              " has no 'meta' tensor [vocab_size, mask_id, pad_id]");
  const at::Tensor meta = t.at("meta").to(at::kLong);
  Corpus c;
  c.vocab_size = meta[0].item<int64_t>();
  c.mask_id = meta[1].item<int64_t>();
  c.pad_id = meta[2].item<int64_t>();
  c.source = path;
  at::Tensor ids = t.at("ids").to(at::kLong);
  TORCH_CHECK(ids.numel() > 0, kOp, ": the corpus ", path, " is empty");
  TORCH_CHECK(ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < c.vocab_size, kOp, ": ", path,
              " has ids outside [0, ", c.vocab_size, ")");
  return split(ids, share, min_eval, c);
}

Windows::Windows(at::Tensor ids, int64_t seq, uint64_t seed, bool shuffle)
    : ids_(std::move(ids)), seq_(seq), count_(ids_.numel() / seq), seed_(seed), shuffle_(shuffle) {
  TORCH_CHECK(count_ > 0, kOp, ": ", ids_.numel(), " tokens make no sequence of ", seq);
}

at::Tensor Windows::batch(int64_t first, int64_t n) {
  std::vector<at::Tensor> rows;
  for (int64_t g = first; g < first + n; ++g) {
    const int64_t e = g / count_;
    if (shuffle_ && e != epoch_) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(mix(seed_, static_cast<uint64_t>(e)));
      perm_ = at::randperm(count_, gen, at::TensorOptions().dtype(at::kLong));
      epoch_ = e;
    }
    const int64_t w = shuffle_ ? perm_[g % count_].item<int64_t>() : g % count_;
    rows.push_back(ids_.narrow(0, w * seq_, seq_));
  }
  return at::stack(rows);
}

tempo::models::Batch make_batch(const at::Tensor& windows, int64_t first, bool mlm, uint64_t seed, int64_t mask_id,
                                int64_t vocab) {
  tempo::models::Batch b;
  b.input_ids = windows.clone();
  b.attention_mask = at::ones_like(windows);
  if (!mlm) return b;
  TORCH_CHECK(mask_id >= 0, kOp, ": masked-LM training needs a [MASK] token; the tokenizer has none");
  b.labels = at::full_like(windows, -100);
  const int64_t S = windows.size(1);
  for (int64_t i = 0; i < windows.size(0); ++i) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(mix(seed ^ 0x5EEDull, static_cast<uint64_t>(first + i)));
    const at::Tensor u = at::rand({S}, gen);
    at::Tensor pick = u < 0.15;
    if (!pick.any().item<bool>()) pick[u.argmin()] = true;  // at least one target per sequence
    const at::Tensor r = at::rand({S}, gen);
    const at::Tensor random_ids = at::randint(0, vocab, {S}, gen, at::TensorOptions().dtype(at::kLong));
    at::Tensor row = b.input_ids[i];
    b.labels[i].copy_(at::where(pick, row, b.labels[i]));
    // 80% [MASK], 10% a random token, 10% unchanged
    row.copy_(at::where(pick.logical_and(r < 0.8), at::full({}, mask_id, row.options()), row));
    row.copy_(at::where(pick.logical_and(r >= 0.8).logical_and(r < 0.9), random_ids, row));
  }
  return b;
}

}  // namespace tempo::train
