#include "tempo/train/tokenizer.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "tempo/models/file_write.h"

#if TEMPO_WITH_SENTENCEPIECE
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

namespace tempo::train {

namespace {
namespace fs = std::filesystem;
const char* kOp = "tempo::train::Tokenizer";

// Lines of the files in order, each file read once (SentencePiece's trainer samples from them).
// A line longer than kPiece bytes is given in pieces, cut after a space where there is one and
// never inside a UTF-8 character: SentencePiece drops every sentence longer than
// --max_sentence_length (8192 bytes), so text with a paragraph per line, or none at all, would
// otherwise train on little or nothing.
class Lines : public sentencepiece::SentenceIterator {
 public:
  static constexpr size_t kPiece = 4096;
  explicit Lines(const std::vector<std::string>& files) : files_(files) { next(); }
  bool done() const override { return file_ >= files_.size() && !has_; }
  void Next() override { next(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void next() {
    has_ = false;
    while (!has_) {
      if (pos_ < text_.size()) {
        size_t n = std::min(kPiece, text_.size() - pos_);
        if (pos_ + n < text_.size()) {
          const size_t space = text_.rfind(' ', pos_ + n - 1);
          if (space != std::string::npos && space > pos_) {
            n = space + 1 - pos_;
          } else {
            while (n > 1 && (static_cast<unsigned char>(text_[pos_ + n]) & 0xC0) == 0x80) --n;
          }
        }
        line_.assign(text_, pos_, n);
        pos_ += n;
        has_ = true;
        continue;
      }
      text_.clear();
      pos_ = 0;
      if (!in_.is_open() || !std::getline(in_, text_)) {
        if (in_.is_open()) in_.close();
        if (file_ >= files_.size()) return;
        in_.open(files_[file_++]);
      }
    }
  }
  const std::vector<std::string>& files_;
  size_t file_ = 0;
  std::ifstream in_;
  std::string text_, line_;  // the line read, the piece of it given
  size_t pos_ = 0;
  bool has_ = false;
};
}  // namespace

bool Tokenizer::available() { return true; }
Tokenizer::Tokenizer() : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) {
  Tokenizer t;
  const auto status = t.sp_->Load(path);
  TORCH_CHECK(status.ok(), kOp, ": cannot load the SentencePiece model ", path, ": ", status.ToString());
  t.path_ = path;
  return t;
}

Tokenizer Tokenizer::train(const std::vector<std::string>& files, const std::string& model_path, int vocab_size,
                           uint64_t seed) {
  TORCH_CHECK(!files.empty(), kOp, ": no text files to train a tokenizer on");
  TORCH_CHECK(vocab_size >= 16, kOp, ": vocab_size must be at least 16, got ", vocab_size);
  std::string prefix = model_path;
  if (prefix.size() > 6 && prefix.compare(prefix.size() - 6, 6, ".model") == 0) prefix.resize(prefix.size() - 6);
  // Trained under a temporary name, loaded back, then renamed: a run stopped by a full disk or
  // a kill leaves no half-written model that a later run would take for its tokenizer.
  const std::string tmp = prefix + ".tmp";
  std::ostringstream args;
  args << "--model_prefix=" << tmp << " --vocab_size=" << vocab_size << " --model_type=unigram"
       << " --pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3 --user_defined_symbols=[MASK]"
       << " --input_sentence_size=300000 --shuffle_input_sentence=true --max_sentence_length=8192"
       << " --character_coverage=0.9995 --hard_vocab_limit=false --num_threads=1 --minloglevel=2";
  // One thread and a fixed seed: the same corpus gives the same tokenizer.
  sentencepiece::SetRandomGeneratorSeed(static_cast<unsigned int>(seed % 4294967295ull + 1));
  Lines lines(files);
  const auto status = sentencepiece::SentencePieceTrainer::Train(args.str(), &lines);
  const auto remove_tmp = [&]() {
    std::error_code ec;
    fs::remove(tmp + ".model", ec);
    fs::remove(tmp + ".vocab", ec);
  };
  if (!status.ok()) {
    remove_tmp();
    // Every character of the text needs a piece of its own: say so in tempo train's terms
    // ("<vocab> vs <pieces needed>" in SentencePiece's message), not with its option names.
    const std::string msg = status.ToString(), too_small = "Vocabulary size is smaller than required_chars. ";
    const size_t at = msg.find(too_small);
    long long have = 0, need = 0;
    if (at != std::string::npos && std::sscanf(msg.c_str() + at + too_small.size(), "%lld vs %lld", &have, &need) == 2)
      throw std::invalid_argument(std::string(kOp) + ": the text holds more distinct characters than a vocabulary of " +
                                  std::to_string(have) + " pieces can cover: give --vocab " + std::to_string(need) +
                                  " or more (or is --data binary?)");
    throw std::invalid_argument(std::string(kOp) + ": training SentencePiece failed: " + msg);
  }
  // SentencePiece does not report a failed write (it wrote a cut-short model on a full disk):
  // the model must load back before it takes the final name.
  sentencepiece::SentencePieceProcessor check;
  const auto loaded = check.Load(tmp + ".model");
  if (!loaded.ok()) {
    const std::string space = tempo::models::free_space_note(tmp);
    remove_tmp();
    TORCH_CHECK(false, kOp, ": the SentencePiece model just trained into ", tmp,
                ".model does not load back (is the disk full?", space.empty() ? "" : " " + space,
                "): ", loaded.ToString());
  }
  std::error_code ec, vocab_ec;
  fs::rename(tmp + ".vocab", prefix + ".vocab", vocab_ec);  // the pieces as text, for people: not needed to load
  fs::rename(tmp + ".model", prefix + ".model", ec);
  remove_tmp();  // whatever was not renamed
  TORCH_CHECK(!ec, kOp, ": cannot rename ", tmp, ".model to ", prefix, ".model: ", ec.message());
  return load(prefix + ".model");
}

std::vector<int> Tokenizer::encode(const std::string& text) const {
  std::vector<int> ids;
  const auto status = sp_->Encode(text, &ids);
  TORCH_CHECK(status.ok(), kOp, ": encoding failed: ", status.ToString());
  return ids;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  std::string s;
  const auto status = sp_->Decode(ids, &s);
  TORCH_CHECK(status.ok(), kOp, ": decoding failed: ", status.ToString());
  return s;
}

int Tokenizer::vocab_size() const { return sp_->GetPieceSize(); }
int Tokenizer::pad_id() const { return sp_->pad_id(); }
int Tokenizer::eos_id() const { return sp_->eos_id(); }
int Tokenizer::mask_id() const {
  const int id = sp_->PieceToId("[MASK]");
  return id == sp_->unk_id() ? -1 : id;
}

}  // namespace tempo::train
#else
// Built without SentencePiece's C++ library (Debian: libsentencepiece-dev with pkg-config):
// no tokenizer can be made; pretokenized ids (python -m tempo.pretokenize) still train.
namespace sentencepiece {
class SentencePieceProcessor {};
}  // namespace sentencepiece

namespace tempo::train {
namespace {
const char* kUnavailable =
    "tempo::train::Tokenizer: built without SentencePiece's C++ library (apt-get install libsentencepiece-dev "
    "pkg-config and rebuild), so no tokenizer; give --data pretokenized ids (python -m tempo.pretokenize) instead";
[[noreturn]] void unavailable() { TORCH_CHECK(false, kUnavailable); }
}  // namespace

bool Tokenizer::available() { return false; }
Tokenizer::Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;
Tokenizer Tokenizer::load(const std::string&) { unavailable(); }
Tokenizer Tokenizer::train(const std::vector<std::string>&, const std::string&, int, uint64_t) {
  throw std::invalid_argument(kUnavailable);  // not a failed write: what the build cannot do
}
std::vector<int> Tokenizer::encode(const std::string&) const { unavailable(); }
std::string Tokenizer::decode(const std::vector<int>&) const { unavailable(); }
int Tokenizer::vocab_size() const { unavailable(); }
int Tokenizer::pad_id() const { unavailable(); }
int Tokenizer::eos_id() const { unavailable(); }
int Tokenizer::mask_id() const { unavailable(); }

}  // namespace tempo::train
#endif
