#include "tempo/models/pretrained.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#if !TEMPO_WITH_JSON
namespace tempo::models {
using detail::no_json;
ModelConfig pretrained_config(const std::string&) { no_json(); }
TransformerModel load_pretrained(const std::string&, const Method&, LoadReport*,
                                 const std::function<void(ModelConfig&)>&) {
  no_json();
}
void save_pretrained(TransformerModel&, const std::string&) { no_json(); }
}  // namespace tempo::models
#else
#include <nlohmann/json.hpp>

#include "tempo/models/file_write.h"

namespace tempo::models {

namespace {
using json = nlohmann::json;
namespace fs = std::filesystem;
const char* kLoad = "tempo::models::load_pretrained";

// ---- name tables: ours <- theirs, per family -------------------------------------------------

enum class How { kSame, kConcat, kTranspose };
struct Rule {
  std::string ours;
  std::vector<std::string> theirs;  // several: concatenated along dim 0 (q, k, v)
  How how = How::kSame;
  bool head = false;     // a task head: may be absent from a checkpoint
  bool prefixed = true;  // theirs live under the backbone prefix ("bert.", "transformer.", ...)
};

void linear(std::vector<Rule>& r, const std::string& ours, const std::string& theirs, bool bias, How how = How::kSame,
            bool head = false, bool prefixed = true) {
  r.push_back({ours + ".weight", {theirs + ".weight"}, how, head, prefixed});
  if (bias) r.push_back({ours + ".bias", {theirs + ".bias"}, How::kSame, head, prefixed});
}

std::string layer_name(const std::string& pattern, int64_t i) {
  std::string s = pattern;
  const size_t at = s.find("{i}");
  if (at != std::string::npos) s.replace(at, 3, std::to_string(i));
  return s;
}

const char* backbone_prefix(Arch a) {
  switch (a) {
    case Arch::kBert:
      return "bert.";
    case Arch::kRoberta:
      return "roberta.";
    case Arch::kGpt2:
      return "transformer.";
    case Arch::kLlama:
      return "model.";
  }
  return "";
}

// Every parameter of a model of `c`, each with where a Hugging Face checkpoint keeps it.
std::vector<Rule> rules_for(const ModelConfig& c) {
  std::vector<Rule> r, layer;
  switch (c.arch) {
    case Arch::kBert:
    case Arch::kRoberta: {
      linear(r, "tokens", "embeddings.word_embeddings", false);
      linear(r, "positions", "embeddings.position_embeddings", false);
      if (c.type_vocab > 0) linear(r, "token_types", "embeddings.token_type_embeddings", false);
      linear(r, "embed_norm", "embeddings.LayerNorm", true);
      const std::string L = "encoder.layer.{i}.";
      const std::string q = L + "attention.self.";
      layer.push_back(
          {"attention.qkv.weight", {q + "query.weight", q + "key.weight", q + "value.weight"}, How::kConcat});
      layer.push_back({"attention.qkv.bias", {q + "query.bias", q + "key.bias", q + "value.bias"}, How::kConcat});
      linear(layer, "attention.out", L + "attention.output.dense", true);
      linear(layer, "norm1", L + "attention.output.LayerNorm", true);
      linear(layer, "fc1", L + "intermediate.dense", true);
      linear(layer, "fc2", L + "output.dense", true);
      linear(layer, "norm2", L + "output.LayerNorm", true);
      linear(r, "pooler", "pooler.dense", true, How::kSame, /*head=*/true);
      const bool bert = c.arch == Arch::kBert;
      linear(r, "mlm_dense", bert ? "cls.predictions.transform.dense" : "lm_head.dense", true, How::kSame, true, false);
      linear(r, "mlm_norm", bert ? "cls.predictions.transform.LayerNorm" : "lm_head.layer_norm", true, How::kSame, true,
             false);
      r.push_back({"mlm_bias", {bert ? "cls.predictions.bias" : "lm_head.bias"}, How::kSame, true, false});
      // BERT's sequence-classification head is ours; RoBERTa's has two layers (never ours).
      linear(r, "classifier", bert ? "classifier" : "", true, How::kSame, true, false);
      break;
    }
    case Arch::kGpt2: {
      linear(r, "tokens", "wte", false);
      linear(r, "positions", "wpe", false);
      const std::string L = "h.{i}.";
      linear(layer, "norm1", L + "ln_1", true);
      linear(layer, "attention.qkv", L + "attn.c_attn", true, How::kTranspose);  // Conv1D: [in, out]
      linear(layer, "attention.out", L + "attn.c_proj", true, How::kTranspose);
      linear(layer, "norm2", L + "ln_2", true);
      linear(layer, "fc1", L + "mlp.c_fc", true, How::kTranspose);
      linear(layer, "fc2", L + "mlp.c_proj", true, How::kTranspose);
      linear(r, "final_norm", "ln_f", true);
      break;
    }
    case Arch::kLlama: {
      linear(r, "tokens", "embed_tokens", false);
      const std::string L = "layers.{i}.";
      const std::string a = L + "self_attn.";
      layer.push_back(
          {"attention.qkv.weight", {a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"}, How::kConcat});
      linear(layer, "attention.out", a + "o_proj", false);
      linear(layer, "gate", L + "mlp.gate_proj", false);
      linear(layer, "fc1", L + "mlp.up_proj", false);
      linear(layer, "fc2", L + "mlp.down_proj", false);
      linear(layer, "norm1", L + "input_layernorm", false);
      linear(layer, "norm2", L + "post_attention_layernorm", false);
      linear(r, "final_norm", "norm", false);
      linear(r, "lm_head", "lm_head", false, How::kSame, /*head=*/true, /*prefixed=*/false);
      break;
    }
  }
  for (int64_t i = 0; i < c.layers; ++i)
    for (const auto& x : layer) {
      Rule e = x;
      e.ours = "layers." + std::to_string(i) + "." + x.ours;
      for (auto& t : e.theirs) t = layer_name(t, i);
      r.push_back(e);
    }
  // An empty source name: nothing of the checkpoint's is ours.
  for (auto& x : r)
    if (x.theirs.size() == 1 && x.theirs[0].rfind(".", 0) == 0) x.theirs.clear();
  return r;
}

}  // namespace

// ---- load and save ----------------------------------------------------------------------------

ModelConfig pretrained_config(const std::string& dir) {
  const fs::path root(dir);
  TORCH_CHECK(fs::is_directory(root), kLoad, ": ", dir, " is not a directory");
  std::ifstream cf(root / "config.json");
  TORCH_CHECK(cf.good(), kLoad, ": ", dir, " has no config.json");
  std::stringstream text;
  text << cf.rdbuf();
  return config_from_json(text.str(), root.filename().string());
}

TransformerModel load_pretrained(const std::string& dir, const Method& method, LoadReport* report,
                                 const std::function<void(ModelConfig&)>& adjust) {
  const fs::path root(dir);
  ModelConfig c = pretrained_config(dir);
  if (adjust) {
    adjust(c);
    c.validate();
  }
  // The weights: one file, or shards named by an index.
  std::map<std::string, at::Tensor> theirs;
  if (fs::exists(root / "model.safetensors")) {
    theirs = read_safetensors((root / "model.safetensors").string());
  } else if (fs::exists(root / "model.safetensors.index.json")) {
    std::ifstream idx(root / "model.safetensors.index.json");
    json j;
    try {
      j = json::parse(idx);
    } catch (const json::exception& e) {
      TORCH_CHECK(false, kLoad, ": model.safetensors.index.json is not valid JSON (", e.what(), ")");
    }
    TORCH_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), kLoad,
                ": the index has no weight_map");
    std::set<std::string> files;
    for (const auto& [k, v] : j["weight_map"].items()) {
      TORCH_CHECK(v.is_string(), kLoad, ": the index's weight_map maps ", k, " to ", v.dump(), ", not a file name");
      files.insert(v.get<std::string>());
    }
    for (const auto& file : files) {
      TORCH_CHECK(!file.empty() && file.find('/') == std::string::npos && file.find("..") == std::string::npos, kLoad,
                  ": the index names a shard outside the folder: '", file, "'");
      for (auto& [k, t] : read_safetensors((root / file).string())) theirs.emplace(k, std::move(t));
    }
  } else {
    TORCH_CHECK(false, kLoad, ": ", dir, " has neither model.safetensors nor model.safetensors.index.json",
                fs::exists(root / "pytorch_model.bin")
                    ? " (only pytorch_model.bin, a pickle, which tempo does not read: convert it with transformers' "
                      "model.save_pretrained(dir), which writes safetensors)"
                    : "");
  }
  TransformerModel model(c, method);
  const std::string prefix = backbone_prefix(c.arch);
  // A checkpoint's backbone names come with the task model's prefix ("bert.") or without it
  // (a bare BertModel's); LayerNorms of old checkpoints are gamma/beta.
  const auto find = [&](const std::string& name, bool prefixed) -> std::string {
    std::vector<std::string> tries =
        prefixed ? std::vector<std::string>{prefix + name, name} : std::vector<std::string>{name};
    for (auto t : std::vector<std::string>(tries)) {
      if (t.size() > 7 && t.compare(t.size() - 7, 7, ".weight") == 0)
        tries.push_back(t.substr(0, t.size() - 7) + ".gamma");
      if (t.size() > 5 && t.compare(t.size() - 5, 5, ".bias") == 0)
        tries.push_back(t.substr(0, t.size() - 5) + ".beta");
    }
    for (const auto& t : tries)
      if (theirs.count(t)) return t;
    return "";
  };
  LoadReport rep;
  std::set<std::string> used;
  auto params = model->named_parameters();
  std::set<std::string> covered;
  c10::NoGradGuard no_grad;
  for (const auto& rule : rules_for(c)) {
    covered.insert(rule.ours);
    at::Tensor* p = params.find(rule.ours);
    TORCH_CHECK(p != nullptr, kLoad, ": internal: no parameter ", rule.ours);
    std::vector<at::Tensor> parts;
    std::vector<std::string> missing;
    for (const auto& t : rule.theirs) {
      const std::string k = find(t, rule.prefixed);
      if (k.empty())
        missing.push_back(t);
      else
        parts.push_back(theirs.at(k)), used.insert(k);
    }
    if (rule.theirs.empty() || !missing.empty()) {
      if (c.arch == Arch::kLlama && rule.ours == "lm_head.weight" && missing.size() == 1) {
        const std::string k = find("embed_tokens.weight", true);
        p->copy_(theirs.at(k));
        rep.notes.push_back("lm_head.weight: tied to the token embeddings in the checkpoint; copied (trained untied)");
        continue;
      }
      TORCH_CHECK(rule.head, kLoad, ": ", dir, ": the checkpoint has no '", missing.empty() ? "?" : missing[0],
                  "' (for ", rule.ours, "); a ", arch_name(c.arch), " of this config needs it");
      rep.fresh.push_back(rule.ours);
      continue;
    }
    at::Tensor value = rule.how == How::kConcat      ? at::cat(parts, 0)
                       : rule.how == How::kTranspose ? parts[0].t()
                                                     : parts[0];
    TORCH_CHECK(value.sizes() == p->sizes(), kLoad, ": ", dir, ": '", rule.theirs[0], "' (for ", rule.ours,
                ") has shape ", value.sizes(), " in the checkpoint; the config makes it ", p->sizes());
    TORCH_CHECK(at::isFloatingType(value.scalar_type()), kLoad, ": '", rule.theirs[0], "' is ", value.scalar_type(),
                ", not a floating-point tensor");
    p->copy_(value.to(p->scalar_type()));
  }
  for (const auto& kv : params) TORCH_CHECK(covered.count(kv.key()), kLoad, ": internal: no rule for ", kv.key());
  for (const auto& [k, t] : theirs)
    if (!used.count(k)) rep.unused.push_back(k);
  if (report) *report = std::move(rep);
  return model;
}

void save_pretrained(TransformerModel& model, const std::string& dir) {
  const ModelConfig& c = model->config();
  fs::create_directories(dir);
  const std::string prefix = backbone_prefix(c.arch);
  auto params = model->named_parameters();
  std::vector<std::pair<std::string, at::Tensor> > out;
  for (const auto& rule : rules_for(c)) {
    if (rule.theirs.empty()) continue;  // nothing of a Hugging Face model's is this
    const at::Tensor& p = *params.find(rule.ours);
    const auto name = [&](const std::string& t) { return rule.prefixed ? prefix + t : t; };
    if (rule.how == How::kConcat) {
      const auto parts = p.chunk(static_cast<int64_t>(rule.theirs.size()), 0);
      for (size_t i = 0; i < parts.size(); ++i) out.emplace_back(name(rule.theirs[i]), parts[i]);
    } else {
      out.emplace_back(name(rule.theirs[0]), rule.how == How::kTranspose ? p.t() : p);
    }
  }
  json j;
  switch (c.arch) {
    case Arch::kBert:
    case Arch::kRoberta:
      j = {{"model_type", arch_name(c.arch)},
           {"architectures", {c.arch == Arch::kBert ? "BertForMaskedLM" : "RobertaForMaskedLM"}},
           {"vocab_size", c.vocab},
           {"hidden_size", c.hidden},
           {"num_hidden_layers", c.layers},
           {"num_attention_heads", c.heads},
           {"intermediate_size", c.intermediate},
           {"max_position_embeddings", c.max_positions},
           {"type_vocab_size", c.type_vocab},
           {"pad_token_id", c.pad_id},
           {"layer_norm_eps", c.eps},
           {"hidden_dropout_prob", c.dropout},
           {"attention_probs_dropout_prob", c.attention_dropout},
           {"hidden_act", "gelu"}};
      break;
    case Arch::kGpt2:
      j = {{"model_type", "gpt2"},
           {"architectures", {"GPT2LMHeadModel"}},
           {"vocab_size", c.vocab},
           {"n_embd", c.hidden},
           {"n_layer", c.layers},
           {"n_head", c.heads},
           {"n_inner", c.intermediate},
           {"n_positions", c.max_positions},
           {"layer_norm_epsilon", c.eps},
           {"resid_pdrop", c.dropout},
           {"embd_pdrop", c.dropout},
           {"attn_pdrop", c.attention_dropout},
           {"activation_function", "gelu_new"},
           {"tie_word_embeddings", true}};
      break;
    case Arch::kLlama:
      j = {{"model_type", "llama"},
           {"architectures", {"LlamaForCausalLM"}},
           {"vocab_size", c.vocab},
           {"hidden_size", c.hidden},
           {"num_hidden_layers", c.layers},
           {"num_attention_heads", c.heads},
           {"num_key_value_heads", c.heads},
           {"intermediate_size", c.intermediate},
           {"max_position_embeddings", c.max_positions},
           {"rms_norm_eps", c.eps},
           {"rope_theta", c.rope_theta},
           {"attention_dropout", c.attention_dropout},
           {"hidden_act", "silu"},
           {"tie_word_embeddings", false}};
      break;
  }
  if (c.arch == Arch::kBert || c.arch == Arch::kRoberta) {
    json labels = json::object();
    for (int64_t i = 0; i < c.num_labels; ++i) labels[std::to_string(i)] = "LABEL_" + std::to_string(i);
    j["id2label"] = labels;
  }
  write_safetensors((fs::path(dir) / "model.safetensors").string(), out, {{"format", "pt"}});
  const std::string cfg = (fs::path(dir) / "config.json").string();
  write_file_atomically(cfg, j.dump(2) + "\n", "tempo::models::save_pretrained");
}

}  // namespace tempo::models
#endif  // TEMPO_WITH_JSON
