#include "tempo/nn/activation.h"

#include "tempo/ops/activation.h"

namespace tempo::nn {

GELUImpl::GELUImpl(GELUOptions options_) : options(std::move(options_)) {
  TORCH_CHECK(options.approximate() == "none" || options.approximate() == "tanh",  // reject a bad option now
              "tempo::nn::GELU: argument 'approximate' must be 'none' or 'tanh', got '", options.approximate(), "'");
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
