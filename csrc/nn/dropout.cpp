#include "tempo/nn/dropout.h"

#include <ATen/ATen.h>

#include "tempo/ops/dropout.h"

namespace tempo::nn {

DropoutImpl::DropoutImpl(DropoutOptions options_) : options(std::move(options_)) {
  // Reject a bad p or mode at construction, as torch::nn::Dropout does for p.
  tempo::dropout(at::empty({0}), options.p(), false, options.mode());
}
at::Tensor DropoutImpl::forward(const at::Tensor& x) {
  return tempo::dropout(x, options.p(), is_training(), options.mode());
}
void DropoutImpl::reset() {}
void DropoutImpl::pretty_print(std::ostream& stream) const {
  stream << "tempo::nn::Dropout(p=" << options.p() << ", mode=" << options.mode() << ")";
}

at::Tensor baseline_dropout(const at::Tensor& x, double p, bool train) {
  if (!train || p == 0.0) return x;
  const auto bits = std::get<1>(tempo::dropout_forward(x.detach(), p, "bits"));
  const at::Tensor shifts = at::arange(8, bits.options());
  const at::Tensor keep = bits.unsqueeze(1)
                              .bitwise_right_shift(shifts)
                              .bitwise_and(1)
                              .flatten()
                              .slice(0, 0, x.numel())
                              .view(x.sizes())
                              .to(at::kBool);
  return x.masked_fill(keep.logical_not(), 0.0) * (1.0 / (1.0 - p));
}

}  // namespace tempo::nn
