#include "tempo/nn/gated_mlp.h"

#include "tempo/ops/gated_mlp.h"

namespace tempo::nn {

namespace {
std::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}
}  // namespace

GatedMLPImpl::GatedMLPImpl(GatedMLPOptions options_) : options(std::move(options_)) {
  const auto& a = options.activation();
  TORCH_CHECK(a == "silu" || a == "gelu" || a == "gelu_tanh",
              "tempo::nn::GatedMLP: argument 'activation' must be 'silu', 'gelu' or 'gelu_tanh', got '", a, "'");
  TORCH_CHECK(options.hidden() > 0 && options.intermediate() > 0,
              "tempo::nn::GatedMLP: hidden and intermediate must be positive, got ", options.hidden(), " and ",
              options.intermediate());
  TORCH_CHECK(options.chunk() >= 0, "tempo::nn::GatedMLP: chunk must be >= 0 (0: automatic), got ", options.chunk());
  const auto& r = options.recompute();
  TORCH_CHECK(r == "product" || r == "up" || r == "gate_up",
              "tempo::nn::GatedMLP: argument 'recompute' must be 'product', 'up' or 'gate_up', got '", r, "'");
  reset();
}

void GatedMLPImpl::reset() {
  const int64_t H = options.hidden(), I = options.intermediate();
  auto linear = [&](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(options.bias()));
  };
  if (options.fused()) {
    gate_up_proj = register_module("gate_up_proj", linear(H, 2 * I));
  } else {
    gate_proj = register_module("gate_proj", linear(H, I));
    up_proj = register_module("up_proj", linear(H, I));
  }
  down_proj = register_module("down_proj", linear(I, H));
}

at::Tensor GatedMLPImpl::forward(const at::Tensor& x) {
  const torch::nn::Linear& gate = options.fused() ? gate_up_proj : gate_proj;
  return tempo::gated_mlp(x, gate->weight, options.fused() ? std::nullopt : optional_of(up_proj->weight),
                          down_proj->weight, optional_of(gate->bias),
                          options.fused() ? std::nullopt : optional_of(up_proj->bias), optional_of(down_proj->bias),
                          options.activation(), options.chunk(), options.recompute());
}

void GatedMLPImpl::pretty_print(std::ostream& stream) const {
  stream << "tempo::nn::GatedMLP(hidden=" << options.hidden() << ", intermediate=" << options.intermediate()
         << ", activation=" << options.activation() << ", fused=" << (options.fused() ? "true" : "false");
  if (options.recompute() != "product") stream << ", recompute=" << options.recompute();
  stream << ")";
}

}  // namespace tempo::nn
