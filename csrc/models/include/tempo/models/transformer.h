// Transformer models built from tempo's modules, each under a Method:
//   BERT (post-LN encoder, MLM and sequence-classification heads), RoBERTa (BERT with
//   RoBERTa's embeddings), GPT-2 (pre-LN decoder, tanh GELU, causal, tied LM head),
//   LLaMA-style (RMSNorm, SwiGLU, rotary embeddings, no dropout, untied LM head).
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <memory>

#include "tempo/models/config.h"
#include "tempo/nn/attention.h"
#include "tempo/nn/norm.h"

namespace tempo::models {

// A batch of token ids [B, S]; attention_mask [B, S] (1: a real token, 0: padding) may be
// undefined; labels: MLM targets [B, S] with -100 where not predicted (BERT/RoBERTa), class
// ids [B] with `classify`, unused by the causal LMs (they predict the next token).
struct Batch {
  at::Tensor input_ids, attention_mask, labels;
  bool classify = false;
};

// The method's choice of each op (torch's, or tempo's that keeps less).
class MethodOps {
 public:
  explicit MethodOps(Method method) : method_(std::move(method)) {}
  const Method& method() const { return method_; }
  // f(x + bias); the bias (optional) is fused into the in-place activation under the method.
  at::Tensor gelu(const at::Tensor& x, const char* approximate, const at::Tensor& bias = {}) const;
  at::Tensor dropout(const at::Tensor& x, double p, bool train) const;
  at::Tensor norm(const at::Tensor& x, const torch::nn::Module& norm_module, bool rms, double eps) const;
  // norm(residual + dropout(x + bias)) (bias optional): one fused pass when the method has bit
  // masks and in-place norms.
  at::Tensor add_norm(const at::Tensor& x, const at::Tensor& residual, double p, bool train,
                      const tempo::nn::LayerNorm& norm, double eps, const at::Tensor& bias = {}) const;

 private:
  Method method_;
};

class TransformerLayerImpl : public torch::nn::Cloneable<TransformerLayerImpl> {
 public:
  TransformerLayerImpl(const ModelConfig& config, std::shared_ptr<const MethodOps> ops);
  // x [B, S, H]; mask [B, S] or undefined.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& mask);
  void reset() override;
  tempo::nn::SelfAttention attention{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, gate{nullptr};  // gate: SwiGLU only
  std::shared_ptr<torch::nn::Module> norm1, norm2;              // LayerNorm or RMSNorm

 private:
  at::Tensor norm(int which, const at::Tensor& x) const;
  // out_bias = false leaves fc2's bias to the caller (fused into the next pass).
  at::Tensor ffn(const at::Tensor& x, bool out_bias = true);
  ModelConfig config_;
  std::shared_ptr<const MethodOps> ops_;
};
TORCH_MODULE(TransformerLayer);

class TransformerModelImpl : public torch::nn::Cloneable<TransformerModelImpl> {
 public:
  TransformerModelImpl(ModelConfig config, Method method);
  // Final hidden states [B, S, H].
  at::Tensor hidden_states(const at::Tensor& input_ids, const at::Tensor& attention_mask);
  // The training loss of the batch: masked-LM (BERT, RoBERTa), sequence classification
  // (batch.classify), or next-token LM (GPT-2, LLaMA); mean cross-entropy.
  at::Tensor loss(const Batch& batch);
  void reset() override;
  const ModelConfig& config() const { return config_; }
  const Method& method() const { return ops_->method(); }

  torch::nn::Embedding tokens{nullptr}, positions{nullptr}, token_types{nullptr};
  std::shared_ptr<torch::nn::Module> embed_norm, final_norm;  // BERT/RoBERTa; GPT-2/LLaMA
  torch::nn::ModuleList layers{nullptr};
  torch::nn::Linear mlm_dense{nullptr}, lm_head{nullptr}, pooler{nullptr}, classifier{nullptr};
  tempo::nn::LayerNorm mlm_norm{nullptr};
  at::Tensor mlm_bias;

 private:
  ModelConfig config_;
  std::shared_ptr<const MethodOps> ops_;
};
TORCH_MODULE(TransformerModel);

// A model of `config` under `method` (both validated; clear errors otherwise).
TransformerModel make_model(const ModelConfig& config, const Method& method);

// A synthetic batch for benchmarks and tests: random ids, every 8th sequence padded by a
// quarter, MLM labels on 15% of the real tokens (BERT/RoBERTa), from the given seed.
Batch synthetic_batch(const ModelConfig& config, int64_t batch, int64_t seq, uint64_t seed,
                      const c10::Device& device = c10::Device(c10::kCPU));

}  // namespace tempo::models
