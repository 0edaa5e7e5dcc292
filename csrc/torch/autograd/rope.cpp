// Autograd kernels of tempo::rope and tempo::rope_backward: each keeps only the tables (the
// caller's cos and sin, shared by every layer that rotates with them) and its backward is the
// other op, so the rotation is differentiable to any order. Tables that need a gradient take
// torch's ops instead (the same formula), which differentiate them too.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "tempo/ops/rope.h"

namespace tempo {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

template <bool Backward>
class RopeFunction : public torch::autograd::Function<RopeFunction<Backward>> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({cos, sin});
    return Backward ? rope_backward(x, cos, sin) : rope(x, cos, sin);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor g = Backward ? RopeFunction<false>::apply(grads[0], saved[0], saved[1])
                                  : RopeFunction<true>::apply(grads[0], saved[0], saved[1]);
    return {g, at::Tensor(), at::Tensor()};
  }
};

// x cos + rotate_half(x) sin by torch's ops (cos and sin as [b, 1, seq, r]); with Backward the
// transposed rotation, g cos + rotate_half^T(g sin), rotate_half^T(y) = [y[h:], -y[:h]].
at::Tensor by_torch(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  const int64_t r = cos.size(-1), h = r / 2, d = x.size(-1);
  const auto table = [&](const at::Tensor& t) {
    return t.dim() == 2 ? t.view({1, 1, t.size(0), r}) : t.dim() == 3 ? t.unsqueeze(1) : t;
  };
  const at::Tensor c = table(cos), s = table(sin), xr = x.narrow(-1, 0, r);
  at::Tensor out;
  if (backward) {
    const at::Tensor gs = xr * s;
    out = xr * c + at::cat({gs.narrow(-1, h, h), -gs.narrow(-1, 0, h)}, -1);
  } else {
    out = xr * c + at::cat({-xr.narrow(-1, h, h), xr.narrow(-1, 0, h)}, -1) * s;
  }
  out = out.to(x.scalar_type());
  return r < d ? at::cat({out, x.narrow(-1, r, d - r)}, -1) : out;
}

template <bool Backward>
at::Tensor rope_autograd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (cos.requires_grad() || sin.requires_grad()) {
    // The op's own argument checks, without running its kernel: on meta copies where the three
    // share a device (across devices the op itself refuses, naming the argument).
    const bool one_device = cos.device() == x.device() && sin.device() == x.device();
    const auto arg = [&](const at::Tensor& t) { return one_device ? t.detach().to(at::kMeta) : t.detach(); };
    (void)(Backward ? rope_backward(arg(x), arg(cos), arg(sin)) : rope(arg(x), arg(cos), arg(sin)));
    return by_torch(x, cos, sin, Backward);
  }
  return RopeFunction<Backward>::apply(x, cos, sin);
}

}  // namespace
}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, Autograd, m) {
  m.impl("rope", tempo::rope_autograd<false>);
  m.impl("rope_backward", tempo::rope_autograd<true>);
}
