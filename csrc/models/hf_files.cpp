// The two files of a Hugging Face model folder that tempo parses: safetensors (header checked
// field by field against the file) and config.json (mapped to a ModelConfig, refusing what the
// models cannot run). Both parsers are fuzzed (tests/fuzz/).
#include "tempo/models/hf_files.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "tempo/models/file_write.h"

#if !TEMPO_WITH_JSON
namespace tempo::models {
namespace detail {
void no_json() {
  TORCH_CHECK(false,
              "tempo::models: built without nlohmann-json, so Hugging Face checkpoints cannot be read or written "
              "(install nlohmann-json3-dev and rebuild)");
}
}  // namespace detail
using detail::no_json;
bool hf_files_available() { return false; }
std::map<std::string, at::Tensor> read_safetensors(const std::string&) { no_json(); }
std::map<std::string, at::Tensor> read_safetensors(std::istream&, const std::string&) { no_json(); }
void write_safetensors(const std::string&, const std::vector<std::pair<std::string, at::Tensor>>&,
                       const std::map<std::string, std::string>&) {
  no_json();
}
ModelConfig config_from_json(const std::string&, const std::string&) { no_json(); }
}  // namespace tempo::models
#else
#include <nlohmann/json.hpp>

namespace tempo::models {

bool hf_files_available() { return true; }

namespace {
using json = nlohmann::json;
namespace fs = std::filesystem;
const char* kRead = "tempo::models::read_safetensors";
const char* kLoad = "tempo::models::load_pretrained";

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

// An integer field: a JSON integer within int64. A float (1e30), a string or a bool is refused
// by name rather than converted (out-of-range float to integer conversion is undefined).
int64_t as_integer(const json& v, const char* key) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    TORCH_CHECK(u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), kLoad, ": config.json's ", key, " (",
                u, ") is too large");
    return static_cast<int64_t>(u);
  }
  TORCH_CHECK(v.is_number_integer(), kLoad, ": config.json's ", key, " must be an integer, not ", v.dump());
  return v.get<int64_t>();
}
int64_t integer(const json& j, const char* key) {
  const auto it = j.find(key);
  TORCH_CHECK(it != j.end() && !it->is_null(), kLoad, ": config.json has no ", key);
  return as_integer(*it, key);
}
int64_t integer_or(const json& j, const char* key, int64_t fallback) {
  const auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : as_integer(*it, key);
}

// The sizes under the names config.json uses for BERT, RoBERTa and LLaMA alike.
void read_sizes(const json& j, ModelConfig& c) {
  c.vocab = integer(j, "vocab_size");
  c.hidden = integer(j, "hidden_size");
  c.layers = integer(j, "num_hidden_layers");
  c.heads = integer(j, "num_attention_heads");
  c.intermediate = integer(j, "intermediate_size");
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
  return read_safetensors(f, path);
}

std::map<std::string, at::Tensor> read_safetensors(std::istream& f, const std::string& path) {
  f.seekg(0, std::ios::end);
  const auto end = f.tellg();
  TORCH_CHECK(end >= 0, kRead, ": ", path, " cannot be measured (not a seekable file)");
  const uint64_t size = static_cast<uint64_t>(end);
  f.seekg(0);
  TORCH_CHECK(size >= 8, kRead, ": ", path, " is ", size, " bytes: too short for a safetensors header length");
  unsigned char len_bytes[8];
  f.read(reinterpret_cast<char*>(len_bytes), 8);
  const uint64_t n = read_u64_le(len_bytes);
  TORCH_CHECK(n <= kMaxHeader && n <= size - 8, kRead, ": ", path, ": the header claims ", n,
              " bytes but the file has ", size - 8, " after the length (truncated, or not a safetensors file)");
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
    TORCH_CHECK(f.good(), kRead, ": ", path, ": reading tensor '", e.name,
                "' failed (the file changed or is truncated)");
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
    h[name] = {
        {"dtype", dtype_name(c.scalar_type())}, {"shape", c.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(c);
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // data 8-byte aligned, as safetensors writes it
  AtomicFile f(path, "tempo::models::write_safetensors");
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((header.size() >> (8 * i)) & 0xff);
  f.write(len, 8);
  f.write(header);
  for (const auto& c : data) f.write(c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size());
  f.commit();
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
  const auto refuse = [&](const std::string& what) {
    TORCH_CHECK(false, kLoad, ": ", type, " with ", what, " is not supported");
  };
  ModelConfig c;
  try {
    if (type == "bert" || type == "roberta") {
      c = ModelConfig::for_arch(type == "bert" ? Arch::kBert : Arch::kRoberta);
      read_sizes(j, c);
      c.max_positions = integer(j, "max_position_embeddings");
      c.type_vocab = integer_or(j, "type_vocab_size", c.type_vocab);
      c.pad_id = integer_or(j, "pad_token_id", c.pad_id);
      c.eps = get_or<double>(j, "layer_norm_eps", 1e-12);
      c.dropout = get_or<double>(j, "hidden_dropout_prob", 0.1);
      c.attention_dropout = get_or<double>(j, "attention_probs_dropout_prob", 0.1);
      const std::string act = get_or<std::string>(j, "hidden_act", "gelu");
      if (act != "gelu") refuse("hidden_act '" + act + "' (tempo's BERT uses the exact GELU)");
      const std::string pos = get_or<std::string>(j, "position_embedding_type", "absolute");
      if (pos != "absolute") refuse("position_embedding_type '" + pos + "'");
    } else if (type == "gpt2") {
      c = ModelConfig::for_arch(Arch::kGpt2);
      c.vocab = integer(j, "vocab_size");
      c.hidden = integer(j, "n_embd");
      c.layers = integer(j, "n_layer");
      c.heads = integer(j, "n_head");
      TORCH_CHECK(c.hidden > 0 && c.hidden <= std::numeric_limits<int64_t>::max() / 4, kLoad,
                  ": config.json's n_embd (", c.hidden, ") is out of range");
      c.intermediate = integer_or(j, "n_inner", 4 * c.hidden);  // null: 4 x hidden
      c.max_positions = integer(j, "n_positions");
      c.eps = get_or<double>(j, "layer_norm_epsilon", 1e-5);
      c.dropout = get_or<double>(j, "resid_pdrop", 0.1);
      c.attention_dropout = get_or<double>(j, "attn_pdrop", 0.1);
      if (get_or<double>(j, "embd_pdrop", c.dropout) != c.dropout)
        refuse("embd_pdrop different from resid_pdrop (one hidden dropout here)");
      const std::string act = get_or<std::string>(j, "activation_function", "gelu_new");
      if (act != "gelu_new" && act != "gelu_pytorch_tanh") refuse("activation_function '" + act + "'");
      if (get_or<bool>(j, "scale_attn_by_inverse_layer_idx", false) ||
          get_or<bool>(j, "reorder_and_upcast_attn", false))
        refuse("scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn");
      if (!get_or<bool>(j, "scale_attn_weights", true)) refuse("scale_attn_weights false");
    } else if (type == "llama") {
      c = ModelConfig::for_arch(Arch::kLlama);
      read_sizes(j, c);
      c.max_positions = integer_or(j, "max_position_embeddings", c.max_positions);
      c.eps = get_or<double>(j, "rms_norm_eps", 1e-6);
      c.rope_theta = get_or<double>(j, "rope_theta", 10000.0);
      c.attention_dropout = get_or<double>(j, "attention_dropout", 0.0);
      c.dropout = 0.0;
      if (integer_or(j, "num_key_value_heads", c.heads) != c.heads) refuse("grouped-query attention");
      if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) refuse("rope_scaling");
      const int64_t head_dim = integer_or(j, "head_dim", 0);
      if (head_dim && (c.heads <= 0 || c.hidden % c.heads != 0 || head_dim != c.hidden / c.heads))
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
}  // namespace tempo::models
#endif  // TEMPO_WITH_JSON
