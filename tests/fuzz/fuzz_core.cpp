// libFuzzer target: the kernel core's parameter validation and its CPU kernels, including the
// packed 1-bit masks. Each input picks an op and its parameters (sizes that may be negative,
// huge or overflowing; bad dtypes, modes and probabilities; missing pointers). Properties:
//  - a parameter set the core accepts never crashes the kernel or reads/writes outside the
//    buffers its header documents (AddressSanitizer, UBSan);
//  - negative sizes, sizes whose element count overflows, unknown enums, p outside [0, 1] or
//    NaN, and missing required pointers are refused with a message naming the op;
//  - accepted runs give finite output for finite input, and the packed keep bits agree with
//    the output (dropout, attention) and with the philox mode that draws them again.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "tempo/activation.h"
#include "tempo/attention.h"
#include "tempo/qkv_split.h"
#include "tempo/rope.h"
#include "tempo/dropout.h"
#include "tempo/gated_mlp.h"
#include "tempo/linear_cross_entropy.h"
#include "tempo/linear_attention.h"
#include "tempo/norm.h"
#include "math/numeric.h"

namespace {

using namespace tempo;
using tempo::math::bf16_t;
using tempo::math::fp16_t;
using tempo::math::from_float;
using tempo::math::to_float;

// Elements a run may allocate per buffer; larger accepted sizes are validated, not run.
constexpr int64_t kMaxRun = 1 << 14;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_core property violated: %s\n", what.c_str());
  std::abort();
}

// A refusal must say which op refused.
void expect_refused(const Status& s, const char* op, const std::string& why) {
  if (s.ok()) fail(std::string(op) + " accepted " + why);
  if (s.message().empty()) fail(std::string(op) + " refused " + why + " without a message");
}

size_t esize(DType t) { return t == DType::kFloat64 ? 8 : t == DType::kFloat32 ? 4 : 2; }
bool valid(DType t) { return static_cast<int32_t>(t) >= 0 && static_cast<int32_t>(t) <= 3; }

// Product of sizes; false when one is negative or passes `limit`, or the product does: every
// size the target loops over stays bounded, even beside a zero that makes the product 0.
bool count(std::initializer_list<int64_t> dims, int64_t limit, int64_t* out) {
  for (int64_t d : dims)
    if (d < 0 || d > limit) return false;
  int64_t n = 1;
  for (int64_t d : dims) {
    if (d == 0) {
      n = 0;
      break;
    }
    if (n > limit / d) return false;
    n *= d;
  }
  *out = n;
  return true;
}
bool any_negative(std::initializer_list<int64_t> dims) {
  for (int64_t d : dims)
    if (d < 0) return true;
  return false;
}
// Non-negative sizes, none zero, whose element count passes 2^62 (so that byte counts would
// overflow int64).
bool overflowing(std::initializer_list<int64_t> dims) {
  if (any_negative(dims)) return false;
  __int128 n = 1;
  for (int64_t d : dims) {
    if (d == 0) return false;
    n = std::min<__int128>(n * d, __int128{1} << 63);  // capped at 2^63, so the next product fits
  }
  return n > (__int128{1} << 62);
}

struct Buffer {
  DType type;
  std::vector<unsigned char> bytes;
  Buffer(DType t, int64_t n) : type(t), bytes(static_cast<size_t>(n) * esize(t)) {}
  void* data() { return bytes.empty() ? nullptr : bytes.data(); }
  int64_t size() const { return static_cast<int64_t>(bytes.size() / esize(type)); }
  double get(int64_t i) const {
    const unsigned char* b = bytes.data() + i * esize(type);
    switch (type) {
      case DType::kFloat64: {
        double v;
        std::memcpy(&v, b, 8);
        return v;
      }
      case DType::kFloat32: {
        float v;
        std::memcpy(&v, b, 4);
        return v;
      }
      case DType::kBFloat16: {
        bf16_t v;
        std::memcpy(&v, b, 2);
        return to_float(v);
      }
      default: {
        fp16_t v;
        std::memcpy(&v, b, 2);
        return to_float(v);
      }
    }
  }
  void set(int64_t i, double x) {
    unsigned char* b = bytes.data() + i * esize(type);
    switch (type) {
      case DType::kFloat64:
        std::memcpy(b, &x, 8);
        break;
      case DType::kFloat32: {
        float v = static_cast<float>(x);
        std::memcpy(b, &v, 4);
        break;
      }
      case DType::kBFloat16: {
        bf16_t v = from_float<bf16_t>(static_cast<float>(x));
        std::memcpy(b, &v, 2);
        break;
      }
      default: {
        fp16_t v = from_float<fp16_t>(static_cast<float>(x));
        std::memcpy(b, &v, 2);
        break;
      }
    }
  }
  bool finite() const {
    for (int64_t i = 0; i < size(); ++i)
      if (!std::isfinite(get(i))) return false;
    return true;
  }
};

struct Gen {
  FuzzedDataProvider& f;
  int64_t dim(int64_t small) {
    switch (f.ConsumeIntegralInRange(0, 15)) {
      case 0:
        return f.ConsumeIntegral<int64_t>();
      case 1:
        return -f.ConsumeIntegralInRange<int64_t>(1, 3);
      case 2:
        return std::numeric_limits<int64_t>::max() / f.ConsumeIntegralInRange<int64_t>(1, 4096);
      default:
        return f.ConsumeIntegralInRange<int64_t>(0, small);
    }
  }
  DType dtype() {
    const int r = f.ConsumeIntegralInRange(0, 12);
    return static_cast<DType>(r < 12 ? r % 4 : f.ConsumeIntegral<int32_t>());
  }
  double prob() {
    switch (f.ConsumeIntegralInRange(0, 11)) {
      case 0:
        return std::nan("");
      case 1:
        return -f.ConsumeProbability<double>() - 1e-9;
      case 2:
        return 1.0 + f.ConsumeProbability<double>() + 1e-9;
      case 3:
        return 0.0;
      case 4:
        return 1.0;
      case 5:
        return 1e-7;
      default:
        return f.ConsumeProbability<double>();
    }
  }
  bool flag() { return f.ConsumeBool(); }
  // A value of finite input: mostly moderate, sometimes zero, large or tiny.
  double value() {
    switch (f.ConsumeIntegralInRange(0, 15)) {
      case 0:
        return 0.0;
      case 1:
        return f.ConsumeFloatingPointInRange(-6e4, 6e4);
      case 2:
        return f.ConsumeFloatingPointInRange(-1e-6, 1e-6);
      default:
        return f.ConsumeFloatingPointInRange(-8.0, 8.0);
    }
  }
  Buffer data(DType t, int64_t n) {
    Buffer b(t, n);
    for (int64_t i = 0; i < n; ++i) b.set(i, value());
    return b;
  }
  PhiloxState rng() {
    PhiloxState r;
    r.seed = f.ConsumeIntegral<uint64_t>();
    r.offset = f.ConsumeIntegral<uint64_t>();
    return r;
  }
  DropoutMode mode() {
    const int r = f.ConsumeIntegralInRange(0, 8);
    return static_cast<DropoutMode>(r < 8 ? r % 2 : f.ConsumeIntegral<int32_t>());
  }
};

bool bit(const std::vector<uint8_t>& m, int64_t i) { return (m[static_cast<size_t>(i / 8)] >> (i % 8)) & 1; }
double tol(DType t) { return t == DType::kFloat64 ? 1e-12 : t == DType::kFloat32 ? 1e-6 : 1e-2; }
// The smallest subnormal step of the dtype: the absolute error of rounding a tiny result.
double tiny(DType t) {
  switch (t) {
    case DType::kFloat64:
      return 5e-324;
    case DType::kFloat32:
      return 1.5e-45;
    case DType::kBFloat16:
      return 9.2e-41;
    default:
      return 5.97e-8;  // fp16: 2^-24
  }
}
// got equals want rounded to the dtype, within tol: fp16 results past its range are inf, and
// tiny ones carry the subnormal spacing's absolute error.
bool close(DType t, double got, double want, double rel) {
  if (t == DType::kFloat16 && std::fabs(want) >= 65520.0) return got == std::copysign(INFINITY, want);
  return std::fabs(got - want) <= rel * std::fabs(want) + tiny(t);
}

// ---- dropout: bits vs output vs philox --------------------------------------------------------

void fuzz_dropout(Gen& g) {
  DropoutForwardParams p;
  p.dtype = g.dtype();
  p.numel = g.dim(3000);
  p.p = g.prob();
  p.mode = g.mode();
  p.rng = g.rng();
  const bool bad_p = !(p.p >= 0.0 && p.p <= 1.0);
  int64_t n = 0;
  const bool runnable = count({p.numel}, kMaxRun, &n) && valid(p.dtype) && !bad_p &&
                        (p.mode == DropoutMode::kBits || p.mode == DropoutMode::kPhilox);
  if (!runnable) {
    // Sizes too large to run here: the validation the kernel runs first (pointers to a
    // small buffer, never read).
    static unsigned char one[8];
    p.x = one;
    p.y = one;
    p.mask = one;
    const Status s = detail::validate(p);
    if (!valid(p.dtype))
      expect_refused(s, "dropout forward", "an unknown dtype");
    else if (bad_p)
      expect_refused(s, "dropout forward", "p outside [0, 1]");
    else if (p.numel < 0)
      expect_refused(s, "dropout forward", "a negative numel");
    else if (overflowing({p.numel}))
      expect_refused(s, "dropout forward", "a numel whose byte count overflows");
    else if (p.mode != DropoutMode::kBits && p.mode != DropoutMode::kPhilox && p.numel > 0)
      expect_refused(s, "dropout forward", "an unknown mode");
    return;
  }
  Buffer x = g.data(p.dtype, n), y(p.dtype, n), y2(p.dtype, n);
  std::vector<uint8_t> mask(static_cast<size_t>(bit_mask_bytes(n)) + 0);
  const bool drop_null = g.flag() && g.flag();
  p.x = x.data();
  p.y = y.data();
  p.mask = p.mode == DropoutMode::kBits && !drop_null ? mask.data() : nullptr;
  if (n > 0 && p.mode == DropoutMode::kBits && mask.empty()) p.mask = nullptr;
  Status s = dropout_forward_cpu(p);
  if (!s.ok()) {
    if (s.message().find("dropout forward") == std::string::npos) fail("unnamed refusal: " + s.message());
    if (n > 0 && p.mode == DropoutMode::kBits && p.p > 0 && p.p < 1 && p.mask)
      fail("refused a valid call: " + s.message());
    return;
  }
  // Finite, except where x / (1 - p) passes fp16's range (as x * scale does in torch).
  const double scale = dropout_scale(p.p);
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(y.get(i)) && !(p.dtype == DType::kFloat16 && std::fabs(x.get(i) * scale) >= 65520.0))
      fail("dropout forward: non-finite output from finite input");
  if (p.mode != DropoutMode::kBits || !p.mask || n == 0) return;
  for (int64_t i = 0; i < n; ++i) {
    const double want = bit(mask, i) ? x.get(i) * scale : 0.0;
    if (!close(p.dtype, y.get(i), want, tol(p.dtype)))
      fail("dropout forward: y disagrees with its keep bit at " + std::to_string(i) + " (dtype " + dtype_name(p.dtype) +
           ", p " + std::to_string(p.p) + ", x " + std::to_string(x.get(i)) + ", y " + std::to_string(y.get(i)) +
           ", bit " + std::to_string(bit(mask, i)) + ")");
  }
  // The philox mode draws the same bits: same output.
  DropoutForwardParams q = p;
  q.mode = DropoutMode::kPhilox;
  q.mask = nullptr;
  q.y = y2.data();
  if (!dropout_forward_cpu(q).ok()) fail("dropout forward: philox mode refused what bits mode ran");
  if (std::memcmp(y.data(), y2.data(), y.bytes.size()) != 0) fail("dropout forward: philox and bits outputs differ");
  // Backward from the bits and from philox: identical.
  DropoutBackwardParams b;
  b.dtype = p.dtype;
  b.numel = n;
  b.p = p.p;
  b.rng = p.rng;
  Buffer gy = g.data(p.dtype, n), gx(p.dtype, n), gx2(p.dtype, n);
  b.grad_y = gy.data();
  b.grad_x = gx.data();
  b.mode = DropoutMode::kBits;
  b.mask = mask.data();
  if (!dropout_backward_cpu(b).ok()) fail("dropout backward refused the forward's bits");
  b.mode = DropoutMode::kPhilox;
  b.mask = nullptr;
  b.grad_x = gx2.data();
  if (!dropout_backward_cpu(b).ok()) fail("dropout backward refused philox mode");
  if (std::memcmp(gx.data(), gx2.data(), gx.bytes.size()) != 0) fail("dropout backward: philox and bits differ");
}

// ---- activations --------------------------------------------------------------------------------

void fuzz_activation(Gen& g) {
  ActivationForwardParams p;
  const int a = g.f.ConsumeIntegralInRange(0, 7);
  p.act = static_cast<Activation>(a < 6 ? a % 3 : g.f.ConsumeIntegral<int32_t>());
  p.dtype = g.dtype();
  p.numel = g.dim(2000);
  const bool with_bias = g.flag();
  p.bias_size = with_bias ? g.dim(64) : 0;
  const bool act_ok = static_cast<int32_t>(p.act) >= 0 && static_cast<int32_t>(p.act) <= 2;
  int64_t n = 0;
  const bool bias_ok = !with_bias || (p.bias_size > 0 && p.numel % p.bias_size == 0);
  const bool runnable = count({p.numel}, kMaxRun, &n) && valid(p.dtype) && act_ok && (!with_bias || p.bias_size > 0) &&
                        p.bias_size <= kMaxRun;
  if (!runnable) {
    static unsigned char one[8];
    p.x = p.y = one;
    p.bias = with_bias ? one : nullptr;
    p.mask = one;
    const Status s = detail::validate(p);
    if (!valid(p.dtype))
      expect_refused(s, "activation forward", "an unknown dtype");
    else if (!act_ok)
      expect_refused(s, "activation forward", "an unknown activation");
    else if (p.numel < 0)
      expect_refused(s, "activation forward", "a negative numel");
    else if (overflowing({p.numel}))
      expect_refused(s, "activation forward", "a numel whose byte count overflows");
    else if (with_bias && p.bias_size <= 0 && p.numel > 0)
      expect_refused(s, "activation forward", "a bias of size <= 0");
    return;
  }
  Buffer x = g.data(p.dtype, n), y(p.dtype, n), bias = g.data(p.dtype, with_bias ? p.bias_size : 0);
  std::vector<uint8_t> mask(static_cast<size_t>(bit_mask_bytes(n)));
  p.x = x.data();
  p.y = y.data();
  p.bias = with_bias ? bias.data() : nullptr;
  p.mask = mask.empty() ? nullptr : mask.data();
  const Status s = activation_forward_cpu(p);
  if (!bias_ok && n > 0) {
    expect_refused(s, "activation forward", "a numel that is not a multiple of the bias size");
    return;
  }
  if (!s.ok()) {
    if (n > 0) fail("activation forward refused a valid call: " + s.message());
    return;
  }
  // Finite, except where x + bias passes fp16's range (f(z) ~ z for large z).
  for (int64_t i = 0; i < n; ++i) {
    const double z = x.get(i) + (with_bias ? bias.get(i % p.bias_size) : 0.0);
    if (!std::isfinite(y.get(i)) && !(p.dtype == DType::kFloat16 && std::fabs(z) >= 65520.0))
      fail("activation forward: non-finite output from finite input");
  }
  // The backward, with the bias gradient when there is a bias: finite.
  ActivationBackwardParams b;
  b.act = p.act;
  b.dtype = p.dtype;
  b.numel = n;
  Buffer gy = g.data(p.dtype, n), gx(p.dtype, n), gb(p.dtype, with_bias ? p.bias_size : 0);
  b.y = y.data();
  b.mask = p.mask;
  b.grad_y = gy.data();
  b.grad_x = gx.data();
  if (with_bias) {
    b.grad_bias = gb.data();
    b.bias_size = p.bias_size;
  }
  const Status sb = activation_backward_cpu(b);
  if (!sb.ok()) {
    if (n > 0) fail("activation backward refused the forward's output: " + sb.message());
    return;
  }
  // Finite unless fp16's range overflows in the bias sums.
  if (!gx.finite() && p.dtype != DType::kFloat16) fail("activation backward: non-finite gradient from finite input");
}

// ---- norms and the column rule --------------------------------------------------------------------

void fuzz_norm(Gen& g) {
  NormForwardParams p;
  const int k = g.f.ConsumeIntegralInRange(0, 5);
  p.kind = static_cast<NormKind>(k < 5 ? k % 2 : g.f.ConsumeIntegral<int32_t>());
  p.dtype = g.dtype();
  p.rows = g.dim(40);
  p.cols = g.dim(200);
  p.eps = g.flag() ? 1e-5 : g.f.ConsumeFloatingPoint<double>();
  const bool kind_ok = p.kind == NormKind::kLayerNorm || p.kind == NormKind::kRmsNorm;
  int64_t n = 0;
  const bool runnable = count({p.rows, p.cols}, kMaxRun, &n) && valid(p.dtype) && kind_ok;
  if (!runnable) {
    static unsigned char one[8];
    p.x = p.y = p.rstd = one;
    const Status s = detail::validate(p);
    if (!valid(p.dtype))
      expect_refused(s, "norm forward", "an unknown dtype");
    else if (!kind_ok)
      expect_refused(s, "norm forward", "an unknown kind");
    else if (any_negative({p.rows, p.cols}))
      expect_refused(s, "norm forward", "a negative size");
    else if (overflowing({p.rows, p.cols}))
      expect_refused(s, "norm forward", "rows x cols overflowing");
    return;
  }
  const bool with_weight = g.flag(), with_beta = p.kind == NormKind::kLayerNorm && g.flag();
  // float32 gamma and beta (as under CPU autocast): for 16-bit data only.
  p.float_params = g.f.ConsumeIntegralInRange(0, 3) == 0;
  if (p.float_params && p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) {
    static unsigned char one[8];
    p.x = p.y = p.rstd = one;
    expect_refused(detail::validate(p), "norm forward", "float32 parameters over 32/64-bit data");
    return;
  }
  const DType pdt = p.float_params ? DType::kFloat32 : p.dtype;
  Buffer x = g.data(p.dtype, n), y(p.dtype, n), w(pdt, with_weight ? p.cols : 0), beta(pdt, with_beta ? p.cols : 0);
  // Gammas as trained models have them: mostly ordinary, some tiny, zero or subnormal.
  for (int64_t j = 0; j < w.size(); ++j) {
    const int r = g.f.ConsumeIntegralInRange(0, 9);
    w.set(j, r == 0 ? 0.0 : r == 1 ? 1e-33 : r == 2 ? -4.8e-33 : r == 3 ? 1e-41 : g.value());
  }
  for (int64_t j = 0; j < beta.size(); ++j) beta.set(j, g.value());
  const DType math = p.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  Buffer rstd(math, p.rows);
  std::vector<int64_t> kept_cols(static_cast<size_t>(p.cols));
  const int64_t kept = norm_kept_columns(p.dtype, pdt, with_weight ? w.data() : nullptr,
                                         with_beta ? beta.data() : nullptr, p.cols, kept_cols.data());
  if (kept < 0 || kept > p.cols) fail("norm_kept_columns returned " + std::to_string(kept));
  // The kept columns are exactly the unrecoverable ones, ascending.
  int64_t at = 0;
  for (int64_t j = 0; j < p.cols; ++j) {
    const bool rec = norm_column_recoverable(p.dtype, with_weight ? w.get(j) : 1.0, with_beta ? beta.get(j) : 0.0);
    if (!rec) {
      if (at >= kept || kept_cols[static_cast<size_t>(at)] != j)
        fail("norm_kept_columns disagrees with the column rule");
      ++at;
    }
  }
  if (at != kept) fail("norm_kept_columns lists a recoverable column");
  std::vector<int32_t> slot(static_cast<size_t>(p.cols), -1);
  for (int64_t i = 0; i < kept; ++i)
    slot[static_cast<size_t>(kept_cols[static_cast<size_t>(i)])] = static_cast<int32_t>(i);
  Buffer kx(math, p.rows * kept);
  p.x = x.data();
  p.y = y.data();
  p.weight = with_weight ? w.data() : nullptr;
  p.beta = with_beta ? beta.data() : nullptr;
  p.rstd = rstd.data();
  p.kept_slot = kept ? slot.data() : nullptr;
  p.kept = kept;
  p.kept_xhat = kx.data();
  const bool eps_ok = p.eps >= 0 && std::isfinite(p.eps);
  const Status s = norm_forward_cpu(p);
  if (!eps_ok && n > 0) {
    expect_refused(s, "norm forward", "eps < 0 or not finite");
    return;
  }
  if (!s.ok()) {
    if (n > 0) fail("norm forward refused a valid call: " + s.message());
    return;
  }
  // (A constant row with eps ~ 0 gives 0 x inf, as torch's layer_norm does.)
  if (p.eps >= 1e-12 && !y.finite() && p.dtype != DType::kFloat16)
    fail("norm forward: non-finite output from finite input");
  NormBackwardParams b;
  b.kind = p.kind;
  b.dtype = p.dtype;
  b.float_params = p.float_params;
  b.rows = p.rows;
  b.cols = p.cols;
  Buffer gy = g.data(p.dtype, n), gx(p.dtype, n), gw(pdt, w.size()), gbeta(pdt, beta.size());
  b.grad_y = gy.data();
  b.y = y.data();
  b.rstd = rstd.data();
  b.weight = p.weight;
  b.beta = p.beta;
  b.grad_x = gx.data();
  b.grad_weight = with_weight ? gw.data() : nullptr;
  b.grad_beta = with_beta ? gbeta.data() : nullptr;
  b.kept_slot = p.kept_slot;
  b.kept = kept;
  b.kept_xhat = kx.data();
  const Status sb = norm_backward_cpu(b);
  if (!sb.ok()) {
    if (n > 0) fail("norm backward refused the forward's output: " + sb.message());
    return;
  }
}

// ---- attention softmax ----------------------------------------------------------------------------

void fuzz_attention(Gen& g) {
  AttentionSoftmaxForwardParams p;
  p.dtype = g.dtype();
  p.batch = g.dim(3);
  p.heads = g.dim(3);
  p.rows = g.dim(24);
  p.cols = g.dim(40);
  p.causal = g.flag();
  p.scale = g.flag() ? 0.125 : g.value();
  p.p = g.flag() ? 0.0 : g.prob();
  p.mode = g.mode();
  p.rng = g.rng();
  if (g.flag()) {
    p.row_offset = g.dim(24);
    p.seq_q = g.dim(48);
  }
  const bool bad_p = !(p.p >= 0.0 && p.p <= 1.0);
  int64_t n = 0;
  const bool runnable = count({p.batch, p.heads, p.rows, p.cols}, kMaxRun, &n) && valid(p.dtype) && !bad_p &&
                        (p.mode == DropoutMode::kBits || p.mode == DropoutMode::kPhilox) && p.row_offset >= 0 &&
                        p.seq_q >= 0 && p.row_offset <= kMaxRun && p.seq_q <= kMaxRun;
  if (!runnable) {
    static unsigned char one[8];
    p.scores = p.dropped = one;
    p.mask_bits = one;
    const Status s = detail::validate(p);
    if (!valid(p.dtype))
      expect_refused(s, "attention softmax forward", "an unknown dtype");
    else if (bad_p)
      expect_refused(s, "attention softmax forward", "p outside [0, 1]");
    else if (any_negative({p.batch, p.heads, p.rows, p.cols, p.row_offset, p.seq_q}))
      expect_refused(s, "attention softmax forward", "a negative size or offset");
    else if (overflowing({p.batch, p.heads, p.rows, p.cols}) || overflowing({p.batch, p.heads, p.seq_q, p.cols}))
      expect_refused(s, "attention softmax forward", "sizes whose element count overflows");
    return;
  }
  const bool block_ok = p.seq_q == 0 ? p.row_offset == 0 : p.row_offset + p.rows <= p.seq_q;
  Buffer scores = g.data(p.dtype, n), dropped(p.dtype, n);
  std::vector<uint8_t> bits(static_cast<size_t>(bit_mask_bytes(n)));
  // An optional additive mask, broadcast by non-negative strides, with -inf entries.
  std::vector<float> mask;
  if (g.flag()) {
    int64_t extent = 1;
    const int64_t dims[4] = {p.batch, p.heads, p.seq(), p.cols};
    for (int d = 0; d < 4; ++d) {
      p.mask_stride[d] = g.f.ConsumeIntegralInRange<int64_t>(0, 3);
      if (dims[d] > 0) extent += (dims[d] - 1) * p.mask_stride[d];
    }
    if (extent <= kMaxRun) {
      mask.resize(static_cast<size_t>(extent));
      for (auto& m : mask) m = g.f.ConsumeIntegralInRange(0, 4) == 0 ? -INFINITY : static_cast<float>(g.value());
      p.attn_mask = mask.data();
    }
  }
  p.scores = scores.data();
  p.dropped = p.p > 0 ? dropped.data() : nullptr;
  p.mask_bits = p.p > 0 && p.mode == DropoutMode::kBits && !bits.empty() ? bits.data() : nullptr;
  const Status s = attention_softmax_forward_cpu(p);
  if (!block_ok && n > 0) {
    expect_refused(s, "attention softmax forward", "a block of rows outside seq_q");
    return;
  }
  if (!std::isfinite(p.scale) && n > 0) {
    expect_refused(s, "attention softmax forward", "a non-finite scale");
    return;
  }
  if (!s.ok()) {
    if (s.message().find("attention softmax forward") == std::string::npos) fail("unnamed refusal: " + s.message());
    return;
  }
  // Rows of P: entries in [0, 1], summing to 1 or (a fully masked row) to 0.
  const bool narrow = p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16;
  for (int64_t r = 0; n > 0 && r < p.rows_total(); ++r) {
    double sum = 0;
    for (int64_t j = 0; j < p.cols; ++j) {
      const double v = scores.get(r * p.cols + j);
      if (!(v >= 0.0 && v <= 1.0 + 1e-2)) fail("attention softmax forward: P outside [0, 1]");
      sum += v;
    }
    if (sum != 0.0 &&
        std::fabs(sum - 1.0) > (narrow ? 2e-2 * std::max<double>(1, static_cast<double>(p.cols) / 64) : 1e-4))
      fail("attention softmax forward: a row of P sums to " + std::to_string(sum));
  }
  if (p.p > 0 && p.p < 1 && p.mode == DropoutMode::kBits && n > 0) {
    const double scale = dropout_scale(p.p);
    for (int64_t i = 0; i < n; ++i) {
      const double want = bit(bits, i) ? scores.get(i) * scale : 0.0;
      if (std::fabs(dropped.get(i) - want) > 1e-2 * std::fabs(want) + tiny(p.dtype))
        fail("attention softmax forward: dropped P disagrees with its keep bit");
    }
  }
  AttentionSoftmaxBackwardParams b;
  static_cast<AttentionSoftmaxParams&>(b) = static_cast<const AttentionSoftmaxParams&>(p);
  Buffer grad = g.data(p.dtype, n);
  b.grad = grad.data();
  b.probs = scores.data();
  b.mask_bits = p.mask_bits;
  if (!attention_softmax_backward_cpu(b).ok() && n > 0) fail("attention softmax backward refused the forward's output");
  if (!grad.finite() && p.dtype != DType::kFloat16) fail("attention softmax backward: non-finite gradient");
}

// ---- q/k/v split ------------------------------------------------------------------------------------

void fuzz_qkv_split(Gen& g) {
  QkvSplitForwardParams p;
  p.dtype = g.dtype();
  p.batch = g.dim(3);
  p.seq = g.dim(9);
  p.heads = g.dim(4);
  p.head_dim = g.dim(9);
  int64_t n = 0;
  int64_t cols_n = 0;
  const bool runnable = count({p.batch, p.seq, 3, p.heads, p.head_dim}, kMaxRun, &n) &&
                        count({3, p.heads, p.head_dim}, kMaxRun, &cols_n) && valid(p.dtype);
  if (!runnable) {
    static unsigned char one[8];
    p.z = p.q = p.k = p.v = one;
    const Status s = detail::validate(p);
    if (!valid(p.dtype))
      expect_refused(s, "qkv split forward", "an unknown dtype");
    else if (any_negative({p.batch, p.seq, p.heads, p.head_dim}))
      expect_refused(s, "qkv split forward", "a negative size");
    else if (overflowing({p.batch, p.seq, 3, p.heads, p.head_dim}))
      expect_refused(s, "qkv split forward", "sizes whose element count overflows");
    return;
  }
  const int64_t cols = 3 * p.heads * p.head_dim, each = n / 3 * (n > 0);
  Buffer z = g.data(p.dtype, n), bias = g.data(p.dtype, cols), q(p.dtype, each), k(p.dtype, each), v(p.dtype, each);
  p.z = z.data();
  p.bias = g.flag() ? bias.data() : nullptr;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  if (!qkv_split_forward_cpu(p).ok()) {
    if (n > 0) fail("qkv split forward refused a valid call");
    return;
  }
  // q[b, h, s, e] = z[b, s, 0, h, e] + bias[0, h, e] (and k, v at 1, 2): a scalar loop.
  Buffer* out[3] = {&q, &k, &v};
  for (int64_t bb = 0; bb < p.batch; ++bb)
    for (int64_t s = 0; s < p.seq; ++s)
      for (int64_t w = 0; w < 3; ++w)
        for (int64_t h = 0; h < p.heads; ++h)
          for (int64_t e = 0; e < p.head_dim; ++e) {
            const int64_t c = (w * p.heads + h) * p.head_dim + e;
            const double want = z.get((bb * p.seq + s) * cols + c) + (p.bias ? bias.get(c) : 0.0);
            const double got = out[w]->get(((bb * p.heads + h) * p.seq + s) * p.head_dim + e);
            if (!close(p.dtype, got, want, tol(p.dtype)))
              fail("qkv split forward: element " + std::to_string(c) + " is " + std::to_string(got) + ", not " +
                   std::to_string(want));
          }
}

// ---- rotary embedding ----------------------------------------------------------------------------------

// Random sizes, rotary_dim (sometimes odd or past head_dim), a table batch of 1, batch or
// neither, x contiguous, transposed or with padded rows, tables in x's dtype or float32; the
// valid calls against a double loop of x cos + rotate_half(x) sin (or its transpose), each
// element within the dtype's rounding of the terms' magnitude.
void fuzz_rope(Gen& g) {
  RopeParams p;
  p.dtype = g.dtype();
  p.table_dtype = g.flag() ? DType::kFloat32 : p.dtype;
  p.batch = g.dim(3);
  p.heads = g.dim(3);
  p.seq = g.dim(6);
  p.head_dim = g.dim(12);
  p.rotary_dim = g.flag() ? p.head_dim : g.dim(12);
  const int tb = g.f.ConsumeIntegralInRange(0, 4);
  p.table_batch = tb == 0 ? p.batch : tb == 4 ? g.dim(4) : 1;
  const int layout = g.f.ConsumeIntegralInRange(0, 2);  // contiguous, transposed, padded rows
  const int64_t pad = layout == 2 ? g.f.ConsumeIntegralInRange<int64_t>(0, 3) : 0;
  int64_t n = 0, tn = 0;
  const bool sizes_ok =
      p.head_dim <= kMaxRun && count({p.batch, p.heads, p.seq, p.head_dim + pad}, kMaxRun, &n) &&
      count({std::max<int64_t>(p.table_batch, 0), p.seq, std::max<int64_t>(p.rotary_dim, 0)}, kMaxRun, &tn);
  const bool table_ok = p.table_dtype == p.dtype || (p.table_dtype == DType::kFloat32 && p.dtype != DType::kFloat64);
  const bool runnable = sizes_ok && valid(p.dtype) && table_ok && p.rotary_dim >= 0 && p.rotary_dim % 2 == 0 &&
                        p.rotary_dim <= p.head_dim && (p.table_batch == 1 || p.table_batch == p.batch);
  if (!runnable) {
    static unsigned char one[8];
    p.x = p.cos = p.sin = p.out = one;
    p.x_stride_batch = p.x_stride_head = p.x_stride_seq = 1;
    p.out_stride_batch = p.out_stride_head = p.out_stride_seq = 1;
    const Status s = detail::validate(p);
    if (!valid(p.dtype))
      expect_refused(s, "rope", "an unknown dtype");
    else if (!table_ok)
      expect_refused(s, "rope", "tables of another dtype");
    else if (any_negative({p.batch, p.heads, p.seq, p.head_dim}))
      expect_refused(s, "rope", "a negative size");
    else if (p.rotary_dim < 0 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim)
      expect_refused(s, "rope", "a rotary_dim that is odd, negative or past head_dim");
    else if (p.table_batch != 1 && p.table_batch != p.batch)
      expect_refused(s, "rope", "a table batch that is neither 1 nor x's");
    else if (overflowing({p.batch, p.heads, p.seq, p.head_dim}))
      expect_refused(s, "rope", "sizes whose element count overflows");
    return;
  }
  const int64_t B = p.batch, H = p.heads, S = p.seq, D = p.head_dim, R = p.rotary_dim, h = R / 2;
  const int64_t row = D + pad;  // x's row pitch
  p.x_stride_batch = H * S * row;
  p.x_stride_head = layout == 1 ? row : S * row;
  p.x_stride_seq = layout == 1 ? H * row : row;
  const bool out_transposed = g.flag();  // out [B, S, H, D] in memory, or contiguous
  p.out_stride_batch = H * S * D;
  p.out_stride_head = out_transposed ? D : S * D;
  p.out_stride_seq = out_transposed ? H * D : D;
  Buffer x = g.data(p.dtype, n), cos = g.data(p.table_dtype, tn), sin = g.data(p.table_dtype, tn), out(p.dtype, n);
  const bool backward = g.flag();
  p.x = x.data();
  p.cos = cos.data();
  p.sin = sin.data();
  p.out = out.data();
  const Status s = backward ? rope_backward_cpu(p) : rope_forward_cpu(p);
  if (!s.ok()) {
    if (n > 0) fail("rope refused a valid call: " + s.message());
    return;
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t a = 0; a < H; ++a)
      for (int64_t q = 0; q < S; ++q) {
        const int64_t xo = b * p.x_stride_batch + a * p.x_stride_head + q * p.x_stride_seq;
        const int64_t to = ((p.table_batch == 1 ? 0 : b) * S + q) * R;
        for (int64_t j = 0; j < D; ++j) {
          double want = x.get(xo + j), mag = std::fabs(want);
          if (j < R) {
            const int64_t o = j < h ? j + h : j - h;  // the pair's other column
            const double sign = (j < h) != backward ? -1.0 : 1.0;
            const double sn = backward ? sin.get(to + o) : sin.get(to + j);
            want = x.get(xo + j) * cos.get(to + j) + sign * x.get(xo + o) * sn;
            mag = std::fabs(x.get(xo + j) * cos.get(to + j)) + std::fabs(x.get(xo + o) * sn);
          }
          const double got = out.get(b * p.out_stride_batch + a * p.out_stride_head + q * p.out_stride_seq + j);
          if (!(std::fabs(got - want) <= tol(p.dtype) * (mag + 1e-300) + tiny(p.dtype)) &&
              !(std::isinf(got) && p.dtype == DType::kFloat16))
            fail("rope: element (" + std::to_string(b) + ", " + std::to_string(a) + ", " + std::to_string(q) + ", " +
                 std::to_string(j) + ") is " + std::to_string(got) + ", not " + std::to_string(want));
        }
      }
}

// ---- gated MLP ----------------------------------------------------------------------------------------

// act(g) in double: SiLU, the erf GELU, the tanh GELU (as g sigma(2u): no cancellation).
double gated_act(Activation act, double g) {
  if (act == Activation::kSilu) return g / (1.0 + std::exp(-g));
  if (act == Activation::kGeluErf) return 0.5 * g * std::erfc(-g * 0.70710678118654752440);
  const double u = 0.79788456080286535588 * (g + 0.044715 * g * g * g);
  return g / (1.0 + std::exp(-2.0 * u));
}

void fuzz_gated_mlp(Gen& g) {
  GatedMlpForwardParams p;
  const int a = g.f.ConsumeIntegralInRange(0, 6);
  p.act = static_cast<Activation>(a < 6 ? a % 3 : g.f.ConsumeIntegral<int32_t>());
  p.dtype = g.dtype();
  p.rows = g.dim(9);
  p.cols = g.dim(40);
  // a fused gate_up row (stride 2 cols, up after gate) or separate rows, sometimes too short
  const bool fused = g.flag();
  const int64_t pad = g.f.ConsumeIntegralInRange<int64_t>(-1, 3);
  const int64_t c = std::clamp<int64_t>(p.cols, 0, int64_t{1} << 60);  // no overflow in the stride
  p.gate_stride = p.up_stride = (fused ? 2 * c : c) + pad;
  const bool known_act = static_cast<int32_t>(p.act) >= 0 && static_cast<int32_t>(p.act) <= 2;
  int64_t n = 0, span = 0;
  const bool runnable = count({p.rows, p.cols}, kMaxRun, &n) && count({p.rows, p.gate_stride}, kMaxRun, &span) &&
                        valid(p.dtype) && known_act && p.gate_stride >= p.cols;
  if (!runnable) {
    static unsigned char one[8];
    p.gate = p.up = p.h = one;
    const Status s = detail::validate(p);
    if (!valid(p.dtype))
      expect_refused(s, "gated mlp forward", "an unknown dtype");
    else if (!known_act)
      expect_refused(s, "gated mlp forward", "an unknown activation");
    else if (any_negative({p.rows, p.cols}))
      expect_refused(s, "gated mlp forward", "a negative size");
    else if (p.gate_stride < p.cols)
      expect_refused(s, "gated mlp forward", "a row stride under cols");
    else if (overflowing({p.rows, p.gate_stride}))
      expect_refused(s, "gated mlp forward", "sizes whose element count overflows");
    return;
  }
  const int64_t up_offset = fused ? p.cols : 0;
  Buffer gate = g.data(p.dtype, span + up_offset), up = fused ? Buffer(p.dtype, 0) : g.data(p.dtype, span);
  Buffer h(p.dtype, n);
  p.gate = gate.data();
  p.up =
      fused ? static_cast<const void*>(static_cast<const char*>(gate.data()) + up_offset * esize(p.dtype)) : up.data();
  p.h = h.data();
  const Status s = gated_mlp_forward_cpu(p);
  if (!s.ok()) {
    if (n > 0) fail("gated mlp forward refused a valid call: " + s.message());
    return;
  }
  const Buffer& ub = fused ? gate : up;
  for (int64_t r = 0; r < p.rows; ++r)
    for (int64_t j = 0; j < p.cols; ++j) {
      const double gv = gate.get(r * p.gate_stride + j), uv = ub.get(r * p.up_stride + j + up_offset);
      const double want = gated_act(p.act, gv) * uv;
      if (!close(p.dtype, h.get(r * p.cols + j), want, tol(p.dtype) + 1e-9))
        fail("gated mlp forward: element " + std::to_string(r * p.cols + j) + " is " +
             std::to_string(h.get(r * p.cols + j)) + ", not " + std::to_string(want));
    }
  GatedMlpBackwardParams b;
  b.act = p.act;
  b.dtype = p.dtype;
  b.gate = p.gate;
  b.up = p.up;
  b.rows = p.rows;
  b.cols = p.cols;
  b.gate_stride = p.gate_stride;
  b.up_stride = p.up_stride;
  Buffer grad_h = g.data(p.dtype, n), grad_gate(p.dtype, n), grad_up(p.dtype, n), h2(p.dtype, n);
  b.grad_h = grad_h.data();
  b.grad_gate = grad_gate.data();
  b.grad_up = grad_up.data();
  b.grad_gate_stride = b.grad_up_stride = p.cols;
  b.h = h2.data();
  if (!gated_mlp_backward_cpu(b).ok()) {
    if (n > 0) fail("gated mlp backward refused the forward's call");
    return;
  }
  for (int64_t i = 0; i < n; ++i)
    if (!(h2.get(i) == h.get(i) || (std::isnan(h2.get(i)) && std::isnan(h.get(i)))))
      fail("gated mlp backward: its h differs from the forward's at " + std::to_string(i));
  if (p.dtype != DType::kFloat16 && h.finite() && (!grad_gate.finite() || !grad_up.finite()))
    fail("gated mlp backward: non-finite gradient from finite input");
}

// ---- the LM head's row passes (linear_cross_entropy) --------------------------------------------

void fuzz_linear_cross_entropy(Gen& g) {
  LinearCrossEntropyForwardParams p;
  p.dtype = g.dtype();
  p.rows = g.dim(6);
  p.vocab = g.dim(300);
  p.smoothing = g.flag() ? 0.0 : g.prob();
  p.ignore_index = -100;
  int64_t n = 0;
  const bool good_eps = p.smoothing >= 0.0 && p.smoothing <= 1.0;
  const bool runnable =
      count({p.rows, p.vocab}, kMaxRun, &n) && valid(p.dtype) && good_eps && p.vocab > 0 && p.rows >= 0;
  std::vector<int64_t> labels(static_cast<size_t>(std::clamp<int64_t>(p.rows, 0, kMaxRun)) + 1);
  for (auto& y : labels) {
    const int r = g.f.ConsumeIntegralInRange(0, 9);
    y = r == 0 ? -100 : r == 1 ? g.f.ConsumeIntegral<int64_t>() : g.f.ConsumeIntegralInRange<int64_t>(0, 299);
  }
  p.labels = labels.data();
  if (!runnable) {
    static unsigned char one[8];
    p.logits = p.lse = p.loss = one;
    const Status s = detail::validate(p);
    if (!valid(p.dtype))
      expect_refused(s, "linear cross entropy forward", "an unknown dtype");
    else if (!good_eps)
      expect_refused(s, "linear cross entropy forward", "a smoothing outside [0, 1]");
    else if (p.vocab <= 0)
      expect_refused(s, "linear cross entropy forward", "an empty or negative vocabulary");
    else if (p.rows < 0)
      expect_refused(s, "linear cross entropy forward", "a negative size");
    else if (overflowing({p.rows, p.vocab}))
      expect_refused(s, "linear cross entropy forward", "sizes whose element count overflows");
    return;
  }
  const DType acc = p.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  Buffer z = g.data(p.dtype, n), lse(acc, p.rows), loss(acc, p.rows);
  p.logits = z.data();
  p.lse = lse.data();
  p.loss = loss.data();
  if (!linear_cross_entropy_forward_cpu(p).ok()) {
    if (n > 0) fail("linear cross entropy forward refused a valid call");
    return;
  }
  for (int64_t r = 0; r < p.rows; ++r) {
    double mx = -INFINITY, sum = 0.0;
    for (int64_t j = 0; j < p.vocab; ++j) mx = std::max(mx, z.get(r * p.vocab + j));
    for (int64_t j = 0; j < p.vocab; ++j) sum += std::exp(z.get(r * p.vocab + j) - mx);
    const double want = mx + std::log(sum);
    if (std::fabs(lse.get(r) - want) > 4 * tol(acc) * (std::fabs(want) + 1))
      fail("linear cross entropy forward: row " + std::to_string(r) + "'s lse is " + std::to_string(lse.get(r)) +
           ", not " + std::to_string(want));
    if (!std::isfinite(loss.get(r))) fail("linear cross entropy forward: a non-finite loss from finite logits");
    if (labels[static_cast<size_t>(r)] == p.ignore_index && loss.get(r) != 0.0)
      fail("linear cross entropy forward: an ignored row's loss is not 0");
  }
  LinearCrossEntropyBackwardParams b;
  static_cast<LinearCrossEntropyParams&>(b) = static_cast<const LinearCrossEntropyParams&>(p);
  Buffer scale(acc, p.rows);
  for (int64_t r = 0; r < p.rows; ++r) scale.set(r, labels[static_cast<size_t>(r)] == p.ignore_index ? 0.0 : 0.5);
  b.logits = z.data();
  b.lse = lse.data();
  b.scale = scale.data();
  if (!linear_cross_entropy_backward_cpu(b).ok()) {
    if (n > 0) fail("linear cross entropy backward refused the forward's output");
    return;
  }
  // each gradient is scale (p - eps / V - (1 - eps) [j = y]): within [-scale, scale]
  for (int64_t i = 0; i < n; ++i)
    if (!(std::fabs(z.get(i)) <= 0.5 * (1 + 4 * tol(p.dtype))))
      fail("linear cross entropy backward: gradient " + std::to_string(z.get(i)) + " outside [-scale, scale]");
}

// ---- causal linear attention ------------------------------------------------------------------------

void fuzz_linear_attention(Gen& g) {
  LinearAttentionForwardParams p;
  p.dtype = g.dtype();
  p.rows = g.dim(3);
  p.len = g.dim(17);
  p.m = g.dim(6);
  p.d = g.dim(6);
  p.eps = g.flag() ? 1e-6 : g.f.ConsumeFloatingPoint<double>();
  int64_t nq = 0, nv = 0, ns = 0, nden = 0;
  const bool runnable = count({p.rows, p.len, p.m}, kMaxRun, &nq) && count({p.rows, p.len, p.d}, kMaxRun, &nv) &&
                        count({p.rows, p.m, p.d}, kMaxRun, &ns) && count({p.rows, p.m}, kMaxRun, &nden) &&
                        valid(p.dtype);
  if (!runnable) {
    static unsigned char one[8];
    p.q = p.k = p.v = p.y = p.num_out = p.den_out = one;
    const Status s = detail::validate(p);
    if (!valid(p.dtype))
      expect_refused(s, "linear attention forward", "an unknown dtype");
    else if (any_negative({p.rows, p.len, p.m, p.d}))
      expect_refused(s, "linear attention forward", "a negative size");
    else if (p.m == 0 || p.d == 0)
      expect_refused(s, "linear attention forward", "an empty feature or value size");
    else if (overflowing({p.rows, p.len, p.m}) || overflowing({p.rows, p.len, p.d}) || overflowing({p.rows, p.m, p.d}))
      expect_refused(s, "linear attention forward", "sizes whose element count overflows");
    return;
  }
  const DType st = linear_attention_state_dtype(p.dtype);
  Buffer q = g.data(p.dtype, nq), k = g.data(p.dtype, nq), v = g.data(p.dtype, nv), y(p.dtype, nv);
  // Feature-mapped queries and keys are non-negative.
  for (int64_t i = 0; i < nq; ++i) {
    q.set(i, std::fabs(q.get(i)));
    k.set(i, std::fabs(k.get(i)));
  }
  Buffer num(st, ns), den(st, nden);
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.y = y.data();
  p.num_out = num.data();
  p.den_out = den.data();
  const Status s = linear_attention_forward_cpu(p);
  if (p.m == 0 || p.d == 0) {
    expect_refused(s, "linear attention forward", "an empty feature or value size");
    return;
  }
  if (!(p.eps >= 0 && std::isfinite(p.eps))) {
    expect_refused(s, "linear attention forward", "eps < 0 or not finite");
    return;
  }
  if (!s.ok()) {
    if (nv > 0 || nq > 0) fail("linear attention forward refused a valid call: " + s.message());
    return;
  }
  if (p.eps >= 1e-12 && !y.finite() && p.dtype != DType::kFloat16)
    fail("linear attention forward: non-finite output from finite input");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider f(data, size);
  Gen g{f};
  switch (f.ConsumeIntegralInRange(0, 8)) {
    case 0:
      fuzz_dropout(g);
      break;
    case 1:
      fuzz_activation(g);
      break;
    case 2:
      fuzz_norm(g);
      break;
    case 3:
      fuzz_attention(g);
      break;
    case 4:
      fuzz_qkv_split(g);
      break;
    case 5:
      fuzz_gated_mlp(g);
      break;
    case 6:
      fuzz_linear_cross_entropy(g);
      break;
    case 7:
      fuzz_rope(g);
      break;
    default:
      fuzz_linear_attention(g);
      break;
  }
  return 0;
}
