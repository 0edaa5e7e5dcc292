// Kernels of tempo::layer_norm, tempo::rms_norm and tempo::bias_dropout_add_layer_norm (their
// schemas and C++ API: norm.cpp). Device-generic (CompositeExplicitAutograd): check, allocate,
// hand the core pointers and the stream; on Meta/fake tensors only allocate.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "common.h"
#include "dtype.h"
#include "norm_kept_columns.h"
#include "tempo/norm.h"
#include "tempo/ops/norm.h"

namespace tempo {
namespace {
using namespace torch_impl;

// Rows and columns of x normalised over its trailing `normalized_shape`; checks shapes.
std::pair<c10::SymInt, int64_t> rows_cols(const at::Tensor& x, at::IntArrayRef shape, const char* op) {
  TORCH_CHECK(!shape.empty(), op, ": argument 'normalized_shape' must not be empty");
  const int64_t k = static_cast<int64_t>(shape.size());
  TORCH_CHECK(x.dim() >= k, op, ": argument 'normalized_shape' ", shape, " has more dimensions than x ", x.sym_sizes());
  int64_t cols = 1;
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(x.sym_size(x.dim() - k + i) == shape[i], op, ": argument 'normalized_shape' ", shape,
                " does not match the trailing dimensions of x ", x.sym_sizes());
    cols *= shape[i];
  }
  c10::SymInt rows = 1;
  for (int64_t i = 0; i < x.dim() - k; ++i) rows = rows * x.sym_size(i);
  return {rows, cols};
}

void check_param_shape(const at::Tensor* t, at::IntArrayRef shape, const char* op, const char* arg) {
  if (!t) return;
  TORCH_CHECK(t->sizes() == shape, op, ": argument '", arg, "' must have shape ", shape, " (normalized_shape), got ",
              t->sizes());
}

void check_param(const at::Tensor* t, const at::Tensor& x, at::IntArrayRef shape, const char* op, const char* arg) {
  if (!t) return;
  check_floating(*t, op, arg);
  check_like(*t, x, op, arg);
  check_param_shape(t, shape, op, arg);
}

// The norm's own parameters (gamma, beta): of x's dtype, or float32 for a bfloat16/float16 x
// (as torch's CPU layer_norm takes them, and autocast leaves them); both of one dtype. Returns
// whether they are float32 under 16-bit data (the core's float_params).
bool float_params(const at::Tensor* w, const at::Tensor* b, const at::Tensor& x) {
  const at::Tensor* ref = w ? w : b;
  return ref && ref->scalar_type() == at::kFloat && low_precision(x.scalar_type());
}

bool check_norm_params(const at::Tensor* w, const at::Tensor* b, const at::Tensor& x, const char* op, const char* w_arg,
                       const char* b_arg) {
  const at::Tensor* ref = w ? w : b;
  if (!ref) return false;
  const bool fp = float_params(w, b, x);
  for (const auto& [t, arg] : {std::pair<const at::Tensor*, const char*>{w, w_arg}, {b, b_arg}}) {
    if (!t) continue;
    check_floating(*t, op, arg);
    TORCH_CHECK(t->scalar_type() == ref->scalar_type(), op, ": argument '", arg, "' must have the dtype of '", w_arg,
                "' (", ref->scalar_type(), "), got ", t->scalar_type());
    if (!fp) {
      TORCH_CHECK(t->scalar_type() == x.scalar_type(), op, ": argument '", arg, "' must have the dtype of x (",
                  x.scalar_type(), ")", low_precision(x.scalar_type()) ? " or float32" : "", ", got ",
                  t->scalar_type());
    }
    TORCH_CHECK(t->device() == x.device(), op, ": argument '", arg, "' must be on the device of x (", x.device(),
                "), got ", t->device());
  }
  return fp;
}

const void* data_or_null(const at::Tensor* t, at::Tensor& keep) {
  if (!t) return nullptr;
  keep = t->contiguous();
  return keep.const_data_ptr();
}

struct PrologueArgs {
  const at::Tensor* residual = nullptr;
  const at::Tensor* bias = nullptr;  // added before dropout
  double p = 0.0;
  DropoutMode mode = DropoutMode::kBits;
};

struct ForwardOut {
  at::Tensor y, rstd, kept_xhat, keep;  // keep: the dropout's (prologue only)
};

// Forward of either norm, with or without the prologue (arguments checked by the caller).
ForwardOut norm_forward(NormKind kind, const at::Tensor& x, const c10::SymInt& rows, int64_t cols, const at::Tensor* w,
                        const at::Tensor* b, double eps, const at::Tensor* kept_cols, const PrologueArgs* pro,
                        const char* op) {
  TORCH_CHECK(eps >= 0.0, op, ": argument 'eps' must be non-negative, got ", eps);
  ForwardOut out;
  out.y = at::empty_like(x, at::MemoryFormat::Contiguous);
  out.rstd = at::empty_symint({rows}, x.options().dtype(acc_type(x)));
  const at::Tensor slot = kept_slot(kept_cols, cols, x, op);
  const int64_t kept = slot.defined() ? kept_cols->numel() : 0;
  out.kept_xhat =
      at::empty_symint({rows, kept_cols ? kept_cols->sym_size(0) : c10::SymInt(0)}, x.options().dtype(acc_type(x)));
  DropoutKeep k;
  if (pro) out.keep = (k = new_dropout_keep(x, pro->p, pro->mode)).keep;
  if (shapes_only(x) || x.numel() == 0) return out;
  if (x.is_meta()) {  // tempo.plan's count: the copies the kernel makes of what is not contiguous
    const at::Tensor xc = x.contiguous();
    for (const at::Tensor* t : {w, b, pro ? pro->residual : nullptr, pro ? pro->bias : nullptr})
      if (t) t->contiguous();
    return out;
  }
  c10::OptionalDeviceGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor wc, bc, rc, pbc;
  NormForwardParams params;
  params.kind = kind;
  params.dtype = to_core_dtype(x.scalar_type());
  params.x = xc.const_data_ptr();
  params.weight = data_or_null(w, wc);
  params.beta = data_or_null(b, bc);
  params.float_params = float_params(w, b, x);
  if (pro) {
    params.prologue.residual = data_or_null(pro->residual, rc);
    params.prologue.bias = data_or_null(pro->bias, pbc);
    params.prologue.p = pro->p;
    params.prologue.mode = pro->mode;
    params.prologue.rng = k.rng;
    params.mask = k.mask;
  }
  params.kept_slot = kept ? slot.const_data_ptr<int32_t>() : nullptr;
  params.kept = kept;
  params.kept_xhat = kept ? out.kept_xhat.mutable_data_ptr() : nullptr;
  params.y = out.y.mutable_data_ptr();
  params.rstd = out.rstd.mutable_data_ptr();
  params.rows = rows.expect_int();
  params.cols = cols;
  params.eps = eps;
  run_core(x, params, norm_forward_cpu, norm_forward_cuda, op);
  return out;
}

// The plain norms' forward: checks, then norm_forward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> plain_forward(NormKind kind, const at::Tensor& x, at::IntArrayRef shape,
                                                             const at::Tensor* w, const at::Tensor* b, double eps,
                                                             const at::Tensor* kept_cols, const char* op) {
  check_floating(x, op, "x");
  check_device(x, op, "x");
  const auto [rows, cols] = rows_cols(x, shape, op);
  check_norm_params(w, b, x, op, "weight", "bias");
  check_param_shape(w, shape, op, "weight");
  check_param_shape(b, shape, op, "bias");
  ForwardOut o = norm_forward(kind, x, rows, cols, w, b, eps, kept_cols, nullptr, op);
  return {o.y, o.rstd, o.kept_xhat};
}

// Backward of either norm, with or without the bias-dropout-residual prologue. Outputs
// (grad_x, grad_weight, grad_beta, grad_residual, grad_bias); absent ones are empty.
struct BackwardOut {
  at::Tensor dx, dw, dbeta, dres, dbias;
};

BackwardOut norm_backward(NormKind kind, const at::Tensor& grad, const at::Tensor& y, const at::Tensor& rstd,
                          int64_t cols, const at::Tensor* w, const at::Tensor* b, const NormPrologue* prologue,
                          bool has_bias, const uint8_t* mask, const at::Tensor* kept_cols, const at::Tensor* kept_xhat,
                          const char* op) {
  check_floating(grad, op, "grad");
  check_floating(y, op, "y");
  check_device(y, op, "y");
  check_like(grad, y, op, "grad");
  TORCH_CHECK(grad.sym_sizes() == y.sym_sizes(), op, ": argument 'grad' must have the shape of y ", y.sym_sizes(),
              ", got ", grad.sym_sizes());
  TORCH_CHECK(cols > 0 ? y.sym_numel() % cols == 0 : cols == 0 && y.sym_numel() == 0, op,
              ": y does not hold whole rows of ", cols, " elements");
  // Rows of no columns (normalized_shape [0]): as many as the forward's rstd holds.
  const c10::SymInt rows = cols > 0 ? y.sym_numel() / cols : rstd.sym_numel();
  TORCH_CHECK(rstd.scalar_type() == acc_type(y) && rstd.sym_numel() == rows && rstd.device() == y.device(), op,
              ": argument 'rstd' must hold ", rows, " ", acc_type(y), " values on ", y.device(), ", got ",
              rstd.scalar_type(), " of shape ", rstd.sym_sizes());
  // layer_norm calls beta 'bias'; bias_dropout_add_layer_norm (the prologue) 'beta'.
  const bool float_params = check_norm_params(w, b, y, op, "weight", prologue ? "beta" : "bias");
  check_kept_xhat(kept_cols, kept_xhat, rows, y, op);
  if (!kept_cols && (w || b) && !y.is_meta() && y.numel() > 0) {
    // Called without the forward's kept columns (the autograd path always passes them): a
    // column that needs keeping is an error on every device, not inf/NaN on CUDA.
    TORCH_CHECK(!capturing(y), op,
                ": called without the forward's kept_cols in a CUDA graph capture, where the parameters cannot be "
                "checked on the host; pass the forward's kept_cols and kept_xhat");
    const at::Tensor need = norm_kept_columns(w ? std::optional<at::Tensor>(*w) : std::nullopt,
                                              b ? std::optional<at::Tensor>(*b) : std::nullopt, y.scalar_type());
    // (A direct call: the one place a norm reads the parameters' verdict on the host, a
    // synchronisation on CUDA; the autograd path never comes here.)
    const at::Tensor first = need.numel() > 0 ? need.narrow(0, 0, 1).cpu() : need.cpu();
    TORCH_CHECK(first.numel() == 0 || first[0].item<int64_t>() < 0, op, ": column ", first[0].item<int64_t>(),
                " cannot be recovered from y (its gamma is zero, subnormal or tiny against beta); pass the "
                "forward's kept_cols (norm_kept_columns) and kept_xhat");
  }
  const at::Tensor slot = kept_slot(kept_cols, cols, y, op);
  const auto opts = y.options();
  BackwardOut out;
  out.dx = at::empty_like(y, at::MemoryFormat::Contiguous);
  const auto param_opts = float_params ? opts.dtype(at::kFloat) : opts;
  out.dw = w ? at::empty({cols}, param_opts) : at::empty({0}, param_opts);
  out.dbeta = b ? at::empty({cols}, param_opts) : at::empty({0}, param_opts);
  out.dres = prologue ? at::empty_like(y, at::MemoryFormat::Contiguous) : at::empty({0}, opts);
  out.dbias = has_bias ? at::empty({cols}, opts) : at::empty({0}, opts);
  if (shapes_only(y)) return out;
  c10::OptionalDeviceGuard guard(y.device());
  const at::Tensor gc = grad.contiguous(), yc = y.contiguous(), rc = rstd.contiguous();
  at::Tensor wc, bc;
  if (y.is_meta()) {  // tempo.plan's count: the copies above and below and CUDA's workspace, then the outputs
    if (w) wc = w->contiguous();
    if (b) bc = b->contiguous();
    if (on_cuda(y)) at::empty({norm_backward_workspace_elems(rows.expect_int(), cols)}, opts.dtype(acc_type(y)));
    return out;
  }
  NormBackwardParams params;
  params.kind = kind;
  params.dtype = to_core_dtype(y.scalar_type());
  params.grad_y = gc.const_data_ptr();
  params.y = yc.const_data_ptr();
  params.rstd = rc.const_data_ptr();
  params.weight = data_or_null(w, wc);
  params.beta = data_or_null(b, bc);
  params.float_params = float_params;
  if (prologue) params.prologue = *prologue;
  params.mask = mask;
  const at::Tensor kxc = slot.defined() ? kept_xhat->contiguous() : at::Tensor();
  params.kept = slot.defined() ? kept_cols->numel() : 0;
  params.kept_slot = params.kept ? slot.const_data_ptr<int32_t>() : nullptr;
  params.kept_xhat = params.kept ? kxc.const_data_ptr() : nullptr;
  params.grad_x = out.dx.mutable_data_ptr();
  params.grad_weight = w ? out.dw.mutable_data_ptr() : nullptr;
  params.grad_beta = b ? out.dbeta.mutable_data_ptr() : nullptr;
  params.grad_residual = prologue ? out.dres.mutable_data_ptr() : nullptr;
  params.grad_bias = has_bias ? out.dbias.mutable_data_ptr() : nullptr;
  params.rows = rows.expect_int();
  params.cols = cols;
  at::Tensor workspace;
  if (y.is_cuda()) {
    workspace = at::empty({norm_backward_workspace_elems(params.rows, cols)}, opts.dtype(acc_type(y)));
    params.workspace = workspace.mutable_data_ptr();
  }
  run_core(y, params, norm_backward_cpu, norm_backward_cuda, op);
  return out;
}

int64_t numel_of(at::IntArrayRef shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// ---- layer_norm / rms_norm ----------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_kernel(const at::Tensor& x, at::IntArrayRef shape,
                                                                         const std::optional<at::Tensor>& weight,
                                                                         const std::optional<at::Tensor>& bias,
                                                                         double eps,
                                                                         const std::optional<at::Tensor>& kept_cols) {
  return plain_forward(NormKind::kLayerNorm, x, shape, get(weight), get(bias), eps, get(kept_cols),
                       "tempo::layer_norm");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_kernel(const at::Tensor& grad, const at::Tensor& y,
                                                                          const at::Tensor& rstd, at::IntArrayRef shape,
                                                                          const std::optional<at::Tensor>& weight,
                                                                          const std::optional<at::Tensor>& bias,
                                                                          const std::optional<at::Tensor>& kept_cols,
                                                                          const std::optional<at::Tensor>& kept_xhat) {
  const char* op = "tempo::layer_norm_backward";
  const auto* w = get(weight);
  const auto* b = get(bias);
  if (w) TORCH_CHECK(w->sizes() == shape, op, ": argument 'weight' must have shape ", shape);
  if (b) TORCH_CHECK(b->sizes() == shape, op, ": argument 'bias' must have shape ", shape);
  BackwardOut o = norm_backward(NormKind::kLayerNorm, grad, y, rstd, numel_of(shape), w, b, nullptr, false, nullptr,
                                get(kept_cols), get(kept_xhat), op);
  return {o.dx, o.dw.view(w ? shape : at::IntArrayRef{0}), o.dbeta.view(b ? shape : at::IntArrayRef{0})};
}

// torch's default: the machine epsilon of the math type (fp32 for 16-bit data).
double rms_eps(const at::Tensor& x, std::optional<double> eps) {
  if (eps.has_value()) return *eps;
  return x.scalar_type() == at::kDouble ? std::numeric_limits<double>::epsilon()
                                        : static_cast<double>(std::numeric_limits<float>::epsilon());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_forward_kernel(const at::Tensor& x, at::IntArrayRef shape,
                                                                       const std::optional<at::Tensor>& weight,
                                                                       std::optional<double> eps,
                                                                       const std::optional<at::Tensor>& kept_cols) {
  check_floating(x, "tempo::rms_norm", "x");
  return plain_forward(NormKind::kRmsNorm, x, shape, get(weight), nullptr, rms_eps(x, eps), get(kept_cols),
                       "tempo::rms_norm");
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_kernel(const at::Tensor& grad, const at::Tensor& y,
                                                            const at::Tensor& rstd, at::IntArrayRef shape,
                                                            const std::optional<at::Tensor>& weight,
                                                            const std::optional<at::Tensor>& kept_cols,
                                                            const std::optional<at::Tensor>& kept_xhat) {
  const char* op = "tempo::rms_norm_backward";
  const auto* w = get(weight);
  if (w) TORCH_CHECK(w->sizes() == shape, op, ": argument 'weight' must have shape ", shape);
  BackwardOut o = norm_backward(NormKind::kRmsNorm, grad, y, rstd, numel_of(shape), w, nullptr, nullptr, false, nullptr,
                                get(kept_cols), get(kept_xhat), op);
  return {o.dx, o.dw.view(w ? shape : at::IntArrayRef{0})};
}

// Without autograd nothing is kept: kept_cols is ignored.
at::Tensor layer_norm_kernel(const at::Tensor& x, at::IntArrayRef shape, const std::optional<at::Tensor>& weight,
                             const std::optional<at::Tensor>& bias, double eps, const std::optional<at::Tensor>&) {
  return std::get<0>(layer_norm_forward_kernel(x, shape, weight, bias, eps, std::nullopt));
}
at::Tensor rms_norm_kernel(const at::Tensor& x, at::IntArrayRef shape, const std::optional<at::Tensor>& weight,
                           std::optional<double> eps, const std::optional<at::Tensor>&) {
  return std::get<0>(rms_norm_forward_kernel(x, shape, weight, eps, std::nullopt));
}

// ---- bias_dropout_add_layer_norm ----------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bias_dropout_add_layer_norm_forward_kernel(
    const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& residual, double p,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& beta, double eps,
    c10::string_view mode_name, const std::optional<at::Tensor>& kept_cols) {
  const char* op = "tempo::bias_dropout_add_layer_norm";
  check_floating(x, op, "x");
  check_device(x, op, "x");
  TORCH_CHECK(x.dim() >= 1, op, ": argument 'x' must have at least one dimension");
  check_floating(residual, op, "residual");
  check_like(residual, x, op, "residual");
  TORCH_CHECK(residual.sym_sizes() == x.sym_sizes(), op, ": argument 'residual' must have the shape of x ",
              x.sym_sizes(), ", got ", residual.sym_sizes());
  check_probability(p, op, "p");
  PrologueArgs pro;
  pro.residual = &residual;
  pro.bias = get(bias);
  pro.p = p;
  pro.mode = dropout_mode(mode_name, op);
  const int64_t cols = x.sym_size(-1).guard_int(__FILE__, __LINE__);
  const std::vector<int64_t> shape{cols};
  check_param(pro.bias, x, shape, op, "bias");
  check_norm_params(get(weight), get(beta), x, op, "weight", "beta");
  check_param_shape(get(weight), shape, op, "weight");
  check_param_shape(get(beta), shape, op, "beta");
  const c10::SymInt rows = x.sym_numel() / std::max<int64_t>(cols, 1);
  ForwardOut o =
      norm_forward(NormKind::kLayerNorm, x, rows, cols, get(weight), get(beta), eps, get(kept_cols), &pro, op);
  return {o.y, o.rstd, o.keep, o.kept_xhat};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bias_dropout_add_layer_norm_backward_kernel(
    const at::Tensor& grad, const at::Tensor& y, const at::Tensor& rstd, const at::Tensor& keep, double p,
    c10::string_view mode_name, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& beta,
    bool has_bias, const std::optional<at::Tensor>& kept_cols, const std::optional<at::Tensor>& kept_xhat) {
  const char* op = "tempo::bias_dropout_add_layer_norm_backward";
  check_floating(y, op, "y");
  check_device(y, op, "y");
  check_probability(p, op, "p");
  TORCH_CHECK(y.dim() >= 1, op, ": argument 'y' must have at least one dimension");
  NormPrologue pr;
  pr.p = p;
  pr.mode = dropout_mode(mode_name, op);
  const uint8_t* mask = nullptr;
  read_dropout_keep(keep, y, p, pr.mode, op, &mask, &pr.rng);
  const int64_t cols = y.sym_size(-1).guard_int(__FILE__, __LINE__);
  for (const auto& [t, name] :
       {std::pair<const at::Tensor*, const char*>{get(weight), "weight"}, {get(beta), "beta"}}) {
    if (!t) continue;
    TORCH_CHECK(t->dim() == 1 && t->sym_size(0) == cols, op, ": argument '", name, "' must have shape [", cols,
                "], got ", t->sym_sizes());
  }
  BackwardOut o = norm_backward(NormKind::kLayerNorm, grad, y, rstd, cols, get(weight), get(beta), &pr, has_bias, mask,
                                get(kept_cols), get(kept_xhat), op);
  return {o.dx, o.dbias, o.dres, o.dw, o.dbeta};
}

at::Tensor bias_dropout_add_layer_norm_kernel(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                              const at::Tensor& residual, double p,
                                              const std::optional<at::Tensor>& weight,
                                              const std::optional<at::Tensor>& beta, double eps, c10::string_view mode,
                                              const std::optional<at::Tensor>&) {
  return std::get<0>(
      bias_dropout_add_layer_norm_forward_kernel(x, bias, residual, p, weight, beta, eps, mode, std::nullopt));
}

}  // namespace
}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, CompositeExplicitAutograd, m) {
  m.impl("layer_norm", tempo::layer_norm_kernel);
  m.impl("layer_norm_forward", tempo::layer_norm_forward_kernel);
  m.impl("layer_norm_backward", tempo::layer_norm_backward_kernel);
  m.impl("rms_norm", tempo::rms_norm_kernel);
  m.impl("rms_norm_forward", tempo::rms_norm_forward_kernel);
  m.impl("rms_norm_backward", tempo::rms_norm_backward_kernel);
  m.impl("bias_dropout_add_layer_norm", tempo::bias_dropout_add_layer_norm_kernel);
  m.impl("bias_dropout_add_layer_norm_forward", tempo::bias_dropout_add_layer_norm_forward_kernel);
  m.impl("bias_dropout_add_layer_norm_backward", tempo::bias_dropout_add_layer_norm_backward_kernel);
}
