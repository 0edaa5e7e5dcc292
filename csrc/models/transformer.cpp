#include "tempo/models/transformer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/init.h>

#include <cmath>

#include "tempo/memory.h"
#include "tempo/nn/checkpoint.h"
#include "tempo/nn/dropout.h"
#include "tempo/ops/activation.h"
#include "tempo/ops/dropout.h"
#include "tempo/ops/gated_mlp.h"
#include "tempo/ops/linear_cross_entropy.h"
#include "tempo/ops/norm.h"

namespace tempo::models {

// ---- the method's ops ---------------------------------------------------------------------

at::Tensor MethodOps::gelu(const at::Tensor& x, const char* approximate, const at::Tensor& bias) const {
  // (a bias in x's dtype, as the linear layer it comes from would add it under autocast, so the
  // kept output stays in x's dtype)
  if (method_.inplace_gelu)
    return tempo::gelu(x, approximate,
                       bias.defined() ? std::optional<at::Tensor>(bias.to(x.scalar_type())) : std::nullopt);
  return at::gelu(bias.defined() ? x + bias : x, approximate);
}

at::Tensor MethodOps::dropout(const at::Tensor& x, double p, bool train) const {
  if (!train || p == 0.0) return x;
  if (method_.bit_dropout) return tempo::dropout(x, p, true, "bits");
  // The baseline keeps a byte mask, as PyTorch's CUDA dropout does (its CPU kernel keeps a
  // full-width noise tensor, which would flatter the comparison); same mask as tempo's.
  return tempo::nn::baseline_dropout(x, p, true);
}

at::Tensor MethodOps::norm(const at::Tensor& x, const torch::nn::Module& m, bool rms, double eps) const {
  if (rms) {
    const auto& n = dynamic_cast<const tempo::nn::RMSNormImpl&>(m);
    const std::optional<at::Tensor> w = n.weight.defined() ? std::optional<at::Tensor>(n.weight) : std::nullopt;
    return method_.inplace_norm ? tempo::rms_norm(x, {x.size(-1)}, w, eps) : at::rms_norm(x, {x.size(-1)}, w, eps);
  }
  const auto& n = dynamic_cast<const tempo::nn::LayerNormImpl&>(m);
  const std::optional<at::Tensor> w = n.weight.defined() ? std::optional<at::Tensor>(n.weight) : std::nullopt;
  const std::optional<at::Tensor> b = n.bias.defined() ? std::optional<at::Tensor>(n.bias) : std::nullopt;
  return method_.inplace_norm ? tempo::layer_norm(x, {x.size(-1)}, w, b, eps)
                              : at::layer_norm(x, {x.size(-1)}, w, b, eps);
}

at::Tensor MethodOps::add_norm(const at::Tensor& x, const at::Tensor& residual, double p, bool train,
                               const tempo::nn::LayerNorm& n, double eps, const at::Tensor& bias) const {
  const std::optional<at::Tensor> b = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  if (method_.bit_dropout && method_.inplace_norm)
    return tempo::bias_dropout_add_layer_norm(x, b, residual, p, n->weight, n->bias, eps, "bits", train);
  return norm(residual + dropout(b ? x + bias : x, p, train), *n, false, eps);
}

// ---- one layer ----------------------------------------------------------------------------

namespace {
bool is_decoder(Arch a) { return a == Arch::kGpt2 || a == Arch::kLlama; }

std::shared_ptr<torch::nn::Module> make_norm(const ModelConfig& c) {
  if (c.arch == Arch::kLlama) return tempo::nn::RMSNorm(tempo::nn::RMSNormOptions({c.hidden}).eps(c.eps)).ptr();
  return tempo::nn::LayerNorm(tempo::nn::LayerNormOptions({c.hidden}).eps(c.eps)).ptr();
}
}  // namespace

TransformerLayerImpl::TransformerLayerImpl(const ModelConfig& config, std::shared_ptr<const MethodOps> ops)
    : config_(config), ops_(std::move(ops)) {
  reset();
}

void TransformerLayerImpl::reset() {
  const auto& c = config_;
  const bool llama = c.arch == Arch::kLlama;
  attention =
      register_module("attention", tempo::nn::SelfAttention(tempo::nn::SelfAttentionOptions(c.hidden, c.heads)
                                                                .dropout(c.attention_dropout)
                                                                .bias(!llama)
                                                                .causal(is_decoder(c.arch))
                                                                .backend(ops_->method().attention)
                                                                .rotary(llama)
                                                                .rope_theta(c.rope_theta)
                                                                .fused_qkv(ops_->method().fused_kernels)
                                                                .recompute(ops_->method().recompute_attention)));
  fc1 = register_module("fc1", torch::nn::Linear(torch::nn::LinearOptions(c.hidden, c.intermediate).bias(!llama)));
  fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(c.intermediate, c.hidden).bias(!llama)));
  if (llama)
    gate = register_module("gate", torch::nn::Linear(torch::nn::LinearOptions(c.hidden, c.intermediate).bias(false)));
  norm1 = register_module("norm1", make_norm(c));
  norm2 = register_module("norm2", make_norm(c));
}

at::Tensor TransformerLayerImpl::norm(int which, const at::Tensor& x) const {
  return ops_->norm(x, which == 1 ? *norm1 : *norm2, config_.arch == Arch::kLlama, config_.eps);
}

at::Tensor TransformerLayerImpl::ffn(const at::Tensor& x, bool out_bias) {
  at::Tensor a;
  if (config_.arch == Arch::kLlama) {  // SwiGLU: tempo keeps gate and up, not SiLU(gate) or the product
    if (ops_->method().inplace_gelu) {
      const at::Tensor y = tempo::gated_mlp(x, gate->weight, fc1->weight, fc2->weight, std::nullopt, std::nullopt,
                                            std::nullopt, "silu", 0, ops_->method().mlp_recompute);
      return out_bias && fc2->bias.defined() ? y + fc2->bias : y;
    }
    a = at::silu(gate->forward(x)) * fc1->forward(x);
  } else {
    const char* approximate = config_.arch == Arch::kGpt2 ? "tanh" : "none";
    // Fused kernels: fc1's bias is added inside the activation's pass (bias + GELU + bit).
    a = ops_->method().fused_kernels ? ops_->gelu(at::linear(x, fc1->weight), approximate, fc1->bias)
                                     : ops_->gelu(fc1->forward(x), approximate);
  }
  return out_bias ? fc2->forward(a) : at::linear(a, fc2->weight);
}

at::Tensor TransformerLayerImpl::forward(const at::Tensor& x, const at::Tensor& mask) {
  const bool train = is_training();
  const double p = config_.dropout;
  const std::optional<at::Tensor> m = mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt;
  if (!is_decoder(config_.arch)) {  // post-LN: LN(x + drop(attn(x))), LN(h + drop(ffn(h)))
    const tempo::nn::LayerNorm ln1(std::dynamic_pointer_cast<tempo::nn::LayerNormImpl>(norm1));
    const tempo::nn::LayerNorm ln2(std::dynamic_pointer_cast<tempo::nn::LayerNormImpl>(norm2));
    if (ops_->method().fused_kernels) {
      // The out and fc2 projections' biases go into the bias-dropout-residual-LayerNorm pass.
      const at::Tensor h =
          ops_->add_norm(attention->forward(x, m, false), x, p, train, ln1, config_.eps, attention->out->bias);
      return ops_->add_norm(ffn(h, false), h, p, train, ln2, config_.eps, fc2->bias);
    }
    const at::Tensor h = ops_->add_norm(attention->forward(x, m), x, p, train, ln1, config_.eps);
    return ops_->add_norm(ffn(h), h, p, train, ln2, config_.eps);
  }
  // pre-LN: h = x + drop(attn(norm1(x))), x + drop(ffn(norm2(h)))
  const at::Tensor h = x + ops_->dropout(attention->forward(norm(1, x), m), p, train);
  return h + ops_->dropout(ffn(norm(2, h)), p, train);
}

// ---- the model ----------------------------------------------------------------------------

TransformerModelImpl::TransformerModelImpl(ModelConfig config, Method method)
    : config_(std::move(config)), ops_(std::make_shared<const MethodOps>(std::move(method))) {
  config_.validate();
  // Built on the host (then moved): refused with the sizes rather than killed by the kernel.
  tempo::memory::check_host_fits(
      config_.parameter_count() * c10::get_default_dtype().itemsize(),
      "tempo::models::TransformerModel: " + config_.name + " (" + std::to_string(config_.layers) + " layers, hidden " +
          std::to_string(config_.hidden) + ", " + std::to_string(config_.parameter_count()) + " parameters)");
  reset();
}

void TransformerModelImpl::reset() {
  const auto& c = config_;
  tokens = register_module("tokens", torch::nn::Embedding(c.vocab, c.hidden));
  if (c.arch != Arch::kLlama) positions = register_module("positions", torch::nn::Embedding(c.max_positions, c.hidden));
  if (c.type_vocab > 0) token_types = register_module("token_types", torch::nn::Embedding(c.type_vocab, c.hidden));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.layers; ++i) layers->push_back(TransformerLayer(c, ops_));
  if (is_decoder(c.arch)) {
    final_norm = register_module("final_norm", make_norm(c));
    if (c.arch == Arch::kLlama)
      lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.hidden, c.vocab).bias(false)));
  } else {
    embed_norm = register_module("embed_norm", make_norm(c));
    mlm_dense = register_module("mlm_dense", torch::nn::Linear(c.hidden, c.hidden));
    mlm_norm = register_module("mlm_norm", tempo::nn::LayerNorm(tempo::nn::LayerNormOptions({c.hidden}).eps(c.eps)));
    mlm_bias = register_parameter("mlm_bias", torch::zeros({c.vocab}));
    pooler = register_module("pooler", torch::nn::Linear(c.hidden, c.hidden));
    classifier = register_module("classifier", torch::nn::Linear(c.hidden, c.num_labels));
  }
  // BERT/GPT-2 initialisation: N(0, 0.02) weights, zero biases, unit norms.
  torch::NoGradGuard no_grad;
  for (auto& m : modules(/*include_self=*/false)) {
    if (auto* l = m->as<torch::nn::Linear>()) {
      l->weight.normal_(0, 0.02);
      if (l->bias.defined()) l->bias.zero_();
    } else if (auto* e = m->as<torch::nn::Embedding>()) {
      e->weight.normal_(0, 0.02);
    }
  }
}

at::Tensor TransformerModelImpl::hidden_states(const at::Tensor& ids, const at::Tensor& mask) {
  const auto& c = config_;
  TORCH_CHECK(ids.dim() == 2, "tempo::models: input_ids must be [batch, seq], got ", ids.sizes());
  const int64_t S = ids.size(1);
  TORCH_CHECK(c.arch == Arch::kLlama || S + (c.arch == Arch::kRoberta ? c.pad_id + 1 : 0) <= c.max_positions,
              "tempo::models: sequence length ", S, " exceeds the model's ", c.max_positions, " positions");
  const bool train = is_training();
  at::Tensor x = tokens->forward(ids);
  if (positions) {
    at::Tensor pos;
    if (c.arch == Arch::kRoberta) {  // positions count real tokens, starting after the padding id
      const at::Tensor real = ids.ne(c.pad_id).to(at::kLong);
      pos = at::cumsum(real, 1) * real + c.pad_id;
    } else {
      pos = at::arange(S, ids.options().dtype(at::kLong)).unsqueeze(0);
    }
    x = x + positions->forward(pos);
  }
  if (token_types) x = x + token_types->forward(at::zeros_like(ids));
  if (embed_norm) x = ops_->norm(x, *embed_norm, false, c.eps);
  x = ops_->dropout(x, c.dropout, train);
  for (const auto& m : *layers) {
    auto layer = std::dynamic_pointer_cast<TransformerLayerImpl>(m);
    if (ops_->method().checkpoint && train) {
      // (autograd Functions take no undefined tensors: pass the mask only when there is one)
      x = tempo::nn::checkpoint(
          [layer](const std::vector<at::Tensor>& in) {
            return layer->forward(in[0], in.size() > 1 ? in[1] : at::Tensor());
          },
          mask.defined() ? std::vector<at::Tensor>{x, mask} : std::vector<at::Tensor>{x});
    } else {
      x = layer->forward(x, mask);
    }
  }
  if (final_norm) x = ops_->norm(x, *final_norm, c.arch == Arch::kLlama, c.eps);
  return x;
}

at::Tensor TransformerModelImpl::loss(const Batch& batch) {
  const auto& c = config_;
  const at::Tensor h = hidden_states(batch.input_ids, batch.attention_mask);
  namespace F = torch::nn::functional;
  if (is_decoder(c.arch)) {  // next-token prediction on real tokens
    TORCH_CHECK(!batch.classify, "tempo::models: ", arch_name(c.arch), " has no classification head");
    const at::Tensor& w = c.arch == Arch::kLlama ? lm_head->weight : tokens->weight;
    at::Tensor target = batch.input_ids.slice(1, 1).clone();
    if (batch.attention_mask.defined()) target.masked_fill_(batch.attention_mask.slice(1, 1).eq(0), -100);
    const at::Tensor hs = h.slice(1, 0, -1).reshape({-1, c.hidden});
    if (ops_->method().fused_head) return tempo::linear_cross_entropy(hs, w, std::nullopt, target.reshape({-1}));
    return F::cross_entropy(at::matmul(hs, w.t()), target.reshape({-1}),
                            F::CrossEntropyFuncOptions().ignore_index(-100));
  }
  if (batch.classify) {
    const at::Tensor pooled = at::tanh(pooler->forward(h.select(1, 0)));
    const at::Tensor logits = classifier->forward(ops_->dropout(pooled, c.dropout, is_training()));
    return F::cross_entropy(logits, batch.labels);
  }
  // Masked LM on the labelled positions only (gathered before the vocabulary projection).
  TORCH_CHECK(batch.labels.defined(), "tempo::models: a masked-LM batch needs labels");
  const at::Tensor sel = batch.labels.reshape({-1}).ne(-100).nonzero().squeeze(1);
  const at::Tensor hs = h.reshape({-1, c.hidden}).index_select(0, sel);
  at::Tensor t = ops_->gelu(mlm_dense->forward(hs), "none");
  t = ops_->norm(t, *mlm_norm, false, c.eps);
  const at::Tensor target = batch.labels.reshape({-1}).index_select(0, sel);
  if (ops_->method().fused_head) return tempo::linear_cross_entropy(t, tokens->weight, mlm_bias, target);
  return F::cross_entropy(at::matmul(t, tokens->weight.t()) + mlm_bias, target);
}

TransformerModel make_model(const ModelConfig& config, const Method& method) {
  return TransformerModel(config, method);
}

namespace {
// The masked-language-model batch: BERT's [MASK] token id (bert-base-uncased's vocabulary; a
// smaller vocabulary uses its last id), the share of tokens masked (BERT's 15%), the label
// cross-entropy ignores (torch's default ignore_index), and every how-many'th sequence ends
// in padding (its last quarter).
constexpr int64_t kBertMaskId = 103;
constexpr double kMaskShare = 0.15;
constexpr int64_t kIgnoreLabel = -100;
constexpr int64_t kPaddedEvery = 8;
}  // namespace

Batch synthetic_batch(const ModelConfig& config, int64_t batch, int64_t seq, uint64_t seed, const c10::Device& device) {
  TORCH_CHECK(batch > 0 && seq > 1, "tempo::models: a batch needs batch > 0 and seq > 1, got ", batch, " x ", seq);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto l = at::TensorOptions().dtype(at::kLong);
  const int64_t lo = std::min<int64_t>(config.pad_id + 2, config.vocab - 1);
  Batch b;
  b.input_ids = at::randint(lo, config.vocab, {batch, seq}, gen, l);
  b.attention_mask = at::ones({batch, seq}, l);
  for (int64_t i = kPaddedEvery - 1; i < batch; i += kPaddedEvery) {
    b.attention_mask[i].slice(0, seq - seq / 4).fill_(0);
    b.input_ids[i].slice(0, seq - seq / 4).fill_(config.pad_id);
  }
  if (config.arch == Arch::kBert || config.arch == Arch::kRoberta) {
    at::Tensor pick = at::rand({batch, seq}, gen) < kMaskShare;
    pick.select(1, 1).fill_(true);
    pick = pick.logical_and(b.attention_mask.ne(0));
    b.labels = at::where(pick, b.input_ids, at::full({}, kIgnoreLabel, l));
    b.input_ids = at::where(pick, at::full({}, std::min<int64_t>(kBertMaskId, config.vocab - 1), l), b.input_ids);
  }
  b.input_ids = b.input_ids.to(device);
  b.attention_mask = b.attention_mask.to(device);
  if (b.labels.defined()) b.labels = b.labels.to(device);
  return b;
}

}  // namespace tempo::models
