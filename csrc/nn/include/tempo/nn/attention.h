// Multi-head self-attention with a choice of how the attention core keeps its activations:
//   "tempo": tempo::attention (keeps P and 1 bit per probability; dropped probabilities
//            recomputed in backward),
//   "sdpa":  torch's scaled_dot_product_attention (fused kernels keep no S^2 tensor),
//   "eager": the plain PyTorch baseline (keeps P, a byte mask and the dropped P),
//   "fused": no S^2 tensor at all: torch's fused sdpa kernel where torch has one for these
//            inputs, else tempo::fused_attention (blocks of query rows, P recomputed in
//            backward; e.g. on CPU with dropout, where torch's sdpa falls back to its math path),
//   "auto":  sdpa where torch picks a fused kernel for these inputs, else tempo.
// One GEMM projects q, k and v (weight [3 hidden, hidden], submodule "qkv"), then "out".
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <utility>

namespace tempo::nn {

struct SelfAttentionOptions {
  SelfAttentionOptions(int64_t hidden, int64_t heads) : hidden_(hidden), heads_(heads) {}
  TORCH_ARG(int64_t, hidden);
  TORCH_ARG(int64_t, heads);
  TORCH_ARG(double, dropout) = 0.0;  // on the attention probabilities, in training
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(bool, causal) = false;
  TORCH_ARG(std::string, backend) = "auto";  // tempo | sdpa | eager | fused | auto
  TORCH_ARG(std::string, mode) = "bits";     // tempo's dropout: bits | philox
  TORCH_ARG(bool, rotary) = false;           // rotary position embedding of q and k (LLaMA)
  TORCH_ARG(double, rope_theta) = 10000.0;
  // q, k, v by tempo::qkv_split: the projection GEMM without its bias, then one pass adds the
  // bias and writes the [B, A, S, d] layout (the Data Movement paper's "aib").
  TORCH_ARG(bool, fused_qkv) = false;
  // In training, keep only x for the q/k/v projection and the attention core, and recompute
  // both in the backward (tempo::nn::checkpoint around them): q, k, v and whatever the core
  // keeps are not held between forward and backward, for one more projection GEMM and
  // attention forward in the backward.
  TORCH_ARG(bool, recompute) = false;
};

class SelfAttentionImpl : public torch::nn::Cloneable<SelfAttentionImpl> {
 public:
  explicit SelfAttentionImpl(SelfAttentionOptions options);
  // x: [batch, seq, hidden]. attention_mask: [batch, seq] padding mask (nonzero / true:
  // attend to that key), or a bool (true: attend) / additive mask broadcastable to
  // [batch, heads, seq, seq].
  // out_bias = false leaves the output projection's bias (`out->bias`) to the caller, to be
  // fused into what follows (tempo::bias_dropout_add_layer_norm's bias).
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& attention_mask = std::nullopt,
                     bool out_bias = true);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  // The backend the last forward used ("auto" and "fused" resolved; "tempo-fused" is
  // tempo::fused_attention).
  const std::string& last_backend() const { return last_backend_; }
  SelfAttentionOptions options;
  torch::nn::Linear qkv{nullptr}, out{nullptr};

 private:
  // The q/k/v projection and the attention core: the heads merged, [B, S, hidden], before `out`.
  at::Tensor attend(const at::Tensor& x, const std::optional<at::Tensor>& attention_mask);
  std::string last_backend_;
};
TORCH_MODULE(SelfAttention);

// The attention core of each backend on [B, A, S, d] tensors (mask as for tempo::attention).
at::Tensor eager_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const std::optional<at::Tensor>& mask, double dropout_p, bool causal);
// The rotary embedding's cos and sin for positions 0..seq-1 ([seq, head_dim] in options' dtype
// and device; LLaMA's frequencies theta^(-2i / head_dim), computed in float32), as tempo::rope
// takes them: one pair a layer serves its q and k.
std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t seq, int64_t head_dim, double theta,
                                                const at::TensorOptions& options);

at::Tensor sdpa_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double dropout_p, bool causal);

}  // namespace tempo::nn
