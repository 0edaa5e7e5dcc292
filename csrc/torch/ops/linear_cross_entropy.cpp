// Schemas, kernels and C++ API of tempo::linear_cross_entropy. The kernels walk chunks of rows
// (device-generic, CompositeExplicitAutograd): per chunk the logits are formed in the data's
// dtype by the framework's GEMM (as F.linear would), then one pass of the core's row kernel
// (tempo/linear_cross_entropy.h) reduces each row in the math type (float64 for float64 data,
// float32 otherwise) to its log-sum-exp and loss, reading 16-bit logits as they are; the
// backward forms them again, the row kernel turns them into the logits' gradient in place, and
// GEMMs make the chunk's share of every gradient from it.
#include "tempo/ops/linear_cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cmath>

#include "common.h"
#include "dtype.h"
#include "tempo/linear_cross_entropy.h"

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  m.def(
      "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, int ignore_index=-100, "
      "float label_smoothing=0.0, str reduction='mean', int chunk=0, ScalarType? dtype=None, float logit_scale=1.0, "
      "float? softcap=None, float z_loss=0.0) -> Tensor");
  m.def(
      "linear_cross_entropy_forward(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, int ignore_index, "
      "float label_smoothing, str reduction, int chunk, ScalarType? dtype=None, float logit_scale=1.0, "
      "float? softcap=None, float z_loss=0.0) -> (Tensor, Tensor)");
  m.def(
      "linear_cross_entropy_backward(Tensor grad, Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, "
      "Tensor lse, int ignore_index, float label_smoothing, str reduction, int chunk, float logit_scale=1.0, "
      "float? softcap=None, float z_loss=0.0) -> (Tensor, Tensor, Tensor)");
  m.def(
      "linear_cross_entropy_stats(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, int ignore_index=-100, "
      "float temperature=1.0, float logit_scale=1.0, float? softcap=None, int chunk=0) -> (Tensor, Tensor, Tensor)");
}

namespace tempo {
namespace {
using namespace torch_impl;
const char* kOp = "tempo::linear_cross_entropy";

enum class Reduction { kMean, kSum, kNone };

Reduction reduction_of(c10::string_view r) {
  if (r == "mean") return Reduction::kMean;
  if (r == "sum") return Reduction::kSum;
  if (r == "none") return Reduction::kNone;
  TORCH_CHECK(false, kOp, ": reduction must be mean, sum or none, got '", std::string(r), "'");
}

// Checks shapes, dtypes and devices; returns (N, H, V).
std::tuple<int64_t, int64_t, int64_t> check(const at::Tensor& h, const at::Tensor& w,
                                            const std::optional<at::Tensor>& b, const at::Tensor& labels,
                                            double smoothing, const char* op = kOp) {
  check_device(h, op, "hidden");
  check_device(w, op, "weight");
  TORCH_CHECK(h.is_floating_point(), op, ": argument 'hidden' must be floating point, got ", h.scalar_type());
  TORCH_CHECK(h.dim() >= 1, op, ": argument 'hidden' must be [..., H], got a scalar");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == h.size(-1), op, ": argument 'weight' must be [V, ", h.size(-1),
              "] for hidden [..., ", h.size(-1), "], got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == h.scalar_type() && w.device() == h.device(), op,
              ": argument 'weight' must have hidden's dtype and device (", h.scalar_type(), ", ", h.device(), "), got ",
              w.scalar_type(), ", ", w.device());
  if (b.has_value() && b->defined())
    TORCH_CHECK(
        b->dim() == 1 && b->size(0) == w.size(0) && b->scalar_type() == h.scalar_type() && b->device() == h.device(),
        op, ": argument 'bias' must be [", w.size(0), "] like weight, got ", b->sizes(), " ", b->scalar_type());
  TORCH_CHECK(labels.scalar_type() == at::kLong, op, ": argument 'labels' must be int64, got ", labels.scalar_type());
  TORCH_CHECK(labels.device() == h.device(), op, ": argument 'labels' must be on hidden's device ", h.device());
  const int64_t N = h.numel() / std::max<int64_t>(h.size(-1), 1);
  TORCH_CHECK(labels.numel() == N && labels.dim() == h.dim() - 1 && labels.sizes() == h.sizes().slice(0, h.dim() - 1),
              op, ": argument 'labels' must have hidden's leading shape ", h.sizes().slice(0, h.dim() - 1), ", got ",
              labels.sizes());
  TORCH_CHECK(smoothing >= 0.0 && smoothing <= 1.0, op, ": label_smoothing must be in [0, 1], got ", smoothing);
  TORCH_CHECK(w.size(0) > 0, op, ": the vocabulary (weight's rows) is empty");
  return {N, h.size(-1), w.size(0)};
}

void check_labels(const at::Tensor& labels, int64_t V, int64_t ignore) {
  if (labels.numel() == 0) return;
  const at::Tensor bad = labels.ne(ignore).logical_and(labels.lt(0).logical_or(labels.ge(V)));
  if (labels.is_meta()) return;  // tempo.plan's count: the check's tensors, no values to check
  if (!labels.is_cpu()) {
    // On CUDA the result is not read on the host (no synchronisation, and a CUDA graph
    // capture could not): a device-side assert, as torch's cross_entropy makes (the kernels
    // clamp the labels, so nothing is read out of bounds before it fires).
    at::_assert_async(bad.any().logical_not(),
                      "tempo::linear_cross_entropy: a label is outside [0, vocabulary) and "
                      "is not ignore_index");
    return;
  }
  if (bad.any().item<bool>()) {
    const int64_t i = bad.flatten().nonzero()[0][0].item<int64_t>();
    TORCH_CHECK(false, kOp, ": label ", labels.flatten()[i].item<int64_t>(), " at row ", i, " is outside [0, ", V,
                ") and is not ignore_index (", ignore, ")");
  }
}

// Rows per chunk: `chunk`, or automatic: the chunk's logits take about 32 MiB, and on CUDA as
// much as the hidden states themselves if that is more (Liger-Kernel's rule), at least 64 MiB:
// each chunk reads the whole weight again, so a GEMM of a few dozen rows would be bound by that
// read (at V = 128256, H = 2048 in bf16: 262 rows a chunk rather than 65).
int64_t rows_per_chunk(int64_t chunk, int64_t V, int64_t N, const at::Tensor& hidden) {
  if (chunk > 0) return chunk;
  const int64_t elem = static_cast<int64_t>(hidden.element_size());
  int64_t bytes = 32ll << 20;
  if (on_cuda(hidden)) bytes = std::max<int64_t>(64ll << 20, N * hidden.size(-1) * elem);
  return std::max<int64_t>(1, std::min<int64_t>(N, bytes / (elem * V)));
}

// The core's parameters every pass shares, for `n` rows from r0.
template <typename P>
void fill_rows(P& params, const at::Tensor& z, const at::Tensor& y, int64_t r0, int64_t n, int64_t V, int64_t ignore,
               double smoothing) {
  params.dtype = to_core_dtype(z.scalar_type());
  params.rows = n;
  params.vocab = V;
  params.labels = y.const_data_ptr<int64_t>() + r0;
  params.ignore_index = ignore;
  params.smoothing = smoothing;
}

// What the model does to its logits before the loss, z' = cap tanh(scale z / cap) (Gemma 2/3's
// final_logit_softcapping; Cohere's logit_scale, Granite's 1 / logits_scaling), and the z-loss
// coefficient (z_loss lse^2 added to each row's loss, as PaLM's auxiliary loss).
struct LogitOptions {
  double scale = 1.0;
  std::optional<double> cap;
  double z_loss = 0.0;
};

LogitOptions logit_options(double scale, std::optional<double> cap, double z_loss, const char* op) {
  TORCH_CHECK(std::isfinite(scale) && scale != 0.0, op, ": logit_scale must be finite and nonzero, got ", scale);
  TORCH_CHECK(!cap.has_value() || (std::isfinite(*cap) && *cap > 0.0), op,
              ": softcap must be positive and finite, "
              "got ",
              cap.value_or(0.0));
  TORCH_CHECK(std::isfinite(z_loss) && z_loss >= 0.0, op, ": z_loss must be >= 0 and finite, got ", z_loss);
  return {scale, cap, z_loss};
}

// z (a chunk's logits, in place) -> z'; returns tanh(scale z / cap) (a tensor of its own) when capped.
at::Tensor transform_logits(at::Tensor& z, const LogitOptions& o) {
  if (o.scale != 1.0) z.mul_(o.scale);
  if (!o.cap) return at::Tensor();
  at::Tensor t = (z / *o.cap).tanh_();
  z.copy_(t).mul_(*o.cap);
  return t;
}

// dz' (in place) -> dz: times scale (1 - t^2) where capped, times scale otherwise.
void chain_logit_gradient(at::Tensor& dz, const at::Tensor& t, const LogitOptions& o) {
  if (t.defined()) dz.mul_(t.square().neg_().add_(1.0));
  if (o.scale != 1.0) dz.mul_(o.scale);
}

std::tuple<at::Tensor, at::Tensor> forward_kernel(const at::Tensor& hidden, const at::Tensor& weight,
                                                  const std::optional<at::Tensor>& bias, const at::Tensor& labels,
                                                  int64_t ignore, double smoothing, c10::string_view reduction,
                                                  int64_t chunk, std::optional<at::ScalarType> dtype,
                                                  double logit_scale, std::optional<double> softcap, double z_loss) {
  const Reduction red = reduction_of(reduction);
  TORCH_CHECK(chunk >= 0, kOp, ": chunk must be >= 0 (0: automatic), got ", chunk);
  const LogitOptions opts = logit_options(logit_scale, softcap, z_loss, kOp);
  // The loss's dtype: hidden's unless asked (autocast asks for float32 from 16-bit data).
  TORCH_CHECK(!dtype.has_value() || at::isFloatingType(*dtype), kOp, ": dtype must be a floating type, got ", *dtype);
  const auto out_t = dtype.value_or(hidden.scalar_type());
  // The math type: float64 for float64 data, float32 otherwise (16-bit logits reduced in fp32).
  const auto math_t = hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto math_opts = hidden.options().dtype(math_t);
  if (shapes_only(hidden)) {  // symbolic sizes (torch.compile): the outputs' shapes alone
    TORCH_CHECK(hidden.dim() >= 1 && weight.dim() == 2 && labels.scalar_type() == at::kLong, kOp,
                ": hidden [..., H], weight [V, H] and int64 labels");
    at::Tensor loss = red == Reduction::kNone ? at::empty_symint(labels.sym_sizes(), hidden.options().dtype(out_t))
                                              : at::empty({}, hidden.options().dtype(out_t));
    return {loss, at::empty_symint({labels.sym_numel()}, math_opts)};
  }
  auto [N, H, V] = check(hidden, weight, bias, labels, smoothing);
  at::Tensor lse = at::empty({N}, math_opts);
  at::Tensor rows = at::empty({N}, math_opts);  // per-row losses (0 where ignored)
  if (N > 0) {
    check_labels(labels, V, ignore);
    c10::OptionalDeviceGuard guard(hidden.device());
    const at::Tensor h = hidden.reshape({N, H}), y = labels.reshape({N}).contiguous();
    const std::optional<at::Tensor> b = bias.has_value() && bias->defined() ? bias : std::nullopt;
    const int64_t C = rows_per_chunk(chunk, V, N, hidden);
    PlannedBlocks chunks(hidden, blocks_of(N, C));
    for (int64_t r0 = 0, cb = 0; r0 < N; r0 += C, ++cb) {
      if (chunks.skip(cb)) continue;
      const int64_t n = std::min(C, N - r0);
      at::Tensor z = torch_impl::linear(h.narrow(0, r0, n), weight, b).contiguous();  // [n, V], hidden's dtype
      transform_logits(z, opts);
      if (z.is_meta()) {
        chunks.done(cb);
        continue;
      }
      LinearCrossEntropyForwardParams params;
      fill_rows(params, z, y, r0, n, V, ignore, smoothing);
      params.logits = z.const_data_ptr();
      params.lse = lse.narrow(0, r0, n).mutable_data_ptr();
      params.loss = rows.narrow(0, r0, n).mutable_data_ptr();
      run_core(z, params, linear_cross_entropy_forward_cpu, linear_cross_entropy_forward_cuda, kOp);
    }
    if (opts.z_loss > 0.0)  // the rows not ignored
      rows.add_(lse.square().mul_(opts.z_loss).mul_(y.ne(ignore).to(math_t)));
  } else {
    lse.zero_(), rows.zero_();
  }
  at::Tensor loss;
  if (red == Reduction::kNone) {
    loss = rows.reshape(labels.sizes()).to(out_t);
  } else {
    at::Tensor total = rows.sum();
    if (red == Reduction::kMean) total = total / labels.ne(ignore).sum().clamp_min(1).to(math_t);
    loss = total.to(out_t);
  }
  return {loss, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_kernel(
    const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, const at::Tensor& lse, int64_t ignore, double smoothing, c10::string_view reduction,
    int64_t chunk, double logit_scale, std::optional<double> softcap, double z_loss) {
  const Reduction red = reduction_of(reduction);
  const LogitOptions opts = logit_options(logit_scale, softcap, z_loss, "tempo::linear_cross_entropy_backward");
  const bool has_bias = bias.has_value() && bias->defined();
  const char* bop = "tempo::linear_cross_entropy_backward";
  TORCH_CHECK(grad.is_floating_point(), bop, ": argument 'grad' must be floating point, got ", grad.scalar_type());
  const auto math_t = hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(lse.scalar_type() == math_t, bop, ": argument 'lse' must be the forward's ", math_t, " log-sum-exp, got ",
              lse.scalar_type());
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&weight, "weight"},
                                {&labels, "labels"},
                                {&grad, "grad"},
                                {&lse, "lse"}})
    TORCH_CHECK(t->device() == hidden.device(), bop, ": argument '", name, "' must be on hidden's device (",
                hidden.device(), "), got ", t->device());
  if (shapes_only(hidden))
    return {at::empty_like(hidden, at::MemoryFormat::Contiguous), at::empty_like(weight),
            has_bias ? at::empty_like(*bias) : at::Tensor()};
  auto [N, H, V] = check(hidden, weight, bias, labels, smoothing);
  TORCH_CHECK(lse.dim() == 1 && lse.size(0) == N, bop, ": argument 'lse' must be [", N,
              "] (one log-sum-exp per row of hidden), got ", lse.sizes());
  TORCH_CHECK(red == Reduction::kNone ? grad.numel() == N : grad.numel() == 1, bop, ": argument 'grad' must have ",
              red == Reduction::kNone ? "one value per row" : "one value", ", got shape ", grad.sizes());
  const bool low = hidden.scalar_type() != at::kFloat && hidden.scalar_type() != at::kDouble;
  const auto acc = low ? at::kFloat : hidden.scalar_type();  // gradient accumulation across chunks
  at::Tensor gh = at::empty_like(hidden, at::MemoryFormat::Contiguous);
  at::Tensor gw = at::zeros(weight.sizes(), weight.options().dtype(acc));
  at::Tensor gb = has_bias ? at::zeros({V}, weight.options().dtype(acc)) : at::Tensor();
  if (N == 0) {
    gh.zero_();
    return {gh, gw.to(weight.scalar_type()), has_bias ? gb.to(weight.scalar_type()) : gb};
  }
  c10::OptionalDeviceGuard guard(hidden.device());
  const at::Tensor h = hidden.reshape({N, H}), y = labels.reshape({N}).contiguous();
  at::Tensor ghf = gh.view({N, H});
  // d loss_i / d z_i = softmax(z_i) - (1 - eps) onehot(y_i) - eps / V, times the row's weight:
  // grad (reduction none: per row; mean: over the rows not ignored), 0 where ignored.
  at::Tensor scale;
  if (red == Reduction::kNone) {
    scale = grad.reshape({N}).to(math_t);
  } else {
    at::Tensor g = grad.to(math_t);
    if (red == Reduction::kMean) g = g / y.ne(ignore).sum().clamp_min(1).to(math_t);
    scale = g.expand({N});
  }
  scale = at::where(y.ne(ignore), scale, at::zeros({}, scale.options())).contiguous();
  const at::Tensor lse_c = lse.contiguous();
  // z-loss: its gradient 2 z_loss lse p adds to softmax's p, not to the label terms: the row
  // kernel runs with the weight s (1 + 2 z_loss lse) and the label terms get s 2 z_loss lse back
  at::Tensor z_extra, kernel_scale = scale;
  if (opts.z_loss > 0.0) {
    z_extra = scale * lse_c * (2.0 * opts.z_loss);
    kernel_scale = (scale + z_extra).contiguous();
  }
  const std::optional<at::Tensor> b = has_bias ? bias : std::nullopt;
  const int64_t C = rows_per_chunk(chunk, V, N, hidden);
  PlannedBlocks chunks(hidden, blocks_of(N, C));
  for (int64_t r0 = 0, cb = 0; r0 < N; r0 += C, ++cb) {
    if (chunks.skip(cb)) continue;
    const int64_t n = std::min(C, N - r0);
    const at::Tensor hc = h.narrow(0, r0, n);
    at::Tensor dz = torch_impl::linear(hc, weight, b).contiguous();  // the logits again, made their gradient in place
    const at::Tensor t = transform_logits(dz, opts);
    if (!dz.is_meta()) {
      LinearCrossEntropyBackwardParams params;
      fill_rows(params, dz, y, r0, n, V, ignore, smoothing);
      params.logits = dz.mutable_data_ptr();
      params.lse = lse_c.narrow(0, r0, n).const_data_ptr();
      params.scale = kernel_scale.narrow(0, r0, n).const_data_ptr();
      run_core(dz, params, linear_cross_entropy_backward_cpu, linear_cross_entropy_backward_cuda, bop);
    }
    if (z_extra.defined()) {  // + s 2 z_loss lse ((1 - eps) onehot(y) + eps / V)
      const at::Tensor extra = z_extra.narrow(0, r0, n).unsqueeze(1);
      if (smoothing > 0.0) dz.add_((extra * (smoothing / V)).to(dz.scalar_type()));
      const at::Tensor yc = y.narrow(0, r0, n).clamp(0, V - 1).unsqueeze(1);  // ignored rows: extra is 0
      dz.scatter_add_(1, yc, (extra * (1.0 - smoothing)).to(dz.scalar_type()));
    }
    chain_logit_gradient(dz, t, opts);
    ghf.narrow(0, r0, n).copy_(at::matmul(dz, weight));
    add_matmul(gw, dz.t(), hc, low);
    if (has_bias) gb.add_(dz.sum(0, false, acc));
    chunks.done(cb);
  }
  return {gh, gw.to(weight.scalar_type()), has_bias ? gb.to(weight.scalar_type()) : gb};
}

// Per row, from the same chunks and transforms as the loss, no logits kept and no gradient: the
// log-probability of the label at temperature 1 (0 where ignored), the entropy of softmax(z' / T)
// (every row), and whether the label is the arg max (false where ignored); float32 (float64 data:
// float64), the labels' shape.
std::tuple<at::Tensor, at::Tensor, at::Tensor> stats_kernel(const at::Tensor& hidden, const at::Tensor& weight,
                                                            const std::optional<at::Tensor>& bias,
                                                            const at::Tensor& labels, int64_t ignore,
                                                            double temperature, double logit_scale,
                                                            std::optional<double> softcap, int64_t chunk) {
  const char* op = "tempo::linear_cross_entropy_stats";
  const LogitOptions opts = logit_options(logit_scale, softcap, 0.0, op);
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0, op, ": temperature must be positive and finite, got ",
              temperature);
  TORCH_CHECK(chunk >= 0, op, ": chunk must be >= 0 (0: automatic), got ", chunk);
  const auto math_t = hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto math_opts = hidden.options().dtype(math_t);
  if (shapes_only(hidden))
    return {at::empty_symint(labels.sym_sizes(), math_opts), at::empty_symint(labels.sym_sizes(), math_opts),
            at::empty_symint(labels.sym_sizes(), labels.options().dtype(at::kBool))};
  auto [N, H, V] = check(hidden, weight, bias, labels, 0.0, op);
  at::Tensor logprob = at::zeros({N}, math_opts), entropy = at::zeros({N}, math_opts);
  at::Tensor correct = at::zeros({N}, labels.options().dtype(at::kBool));
  if (N > 0) {
    check_labels(labels, V, ignore);
    at::NoGradGuard no_grad;
    c10::OptionalDeviceGuard guard(hidden.device());
    const at::Tensor h = hidden.reshape({N, H}), y = labels.reshape({N});
    const std::optional<at::Tensor> b = bias.has_value() && bias->defined() ? bias : std::nullopt;
    const int64_t C = rows_per_chunk(chunk, V, N, hidden);
    PlannedBlocks chunks(hidden, blocks_of(N, C));
    for (int64_t r0 = 0, cb = 0; r0 < N; r0 += C, ++cb) {
      if (chunks.skip(cb)) continue;
      const int64_t n = std::min(C, N - r0);
      at::Tensor z = torch_impl::linear(h.narrow(0, r0, n), weight, b).contiguous();
      transform_logits(z, opts);
      const at::Tensor zf = z.to(math_t);  // the chunk in the math type (a chunk's worth, freed per chunk)
      const at::Tensor yc = y.narrow(0, r0, n), kept = yc.ne(ignore);
      const at::Tensor label = zf.gather(1, yc.clamp(0, V - 1).unsqueeze(1)).squeeze(1);
      logprob.narrow(0, r0, n).copy_(at::where(kept, label - zf.logsumexp(1), at::zeros({}, math_opts)));
      correct.narrow(0, r0, n).copy_(kept.logical_and(zf.argmax(1).eq(yc)));
      const at::Tensor zt = zf / temperature, lt = zt.logsumexp(1, true);
      entropy.narrow(0, r0, n).copy_(lt.squeeze(1) - ((zt - lt).exp_() * zt).sum(1));
      chunks.done(cb);
    }
  }
  return {logprob.view(labels.sizes()), entropy.view(labels.sizes()), correct.view(labels.sizes())};
}

at::Tensor composite(const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     const at::Tensor& labels, int64_t ignore, double smoothing, c10::string_view reduction,
                     int64_t chunk, std::optional<at::ScalarType> dtype, double logit_scale,
                     std::optional<double> softcap, double z_loss) {
  return std::get<0>(linear_cross_entropy_forward(hidden, weight, bias, labels, ignore, smoothing, reduction, chunk,
                                                  dtype, logit_scale, softcap, z_loss));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_forward(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& labels,
    int64_t ignore_index, double label_smoothing, c10::string_view reduction, int64_t chunk,
    std::optional<at::ScalarType> dtype, double logit_scale, std::optional<double> softcap, double z_loss) {
  static const auto& op = op_for<&linear_cross_entropy_forward>("tempo::linear_cross_entropy_forward");
  return op.call(hidden, weight, bias, labels, ignore_index, label_smoothing, reduction, chunk, dtype, logit_scale,
                 softcap, z_loss);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, const at::Tensor& lse, int64_t ignore_index, double label_smoothing,
    c10::string_view reduction, int64_t chunk, double logit_scale, std::optional<double> softcap, double z_loss) {
  static const auto& op = op_for<&linear_cross_entropy_backward>("tempo::linear_cross_entropy_backward");
  return op.call(grad, hidden, weight, bias, labels, lse, ignore_index, label_smoothing, reduction, chunk, logit_scale,
                 softcap, z_loss);
}

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, const at::Tensor& labels, int64_t ignore_index,
                                double label_smoothing, c10::string_view reduction, int64_t chunk,
                                std::optional<at::ScalarType> dtype, double logit_scale, std::optional<double> softcap,
                                double z_loss) {
  static const auto& op = op_for<&linear_cross_entropy>("tempo::linear_cross_entropy");
  return op.call(hidden, weight, bias, labels, ignore_index, label_smoothing, reduction, chunk, dtype, logit_scale,
                 softcap, z_loss);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_stats(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& labels,
    int64_t ignore_index, double temperature, double logit_scale, std::optional<double> softcap, int64_t chunk) {
  static const auto& op = op_for<&linear_cross_entropy_stats>("tempo::linear_cross_entropy_stats");
  return op.call(hidden, weight, bias, labels, ignore_index, temperature, logit_scale, softcap, chunk);
}

}  // namespace tempo

TORCH_LIBRARY_IMPL(tempo, CompositeExplicitAutograd, m) {
  m.impl("linear_cross_entropy", tempo::composite);
  m.impl("linear_cross_entropy_forward", tempo::forward_kernel);
  m.impl("linear_cross_entropy_backward", tempo::backward_kernel);
  m.impl("linear_cross_entropy_stats", tempo::stats_kernel);
}
