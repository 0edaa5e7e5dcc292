#include "tempo/models/config.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

namespace tempo::models {

const char* arch_name(Arch arch) {
  switch (arch) {
    case Arch::kBert:
      return "bert";
    case Arch::kRoberta:
      return "roberta";
    case Arch::kGpt2:
      return "gpt2";
    case Arch::kLlama:
      return "llama";
  }
  return "unknown";
}

Arch parse_arch(const std::string& name) {
  if (name == "bert") return Arch::kBert;
  if (name == "roberta") return Arch::kRoberta;
  if (name == "gpt2") return Arch::kGpt2;
  if (name == "llama") return Arch::kLlama;
  TORCH_CHECK(false, "tempo::models: unknown architecture '", name, "' (bert, roberta, gpt2, llama)");
}

ModelConfig ModelConfig::for_arch(Arch arch) {
  ModelConfig c;
  c.arch = arch;
  c.name = std::string("custom-") + arch_name(arch);
  switch (arch) {
    case Arch::kBert:
      break;
    case Arch::kRoberta:
      c.type_vocab = 1;
      c.pad_id = 1;
      c.eps = 1e-5;
      break;
    case Arch::kGpt2:
      c.type_vocab = 0;
      c.eps = 1e-5;
      break;
    case Arch::kLlama:
      c.type_vocab = 0;
      c.eps = 1e-6;
      c.dropout = c.attention_dropout = 0.0;
      break;
  }
  return c;
}

namespace {
ModelConfig make(Arch arch, const char* name, int64_t vocab, int64_t hidden, int64_t layers, int64_t heads,
                 int64_t intermediate, int64_t positions) {
  ModelConfig c = ModelConfig::for_arch(arch);
  c.name = name;
  c.vocab = vocab;
  c.hidden = hidden;
  c.layers = layers;
  c.heads = heads;
  c.intermediate = intermediate;
  c.max_positions = positions;
  return c;
}
}  // namespace

std::vector<std::string> ModelConfig::presets() {
  return {"bert-base", "bert-large",  "roberta-base", "roberta-large",
          "gpt2",      "gpt2-medium", "gpt2-large",   "llama-small"};
}

ModelConfig ModelConfig::preset(const std::string& name) {
  if (name == "bert-base") return make(Arch::kBert, "bert-base", 30522, 768, 12, 12, 3072, 512);
  if (name == "bert-large") return make(Arch::kBert, "bert-large", 30522, 1024, 24, 16, 4096, 512);
  if (name == "roberta-base") return make(Arch::kRoberta, "roberta-base", 50265, 768, 12, 12, 3072, 514);
  if (name == "roberta-large") return make(Arch::kRoberta, "roberta-large", 50265, 1024, 24, 16, 4096, 514);
  if (name == "gpt2") return make(Arch::kGpt2, "gpt2", 50257, 768, 12, 12, 3072, 1024);
  if (name == "gpt2-medium") return make(Arch::kGpt2, "gpt2-medium", 50257, 1024, 24, 16, 4096, 1024);
  if (name == "gpt2-large") return make(Arch::kGpt2, "gpt2-large", 50257, 1280, 36, 20, 5120, 1024);
  if (name == "llama-small") return make(Arch::kLlama, "llama-small", 32000, 512, 8, 8, 1376, 2048);
  std::ostringstream known;
  for (const auto& p : presets()) known << " " << p;
  TORCH_CHECK(false, "tempo::models: unknown model preset '", name, "'; known:", known.str());
}

namespace {
// In double, so that absurd sizes cannot overflow (exact below 2^53, where validate() stops).
double parameters(const ModelConfig& c) {
  const bool llama = c.arch == Arch::kLlama;
  const double h = static_cast<double>(c.hidden), inter = static_cast<double>(c.intermediate);
  const double vocab = static_cast<double>(c.vocab), norm = llama ? h : 2 * h;  // RMSNorm: weight; LayerNorm: + bias
  const double bias = llama ? 0 : 1;
  double layer = 3 * h * h + bias * 3 * h + h * h + bias * h  // q/k/v and out projections
                 + 2 * h * inter + bias * (inter + h)         // fc1, fc2
                 + 2 * norm;
  if (llama) layer += h * inter;  // the SwiGLU gate
  double n = vocab * h + (llama ? 0 : static_cast<double>(c.max_positions) * h) +
             static_cast<double>(c.type_vocab) * h + static_cast<double>(c.layers) * layer;
  if (c.arch == Arch::kGpt2 || llama) return n + norm + (llama ? h * vocab : 0);  // final norm; LLaMA's LM head
  const double labels = static_cast<double>(c.num_labels);
  return n + 2 * h                               // embedding norm
         + (h * h + h) + 2 * h + vocab           // MLM head: dense, norm, bias
         + (h * h + h) + (h * labels + labels);  // pooler, classifier
}
}  // namespace

void ModelConfig::validate() const {
  const char* m = "tempo::models: invalid config";
  TORCH_CHECK(vocab > 0, m, ": vocab must be positive, got ", vocab);
  TORCH_CHECK(hidden > 0 && heads > 0, m, ": hidden and heads must be positive, got ", hidden, " and ", heads);
  TORCH_CHECK(hidden % heads == 0, m, ": hidden (", hidden, ") must be divisible by heads (", heads, ")");
  TORCH_CHECK(layers > 0, m, ": layers must be positive, got ", layers);
  TORCH_CHECK(intermediate > 0, m, ": intermediate must be positive, got ", intermediate);
  TORCH_CHECK(max_positions > 0 || arch == Arch::kLlama, m, ": max_positions must be positive");
  TORCH_CHECK(dropout >= 0 && dropout < 1 && attention_dropout >= 0 && attention_dropout < 1, m,
              ": dropout probabilities must be in [0, 1)");
  TORCH_CHECK(eps > 0 && std::isfinite(eps), m, ": eps must be positive and finite");
  TORCH_CHECK(arch != Arch::kLlama || (rope_theta > 0 && std::isfinite(rope_theta)), m,
              ": rope_theta must be positive and finite");
  TORCH_CHECK(arch != Arch::kLlama || head_dim() % 2 == 0, m, ": rotary embeddings need an even head dim");
  TORCH_CHECK(num_labels > 0, m, ": num_labels must be positive");
  TORCH_CHECK(parameters(*this) < 0x1p53, m, ": ", parameters(*this), " parameters is more than any machine holds");
}

std::vector<std::string> Method::names() { return {"eager", "sdpa", "tempo", "tempo-sdpa", "tempo-fused"}; }

void ModelConfig::resize(int64_t hidden_, int64_t layers_, int64_t heads_, int64_t intermediate_, int64_t positions_,
                         int64_t vocab_) {
  if (hidden_) hidden = hidden_;
  if (layers_) layers = layers_;
  if (heads_) heads = heads_;
  if (intermediate_) intermediate = intermediate_;
  if (positions_) max_positions = positions_;
  if (vocab_) vocab = vocab_;
}

namespace {
// Spellings of a method that an earlier version took, and the glossary's one (docs/architecture.md).
const std::map<std::string, std::string>& deprecated_spellings() {
  static const std::map<std::string, std::string> m = {{"checkpoint", "ckpt"},
                                                       {"recompute", "recompute-attention"},
                                                       {"mlp_up", "recompute-up"},
                                                       {"mlp_gate_up", "recompute-gate_up"}};
  return m;
}
// tempo.methods' parts and recipes (python/tempo/methods/table.py) that belong to a transformers model
// and its trainer, and why the C++ models do not take them.
const std::map<std::string, std::string>& python_only() {
  static const std::string hf = "a transformers model's (python -m tempo.plan / tempo.optimize(model, method=...))";
  static const std::map<std::string, std::string> m = {
      {"ckpt-offload", hf + ": the C++ models keep their checkpoints on the device"},
      {"offload", hf + ": the C++ models keep what they save on the device"},
      {"trl-head", hf + ": TRL's head; the C++ models' fused head is the change 'head'"},
      {"torch-lce", hf + ": PyTorch's chunked loss; the C++ models' fused head is the change 'head'"},
      {"compile", hf + ": torch.compile is Python's"},
      {"liger", hf + ": Liger-Kernel's Triton kernels are Python's"},
      {"trl", "TRL's recipe for " + hf},
      {"trl-offload", "TRL's recipe for " + hf},
      {"hf-offload", "transformers' recipe for " + hf}};
  return m;
}
}  // namespace

Method Method::parse(const std::string& spec) {
  Method p;
  p.name = spec;
  std::string s = spec;
  if (s.compare(0, 10, "checkpoint") == 0) {  // the method "checkpoint" of earlier versions
    TORCH_WARN("tempo::models: the method 'checkpoint' is deprecated; it is spelled 'eager+ckpt'");
    s = "eager+ckpt" + s.substr(10);
  }
  // The longest base name that prefixes the spec ("tempo-sdpa" before "tempo").
  std::string base;
  for (const auto& n : names())
    if (s.compare(0, n.size(), n) == 0 && n.size() > base.size()) base = n;
  std::ostringstream known;
  for (const auto& n : names()) known << " " << n;
  const auto python = python_only().find(s.substr(0, s.find('+')));
  TORCH_CHECK(python == python_only().end(), "tempo::models: the method '", spec, "' is ", python->second);
  TORCH_CHECK(!base.empty(), "tempo::models: unknown method '", spec, "'; known:", known.str(),
              " (optionally followed by +change / -change)");
  const bool tempo = base == "tempo" || base == "tempo-sdpa" || base == "tempo-fused";
  p.inplace_gelu = p.inplace_norm = p.bit_dropout = p.fused_head = tempo;
  p.fused_kernels = base == "tempo-fused";
  p.attention = base == "tempo"         ? "auto"
                : base == "tempo-fused" ? "tempo"
                : base == "sdpa"        ? "sdpa"
                : base == "tempo-sdpa"  ? "fused"
                                        : "eager";
  size_t i = base.size();
  while (i < s.size()) {
    const char sign = s[i];
    TORCH_CHECK(sign == '+' || sign == '-', "tempo::models: bad method '", spec, "': expected +change or -change at '",
                s.substr(i), "'");
    size_t j = s.find_first_of("+-", i + 1);
    if (j == std::string::npos) j = s.size();
    std::string t = s.substr(i + 1, j - i - 1);
    // recompute-<what> and tempo.methods' hyphenated parts (ckpt-offload, trl-head, torch-lce,
    // compile-mem<F>): one change
    const bool hyphenated = t == "recompute" || t == "trl" || t == "torch" || t == "compile" ||
                            (t == "ckpt" && s.compare(j, 8, "-offload") == 0);
    if (hyphenated && j < s.size() && s[j] == '-') {
      size_t k = s.find_first_of("+-", j + 1);
      if (k == std::string::npos) k = s.size();
      t = s.substr(i + 1, k - i - 1);
      j = k;
    }
    const auto old = deprecated_spellings().find(t);
    if (old != deprecated_spellings().end()) {
      TORCH_WARN("tempo::models: the change '", t, "' in method '", spec, "' is deprecated; it is spelled '",
                 old->second, "'");
      t = old->second;
    }
    const auto part = python_only().find(t.compare(0, 11, "compile-mem") == 0 ? "compile" : t);
    TORCH_CHECK(part == python_only().end(), "tempo::models: the part '", t, "' of method '", spec, "' is ",
                part == python_only().end() ? "" : part->second);
    const bool on = sign == '+';
    if (t == "gelu")
      p.inplace_gelu = on;
    else if (t == "norm")
      p.inplace_norm = on;
    else if (t == "dropout")
      p.bit_dropout = on;
    else if (t == "attention")
      p.attention = on ? "tempo" : "eager";
    else if (t == "sdpa")
      p.attention = on ? "sdpa" : "eager";
    else if (t == "fused")
      p.attention = on ? "fused" : "eager";
    else if (t == "ckpt")
      p.checkpoint = on;
    else if (t == "head")
      p.fused_head = on;
    else if (t == "kernels")
      p.fused_kernels = on;
    else if (t == "recompute-attention")
      p.recompute_attention = on;
    else if (t == "recompute-up" || t == "recompute-gate_up")
      p.mlp_recompute = on ? t.substr(10) : "product";
    else
      TORCH_CHECK(false, "tempo::models: unknown change '", t, "' in method '", spec,
                  "' (gelu, norm, dropout, attention, sdpa, fused, ckpt, head, kernels, recompute-attention, ",
                  "recompute-up, recompute-gate_up)");
    i = j;
  }
  return p;
}

int64_t ModelConfig::parameter_count() const {
  validate();
  return static_cast<int64_t>(parameters(*this));
}

}  // namespace tempo::models
