#include "tempo/nn/dropout.h"

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

}  // namespace tempo::nn
