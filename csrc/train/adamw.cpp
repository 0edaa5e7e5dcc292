// AdamW whose CPU update is one element-wise pass with IEEE square roots (see adamw.h).
// Built with -ffp-contract=off (CMakeLists.txt): the vectorised body and the scalar tail of the
// loop round alike, so where a thread's range begins cannot change a bit.
#include "tempo/train/adamw.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

namespace tempo::train {

namespace {

template <typename T>
void update_cpu(T* p, const T* g, T* m, T* v, T* vmax, int64_t n, double lr, double beta1, double beta2, double eps,
                double weight_decay, int64_t step) {
  const double bc1 = 1 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(beta2, static_cast<double>(step));
  const T decay = static_cast<T>(1 - lr * weight_decay);
  const T b1 = static_cast<T>(beta1), a1 = static_cast<T>(1 - beta1);
  const T b2 = static_cast<T>(beta2), a2 = static_cast<T>(1 - beta2);
  const T root_bc2 = static_cast<T>(std::sqrt(bc2));
  const T e = static_cast<T>(eps);
  const T step_size = static_cast<T>(lr / bc1);
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T gi = g[i];
      const T mi = b1 * m[i] + a1 * gi;
      T vi = b2 * v[i] + a2 * gi * gi;
      m[i] = mi;
      v[i] = vi;
      if (vmax) vi = vmax[i] = std::max(vmax[i], vi);
      const T denom = std::sqrt(vi) / root_bc2 + e;
      p[i] = p[i] * decay - step_size * (mi / denom);
    }
  });
}

// The same update in tensor ops (CUDA, where the square root is IEEE's, and the CPU's reduced
// precisions, which ATen computes in float without VML).
void update_tensors(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                    const at::Tensor& vmax, double lr, double beta1, double beta2, double eps, double weight_decay,
                    int64_t step) {
  const double bc1 = 1 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(beta2, static_cast<double>(step));
  m.mul_(beta1).add_(g, 1 - beta1);
  v.mul_(beta2).addcmul_(g, g, 1 - beta2);
  at::Tensor second = v;
  if (vmax.defined()) {
    at::Tensor out = vmax;
    at::maximum_out(out, vmax, v);
    second = vmax;
  }
  const at::Tensor denom = (second.sqrt() / std::sqrt(bc2)).add_(eps);
  if (weight_decay != 0) p.mul_(1 - lr * weight_decay);
  p.addcdiv_(m, denom, -lr / bc1);
}

void check_like(const at::Tensor& param, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), "tempo::train::adamw_update: ", name, " is undefined");
  TORCH_CHECK(t.device() == param.device(), "tempo::train::adamw_update: ", name, " is on ", t.device(),
              ", the parameter on ", param.device());
  TORCH_CHECK(t.scalar_type() == param.scalar_type(), "tempo::train::adamw_update: ", name, " is ", t.scalar_type(),
              ", the parameter ", param.scalar_type());
  TORCH_CHECK(t.sizes() == param.sizes(), "tempo::train::adamw_update: ", name, " has shape ", t.sizes(),
              ", the parameter ", param.sizes());
  TORCH_CHECK(t.layout() == at::kStrided, "tempo::train::adamw_update: ", name,
              " is sparse (AdamW takes dense gradients)");
}

}  // namespace

void adamw_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq, int64_t step, double lr, double beta1,
                  double beta2, double eps, double weight_decay) {
  TORCH_CHECK(param.defined() && param.is_floating_point(), "tempo::train::adamw_update: the parameter must be a ",
              "floating-point tensor");
  check_like(param, grad, "grad");
  check_like(param, exp_avg, "exp_avg");
  check_like(param, exp_avg_sq, "exp_avg_sq");
  if (max_exp_avg_sq.defined()) check_like(param, max_exp_avg_sq, "max_exp_avg_sq");
  TORCH_CHECK(step >= 1, "tempo::train::adamw_update: step counts from 1 (got ", step, ")");
  TORCH_CHECK(lr >= 0 && eps >= 0 && weight_decay >= 0 && beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1,
              "tempo::train::adamw_update: needs lr, eps, weight_decay >= 0 and betas in [0, 1) (got lr ", lr,
              ", betas (", beta1, ", ", beta2, "), eps ", eps, ", weight_decay ", weight_decay, ")");
  at::NoGradGuard no_grad;
  const auto type = param.scalar_type();
  if (!param.is_cpu() || (type != at::kFloat && type != at::kDouble)) {
    update_tensors(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step);
    return;
  }
  // Contiguous working copies where a tensor is not (written back after).
  std::vector<std::pair<at::Tensor, at::Tensor>> back;
  const auto work = [&](const at::Tensor& t) {
    if (!t.defined() || t.is_contiguous()) return t;
    at::Tensor c = t.contiguous();
    back.emplace_back(t, c);
    return c;
  };
  const at::Tensor p = work(param), m = work(exp_avg), v = work(exp_avg_sq), vmax = work(max_exp_avg_sq);
  const at::Tensor g = grad.contiguous();
  AT_DISPATCH_FLOATING_TYPES(type, "tempo::train::adamw_update", [&] {
    update_cpu<scalar_t>(p.data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(), m.data_ptr<scalar_t>(),
                         v.data_ptr<scalar_t>(), vmax.defined() ? vmax.data_ptr<scalar_t>() : nullptr, p.numel(), lr,
                         beta1, beta2, eps, weight_decay, step);
  });
  for (auto& [t, c] : back) t.copy_(c);
}

at::Tensor AdamW::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& slot = state_[p.unsafeGetTensorImpl()];  // a sparse gradient is refused by adamw_update
      if (!slot) {
        auto s = std::make_unique<torch::optim::AdamWParamState>();
        s->step(0);
        s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        slot = std::move(s);
      }
      auto& s = static_cast<torch::optim::AdamWParamState&>(*slot);
      // amsgrad's maximum: made at its first step (also for state loaded from a run without it)
      if (o.amsgrad() && !s.max_exp_avg_sq().defined()) s.max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      s.step(s.step() + 1);
      adamw_update(p, p.grad(), s.exp_avg(), s.exp_avg_sq(), o.amsgrad() ? s.max_exp_avg_sq() : at::Tensor(), s.step(),
                   o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay());
    }
  }
  return loss;
}

}  // namespace tempo::train
