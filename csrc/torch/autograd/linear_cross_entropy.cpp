// Autograd kernel of tempo::linear_cross_entropy: saves hidden, weight, bias, labels and one
// float32 log-sum-exp per row; never the logits.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "common.h"
#include "tempo/ops/linear_cross_entropy.h"

namespace tempo {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& labels, int64_t ignore,
                            double smoothing, c10::string_view reduction, int64_t chunk,
                            std::optional<at::ScalarType> dtype, double logit_scale, std::optional<double> softcap,
                            double z_loss) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [loss, lse] = linear_cross_entropy_forward(hidden, weight, bias, labels, ignore, smoothing, reduction, chunk,
                                                    dtype, logit_scale, softcap, z_loss);
    const bool has_bias = bias.has_value() && bias->defined();
    ctx->save_for_backward({hidden, weight, has_bias ? *bias : at::Tensor(), labels, lse});
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["ignore"] = ignore;
    ctx->saved_data["smoothing"] = smoothing;
    ctx->saved_data["reduction"] = std::string(reduction);
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["logit_scale"] = logit_scale;
    ctx->saved_data["softcap"] = softcap.has_value() ? c10::IValue(*softcap) : c10::IValue();
    ctx->saved_data["z_loss"] = z_loss;
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    return autograd_impl::once_differentiable("tempo::linear_cross_entropy", grads, [&]() -> variable_list {
      auto [gh, gw, gb] = linear_cross_entropy_backward(
          grads[0], s[0], s[1], has_bias ? std::optional<at::Tensor>(s[2]) : std::nullopt, s[3], s[4],
          ctx->saved_data["ignore"].toInt(), ctx->saved_data["smoothing"].toDouble(),
          ctx->saved_data["reduction"].toStringRef(), ctx->saved_data["chunk"].toInt(),
          ctx->saved_data["logit_scale"].toDouble(),
          ctx->saved_data["softcap"].isNone() ? std::nullopt
                                              : std::optional<double>(ctx->saved_data["softcap"].toDouble()),
          ctx->saved_data["z_loss"].toDouble());
      return {gh,           gw,           has_bias ? gb : at::Tensor(),
              at::Tensor(), at::Tensor(), at::Tensor(),
              at::Tensor(), at::Tensor(), at::Tensor(),
              at::Tensor(), at::Tensor(), at::Tensor()};
    });
  }
};

at::Tensor linear_cross_entropy_autograd(const at::Tensor& hidden, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias, const at::Tensor& labels,
                                         int64_t ignore, double smoothing, c10::string_view reduction, int64_t chunk,
                                         std::optional<at::ScalarType> dtype, double logit_scale,
                                         std::optional<double> softcap, double z_loss) {
  return LinearCrossEntropyFunction::apply(hidden, weight, bias, labels, ignore, smoothing, reduction, chunk, dtype,
                                           logit_scale, softcap, z_loss);
}

// The statistics have no gradient: computed below autograd, so their outputs are plain tensors
// whatever the inputs need (without this kernel autograd would warn and fail at backward).
std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_autograd(const at::Tensor& hidden, const at::Tensor& weight,
                                                              const std::optional<at::Tensor>& bias,
                                                              const at::Tensor& labels, int64_t ignore,
                                                              double temperature, double logit_scale,
                                                              std::optional<double> softcap, int64_t chunk) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return linear_cross_entropy_stats(hidden, weight, bias, labels, ignore, temperature, logit_scale, softcap, chunk);
}

}  // namespace
}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, Autograd, m) {
  m.impl("linear_cross_entropy", tempo::linear_cross_entropy_autograd);
  m.impl("linear_cross_entropy_stats", tempo::stats_autograd);
}
