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

// The baseline's dropout: PyTorch's as it runs on CUDA, keeping a bool mask (1 byte per
// element) for backward. It draws the same mask tempo::dropout draws from the same generator
// state, so a baseline and tempo compare under identical masks. p = 0 or !train: x itself.
at::Tensor baseline_dropout(const at::Tensor& x, double p, bool train = true);

}  // namespace tempo::nn
