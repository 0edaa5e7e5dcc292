// Drop-in modules for torch::nn::GELU and torch::nn::SiLU whose backward keeps only the
// output and a 1-bit mask (see tempo/ops/activation.h).
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <string>

namespace tempo::nn {

struct GELUOptions {
  /* implicit */ GELUOptions(std::string approximate = "none") : approximate_(std::move(approximate)) {}
  TORCH_ARG(std::string, approximate);
};

class GELUImpl : public torch::nn::Cloneable<GELUImpl> {
 public:
  explicit GELUImpl(GELUOptions options = {});
  at::Tensor forward(const at::Tensor& x);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  GELUOptions options;
};
TORCH_MODULE(GELU);

class SiLUImpl : public torch::nn::Cloneable<SiLUImpl> {
 public:
  SiLUImpl() = default;
  at::Tensor forward(const at::Tensor& x);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
};
TORCH_MODULE(SiLU);

}  // namespace tempo::nn
