#include "tempo/models/performer.h"

#include <ATen/ATen.h>

#include <cmath>
#include <sstream>

#include "tempo/memory.h"

namespace tempo::models {

namespace {
const char* kOp = "tempo::models::PerformerLM";

// In double, so that absurd sizes cannot overflow (exact below 2^53, where validate() stops):
// the embedding; per block two LayerNorms, the q/k/v and out projections, the FFN; the final
// LayerNorm and the head.
double parameters(const PerformerConfig& c) {
  const double d = static_cast<double>(c.d_model), f = static_cast<double>(c.ffn), v = static_cast<double>(c.vocab);
  return v * d + static_cast<double>(c.layers) * (4 * d + 4 * d * d + 4 * d + 2 * d * f + f + d) + 2 * d + d * v + v;
}
}  // namespace

// ---- configuration --------------------------------------------------------------------------

PerformerConfig PerformerConfig::preset(const std::string& name) {
  PerformerConfig c;
  c.name = name;
  if (name == "copy") {
    c.max_len = 512, c.d_model = 256, c.layers = 1, c.ffn = 1024, c.heads = 4;
  } else if (name == "ptb") {
    c.max_len = 1024, c.d_model = 512, c.layers = 3, c.ffn = 2048, c.heads = 8;
  } else if (name == "enwik8") {
    c.max_len = 4096, c.d_model = 1024, c.layers = 3, c.ffn = 4096, c.heads = 16;
  } else {
    TORCH_CHECK(false, kOp, ": unknown preset '", name, "'; known: copy, ptb, enwik8");
  }
  return c;
}

std::vector<std::string> PerformerConfig::presets() { return {"copy", "ptb", "enwik8"}; }

void PerformerConfig::validate() const {
  TORCH_CHECK(d_model > 0 && layers > 0 && ffn > 0 && heads > 0 && max_len > 0 && vocab > 0, kOp,
              ": every size must be positive (d_model ", d_model, ", layers ", layers, ", ffn ", ffn, ", heads ", heads,
              ", max_len ", max_len, ", vocab ", vocab, ")");
  TORCH_CHECK(d_model % heads == 0, kOp, ": d_model ", d_model, " is not a multiple of heads ", heads);
  TORCH_CHECK(feature_map == "relu" || feature_map == "elu" || feature_map == "sqr" || feature_map == "favor", kOp,
              ": unknown feature map '", feature_map, "'; known: relu, elu, sqr, favor");
  TORCH_CHECK(mode == "iterative" || mode == "prefix", kOp, ": mode must be iterative or prefix, got '", mode, "'");
  TORCH_CHECK(features >= 0 && attention_eps > 0 && norm_eps > 0, kOp,
              ": features must be >= 0 and the epsilons positive");
  TORCH_CHECK(parameters(*this) < 0x1p53, kOp, ": ", parameters(*this), " parameters is more than any machine holds");
}

int64_t PerformerConfig::parameter_count() const {
  validate();
  return static_cast<int64_t>(parameters(*this));
}

int64_t PerformerConfig::buffer_count() const {
  validate();
  const int64_t head_dim = d_model / heads;
  return feature_map == "favor" ? layers * (features > 0 ? features : head_dim) * head_dim : 0;
}

// ---- one block ------------------------------------------------------------------------------

PerformerBlockImpl::PerformerBlockImpl(const PerformerConfig& config, std::shared_ptr<const MethodOps> ops)
    : config_(config), ops_(std::move(ops)) {
  reset();
}

void PerformerBlockImpl::reset() {
  const auto& c = config_;
  ln1 = register_module("ln1", tempo::nn::LayerNorm(tempo::nn::LayerNormOptions({c.d_model}).eps(c.norm_eps)));
  attn = register_module("attn",
                         tempo::nn::CausalLinearAttention(tempo::nn::CausalLinearAttentionOptions(c.d_model, c.heads)
                                                              .feature_map(c.feature_map)
                                                              .features(c.features)
                                                              .eps(c.attention_eps)
                                                              .mode(c.mode)));
  ln2 = register_module("ln2", tempo::nn::LayerNorm(tempo::nn::LayerNormOptions({c.d_model}).eps(c.norm_eps)));
  fc1 = register_module("fc1", torch::nn::Linear(c.d_model, c.ffn));
  fc2 = register_module("fc2", torch::nn::Linear(c.ffn, c.d_model));
}

at::Tensor PerformerBlockImpl::mlp_residual(const at::Tensor& x) {
  const at::Tensor h = ops_->norm(x, *ln2, false, config_.norm_eps);
  return x + fc2->forward(ops_->gelu(fc1->forward(h), "none"));
}

std::tuple<at::Tensor, tempo::nn::LinearAttentionState> PerformerBlockImpl::forward(
    const at::Tensor& x, const tempo::nn::LinearAttentionState& state) {
  auto [a, after] = attn->forward(ops_->norm(x, *ln1, false, config_.norm_eps), state);
  return {mlp_residual(x + a), after};
}

std::tuple<at::Tensor, tempo::nn::LinearAttentionState, tempo::nn::LinearAttentionState>
PerformerBlockImpl::forward_rebuilding(const at::Tensor& x, const tempo::nn::LinearAttentionState& state_after) {
  auto [a, after, before] = attn->forward_rebuilding(ops_->norm(x, *ln1, false, config_.norm_eps), state_after);
  return {mlp_residual(x + a), after, before};
}

// ---- the model ------------------------------------------------------------------------------

PerformerLMImpl::PerformerLMImpl(PerformerConfig config, const Method& method) : config_(std::move(config)) {
  config_.validate();
  tempo::memory::check_host_fits(
      (config_.parameter_count() + config_.buffer_count()) * c10::get_default_dtype().itemsize(),
      std::string(kOp) + ": " + config_.name + " (" + std::to_string(config_.layers) + " layers, d_model " +
          std::to_string(config_.d_model) + ", " + std::to_string(config_.parameter_count()) + " parameters)");
  TORCH_CHECK(!method.checkpoint, kOp, ": method '", method.name,
              "' checkpoints layers; SLiM's chunks already bound the memory (use eager or tempo)");
  ops_ = std::make_shared<const MethodOps>(method);
  reset();
}

void PerformerLMImpl::reset() {
  const auto& c = config_;
  embed = register_module("embed", torch::nn::Embedding(c.vocab, c.d_model));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(PerformerBlock(c, ops_));
  ln = register_module("ln", tempo::nn::LayerNorm(tempo::nn::LayerNormOptions({c.d_model}).eps(c.norm_eps)));
  head = register_module("head", torch::nn::Linear(c.d_model, c.vocab));
}

at::Tensor PerformerLMImpl::positions(int64_t offset, int64_t length, const at::TensorOptions& options) const {
  const int64_t d = config_.d_model;
  const auto f64 = options.dtype(at::kDouble);
  const at::Tensor pos = at::arange(offset, offset + length, f64).unsqueeze(1);
  const at::Tensor freq = at::exp(at::arange(0, d, 2, f64) * (-std::log(10000.0) / static_cast<double>(d)));
  const at::Tensor angle = pos * freq;  // [length, ceil(d / 2)]
  at::Tensor enc = at::zeros({length, d}, f64);
  enc.slice(1, 0, d, 2).copy_(at::sin(angle));
  enc.slice(1, 1, d, 2).copy_(at::cos(angle).narrow(1, 0, d / 2));
  return enc.to(options.dtype());
}

at::Tensor PerformerLMImpl::embed_chunk(const at::Tensor& tokens, int64_t offset) {
  const at::Tensor x = embed->forward(tokens);
  return x + positions(offset, tokens.size(1), x.options());
}

at::Tensor PerformerLMImpl::logits(const at::Tensor& hidden) {
  return head->forward(ops_->norm(hidden, *ln, false, config_.norm_eps));
}

std::tuple<at::Tensor, LayerStates> PerformerLMImpl::forward_chunk(const at::Tensor& tokens, int64_t offset,
                                                                   const LayerStates& states) {
  TORCH_CHECK(tokens.dim() == 2 && !at::isFloatingType(tokens.scalar_type()), kOp,
              ": tokens must be integer ids [batch, length], got ", tokens.scalar_type(), " ", tokens.sizes());
  TORCH_CHECK(offset >= 0 && offset + tokens.size(1) <= config_.max_len, kOp, ": positions ", offset, " .. ",
              offset + tokens.size(1) - 1, " exceed the model's max_len ", config_.max_len);
  TORCH_CHECK(states.empty() || states.size() == blocks->size(), kOp, ": ", states.size(), " states for ",
              blocks->size(), " blocks");
  at::Tensor x = embed_chunk(tokens, offset);
  LayerStates out;
  for (size_t i = 0; i < blocks->size(); ++i) {
    auto [y, s] =
        blocks[i]->as<PerformerBlockImpl>()->forward(x, states.empty() ? tempo::nn::LinearAttentionState{} : states[i]);
    x = y;
    out.push_back(s);
  }
  return {logits(x), out};
}

}  // namespace tempo::models
