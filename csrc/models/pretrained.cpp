#include "tempo/models/pretrained.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#if !TEMPO_WITH_JSON
namespace tempo::models {
namespace {
[[noreturn]] void no_json() {
  TORCH_CHECK(false, "tempo::models: built without nlohmann-json, so Hugging Face checkpoints cannot be read or written "
              "(install nlohmann-json3-dev and rebuild)");
}
}  // namespace
std::map<std::string, at::Tensor> read_safetensors(const std::string&) { no_json(); }
void write_safetensors(const std::string&, const std::vector<std::pair<std::string, at::Tensor>>&,
                       const std::map<std::string, std::string>&) { no_json(); }
ModelConfig config_from_json(const std::string&, const std::string&) { no_json(); }
TransformerModel load_pretrained(const std::string&, const MemoryPolicy&, LoadReport*,
                                 const std::function<void(ModelConfig&)>&) {
  no_json();
}
void save_pretrained(TransformerModel&, const std::string&) { no_json(); }
}  // namespace tempo::models
#else
#include <nlohmann/json.hpp>

namespace tempo::models {

namespace {
using json = nlohmann::json;
namespace fs = std::filesystem;
const char* kRead = "tempo::models::read_safetensors";
const char* kLoad = "tempo::models::load_pretrained";

// ---- safetensors ----------------------------------------------------------------------------

struct DType {
  const char* name;
  at::ScalarType type;
};
constexpr DType kDTypes[] = {{"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
                             {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
                             {"U8", at::kByte},    {"BOOL", at::kBool}};
// A header this large is not a checkpoint's (safetensors' own reader refuses past 100 MB).
constexpr uint64_t kMaxHeader = 100ull << 20;

at::ScalarType dtype_of(const std::string& path, const std::string& name, const std::string& d) {
  for (const auto& t : kDTypes)
    if (d == t.name) return t.type;
  TORCH_CHECK(false, kRead, ": ", path, ": tensor '", name, "' has dtype '", d,
              "', not one of F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL");
}

const char* dtype_name(at::ScalarType s) {
  for (const auto& t : kDTypes)
    if (t.type == s) return t.name;
  TORCH_CHECK(false, "tempo::models::write_safetensors: no safetensors dtype for ", s);
}

struct Entry {
  std::string name;
  at::ScalarType type;
  std::vector<int64_t> shape;
  uint64_t begin, end;
};

uint64_t read_u64_le(const unsigned char* b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}

// ---- name tables: ours <- theirs, per family -------------------------------------------------

enum class How { kSame, kConcat, kTranspose };
struct Rule {
  std::string ours;
  std::vector<std::string> theirs;  // several: concatenated along dim 0 (q, k, v)
  How how = How::kSame;
  bool head = false;      // a task head: may be absent from a checkpoint
  bool prefixed = true;   // theirs live under the backbone prefix ("bert.", "transformer.", ...)
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
    case Arch::kBert: return "bert.";
    case Arch::kRoberta: return "roberta.";
    case Arch::kGpt2: return "transformer.";
    case Arch::kLlama: return "model.";
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
      layer.push_back({"attention.qkv.weight", {q + "query.weight", q + "key.weight", q + "value.weight"}, How::kConcat});
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
      layer.push_back({"attention.qkv.weight", {a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"},
                       How::kConcat});
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

// The sizes under the names config.json uses for BERT, RoBERTa and LLaMA alike.
void read_sizes(const json& j, ModelConfig& c) {
  c.vocab = j.at("vocab_size");
  c.hidden = j.at("hidden_size");
  c.layers = j.at("num_hidden_layers");
  c.heads = j.at("num_attention_heads");
  c.intermediate = j.at("intermediate_size");
}

template <typename T>
T get_or(const json& j, const char* key, T fallback) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : it->get<T>();
}

}  // namespace

// ---- safetensors: read and write --------------------------------------------------------------

std::map<std::string, at::Tensor> read_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f.good(), kRead, ": cannot open ", path);
  f.seekg(0, std::ios::end);
  const uint64_t size = static_cast<uint64_t>(f.tellg());
  f.seekg(0);
  TORCH_CHECK(size >= 8, kRead, ": ", path, " is ", size, " bytes: too short for a safetensors header length");
  unsigned char len_bytes[8];
  f.read(reinterpret_cast<char*>(len_bytes), 8);
  const uint64_t n = read_u64_le(len_bytes);
  TORCH_CHECK(n <= kMaxHeader && n <= size - 8, kRead, ": ", path, ": the header claims ", n, " bytes but the file has ",
              size - 8, " after the length (truncated, or not a safetensors file)");
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  json h;
  try {
    h = json::parse(header);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, kRead, ": ", path, ": the header is not valid JSON (", e.what(), ")");
  }
  TORCH_CHECK(h.is_object(), kRead, ": ", path, ": the header is not a JSON object");
  const uint64_t data_size = size - 8 - n;
  std::vector<Entry> entries;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& name = it.key();
    const json& v = it.value();
    const auto bad = [&](const std::string& what) {
      TORCH_CHECK(false, kRead, ": ", path, ": tensor '", name, "': ", what);
    };
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      bad("needs dtype, shape and data_offsets");
    if (!v["dtype"].is_string()) bad("dtype is not a string");
    Entry e;
    e.name = name;
    e.type = dtype_of(path, name, v["dtype"].get<std::string>());
    if (!v["shape"].is_array()) bad("shape is not a list");
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) bad("shape holds something other than non-negative integers");
      const uint64_t x = d.get<uint64_t>();
      if (x > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          (x && numel > std::numeric_limits<uint64_t>::max() / x))
        bad("shape overflows");
      numel *= x;
      e.shape.push_back(static_cast<int64_t>(x));
    }
    const auto& o = v["data_offsets"];
    if (!o.is_array() || o.size() != 2 || !o[0].is_number_unsigned() || !o[1].is_number_unsigned())
      bad("data_offsets is not [begin, end]");
    e.begin = o[0].get<uint64_t>();
    e.end = o[1].get<uint64_t>();
    if (e.begin > e.end || e.end > data_size)
      bad("bytes [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + ") lie outside the " +
          std::to_string(data_size) + " data bytes of the file (truncated?)");
    const uint64_t esize = c10::elementSize(e.type);
    if (numel > std::numeric_limits<uint64_t>::max() / esize || e.end - e.begin != numel * esize)
      bad("holds " + std::to_string(e.end - e.begin) + " bytes, but its dtype and shape need " +
          std::to_string(numel * esize));
    entries.push_back(std::move(e));
  }
  std::vector<const Entry*> by_offset;
  for (const auto& e : entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    TORCH_CHECK(by_offset[i]->begin >= by_offset[i - 1]->end, kRead, ": ", path, ": tensors '", by_offset[i - 1]->name,
                "' and '", by_offset[i]->name, "' overlap");
  std::map<std::string, at::Tensor> out;
  for (const auto& e : entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.type));
    f.seekg(static_cast<std::streamoff>(8 + n + e.begin));
    f.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.end - e.begin));
    TORCH_CHECK(f.good(), kRead, ": ", path, ": reading tensor '", e.name, "' failed (the file changed or is truncated)");
    out.emplace(e.name, std::move(t));
  }
  return out;
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::vector<at::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(name != "__metadata__" && !h.contains(name), "tempo::models::write_safetensors: bad or repeated name '",
                name, "'");
    const at::Tensor c = t.detach().to(at::kCPU).contiguous();
    const uint64_t bytes = static_cast<uint64_t>(c.numel()) * c.element_size();
    h[name] = {{"dtype", dtype_name(c.scalar_type())}, {"shape", c.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(c);
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // data 8-byte aligned, as safetensors writes it
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(f.good(), "tempo::models::write_safetensors: cannot write ", tmp);
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((header.size() >> (8 * i)) & 0xff);
    f.write(reinterpret_cast<const char*>(len), 8);
    f.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (const auto& c : data)
      f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.numel() * c.element_size()));
    TORCH_CHECK(f.good(), "tempo::models::write_safetensors: writing ", tmp, " failed");
  }
  fs::rename(tmp, path);
}

// ---- config.json --------------------------------------------------------------------------------

ModelConfig config_from_json(const std::string& text, const std::string& name) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, kLoad, ": config.json is not valid JSON (", e.what(), ")");
  }
  TORCH_CHECK(j.is_object() && j.contains("model_type") && j["model_type"].is_string(), kLoad,
              ": config.json has no model_type");
  const std::string type = j["model_type"];
  const auto refuse = [&](const std::string& what) { TORCH_CHECK(false, kLoad, ": ", type, " with ", what, " is not supported"); };
  ModelConfig c;
  try {
    if (type == "bert" || type == "roberta") {
      c = ModelConfig::for_arch(type == "bert" ? Arch::kBert : Arch::kRoberta);
      read_sizes(j, c);
      c.max_positions = j.at("max_position_embeddings");
      c.type_vocab = get_or<int64_t>(j, "type_vocab_size", c.type_vocab);
      c.pad_id = get_or<int64_t>(j, "pad_token_id", c.pad_id);
      c.eps = get_or<double>(j, "layer_norm_eps", 1e-12);
      c.dropout = get_or<double>(j, "hidden_dropout_prob", 0.1);
      c.attention_dropout = get_or<double>(j, "attention_probs_dropout_prob", 0.1);
      const std::string act = get_or<std::string>(j, "hidden_act", "gelu");
      if (act != "gelu") refuse("hidden_act '" + act + "' (tempo's BERT uses the exact GELU)");
      const std::string pos = get_or<std::string>(j, "position_embedding_type", "absolute");
      if (pos != "absolute") refuse("position_embedding_type '" + pos + "'");
    } else if (type == "gpt2") {
      c = ModelConfig::for_arch(Arch::kGpt2);
      c.vocab = j.at("vocab_size");
      c.hidden = j.at("n_embd");
      c.layers = j.at("n_layer");
      c.heads = j.at("n_head");
      c.intermediate = get_or<int64_t>(j, "n_inner", 4 * c.hidden);  // null: 4 x hidden
      c.max_positions = j.at("n_positions");
      c.eps = get_or<double>(j, "layer_norm_epsilon", 1e-5);
      c.dropout = get_or<double>(j, "resid_pdrop", 0.1);
      c.attention_dropout = get_or<double>(j, "attn_pdrop", 0.1);
      if (get_or<double>(j, "embd_pdrop", c.dropout) != c.dropout)
        refuse("embd_pdrop different from resid_pdrop (one hidden dropout here)");
      const std::string act = get_or<std::string>(j, "activation_function", "gelu_new");
      if (act != "gelu_new" && act != "gelu_pytorch_tanh") refuse("activation_function '" + act + "'");
      if (get_or<bool>(j, "scale_attn_by_inverse_layer_idx", false) || get_or<bool>(j, "reorder_and_upcast_attn", false))
        refuse("scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn");
      if (!get_or<bool>(j, "scale_attn_weights", true)) refuse("scale_attn_weights false");
    } else if (type == "llama") {
      c = ModelConfig::for_arch(Arch::kLlama);
      read_sizes(j, c);
      c.max_positions = get_or<int64_t>(j, "max_position_embeddings", c.max_positions);
      c.eps = get_or<double>(j, "rms_norm_eps", 1e-6);
      c.rope_theta = get_or<double>(j, "rope_theta", 10000.0);
      c.attention_dropout = get_or<double>(j, "attention_dropout", 0.0);
      c.dropout = 0.0;
      if (get_or<int64_t>(j, "num_key_value_heads", c.heads) != c.heads) refuse("grouped-query attention");
      if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) refuse("rope_scaling");
      if (j.contains("head_dim") && !j["head_dim"].is_null() && j["head_dim"].get<int64_t>() * c.heads != c.hidden)
        refuse("head_dim x heads != hidden_size");
      if (get_or<bool>(j, "attention_bias", false) || get_or<bool>(j, "mlp_bias", false)) refuse("biases");
      const std::string act = get_or<std::string>(j, "hidden_act", "silu");
      if (act != "silu") refuse("hidden_act '" + act + "'");
    } else {
      TORCH_CHECK(false, kLoad, ": model_type '", type, "' is not one of bert, roberta, gpt2, llama");
    }
    if (j.contains("id2label") && j["id2label"].is_object() && !j["id2label"].empty())
      c.num_labels = static_cast<int64_t>(j["id2label"].size());
  } catch (const json::exception& e) {
    TORCH_CHECK(false, kLoad, ": config.json (", type, "): ", e.what());
  }
  c.name = name;
  c.validate();
  return c;
}

// ---- load and save ----------------------------------------------------------------------------

TransformerModel load_pretrained(const std::string& dir, const MemoryPolicy& policy, LoadReport* report,
                                 const std::function<void(ModelConfig&)>& adjust) {
  const fs::path root(dir);
  TORCH_CHECK(fs::is_directory(root), kLoad, ": ", dir, " is not a directory");
  std::ifstream cf(root / "config.json");
  TORCH_CHECK(cf.good(), kLoad, ": ", dir, " has no config.json");
  std::stringstream text;
  text << cf.rdbuf();
  ModelConfig c = config_from_json(text.str(), root.filename().string());
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
    TORCH_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), kLoad, ": the index has no weight_map");
    std::set<std::string> files;
    for (const auto& [k, v] : j["weight_map"].items()) files.insert(v.get<std::string>());
    for (const auto& file : files) {
      TORCH_CHECK(file.find('/') == std::string::npos && file.find("..") == std::string::npos, kLoad,
                  ": the index names a shard outside the folder: ", file);
      for (auto& [k, t] : read_safetensors((root / file).string())) theirs.emplace(k, std::move(t));
    }
  } else {
    TORCH_CHECK(false, kLoad, ": ", dir, " has neither model.safetensors nor model.safetensors.index.json");
  }
  TransformerModel model(c, policy);
  const std::string prefix = backbone_prefix(c.arch);
  // A checkpoint's backbone names come with the task model's prefix ("bert.") or without it
  // (a bare BertModel's); LayerNorms of old checkpoints are gamma/beta.
  const auto find = [&](const std::string& name, bool prefixed) -> std::string {
    std::vector<std::string> tries = prefixed ? std::vector<std::string>{prefix + name, name} : std::vector<std::string>{name};
    for (auto t : std::vector<std::string>(tries)) {
      if (t.size() > 7 && t.compare(t.size() - 7, 7, ".weight") == 0) tries.push_back(t.substr(0, t.size() - 7) + ".gamma");
      if (t.size() > 5 && t.compare(t.size() - 5, 5, ".bias") == 0) tries.push_back(t.substr(0, t.size() - 5) + ".beta");
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
      if (k.empty()) missing.push_back(t);
      else parts.push_back(theirs.at(k)), used.insert(k);
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
    at::Tensor value = rule.how == How::kConcat ? at::cat(parts, 0)
                       : rule.how == How::kTranspose ? parts[0].t() : parts[0];
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
  std::vector<std::pair<std::string, at::Tensor>> out;
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
           {"vocab_size", c.vocab}, {"hidden_size", c.hidden}, {"num_hidden_layers", c.layers},
           {"num_attention_heads", c.heads}, {"intermediate_size", c.intermediate},
           {"max_position_embeddings", c.max_positions}, {"type_vocab_size", c.type_vocab}, {"pad_token_id", c.pad_id},
           {"layer_norm_eps", c.eps}, {"hidden_dropout_prob", c.dropout},
           {"attention_probs_dropout_prob", c.attention_dropout}, {"hidden_act", "gelu"}};
      break;
    case Arch::kGpt2:
      j = {{"model_type", "gpt2"}, {"architectures", {"GPT2LMHeadModel"}}, {"vocab_size", c.vocab}, {"n_embd", c.hidden},
           {"n_layer", c.layers}, {"n_head", c.heads}, {"n_inner", c.intermediate}, {"n_positions", c.max_positions},
           {"layer_norm_epsilon", c.eps}, {"resid_pdrop", c.dropout}, {"embd_pdrop", c.dropout},
           {"attn_pdrop", c.attention_dropout}, {"activation_function", "gelu_new"}, {"tie_word_embeddings", true}};
      break;
    case Arch::kLlama:
      j = {{"model_type", "llama"}, {"architectures", {"LlamaForCausalLM"}}, {"vocab_size", c.vocab},
           {"hidden_size", c.hidden}, {"num_hidden_layers", c.layers}, {"num_attention_heads", c.heads},
           {"num_key_value_heads", c.heads}, {"intermediate_size", c.intermediate},
           {"max_position_embeddings", c.max_positions}, {"rms_norm_eps", c.eps}, {"rope_theta", c.rope_theta},
           {"attention_dropout", c.attention_dropout}, {"hidden_act", "silu"}, {"tie_word_embeddings", false}};
      break;
  }
  if (c.arch == Arch::kBert || c.arch == Arch::kRoberta) {
    json labels = json::object();
    for (int64_t i = 0; i < c.num_labels; ++i) labels[std::to_string(i)] = "LABEL_" + std::to_string(i);
    j["id2label"] = labels;
  }
  write_safetensors((fs::path(dir) / "model.safetensors").string(), out, {{"format", "pt"}});
  const std::string cfg = (fs::path(dir) / "config.json").string();
  std::ofstream f(cfg + ".tmp");
  f << j.dump(2) << "\n";
  f.close();
  TORCH_CHECK(f.good(), "tempo::models::save_pretrained: writing ", cfg, " failed");
  fs::rename(cfg + ".tmp", cfg);
}

}  // namespace tempo::models
#endif  // TEMPO_WITH_JSON
