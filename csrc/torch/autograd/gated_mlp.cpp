// Autograd kernel of tempo::gated_mlp: saves x, gate(x) and up(x) (the fused projection's one
// [rows, 2 I] output), never act(gate) or the product h; the backward recomputes h block by
// block (ops/gated_mlp.cpp). recompute "up" saves gate(x) only, "gate_up" neither (the forward
// makes them block by block and keeps none whole); the backward then recomputes them from x,
// block by block, with the biases it saves for that. Not twice differentiable: a second derivative raises.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "common.h"
#include "tempo/ops/gated_mlp.h"

namespace tempo {
namespace {

using autograd_impl::once_differentiable;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }
std::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

class GatedMlpFunction : public torch::autograd::Function<GatedMlpFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& gate_weight,
                            const std::optional<at::Tensor>& up_weight, const at::Tensor& down_weight,
                            const std::optional<at::Tensor>& gate_bias, const std::optional<at::Tensor>& up_bias,
                            const std::optional<at::Tensor>& down_bias, c10::string_view activation, int64_t chunk,
                            c10::string_view recompute) {
    at::AutoDispatchBelowADInplaceOrView guard;
    TORCH_CHECK(chunk >= 0, "tempo::gated_mlp: chunk must be >= 0 (0: automatic), got ", chunk);
    const bool recomputes = gated_mlp_recompute(recompute) != GatedMlpRecompute::kProduct;
    // what is recomputed comes back empty (never made whole), and is saved as such
    auto [y, gate, up] =
        gated_mlp_forward(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation, recompute);
    ctx->save_for_backward({x, gate, up, gate_weight, or_undefined(up_weight), down_weight,
                            recomputes ? or_undefined(gate_bias) : at::Tensor(),
                            recomputes ? or_undefined(up_bias) : at::Tensor()});
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["has_bias"] =
        c10::List<bool>({gate_bias.has_value() && gate_bias->defined(), up_bias.has_value() && up_bias->defined(),
                         down_bias.has_value() && down_bias->defined()});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return once_differentiable("tempo::gated_mlp", grads, [&]() -> variable_list {
      const auto s = ctx->get_saved_variables();
      const auto has_bias = ctx->saved_data["has_bias"].toBoolList();
      // the graph has an edge for each tensor argument given, in order (an absent optional has none)
      size_t edge = 0;
      auto needs = [&](bool given) { return given && ctx->needs_input_grad(edge++); };
      std::array<bool, 4> mask{};
      mask[0] = needs(true);
      mask[1] = needs(true);
      mask[2] = needs(s[4].defined());
      mask[3] = needs(true);
      std::array<bool, 3> bias_grad{};
      for (size_t i = 0; i < 3; ++i) bias_grad[i] = needs(has_bias[i]);
      auto [dx, dgw, duw, ddw, dgb, dub, ddb] =
          gated_mlp_backward(grads[0], s[0], optional_of(s[1]), optional_of(s[2]), s[3], optional_of(s[4]), s[5],
                             optional_of(s[6]), optional_of(s[7]), bias_grad,
                             ctx->saved_data["activation"].toStringRef(), ctx->saved_data["chunk"].toInt(), mask);
      return {dx, dgw, duw, ddw, dgb, dub, ddb, at::Tensor(), at::Tensor(), at::Tensor()};
    });
  }
};

at::Tensor gated_mlp_autograd(const at::Tensor& x, const at::Tensor& gate_weight,
                              const std::optional<at::Tensor>& up_weight, const at::Tensor& down_weight,
                              const std::optional<at::Tensor>& gate_bias, const std::optional<at::Tensor>& up_bias,
                              const std::optional<at::Tensor>& down_bias, c10::string_view activation, int64_t chunk,
                              c10::string_view recompute) {
  return GatedMlpFunction::apply(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, activation,
                                 chunk, recompute);
}

}  // namespace
}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, Autograd, m) { m.impl("gated_mlp", tempo::gated_mlp_autograd); }
