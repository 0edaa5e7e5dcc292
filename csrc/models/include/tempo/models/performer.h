// PerformerLM: a GPT-2-style pre-LN decoder with causal linear attention over a byte
// vocabulary, fixed sinusoidal positions (nothing that grows with the length), and a memory
// method for its GELU and LayerNorms (tempo: in place, keeping only outputs, so SLiM's and
// Tempo's savings compose). Trained in chunks by tempo::slim (tempo/models/slim.h).
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <tuple>
#include <vector>

#include "tempo/models/config.h"
#include "tempo/models/transformer.h"
#include "tempo/nn/linear_attention.h"
#include "tempo/nn/norm.h"

namespace tempo::models {

struct PerformerConfig {
  std::string name = "custom";
  int64_t d_model = 256, layers = 1, ffn = 1024, heads = 4;
  int64_t max_len = 512;            // positions the model accepts (its sinusoids are computed, not learned)
  int64_t vocab = 256;              // bytes
  std::string feature_map = "sqr";  // relu | elu | sqr | favor
  int64_t features = 0;             // FAVOR+'s M (0: the head dim)
  std::string mode = "iterative";   // the attention op's mode: iterative | prefix
  double attention_eps = 1e-6, norm_eps = 1e-5;

  // The SLiM paper's configurations (docs/slim.md): copy (L 512, d 256, 1 layer,
  // FFN 1024, 4 heads), ptb (L 1024, d 512, 3 layers, FFN 2048, 8 heads), enwik8 (L 4096,
  // d 1024, 3 layers, FFN 4096, 16 heads); byte vocabulary, sqr features.
  static PerformerConfig preset(const std::string& name);
  static std::vector<std::string> presets();
  void validate() const;  // clear errors for inconsistent sizes
  // The parameters PerformerLM(*this) has (tests check it against built models), and the
  // elements of its buffers (FAVOR+'s projections): known, and refused, before allocating.
  int64_t parameter_count() const;
  int64_t buffer_count() const;
};

using LayerStates = std::vector<tempo::nn::LinearAttentionState>;  // one per block

class PerformerBlockImpl : public torch::nn::Cloneable<PerformerBlockImpl> {
 public:
  PerformerBlockImpl(const PerformerConfig& config, std::shared_ptr<const MethodOps> ops);
  std::tuple<at::Tensor, tempo::nn::LinearAttentionState> forward(const at::Tensor& x,
                                                                  const tempo::nn::LinearAttentionState& state = {});
  // The block from the state before x, rebuilt from the state after it (leaves that require
  // grad): (output, state after, state before).
  std::tuple<at::Tensor, tempo::nn::LinearAttentionState, tempo::nn::LinearAttentionState> forward_rebuilding(
      const at::Tensor& x, const tempo::nn::LinearAttentionState& state_after);
  void reset() override;
  tempo::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  tempo::nn::CausalLinearAttention attn{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};

 private:
  at::Tensor mlp_residual(const at::Tensor& x);
  PerformerConfig config_;
  std::shared_ptr<const MethodOps> ops_;
};
TORCH_MODULE(PerformerBlock);

class PerformerLMImpl : public torch::nn::Cloneable<PerformerLMImpl> {
 public:
  // method: eager (torch's GELU and LayerNorm) or tempo (in place); the other toggles of a
  // Method do not apply to this model and are refused.
  PerformerLMImpl(PerformerConfig config, const Method& method = Method::parse("tempo"));
  // Sinusoidal encodings of positions offset .. offset + length - 1 (Vaswani et al.), [length, d].
  at::Tensor positions(int64_t offset, int64_t length, const at::TensorOptions& options) const;
  // Token embeddings plus positions of tokens [B, C] at `offset`.
  at::Tensor embed_chunk(const at::Tensor& tokens, int64_t offset);
  // Logits [B, C, vocab] of positions offset .. offset + C - 1 from the layers' states before
  // them (empty: the sequence's start), and the states after them.
  std::tuple<at::Tensor, LayerStates> forward_chunk(const at::Tensor& tokens, int64_t offset = 0,
                                                    const LayerStates& states = {});
  at::Tensor logits(const at::Tensor& hidden);  // final LayerNorm and the LM head
  at::Tensor forward(const at::Tensor& tokens) { return std::get<0>(forward_chunk(tokens)); }
  void reset() override;
  const PerformerConfig& config() const { return config_; }
  const Method& method() const { return ops_->method(); }

  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  tempo::nn::LayerNorm ln{nullptr};
  torch::nn::Linear head{nullptr};

 private:
  PerformerConfig config_;
  std::shared_ptr<const MethodOps> ops_;
};
TORCH_MODULE(PerformerLM);

}  // namespace tempo::models
