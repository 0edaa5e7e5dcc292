// Drop-in module for torch::nn::Dropout whose backward keeps a 1-bit mask ("bits") or only
// a 16-byte Philox state ("philox"); identity in eval mode (see tempo/ops/dropout.h).
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <string>

namespace tempo::nn {

struct DropoutOptions {
  /* implicit */ DropoutOptions(double p = 0.5) : p_(p) {}
  TORCH_ARG(double, p);
  TORCH_ARG(std::string, mode) = "bits";
};

class DropoutImpl : public torch::nn::Cloneable<DropoutImpl> {
 public:
  explicit DropoutImpl(DropoutOptions options = {});
  at::Tensor forward(const at::Tensor& x);
  void reset() override;
  void pretty_print(std::ostream& stream) const override;
  DropoutOptions options;
};
TORCH_MODULE(Dropout);

}  // namespace tempo::nn
