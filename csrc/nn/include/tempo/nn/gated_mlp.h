// tempo::nn::GatedMLP, the gated MLP of LLaMA-style models: down_proj(act(gate_proj(x)) *
// up_proj(x)) by tempo::gated_mlp, keeping x, gate(x) and up(x) for backward, or fewer with
// options.recompute (see tempo/ops/gated_mlp.h). Projections named as transformers names them (gate_proj, up_proj,
// down_proj; gate_up_proj when fused), torch::nn::Linear modules.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <string>

namespace tempo::nn {

struct GatedMLPOptions {
  GatedMLPOptions(int64_t hidden, int64_t intermediate) : hidden_(hidden), intermediate_(intermediate) {}
  TORCH_ARG(int64_t, hidden);
  TORCH_ARG(int64_t, intermediate);
  TORCH_ARG(std::string, activation) = "silu";  // silu | gelu | gelu_tanh
  TORCH_ARG(bool, bias) = false;
  TORCH_ARG(bool, fused) = false;  // one gate_up_proj [2 intermediate, hidden], the gate's rows first
  TORCH_ARG(int64_t, chunk) = 0;   // the backward's intermediate columns per block (0: automatic)
  // what the backward recomputes: "product" (act(gate) * up only), "up" (also up(x): gate(x) kept
  // alone), "gate_up" (also gate(x): nothing I-wide kept); see tempo/ops/gated_mlp.h
  TORCH_ARG(std::string, recompute) = "product";
};

class GatedMLPImpl : public torch::nn::Cloneable<GatedMLPImpl> {
 public:
  explicit GatedMLPImpl(GatedMLPOptions options);
  at::Tensor forward(const at::Tensor& x);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  GatedMLPOptions options;
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, gate_up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(GatedMLP);

}  // namespace tempo::nn
