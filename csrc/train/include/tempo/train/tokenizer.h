// Tokenizers for training: SentencePiece (trained on the corpus on first use, or a given model
// file), or ids tokenized ahead of time by another tokenizer (`python -m tempo.pretokenize`
// writes them with a Hugging Face tokenizer, e.g. a pretrained model's own WordPiece).
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace tempo::train {

class Tokenizer {
 public:
  // Whether this build has SentencePiece's C++ library (without it load and train raise).
  static bool available();
  // A SentencePiece model file.
  static Tokenizer load(const std::string& model_path);
  // Trains a unigram SentencePiece model of `vocab_size` pieces on the text files and writes
  // `model_path` (trained under a temporary name, loaded back, then renamed: a full disk is an
  // error, never a cut-short model). Ids: 0 <pad>, 1 <unk>, 2 <s>, 3 </s>, 4 [MASK].
  // Raises std::invalid_argument where the text is at fault (SentencePiece cannot train on it,
  // or it needs more pieces than vocab_size), c10::Error where the model cannot be written.
  static Tokenizer train(const std::vector<std::string>& files, const std::string& model_path, int vocab_size,
                         uint64_t seed = 0);
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  std::vector<int> encode(const std::string& text) const;
  std::string decode(const std::vector<int>& ids) const;
  int vocab_size() const;
  int pad_id() const;
  int eos_id() const;
  int mask_id() const;  // -1 if the model has no [MASK] piece
  const std::string& path() const { return path_; }

 private:
  Tokenizer();
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::string path_;
};

}  // namespace tempo::train
