#include "tempo/nn/activation.h"

#include "tempo/ops/activation.h"
#include "../torch/ops/activation.h"

namespace tempo::nn {

GELUImpl::GELUImpl(GELUOptions options_) : options(std::move(options_)) {
  torch_impl::gelu_kind(options.approximate(), "tempo::nn::GELU");  // reject a bad option now
}
at::Tensor GELUImpl::forward(const at::Tensor& x) { return tempo::gelu(x, options.approximate()); }
void GELUImpl::reset() {}
void GELUImpl::pretty_print(std::ostream& stream) const {
  stream << "tempo::nn::GELU(approximate=" << options.approximate() << ")";
}

at::Tensor SiLUImpl::forward(const at::Tensor& x) { return tempo::silu(x); }
void SiLUImpl::reset() {}
void SiLUImpl::pretty_print(std::ostream& stream) const { stream << "tempo::nn::SiLU()"; }

}  // namespace tempo::nn
