// The core's CUDA kernels, run on the host by the SIMT emulator (tests/simt/cuda_runtime.h),
// against the core's CPU kernels on the same inputs: every entry point, every dtype, sizes that
// are 1, odd, primes and past one block, the unaligned (scalar) and aligned (16-byte vector)
// paths, the fused prologues and the bias gradients with their workspaces. The CPU kernels are
// the reference here because their own tests hold them to fp64 loops and to PyTorch.
//
// What must agree exactly: every keep bit and activation bit, dropout's outputs (one rounding
// of the same product), the q/k/v split (a copy, or one add), the activations' gradients of
// 16/32-bit data (the same fp32 element math). What may differ, and by how much (Tol below):
// the activations' forward (the CUDA one of 16/32-bit data is fp32 arithmetic within 2.33 ulp,
// the CPU's a double evaluation rounded once) and fp64 element math (the two sides contract
// multiply-adds differently, and recovering x from y amplifies that); sums whose order differs
// (the norms' and softmax's row reductions, the bias gradients' column sums, the linear
// attention's running sums): kTol units of the dtype's rounding of the magnitude the sum's
// terms have. The run prints, per test, the worst difference / tolerance (0.39 at most when
// this was written): the bounds leave room, and an indexing or reduction error is far outside.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "api.h"
#include "math/gated_mlp_math.h"
#include "math/numeric.h"
#include "tempo/activation.h"
#include "tempo/attention.h"
#include "tempo/qkv_split.h"
#include "tempo/rope.h"
#include "tempo/dropout.h"
#include "tempo/gated_mlp.h"
#include "tempo/linear_attention.h"
#include "tempo/linear_cross_entropy.h"
#include "tempo/norm.h"

namespace {

using tempo::DType;
namespace math = tempo::math;

const DType kDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16};

size_t elem_size(DType t) { return t == DType::kFloat64 ? 8 : t == DType::kFloat32 ? 4 : 2; }

// A device-like buffer: 64-byte aligned storage, `shift` elements in (a shift of 1 makes
// every 16-byte vector path fall back to its scalar loop), with guard bytes around the
// elements that a write out of bounds would change (checked by expect_close).
struct Buf {
  DType dtype = DType::kFloat32;
  int64_t n = 0;
  std::vector<unsigned char> raw;
  int shift = 0;
  Buf() = default;
  static constexpr unsigned char kGuard = 0xa5;
  Buf(DType t, int64_t count, int shift_ = 0)
      : dtype(t), n(count), raw((count + shift_) * elem_size(t) + 128, kGuard), shift(shift_) {}
  // Whether every byte outside the elements still holds the guard pattern.
  bool guard_intact() {
    const auto* begin = static_cast<unsigned char*>(data());
    const auto* end = begin + n * elem_size(dtype);
    for (const unsigned char* q = raw.data(); q < raw.data() + raw.size(); ++q)
      if ((q < begin || q >= end) && *q != kGuard) return false;
    return true;
  }
  // A copy places the elements at its own aligned address (the storage may be aligned otherwise).
  Buf(const Buf& o) : Buf(o.dtype, o.n, o.shift) {
    std::memcpy(data(), const_cast<Buf&>(o).data(), n * elem_size(dtype));
  }
  Buf& operator=(const Buf& o) {
    Buf c(o);
    std::swap(raw, c.raw);
    dtype = o.dtype;
    n = o.n;
    shift = o.shift;
    return *this;
  }
  void* data() {
    auto base = reinterpret_cast<uintptr_t>(raw.data());
    return reinterpret_cast<void*>((base + 63) / 64 * 64 + shift * elem_size(dtype));
  }
  double get(int64_t i) {
    void* p = data();
    switch (dtype) {
      case DType::kFloat32:
        return static_cast<float*>(p)[i];
      case DType::kFloat64:
        return static_cast<double*>(p)[i];
      case DType::kBFloat16:
        return math::to_float(static_cast<math::bf16_t*>(p)[i]);
      case DType::kFloat16:
        return math::to_float(static_cast<math::fp16_t*>(p)[i]);
    }
    return 0;
  }
  void set(int64_t i, double v) {
    void* p = data();
    switch (dtype) {
      case DType::kFloat32:
        static_cast<float*>(p)[i] = static_cast<float>(v);
        break;
      case DType::kFloat64:
        static_cast<double*>(p)[i] = v;
        break;
      case DType::kBFloat16:
        static_cast<math::bf16_t*>(p)[i] = math::from_float<math::bf16_t>(static_cast<float>(v));
        break;
      case DType::kFloat16:
        static_cast<math::fp16_t*>(p)[i] = math::from_float<math::fp16_t>(static_cast<float>(v));
        break;
    }
  }
  std::vector<double> values() {
    std::vector<double> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = get(i);
    return v;
  }
};

Buf randn(DType t, int64_t n, std::mt19937& gen, double scale = 1.0, int shift = 0) {
  Buf b(t, n, shift);
  std::normal_distribution<double> nd(0.0, scale);
  for (int64_t i = 0; i < n; ++i) b.set(i, nd(gen));
  return b;
}

Buf zeros(DType t, int64_t n, int shift = 0) {
  Buf b(t, n, shift);
  std::memset(b.data(), 0, n * elem_size(t));
  return b;
}

// Units of the dtype's rounding a reordered sum may move a value by, against the tensor's largest.
double unit(DType t) {
  switch (t) {
    case DType::kFloat32:
      return std::ldexp(1.0, -24);
    case DType::kFloat64:
      return std::ldexp(1.0, -53);
    case DType::kBFloat16:
      return std::ldexp(1.0, -8);
    case DType::kFloat16:
      return std::ldexp(1.0, -11);
  }
  return 0;
}
constexpr double kTol = 64;  // units of the dtype's rounding (16-bit data: its stored rounding)

// The spacing of the dtype's subnormal numbers (a rounding flip there moves a value by it).
double subnormal_step(DType t) {
  switch (t) {
    case DType::kFloat32:
      return std::ldexp(1.0, -149);
    case DType::kFloat64:
      return 0;
    case DType::kBFloat16:
      return std::ldexp(1.0, -133);
    case DType::kFloat16:
      return std::ldexp(1.0, -24);
  }
  return 0;
}

// How far the emulated CUDA result may be from the CPU kernel's: ulps units of the dtype's
// rounding (unit()) of a magnitude, the larger of |value|, `floor` and, for reductions
// (`row_scale`), the tensor's largest magnitude / 8: a value that cancels in a sum carries the
// error of the terms it came from. ulps = 0: the same value.
struct Tol {
  double ulps = 0;
  double floor = 0;
  bool row_scale = false;
  const std::vector<double>* extra = nullptr;  // optional: added to element i's tolerance
};
constexpr Tol kExact{};
Tol elementwise(double ulps) { return Tol{ulps, 0, false}; }
Tol reduction(double floor = 0) { return Tol{kTol, floor, true}; }
// A column sum over `terms` rows of O(1) values, which the CPU adds in double and the CUDA
// kernels in fp32 partial sums per row group: the recursive-summation bound, terms x u x the
// largest partial sum (at most terms), taken as kTol x u x terms.
Tol column_sum(int64_t terms) { return Tol{kTol, static_cast<double>(terms), true}; }

// Per test: elements compared, how many were bitwise equal, the worst difference / tolerance;
// printed when the run ends (the figures in docs/accuracy.md).
struct Worst {
  int64_t compared = 0, equal = 0;
  double ratio = 0;
};
std::map<std::string, Worst>& worst() {
  static std::map<std::string, Worst> w;
  return w;
}

class Summary : public ::testing::Environment {
 public:
  void TearDown() override {
    for (const auto& [name, w] : worst())
      std::printf("%s: %lld elements compared, %lld bitwise equal, worst difference / tolerance %.3g\n", name.c_str(),
                  static_cast<long long>(w.compared), static_cast<long long>(w.equal), w.ratio);
  }
};
const auto* const kSummary = ::testing::AddGlobalTestEnvironment(new Summary);

void expect_close(Buf& cpu, Buf& gpu, Tol tol, const std::string& what) {
  EXPECT_TRUE(gpu.guard_intact()) << what << ": the emulated CUDA kernel wrote outside the tensor";
  EXPECT_TRUE(cpu.guard_intact()) << what << ": the CPU kernel wrote outside the tensor";
  Worst& w = worst()[::testing::UnitTest::GetInstance()->current_test_info()->name()];
  ASSERT_EQ(cpu.n, gpu.n);
  std::vector<double> a = cpu.values(), b = gpu.values();
  double big = 0;
  for (double v : a)
    if (std::isfinite(v)) big = std::max(big, std::fabs(v));
  const double u = unit(cpu.dtype);
  const bool narrow = cpu.dtype == DType::kBFloat16 || cpu.dtype == DType::kFloat16;
  int64_t bad = 0;
  for (int64_t i = 0; i < cpu.n; ++i) {
    const bool same = a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i]));
    ++w.compared;
    if (same) {
      ++w.equal;
      continue;
    }
    double limit = 0;
    if (tol.ulps > 0) {
      limit = tol.ulps * u * std::max({std::fabs(a[i]), tol.floor, tol.row_scale ? big / 8 : 0.0});
      // 16-bit outputs: a value computed in fp32 a little differently may round to the
      // neighbouring 16-bit number (one unit of the stored dtype).
      if (narrow) limit += 2 * u * std::fabs(a[i]);
      // a result near the subnormal range may also round one subnormal step the other way
      limit += 2 * subnormal_step(cpu.dtype);
      if (tol.extra) limit += (*tol.extra)[i];
    }
    if (limit > 0) w.ratio = std::max(w.ratio, std::fabs(a[i] - b[i]) / limit);
    if (!(std::fabs(a[i] - b[i]) <= limit)) {
      if (++bad <= 3)
        ADD_FAILURE() << what << ": element " << i << " of " << cpu.n << ": cpu " << a[i] << ", emulated cuda " << b[i]
                      << " (" << tempo::dtype_name(cpu.dtype) << ", tolerance " << limit << ")";
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

void expect_same_bytes(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  int64_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff += a[i] != b[i];
  EXPECT_EQ(diff, 0) << what << ": " << diff << " of " << a.size() << " mask bytes differ";
}

std::string tag(DType t, int64_t n) { return std::string(tempo::dtype_name(t)) + " n=" + std::to_string(n); }

// The activations' element math: the CUDA forward of 16/32-bit data is fp32 arithmetic within
// kF32ForwardUlps (2.33) of the exact value and the CPU's within half an ulp, so they may differ
// by 2.83 ulp (6 units of 2^-24 relative). In fp64 both sides run the same double code, compiled
// with different contraction of multiply-adds (and on the device, its own libm): a rounding
// apart, amplified where e^-2a is large (the tanh GELU's left tail): 1e-13 of the value for the
// forward; the backward's recovery of x from y amplifies it further: 1e-12 of max(value, 1).
constexpr double kF32ForwardUnits = 6;
constexpr double kFp64Units = 1e-13 / 0x1p-53;
constexpr double kFp64BackwardUnits = 1e-12 / 0x1p-53;

// ---- activations -------------------------------------------------------------------------------

// One activation case against the CPU kernel: forward, backward (with the bias gradient when
// bias_size > 0, which must divide n), and the backward in place.
void run_activation(tempo::Activation act, DType t, int64_t n, int64_t bias_size, int shift, std::mt19937& gen) {
  const std::string what =
      std::string(tempo::activation_name(act)) + " " + tag(t, n) + " shift " + std::to_string(shift);
  Buf x = randn(t, n, gen, 3.0, shift), bias = randn(t, std::max<int64_t>(bias_size, 1), gen);
  Buf y_cpu = zeros(t, n, shift), y_gpu = zeros(t, n, shift);
  std::vector<uint8_t> m_cpu(tempo::bit_mask_bytes(n)), m_gpu(m_cpu.size(), 0xab);
  tempo::ActivationForwardParams f;
  f.act = act;
  f.dtype = t;
  f.x = x.data();
  f.bias = bias_size ? bias.data() : nullptr;
  f.bias_size = bias_size;
  f.numel = n;
  f.y = y_cpu.data();
  f.mask = m_cpu.data();
  ASSERT_TRUE(tempo::activation_forward_cpu(f).ok()) << what;
  f.y = y_gpu.data();
  f.mask = m_gpu.data();
  ASSERT_EQ(simt_api::call("activation_forward", &f), "") << what;
  expect_same_bytes(m_cpu, m_gpu, what + " forward bits");
  expect_close(y_cpu, y_gpu, elementwise(t == DType::kFloat64 ? kFp64Units : kF32ForwardUnits), what + " forward");

  // Backward from the CPU forward's outputs; with the bias gradient where there is a bias.
  Buf gy = randn(t, n, gen, 1.0, shift);
  // fp64: near the minimum x*, where f' = 0, x is known from y only to the square-root bound
  // the method states (docs/accuracy.md): b = sqrt(2 |f''(x*)| u(y*)), under 8e-9 for all three
  // activations (|f''(x*)| < 1, |y*| < 0.28); the two sides' roundings may each reach it.
  std::vector<double> branch_point(n);
  for (int64_t i = 0; i < n; ++i) branch_point[i] = 2 * 8e-9 * std::fabs(gy.get(i));
  const Tol backward_tol = t == DType::kFloat64 ? Tol{kFp64BackwardUnits, 1.0, false, &branch_point} : kExact;
  Buf gx_cpu = zeros(t, n, shift), gx_gpu = zeros(t, n, shift);
  Buf gb_cpu = zeros(t, std::max<int64_t>(bias_size, 1)), gb_gpu = zeros(t, std::max<int64_t>(bias_size, 1));
  Buf ws(t == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32,
         std::max<int64_t>(tempo::activation_backward_workspace_elems(n, bias_size), 1));
  tempo::ActivationBackwardParams b;
  b.act = act;
  b.dtype = t;
  b.y = y_cpu.data();
  b.mask = m_cpu.data();
  b.grad_y = gy.data();
  b.numel = n;
  b.grad_x = gx_cpu.data();
  if (bias_size) {
    b.grad_bias = gb_cpu.data();
    b.bias_size = bias_size;
  }
  ASSERT_TRUE(tempo::activation_backward_cpu(b).ok()) << what;
  b.grad_x = gx_gpu.data();
  if (bias_size) {
    b.grad_bias = gb_gpu.data();
    b.workspace = ws.data();
  }
  ASSERT_EQ(simt_api::call("activation_backward", &b), "") << what;
  expect_close(gx_cpu, gx_gpu, backward_tol, what + " backward");
  // The bias gradient adds n / bias_size rows of grad_x: in 16/32-bit they agree bitwise and only
  // the order of the sum differs; in fp64 each column also carries the sum of its rows' own
  // allowed differences (backward_tol).
  if (bias_size) {
    std::vector<double> carried(bias_size, 0.0);
    if (t == DType::kFloat64)
      for (int64_t i = 0; i < n; ++i)
        carried[i % bias_size] +=
            kFp64BackwardUnits * unit(t) * std::max(std::fabs(gx_cpu.get(i)), 1.0) + branch_point[i];
    Tol tol = column_sum(n / bias_size);
    tol.extra = &carried;
    expect_close(gb_cpu, gb_gpu, tol, what + " bias gradient");
  }
  // In place: grad_x over grad_y.
  Buf inplace = gy;
  b.grad_x = inplace.data();
  b.grad_y = inplace.data();
  b.grad_bias = nullptr;
  b.bias_size = 0;
  b.workspace = nullptr;
  ASSERT_EQ(simt_api::call("activation_backward", &b), "") << what;
  expect_close(gx_cpu, inplace, backward_tol, what + " backward in place");
}

TEST(SimtCuda, ActivationsMatchTheCpuKernels) {
  std::mt19937 gen(11);
  for (auto act : {tempo::Activation::kGeluErf, tempo::Activation::kGeluTanh, tempo::Activation::kSilu})
    for (DType t : kDTypes)
      for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{250}, int64_t{4099}})
        for (int shift : {0, 1}) {
          run_activation(act, t, n, n % 2 == 0 ? 2 : n == 250 ? 50 : 0, shift, gen);
          if (HasFailure()) return;
        }
}

// ---- dropout -----------------------------------------------------------------------------------

TEST(SimtCuda, DropoutMatchesTheCpuKernelsBitForBit) {
  std::mt19937 gen(12);
  for (DType t : kDTypes)
    for (int64_t n : {int64_t{1}, int64_t{9}, int64_t{1000}, int64_t{8191}})
      for (double p : {0.0, 1e-3, 0.5, 1.0})
        for (auto mode : {tempo::DropoutMode::kBits, tempo::DropoutMode::kPhilox})
          for (int shift : {0, 1}) {  // 1: unaligned, the scalar path
            if (shift && p != 0.5) continue;
            const std::string what = tag(t, n) + " p " + std::to_string(p) +
                                     (mode == tempo::DropoutMode::kBits ? " bits" : " philox") +
                                     (shift ? " unaligned" : "");
            Buf x = randn(t, n, gen, 1.0, shift);
            Buf y_cpu = zeros(t, n), y_gpu = zeros(t, n, shift);
            std::vector<uint8_t> m_cpu(tempo::bit_mask_bytes(n)), m_gpu(m_cpu.size(), 0xcd);
            tempo::DropoutForwardParams f;
            f.dtype = t;
            f.x = x.data();
            f.numel = n;
            f.p = p;
            f.mode = mode;
            f.rng.seed = 1234 + n;
            f.rng.offset = 77;
            f.y = y_cpu.data();
            f.mask = mode == tempo::DropoutMode::kBits ? m_cpu.data() : nullptr;
            ASSERT_TRUE(tempo::dropout_forward_cpu(f).ok()) << what;
            f.y = y_gpu.data();
            f.mask = mode == tempo::DropoutMode::kBits ? m_gpu.data() : nullptr;
            ASSERT_EQ(simt_api::call("dropout_forward", &f), "") << what;
            expect_close(y_cpu, y_gpu, kExact, what + " forward");
            if (mode == tempo::DropoutMode::kBits && p > 0) expect_same_bytes(m_cpu, m_gpu, what + " bits");

            Buf g = randn(t, n, gen, 1.0, shift), gx_cpu = zeros(t, n), gx_gpu = zeros(t, n, shift);
            tempo::DropoutBackwardParams b;
            b.dtype = t;
            b.grad_y = g.data();
            b.numel = n;
            b.p = p;
            b.mode = mode;
            b.rng = f.rng;
            b.mask = mode == tempo::DropoutMode::kBits ? m_cpu.data() : nullptr;
            b.grad_x = gx_cpu.data();
            ASSERT_TRUE(tempo::dropout_backward_cpu(b).ok()) << what;
            b.grad_x = gx_gpu.data();
            ASSERT_EQ(simt_api::call("dropout_backward", &b), "") << what;
            expect_close(gx_cpu, gx_gpu, kExact, what + " backward");
          }
}

// The state a philox-mode backward reads from device memory, and the state read from there.
TEST(SimtCuda, PhiloxStateIsStoredAndReadFromDeviceMemory) {
  tempo::PhiloxState s;
  s.seed = 0x0123456789abcdefULL;
  s.offset = 42;
  uint64_t out[2] = {0, 0};
  ASSERT_EQ(simt_api::philox_state_store(&s, out), "");
  EXPECT_EQ(out[0], s.seed);
  EXPECT_EQ(out[1], s.offset);
  // A graph-captured generator: seed ^ the graph domain, offset + the add.
  int64_t graph_seed = 99, graph_offset = 1000;
  tempo::PhiloxState g;
  g.graph_seed = &graph_seed;
  g.graph_offset = &graph_offset;
  g.graph_offset_add = 8;
  ASSERT_EQ(simt_api::philox_state_store(&g, out), "");
  EXPECT_EQ(out[0], 99ULL ^ tempo::kGraphSeedDomain);
  EXPECT_EQ(out[1], 1008ULL);
  // A dropout whose state is read from `device` draws what the host state draws.
  const int64_t n = 777;
  std::mt19937 gen(13);
  Buf x = randn(DType::kFloat32, n, gen), y_host = zeros(DType::kFloat32, n), y_dev = zeros(DType::kFloat32, n);
  tempo::DropoutForwardParams f;
  f.x = x.data();
  f.numel = n;
  f.p = 0.3;
  f.mode = tempo::DropoutMode::kPhilox;
  f.rng.seed = out[0];
  f.rng.offset = out[1];
  f.y = y_host.data();
  ASSERT_TRUE(tempo::dropout_forward_cpu(f).ok());
  f.rng = tempo::PhiloxState{};
  f.rng.device = out;
  f.y = y_dev.data();
  ASSERT_EQ(simt_api::call("dropout_forward", &f), "");
  expect_close(y_host, y_dev, kExact, "dropout with the state in device memory");
}

// ---- norms -------------------------------------------------------------------------------------

struct NormCase {
  tempo::NormKind kind;
  DType t;
  bool float_params;
  int64_t rows, cols;
  bool weight, beta, prologue, prologue_bias, kept;
  double p;
  tempo::DropoutMode mode;
  double offset = 0;  // added to x: rows whose mean dwarfs their spread
};

void run_norm(const NormCase& c, std::mt19937& gen) {
  const DType t = c.t, pt = c.float_params ? DType::kFloat32 : t;
  const DType acc = t == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  const int64_t R = c.rows, M = c.cols, n = R * M;
  const std::string what = std::string(tempo::norm_name(c.kind)) + " " + tempo::dtype_name(t) +
                           (c.float_params ? " fp32 params" : "") + " " + std::to_string(R) + "x" + std::to_string(M) +
                           (c.prologue ? " prologue p " + std::to_string(c.p) : "") + (c.kept ? " kept" : "") +
                           (c.offset != 0 ? " offset " + std::to_string(c.offset) : "");
  Buf x = randn(t, n, gen, 2.0), res = randn(t, n, gen), pbias = randn(t, M, gen, 0.5);
  for (int64_t e = 0; e < n; ++e) x.set(e, x.get(e) + c.offset);
  Buf w = randn(pt, M, gen, 1.0), be = randn(pt, M, gen, 0.3);
  for (int64_t j = 0; j < M; ++j) w.set(j, 1.0 + 0.5 * w.get(j));
  if (c.kept)  // tiny and zero gammas (a trained BERT's), and a beta that dwarfs its gamma
    for (int64_t j = 0; j < M; j += 3) w.set(j, j % 2 ? 0.0 : -4.8e-33);
  std::vector<int64_t> kept_cols(M);
  const int64_t kept = tempo::norm_kept_columns(t, pt, c.weight ? w.data() : nullptr,
                                                c.beta && c.kind == tempo::NormKind::kLayerNorm ? be.data() : nullptr,
                                                M, kept_cols.data());
  std::vector<int32_t> slot(M, -1);
  for (int64_t k = 0; k < kept; ++k) slot[kept_cols[k]] = static_cast<int32_t>(k);
  if (c.kept) ASSERT_GT(kept, 0) << what;

  Buf y_cpu = zeros(t, n), y_gpu = zeros(t, n), r_cpu = zeros(acc, R), r_gpu = zeros(acc, R);
  Buf kx_cpu = zeros(acc, std::max<int64_t>(R * kept, 1)), kx_gpu = zeros(acc, std::max<int64_t>(R * kept, 1));
  std::vector<uint8_t> m_cpu(tempo::bit_mask_bytes(n)), m_gpu(m_cpu.size(), 0x5a);
  tempo::NormForwardParams f;
  f.kind = c.kind;
  f.dtype = t;
  f.x = x.data();
  f.weight = c.weight ? w.data() : nullptr;
  f.beta = c.beta && c.kind == tempo::NormKind::kLayerNorm ? be.data() : nullptr;
  f.float_params = c.float_params;
  f.rows = R;
  f.cols = M;
  f.kept_slot = kept ? slot.data() : nullptr;
  f.kept = kept;
  if (c.prologue) {
    f.prologue.residual = res.data();
    f.prologue.bias = c.prologue_bias ? pbias.data() : nullptr;
    f.prologue.p = c.p;
    f.prologue.mode = c.mode;
    f.prologue.rng.seed = 5;
    f.prologue.rng.offset = 6;
  }
  const bool bits = c.prologue && c.p > 0 && c.mode == tempo::DropoutMode::kBits;
  f.y = y_cpu.data();
  f.rstd = r_cpu.data();
  f.mask = bits ? m_cpu.data() : nullptr;
  f.kept_xhat = kept ? kx_cpu.data() : nullptr;
  tempo::Status s = tempo::norm_forward_cpu(f);
  ASSERT_TRUE(s.ok()) << what << ": " << s.message();
  f.y = y_gpu.data();
  f.rstd = r_gpu.data();
  f.mask = bits ? m_gpu.data() : nullptr;
  f.kept_xhat = kept ? kx_gpu.data() : nullptr;
  ASSERT_EQ(simt_api::call("norm_forward", &f), "") << what;
  expect_close(y_cpu, y_gpu, reduction(), what + " y");
  expect_close(r_cpu, r_gpu, reduction(), what + " rstd");
  if (kept) expect_close(kx_cpu, kx_gpu, reduction(), what + " kept xhat");
  if (bits) expect_same_bytes(m_cpu, m_gpu, what + " dropout bits");

  Buf gy = randn(t, n, gen);
  Buf gx_cpu = zeros(t, n), gx_gpu = zeros(t, n), gr_cpu = zeros(t, n), gr_gpu = zeros(t, n);
  Buf gw_cpu = zeros(pt, M), gw_gpu = zeros(pt, M), gbe_cpu = zeros(pt, M), gbe_gpu = zeros(pt, M);
  Buf gpb_cpu = zeros(t, M), gpb_gpu = zeros(t, M);
  Buf ws(acc, tempo::norm_backward_workspace_elems(R, M));
  tempo::NormBackwardParams b;
  b.kind = c.kind;
  b.dtype = t;
  b.grad_y = gy.data();
  b.y = y_cpu.data();
  b.rstd = r_cpu.data();
  b.weight = f.weight;
  b.beta = f.beta;
  b.float_params = c.float_params;
  b.prologue = f.prologue;
  b.mask = bits ? m_cpu.data() : nullptr;
  b.kept_slot = f.kept_slot;
  b.kept = kept;
  b.kept_xhat = kept ? kx_cpu.data() : nullptr;
  b.rows = R;
  b.cols = M;
  auto outputs = [&](Buf& gx, Buf& gw, Buf& gbe, Buf& gr, Buf& gpb) {
    b.grad_x = gx.data();
    b.grad_weight = f.weight ? gw.data() : nullptr;
    b.grad_beta = f.beta ? gbe.data() : nullptr;
    b.grad_residual = c.prologue ? gr.data() : nullptr;
    b.grad_bias = c.prologue && c.prologue_bias ? gpb.data() : nullptr;
  };
  outputs(gx_cpu, gw_cpu, gbe_cpu, gr_cpu, gpb_cpu);
  s = tempo::norm_backward_cpu(b);
  ASSERT_TRUE(s.ok()) << what << ": " << s.message();
  outputs(gx_gpu, gw_gpu, gbe_gpu, gr_gpu, gpb_gpu);
  b.workspace = ws.data();
  ASSERT_EQ(simt_api::call("norm_backward", &b), "") << what;
  // grad x's terms are of size rstd |gamma| |grad y| before they cancel (a row of two columns
  // whose values nearly agree has a large rstd): its floor is the largest of those.
  double term = 1.0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < (f.weight ? M : 1); ++j)
      term = std::max(term, r_cpu.get(r) * (f.weight ? std::fabs(w.get(j)) : 1.0));
  expect_close(gx_cpu, gx_gpu, reduction(term), what + " grad x");
  if (f.weight) expect_close(gw_cpu, gw_gpu, column_sum(R), what + " grad weight");
  if (f.beta) expect_close(gbe_cpu, gbe_gpu, column_sum(R), what + " grad beta");
  if (c.prologue) expect_close(gr_cpu, gr_gpu, reduction(term), what + " grad residual");
  if (c.prologue && c.prologue_bias) expect_close(gpb_cpu, gpb_gpu, column_sum(R), what + " grad bias");
}

TEST(SimtCuda, NormsMatchTheCpuKernels) {
  std::mt19937 gen(14);
  using K = tempo::NormKind;
  int cases = 0;
  for (DType t : kDTypes)
    for (bool fp : {false, true}) {
      if (fp && (t == DType::kFloat32 || t == DType::kFloat64)) continue;
      // 600 rows: more than kNormBackwardGroups (512), so a backward block sums two rows (fp32 and bf16 only:
      // 600 blocks of 256 emulated threads per launch).
      // 4 x 4100 and 2 x 8300: the backward's 512-thread register path (16 columns a thread) and
      // its workspace path (wider than 16 x 512), fp32 and bf16 only (emulated threads are slow).
      // Widths that are a multiple of 8 take the rows-in-registers kernels (16-byte accesses):
      // 24 and 64 (a partly idle warp), 1024 (1 pack a thread), 8192 (2 packs; the backward's
      // widest), 12288 (the forward's 4 packs; the backward's workspace path).
      for (auto [R, M] : {std::pair<int64_t, int64_t>{1, 1},
                          {3, 31},
                          {5, 300},
                          {9, 1031},
                          {600, 24},
                          {4, 4100},
                          {2, 8300},
                          {7, 64},
                          {5, 1024},
                          {2, 8192},
                          {2, 12288}}) {
        if (R == 600 && (fp || t == DType::kFloat64 || t == DType::kFloat16)) continue;
        if (M > 4000 && (fp || t == DType::kFloat64 || t == DType::kFloat16)) continue;
        run_norm({K::kLayerNorm, t, fp, R, M, true, true, false, false, false, 0.0, tempo::DropoutMode::kBits}, gen);
        run_norm({K::kRmsNorm, t, fp, R, M, true, false, false, false, false, 0.0, tempo::DropoutMode::kBits}, gen);
        run_norm({K::kLayerNorm, t, fp, R, M, false, false, false, false, false, 0.0, tempo::DropoutMode::kBits}, gen);
        run_norm({K::kLayerNorm, t, fp, R, M, true, true, true, true, false, 0.1, tempo::DropoutMode::kBits}, gen);
        run_norm({K::kLayerNorm, t, fp, R, M, true, true, true, false, false, 0.5, tempo::DropoutMode::kPhilox}, gen);
        run_norm({K::kLayerNorm, t, fp, R, M, true, true, true, true, false, 0.0, tempo::DropoutMode::kBits}, gen);
        if (M >= 24) {
          run_norm({K::kLayerNorm, t, fp, R, M, true, true, false, false, true, 0.0, tempo::DropoutMode::kBits}, gen);
          run_norm({K::kRmsNorm, t, fp, R, M, true, false, false, false, true, 0.0, tempo::DropoutMode::kBits}, gen);
        }
        cases += 8;
        if (HasFatalFailure() || HasNonfatalFailure()) return;
      }
    }
  // Rows with a large offset (mean 3000, spread 2): both kernels correct their first mean by a
  // second pass; uncorrected, the mean's rounding (of 3000's size) shifts every xhat by
  // hundreds of the tolerance's ulps.
  for (bool prologue : {false, true}) {
    run_norm({K::kLayerNorm, DType::kFloat32, false, 9, 1031, true, true, prologue, prologue, false, 0.0,
              tempo::DropoutMode::kBits, 3000.0},
             gen);
    cases += 1;
  }
  EXPECT_GT(cases, 0);
}

// ---- the q/k/v split -----------------------------------------------------------------------

TEST(SimtCuda, QkvSplitMatchesTheCpuKernels) {
  std::mt19937 gen(15);
  for (DType t : kDTypes)
    // (head_dim 16 and 64: 8 elements a thread, 16-byte accesses; 1 and 7: one an element)
    for (auto shape : {std::vector<int64_t>{1, 1, 1, 1}, {2, 5, 3, 7}, {3, 17, 4, 16}, {2, 9, 2, 64}})
      for (bool bias : {false, true}) {
        tempo::QkvSplitForwardParams f;
        f.dtype = t;
        f.batch = shape[0];
        f.seq = shape[1];
        f.heads = shape[2];
        f.head_dim = shape[3];
        const int64_t n = f.numel(), M = f.cols(), tokens = f.batch * f.seq, each = n / 3;
        const std::string what = tag(t, n) + (bias ? " bias" : "");
        Buf z = randn(t, n, gen), bz = randn(t, M, gen);
        Buf qc = zeros(t, each), kc = zeros(t, each), vc = zeros(t, each);
        Buf qg = zeros(t, each), kg = zeros(t, each), vg = zeros(t, each);
        f.z = z.data();
        f.bias = bias ? bz.data() : nullptr;
        f.q = qc.data();
        f.k = kc.data();
        f.v = vc.data();
        ASSERT_TRUE(tempo::qkv_split_forward_cpu(f).ok()) << what;
        f.q = qg.data();
        f.k = kg.data();
        f.v = vg.data();
        ASSERT_EQ(simt_api::call("qkv_split_forward", &f), "") << what;
        expect_close(qc, qg, kExact, what + " q");
        expect_close(kc, kg, kExact, what + " k");
        expect_close(vc, vg, kExact, what + " v");

        tempo::QkvSplitBackwardParams b;
        static_cast<tempo::QkvSplitParams&>(b) = f;
        Buf dq = randn(t, each, gen), dk = randn(t, each, gen), dv = randn(t, each, gen);
        Buf dzc = zeros(t, n), dzg = zeros(t, n), dbc = zeros(t, M), dbg = zeros(t, M);
        Buf ws(t == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32, tempo::qkv_split_workspace_elems(tokens, M));
        b.grad_q = dq.data();
        b.grad_k = dk.data();
        b.grad_v = dv.data();
        b.grad_z = dzc.data();
        b.grad_bias = bias ? dbc.data() : nullptr;
        ASSERT_TRUE(tempo::qkv_split_backward_cpu(b).ok()) << what;
        b.grad_z = dzg.data();
        b.grad_bias = bias ? dbg.data() : nullptr;
        b.workspace = ws.data();
        ASSERT_EQ(simt_api::call("qkv_split_backward", &b), "") << what;
        expect_close(dzc, dzg, kExact, what + " grad z");
        if (bias) expect_close(dbc, dbg, column_sum(tokens), what + " grad bias");
      }
}

// ---- the rotary embedding ------------------------------------------------------------------

// Both directions, x read through a transposed layout or contiguous, tables per batch row or
// shared, in x's dtype or float32: the same fused multiply-adds on both sides, so bitwise equal
// (head_dim 16 and 64 with even eighths: 8 pairs a thread, 16-byte accesses; 10 and 6: one).
TEST(SimtCuda, RopeMatchesTheCpuKernels) {
  std::mt19937 gen(21);
  struct Shape {
    int64_t batch, heads, seq, head_dim, rotary_dim, table_batch;
    bool transposed;
  };
  const Shape shapes[] = {{1, 1, 1, 2, 2, 1, false},   {2, 3, 5, 10, 6, 2, true},  {2, 2, 7, 16, 16, 1, true},
                          {1, 4, 9, 64, 32, 1, false}, {3, 2, 4, 64, 64, 3, true}, {2, 1, 3, 8, 0, 1, false}};
  int cases = 0;
  for (DType t : kDTypes)
    for (const Shape& sh : shapes)
      for (bool f32_tables : {false, true}) {
        if (f32_tables && elem_size(t) != 2) continue;
        const DType tt = f32_tables ? DType::kFloat32 : t;
        tempo::RopeParams p;
        p.dtype = t;
        p.table_dtype = tt;
        p.batch = sh.batch, p.heads = sh.heads, p.seq = sh.seq, p.head_dim = sh.head_dim;
        p.rotary_dim = sh.rotary_dim, p.table_batch = sh.table_batch;
        const int64_t H = sh.heads, S = sh.seq, D = sh.head_dim, n = p.numel();
        p.x_stride_batch = H * S * D;
        p.x_stride_head = sh.transposed ? D : S * D;
        p.x_stride_seq = sh.transposed ? H * D : D;
        p.out_stride_batch = p.x_stride_batch, p.out_stride_head = p.x_stride_head, p.out_stride_seq = p.x_stride_seq;
        const std::string what = tag(t, n) + " D" + std::to_string(D) + " R" + std::to_string(sh.rotary_dim) +
                                 (sh.transposed ? " transposed" : "") + (f32_tables ? " f32 tables" : "");
        const int64_t tn = sh.table_batch * S * sh.rotary_dim;
        Buf x = randn(t, n, gen), cos = randn(tt, tn, gen), sin = randn(tt, tn, gen);
        p.x = x.data();
        p.cos = cos.data();
        p.sin = sin.data();
        for (bool backward : {false, true}) {
          Buf oc = zeros(t, n), og = zeros(t, n);
          p.out = oc.data();
          ASSERT_TRUE((backward ? tempo::rope_backward_cpu(p) : tempo::rope_forward_cpu(p)).ok()) << what;
          p.out = og.data();
          ASSERT_EQ(backward ? simt_api::call("rope_backward", &p) : simt_api::call("rope_forward", &p), "") << what;
          expect_close(oc, og, kExact, what + (backward ? " backward" : " forward"));
          ++cases;
        }
      }
  EXPECT_EQ(cases, 2 * 6 * 6);
}

// ---- the gated MLP's elementwise part ---------------------------------------------------------

// The CUDA kernels evaluate act(g) and act'(g) of 16/32-bit data in fp32 (gate_f32), the CPU's in
// double: gate_f32_ulps(g) units of fp32 apart (kGatedMlpCudaUlps, more in the tails), of h's and
// dup's magnitude and, for dgate, of |dh up| (|d1| + |d2|), the terms act' sums (it cancels near
// act's minimum). fp64: the same double code both sides (libm and contraction apart).
void run_gated_mlp(tempo::Activation act, DType t, int64_t rows, int64_t cols, bool fused, int shift,
                   std::mt19937& gen) {
  const std::string what = std::string(tempo::activation_name(act)) + " " + tag(t, rows * cols) + " cols " +
                           std::to_string(cols) + (fused ? " fused" : "") + " shift " + std::to_string(shift);
  const int64_t gs = fused ? 2 * cols : cols, n = rows * cols;
  Buf gate = randn(t, rows * gs, gen, 3.0, shift), up_own = randn(t, n, gen, 1.0, shift);
  const void* up = fused ? static_cast<char*>(gate.data()) + cols * elem_size(t) : up_own.data();
  Buf dh = randn(t, n, gen, 1.0, shift);
  // per element: the tolerance of h, dup (|value| terms) and dgate (|dh up| (|d1| + |d2|)), in the
  // layouts of the outputs (fused: gate and up columns of one [rows, 2 cols] buffer)
  std::vector<double> tol_h(n), tol_dg(rows * gs), tol_du(n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const double g = gate.get(r * gs + c);
      const double uv = fused ? gate.get(r * gs + cols + c) : up_own.get(r * cols + c);
      const double d = dh.get(r * cols + c);
      math::GateValue<double> v{};
      tempo::math::by_activation(act, [&](auto a) { v = math::gate_exact<decltype(a)::value>(g); });
      const bool f64 = t == DType::kFloat64;
      const double u = f64 ? kFp64Units * 0x1p-53 : math::gate_f32_ulps(act, g) * 0x1p-24;
      // a subnormal e^-|z| in fp32: an absolute error of |g| (times the tanh form's slope for d2)
      const double tiny = f64 ? 0 : math::kGateF32Tiny * std::fabs(g) * (2 + 3.2 * (1 + 0.134 * g * g));
      tol_h[r * cols + c] = u * std::fabs(v.f * uv) + tiny * std::fabs(uv);
      tol_dg[r * gs + c] = u * std::fabs(d * uv) * (std::fabs(v.d1) + std::fabs(v.d2)) + tiny * std::fabs(d * uv);
      (fused ? tol_dg[r * gs + cols + c] : tol_du[r * cols + c]) = u * std::fabs(d * v.f) + tiny * std::fabs(d);
    }
  auto tol = [](const std::vector<double>& extra) { return Tol{1, 0, false, &extra}; };

  Buf hc = zeros(t, n, shift), hg = zeros(t, n, shift);
  tempo::GatedMlpForwardParams f;
  f.act = act;
  f.dtype = t;
  f.gate = gate.data();
  f.up = up;
  f.rows = rows;
  f.cols = cols;
  f.gate_stride = f.up_stride = gs;
  f.h = hc.data();
  ASSERT_TRUE(tempo::gated_mlp_forward_cpu(f).ok()) << what;
  f.h = hg.data();
  ASSERT_EQ(simt_api::call("gated_mlp_forward", &f), "") << what;
  expect_close(hc, hg, tol(tol_h), what + " h");

  Buf dgc = zeros(t, rows * gs, shift), dgg = zeros(t, rows * gs, shift);
  Buf duc = zeros(t, n, shift), dug = zeros(t, n, shift), hbc = zeros(t, n, shift), hbg = zeros(t, n, shift);
  tempo::GatedMlpBackwardParams b;
  b.act = act;
  b.dtype = t;
  b.gate = gate.data();
  b.up = up;
  b.rows = rows;
  b.cols = cols;
  b.gate_stride = b.up_stride = gs;
  b.grad_h = dh.data();
  b.grad_gate_stride = gs;
  b.grad_up_stride = fused ? gs : cols;
  auto run = [&](Buf& dg, Buf& du, Buf& h, bool cuda) {
    b.grad_gate = dg.data();
    b.grad_up = fused ? static_cast<char*>(dg.data()) + cols * elem_size(t) : du.data();
    b.h = h.data();
    if (cuda)
      ASSERT_EQ(simt_api::call("gated_mlp_backward", &b), "") << what;
    else
      ASSERT_TRUE(tempo::gated_mlp_backward_cpu(b).ok()) << what;
  };
  run(dgc, duc, hbc, false);
  run(dgg, dug, hbg, true);
  expect_close(dgc, dgg, tol(tol_dg), what + " grad gate" + (fused ? " and up" : ""));
  if (!fused) expect_close(duc, dug, tol(tol_du), what + " grad up");
  expect_close(hbc, hbg, tol(tol_h), what + " h again");
  expect_close(hc, hbc, kExact, what + " the CPU backward's h is its forward's");
}

TEST(SimtCuda, GatedMlpMatchesTheCpuKernels) {
  std::mt19937 gen(31);
  for (DType t : kDTypes)
    for (auto act : {tempo::Activation::kSilu, tempo::Activation::kGeluErf, tempo::Activation::kGeluTanh})
      // cols 8 and 64: 16-byte accesses (shift 0); 1 and 13: the element loop; 3 rows x 200: several per block
      for (auto rc : {std::pair<int64_t, int64_t>{1, 1}, {5, 13}, {4, 8}, {3, 200}, {7, 64}})
        for (bool fused : {false, true})
          for (int shift : {0, 1}) run_gated_mlp(act, t, rc.first, rc.second, fused, shift, gen);
}

// ---- the attention softmax -------------------------------------------------------------------

struct SoftmaxShape {
  int64_t batch, heads, rows, cols, row_offset, seq_q;
};

// One softmax case (forward and backward) against the CPU kernel. mask_kind: 0 none, 1 a
// key-padding mask [batch, 1, 1, cols] with one batch's every key masked, 2 a full additive mask, 3 a
// key-padding mask read with a stride of 2.
void run_softmax(DType t, SoftmaxShape sh, bool causal, int mask_kind, double p, tempo::DropoutMode mode,
                 std::mt19937& gen) {
  tempo::AttentionSoftmaxForwardParams f;
  f.dtype = t;
  f.batch = sh.batch;
  f.heads = sh.heads;
  f.rows = sh.rows;
  f.cols = sh.cols;
  f.row_offset = sh.row_offset;
  f.seq_q = sh.seq_q;
  f.scale = 0.37;
  f.causal = causal;
  f.p = p;
  f.mode = mode;
  f.rng.seed = 8;
  f.rng.offset = 9;
  const int64_t n = f.rows_total() * f.cols, seq = f.seq();
  const std::string what = tag(t, n) + (causal ? " causal" : "") + " mask " + std::to_string(mask_kind) + " p " +
                           std::to_string(p) + (mode == tempo::DropoutMode::kBits ? " bits" : " philox") + " offset " +
                           std::to_string(sh.row_offset);
  // Masks: 1 a key-padding mask [batch, 1, 1, cols] broadcast over heads and rows, with
  // one batch's every key masked (rows of P = 0); 2 a full [batch, heads, seq, cols] mask.
  std::vector<float> mask;
  if (mask_kind == 1) {
    mask.assign(sh.batch * sh.cols, 0.0f);
    for (int64_t j = 0; j < sh.cols; ++j) {
      mask[j] = -INFINITY;
      if (sh.batch > 1 && j % 3 == 0) mask[sh.cols + j] = -1e4f;
    }
    f.attn_mask = mask.data();
    f.mask_stride[0] = sh.cols;
    f.mask_stride[3] = 1;
  } else if (mask_kind == 3) {  // a key-padding mask read with a stride (every other float): scalar mask loads
    mask.assign(sh.batch * 2 * sh.cols, 0.0f);
    for (int64_t j = 0; j < 2 * sh.cols; j += 2) mask[j] = j % 6 == 0 ? -1e4f : 0.5f;
    f.attn_mask = mask.data();
    f.mask_stride[0] = 2 * sh.cols;
    f.mask_stride[3] = 2;
  } else if (mask_kind == 2) {
    mask.resize(sh.batch * sh.heads * seq * sh.cols);
    std::normal_distribution<float> nd;
    for (auto& v : mask) v = nd(gen);
    f.attn_mask = mask.data();
    f.mask_stride[0] = sh.heads * seq * sh.cols;
    f.mask_stride[1] = seq * sh.cols;
    f.mask_stride[2] = sh.cols;
    f.mask_stride[3] = 1;
  }
  Buf s0 = randn(t, n, gen, 3.0);
  Buf pc = s0, pg = s0, dc = zeros(t, n), dg = zeros(t, n);
  std::vector<uint8_t> bc(tempo::bit_mask_bytes(n)), bg(bc.size(), 0x33);
  const bool bits = p > 0 && mode == tempo::DropoutMode::kBits;
  f.scores = pc.data();
  f.dropped = p > 0 ? dc.data() : nullptr;
  f.mask_bits = bits ? bc.data() : nullptr;
  tempo::Status s = tempo::attention_softmax_forward_cpu(f);
  ASSERT_TRUE(s.ok()) << what << ": " << s.message();
  f.scores = pg.data();
  f.dropped = p > 0 ? dg.data() : nullptr;
  f.mask_bits = bits ? bg.data() : nullptr;
  ASSERT_EQ(simt_api::call("attention_softmax_forward", &f), "") << what;
  expect_close(pc, pg, reduction(), what + " P");
  if (p > 0) expect_close(dc, dg, reduction(), what + " dropped P");
  if (bits) expect_same_bytes(bc, bg, what + " bits");

  tempo::AttentionSoftmaxBackwardParams b;
  static_cast<tempo::AttentionSoftmaxParams&>(b) = f;
  Buf g0 = randn(t, n, gen), gc = g0, gg = g0;
  b.probs = pc.data();
  b.mask_bits = bits ? bc.data() : nullptr;
  b.grad = gc.data();
  s = tempo::attention_softmax_backward_cpu(b);
  ASSERT_TRUE(s.ok()) << what << ": " << s.message();
  b.grad = gg.data();
  ASSERT_EQ(simt_api::call("attention_softmax_backward", &b), "") << what;
  expect_close(gc, gg, reduction(1.0), what + " grad");
}

// A block of query rows draws its bits (philox mode): the core refuses bits there.
bool softmax_case_valid(SoftmaxShape sh, double p, tempo::DropoutMode mode) {
  const bool block = sh.row_offset != 0 || (sh.seq_q != 0 && sh.seq_q != sh.rows);
  return block ? mode == tempo::DropoutMode::kPhilox : !(p == 0.0 && mode == tempo::DropoutMode::kPhilox);
}

// The fast kernels (rows in registers, 16-byte accesses: widths a multiple of 8 up to 8192):
// a warp a row with 1, 2 and 4 packs a lane (up to 1024 columns, 8 rows a block, a partial last
// block), the block a row with 1, 2 and 4 packs a thread, the lanes past the row's packs idle,
// strided (scalar) mask loads, blocks of query rows.
TEST(SimtCuda, AttentionSoftmaxRowKernelsMatchTheCpuKernels) {
  std::mt19937 gen(17);
  using Shape = SoftmaxShape;
  for (DType t : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
    for (Shape sh : {Shape{1, 3, 3, 64, 0, 0}, Shape{2, 1, 5, 256, 0, 0}, Shape{1, 1, 3, 520, 0, 0},
                     Shape{1, 2, 2, 1024, 0, 0}, Shape{1, 1, 2, 2048, 0, 0}, Shape{1, 1, 1, 4104, 0, 0},
                     Shape{1, 1, 1, 8192, 0, 0}, Shape{1, 2, 3, 72, 5, 16}})
      for (bool causal : {false, true})
        for (int mask_kind : {0, 1, 2, 3})
          for (double p : {0.0, 0.2})
            for (auto mode : {tempo::DropoutMode::kBits, tempo::DropoutMode::kPhilox}) {
              if (!softmax_case_valid(sh, p, mode)) continue;
              if (sh.cols >= 2048 && (mask_kind == 2 || causal != (mask_kind == 1))) continue;  // emulator time
              run_softmax(t, sh, causal, mask_kind, p, mode, gen);
              if (HasFailure()) return;
            }
}

TEST(SimtCuda, AttentionSoftmaxMatchesTheCpuKernels) {
  std::mt19937 gen(16);
  using Shape = SoftmaxShape;
  for (DType t : kDTypes)
    for (Shape sh : {Shape{1, 1, 1, 1, 0, 0}, Shape{2, 3, 7, 7, 0, 0}, Shape{1, 2, 5, 300, 0, 0},
                     Shape{2, 2, 3, 11, 4, 11}, Shape{1, 1, 2, 600, 0, 0}})
      for (bool causal : {false, true})
        for (int mask_kind : {0, 1, 2})
          for (double p : {0.0, 0.2})
            for (auto mode : {tempo::DropoutMode::kBits, tempo::DropoutMode::kPhilox}) {
              if (!softmax_case_valid(sh, p, mode)) continue;
              run_softmax(t, sh, causal, mask_kind, p, mode, gen);
              if (HasFailure()) return;
            }
}

// ---- linear_cross_entropy's row passes ---------------------------------------------------------

// One case (forward, then the backward from the CPU forward's lse) against the CPU kernels: rows
// with ignored, out-of-range (clamped) and ordinary labels, a row holding a NaN, a row of -inf, a
// masked row (a finite loss without smoothing), label smoothing; shift 1 misaligns the logits (the scalar path).
void run_lce(DType t, int64_t rows, int64_t V, double smoothing, int shift, std::mt19937& gen) {
  const DType acc = t == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  const std::string what = tag(t, rows * V) + " V " + std::to_string(V) + " smoothing " + std::to_string(smoothing) +
                           (shift ? " unaligned" : "");
  Buf z = randn(t, rows * V, gen, 3.0, shift);
  std::vector<int64_t> labels(rows);
  std::uniform_int_distribution<int64_t> pick(0, V - 1);
  for (int64_t r = 0; r < rows; ++r) labels[r] = r % 5 == 1 ? -100 : r % 7 == 3 ? V + 5 : pick(gen);
  if (rows > 2) z.set(2 * V + V / 2, NAN);  // row 2: NaN loss and lse
  if (rows > 3)
    for (int64_t j = 0; j < V; ++j) z.set(3 * V + j, -INFINITY);  // row 3: every logit -inf
  if (rows > 4) {  // row 4: a masked vocabulary (every odd logit -inf), its label on a finite one
    for (int64_t j = 1; j < V; j += 2) z.set(4 * V + j, -INFINITY);
    labels[4] = 0;
  }
  tempo::LinearCrossEntropyForwardParams f;
  f.dtype = t;
  f.rows = rows;
  f.vocab = V;
  f.labels = labels.data();
  f.smoothing = smoothing;
  f.logits = z.data();
  Buf lc = zeros(acc, rows), lg = zeros(acc, rows), oc = zeros(acc, rows), og = zeros(acc, rows);
  f.lse = lc.data();
  f.loss = oc.data();
  tempo::Status s = tempo::linear_cross_entropy_forward_cpu(f);
  ASSERT_TRUE(s.ok()) << what << ": " << s.message();
  f.lse = lg.data();
  f.loss = og.data();
  ASSERT_EQ(simt_api::call("linear_cross_entropy_forward", &f), "") << what;
  // fp64: the CPU adds V terms in one running sum, the CUDA kernel in 512 partial ones
  const Tol sums = t == DType::kFloat64 ? reduction(static_cast<double>(V)) : reduction();
  expect_close(lc, lg, sums, what + " lse");
  expect_close(oc, og, sums, what + " loss");

  tempo::LinearCrossEntropyBackwardParams b;
  static_cast<tempo::LinearCrossEntropyParams&>(b) = f;
  Buf scale = randn(acc, rows, gen);
  for (int64_t r = 0; r < rows; ++r)
    if (labels[r] == -100) scale.set(r, 0.0);
  Buf gc = z, gg = z;
  b.lse = lc.data();
  b.scale = scale.data();
  b.logits = gc.data();
  s = tempo::linear_cross_entropy_backward_cpu(b);
  ASSERT_TRUE(s.ok()) << what << ": " << s.message();
  b.logits = gg.data();
  ASSERT_EQ(simt_api::call("linear_cross_entropy_backward", &b), "") << what;
  expect_close(gc, gg, elementwise(4), what + " grad logits");
}

TEST(SimtCuda, LinearCrossEntropyMatchesTheCpuKernels) {
  std::mt19937 gen(23);
  const int64_t shapes[][2] = {{1, 1}, {3, 7}, {4, 64}, {6, 1000}, {3, 50257}, {2, 8200}, {9, 24}};
  for (DType t : kDTypes)
    for (const auto& sh : shapes)
      for (double smoothing : {0.0, 0.1})
        for (int shift : {0, 1}) {
          if (shift && sh[1] % 8 != 0) continue;  // already the scalar path
          run_lce(t, sh[0], sh[1], smoothing, shift, gen);
          if (HasFailure()) return;
        }
}

// ---- causal linear attention (SLiM) ----------------------------------------------------------

// One linear attention case (forward and backward, with or without carried states) against the CPU kernel.
void run_linear_attention(DType t, int64_t R, int64_t L, int64_t m, int64_t d, bool state_in, std::mt19937& gen) {
  const DType st = tempo::linear_attention_state_dtype(t);
  const std::string what =
      tag(t, R * L * m) + " m " + std::to_string(m) + " d " + std::to_string(d) + (state_in ? " with a state in" : "");
  auto positive = [&](int64_t n) {  // feature-mapped queries and keys are non-negative
    Buf b(t, n);
    std::uniform_real_distribution<double> u(0.05, 1.5);
    for (int64_t i = 0; i < n; ++i) b.set(i, u(gen));
    return b;
  };
  Buf q = positive(R * L * m), k = positive(R * L * m), v = randn(t, R * L * d, gen);
  Buf num(st, R * m * d), den(st, R * m);
  std::uniform_real_distribution<double> u(0.1, 2.0);
  for (int64_t i = 0; i < num.n; ++i) num.set(i, u(gen) - 0.5);
  for (int64_t i = 0; i < den.n; ++i) den.set(i, u(gen));
  Buf yc = zeros(t, R * L * d), yg = zeros(t, R * L * d);
  Buf nc = zeros(st, R * m * d), ng = zeros(st, R * m * d), dnc = zeros(st, R * m), dng = zeros(st, R * m);
  Buf ws(DType::kFloat64, tempo::linear_attention_workspace_bytes(R, m, d, true) / 8);
  tempo::LinearAttentionForwardParams f;
  f.dtype = t;
  f.q = q.data();
  f.k = k.data();
  f.v = v.data();
  f.num_in = state_in ? num.data() : nullptr;
  f.den_in = state_in ? den.data() : nullptr;
  f.rows = R;
  f.len = L;
  f.m = m;
  f.d = d;
  f.y = yc.data();
  f.num_out = nc.data();
  f.den_out = dnc.data();
  tempo::Status s = tempo::linear_attention_forward_cpu(f);
  ASSERT_TRUE(s.ok()) << what << ": " << s.message();
  f.y = yg.data();
  f.num_out = ng.data();
  f.den_out = dng.data();
  f.workspace = ws.data();
  ASSERT_EQ(simt_api::call("linear_attention_forward", &f), "") << what;
  // fp64 data: the states are sums over L positions of O(1) terms, rebuilt in the backward by
  // subtraction from the total, then contracted over m or d (every side in double): 64 u of
  // L max(m, d). Other dtypes: the double sums are far below the output's own rounding.
  const Tol la = t == DType::kFloat64 ? column_sum(L * std::max(m, d)) : reduction(1.0);
  expect_close(yc, yg, reduction(), what + " y");
  expect_close(nc, ng, reduction(), what + " state out (num)");
  expect_close(dnc, dng, reduction(), what + " state out (den)");

  tempo::LinearAttentionBackwardParams b;
  static_cast<tempo::LinearAttentionInputs&>(b) = f;
  b.workspace = nullptr;
  Buf gy = randn(t, R * L * d, gen), gnum = randn(st, R * m * d, gen, 0.1), gden = randn(st, R * m, gen, 0.1);
  Buf gqc = zeros(t, R * L * m), gqg = zeros(t, R * L * m), gkc = zeros(t, R * L * m), gkg = zeros(t, R * L * m);
  Buf gvc = zeros(t, R * L * d), gvg = zeros(t, R * L * d);
  Buf gnc = zeros(st, R * m * d), gng = zeros(st, R * m * d), gdc = zeros(st, R * m), gdg = zeros(st, R * m);
  b.grad_y = gy.data();
  b.grad_num_out = state_in ? gnum.data() : nullptr;
  b.grad_den_out = state_in ? gden.data() : nullptr;
  auto outputs = [&](Buf& gq, Buf& gk, Buf& gv, Buf& gn, Buf& gd) {
    b.grad_q = gq.data();
    b.grad_k = gk.data();
    b.grad_v = gv.data();
    b.grad_num_in = gn.data();
    b.grad_den_in = gd.data();
  };
  outputs(gqc, gkc, gvc, gnc, gdc);
  s = tempo::linear_attention_backward_cpu(b);
  ASSERT_TRUE(s.ok()) << what << ": " << s.message();
  outputs(gqg, gkg, gvg, gng, gdg);
  b.workspace = ws.data();
  ASSERT_EQ(simt_api::call("linear_attention_backward", &b), "") << what;
  expect_close(gqc, gqg, la, what + " grad q");
  expect_close(gkc, gkg, la, what + " grad k");
  expect_close(gvc, gvg, la, what + " grad v");
  expect_close(gnc, gng, la, what + " grad num in");
  expect_close(gdc, gdg, la, what + " grad den in");
}

TEST(SimtCuda, LinearAttentionMatchesTheCpuKernels) {
  std::mt19937 gen(17);
  for (DType t : kDTypes)
    for (auto shape : {std::vector<int64_t>{1, 1, 1, 1}, {3, 9, 4, 5}, {2, 33, 16, 8}, {1, 5, 40, 130}})
      for (bool state_in : {false, true}) {
        run_linear_attention(t, shape[0], shape[1], shape[2], shape[3], state_in, gen);
        if (HasFailure()) return;
      }
}

// Seeded random cases over every kernel family, sizes drawn around the boundaries of a warp (32),
// a block (128, 256 threads), a mask byte (8) and the row groups, so that partial warps,
// partial blocks and grid-stride remainders all occur. A failure names its case and the seed.
int64_t boundary_size(std::mt19937& gen, int64_t cap) {
  static const int64_t kEdges[] = {1, 2, 7, 8, 9, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 513};
  std::uniform_int_distribution<int> pick(0, 3);
  int64_t v;
  if (pick(gen) == 0) {
    v = std::uniform_int_distribution<int64_t>(1, cap)(gen);
  } else {
    v = kEdges[std::uniform_int_distribution<size_t>(0, std::size(kEdges) - 1)(gen)];
  }
  return std::min(v, cap);
}

TEST(SimtCuda, RandomBoundarySizesMatchTheCpuKernels) {
  // SIMT_SEED=N explores other cases (the failure names the seed to repeat).
  const char* env_seed = std::getenv("SIMT_SEED");
  const unsigned seed = env_seed ? static_cast<unsigned>(std::strtoul(env_seed, nullptr, 10)) : 20261203u;
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> coin(0, 1), dt(0, 3);
  const tempo::Activation acts[] = {tempo::Activation::kGeluErf, tempo::Activation::kGeluTanh,
                                    tempo::Activation::kSilu};
  for (int c = 0; c < 60; ++c) {
    SCOPED_TRACE("case " + std::to_string(c) + " of seed " + std::to_string(seed));
    const DType t = kDTypes[dt(gen)];
    // an activation over rows x cols with a bias of cols
    const int64_t cols = boundary_size(gen, 600), rows = boundary_size(gen, 40);
    run_activation(acts[c % 3], t, rows * cols, coin(gen) ? cols : 0, coin(gen), gen);
    // a norm
    const bool fp = (t == DType::kBFloat16 || t == DType::kFloat16) && coin(gen);
    const bool ln = coin(gen), prologue = ln && coin(gen);
    run_norm({ln ? tempo::NormKind::kLayerNorm : tempo::NormKind::kRmsNorm, t, fp, boundary_size(gen, 40),
              boundary_size(gen, 600), coin(gen) == 1, ln && coin(gen), prologue, prologue && coin(gen), false,
              prologue && coin(gen) ? 0.25 : 0.0, coin(gen) ? tempo::DropoutMode::kBits : tempo::DropoutMode::kPhilox},
             gen);
    // a softmax, sometimes a block of query rows
    SoftmaxShape sh{boundary_size(gen, 2), boundary_size(gen, 3), boundary_size(gen, 9), boundary_size(gen, 600), 0, 0};
    if (coin(gen)) {
      sh.seq_q = sh.rows + boundary_size(gen, 9);
      sh.row_offset = std::uniform_int_distribution<int64_t>(0, sh.seq_q - sh.rows)(gen);
    }
    const double p = coin(gen) ? 0.3 : 0.0;
    const auto mode = coin(gen) ? tempo::DropoutMode::kBits : tempo::DropoutMode::kPhilox;
    if (softmax_case_valid(sh, p, mode)) run_softmax(t, sh, coin(gen), dt(gen) % 3, p, mode, gen);
    // a linear attention chunk
    run_linear_attention(t, boundary_size(gen, 3), boundary_size(gen, 40), boundary_size(gen, 64),
                         boundary_size(gen, 140), coin(gen), gen);
    if (HasFailure()) return;
  }
}

// The CUDA entry points refuse what the CPU ones refuse, with the same message (they share the
// core's validation), and what only they need: a workspace.
TEST(SimtCuda, RefusalsMatchTheCpuEntryPointsAndNameTheWorkspace) {
  std::vector<float> buf(64, 1.0f);
  std::vector<uint8_t> bits(8);
  tempo::ActivationForwardParams f;
  f.x = buf.data();
  f.y = buf.data();
  f.mask = bits.data();
  f.numel = -1;
  const tempo::Status cpu = tempo::activation_forward_cpu(f);
  ASSERT_FALSE(cpu.ok());
  EXPECT_EQ(simt_api::call("activation_forward", &f), cpu.message());

  tempo::ActivationBackwardParams b;
  b.y = buf.data();
  b.mask = bits.data();
  b.grad_y = buf.data();
  b.grad_x = buf.data();
  b.numel = 64;
  b.grad_bias = buf.data();
  b.bias_size = 8;
  EXPECT_NE(simt_api::call("activation_backward", &b).find("needs its workspace"), std::string::npos);

  tempo::NormBackwardParams nb;
  nb.grad_y = nb.y = buf.data();
  std::vector<float> rstd(8, 1.0f);
  nb.rstd = rstd.data();
  nb.grad_x = buf.data();
  nb.rows = 8;
  nb.cols = 8;
  EXPECT_NE(simt_api::call("norm_backward", &nb).find("needs its workspace"), std::string::npos);

  tempo::QkvSplitBackwardParams qb;
  qb.batch = qb.seq = qb.heads = 1;
  qb.head_dim = 4;
  qb.grad_q = qb.grad_k = qb.grad_v = buf.data();
  qb.grad_z = buf.data();
  qb.grad_bias = buf.data();
  EXPECT_NE(simt_api::call("qkv_split_backward", &qb).find("needs its workspace"), std::string::npos);

  tempo::LinearAttentionForwardParams lf;
  lf.q = lf.k = lf.v = buf.data();
  lf.y = lf.num_out = lf.den_out = buf.data();
  lf.rows = lf.len = lf.m = lf.d = 1;
  EXPECT_NE(simt_api::call("linear_attention_forward", &lf).find("needs its workspace"), std::string::npos);
  tempo::LinearAttentionBackwardParams lb;
  static_cast<tempo::LinearAttentionInputs&>(lb) = lf;
  lb.grad_y = buf.data();
  lb.grad_q = lb.grad_k = lb.grad_v = lb.grad_num_in = lb.grad_den_in = buf.data();
  EXPECT_NE(simt_api::call("linear_attention_backward", &lb).find("needs its workspace"), std::string::npos);
}

// The emulator ran the kernels as blocks of threads that met at barriers and shuffles (the
// counters say the block reductions were exercised, not bypassed), and refuses what a GPU refuses.
TEST(SimtCuda, TheEmulatorRanBlocksBarriersAndShuffles) {
  std::mt19937 gen(18);
  const auto before = simt_api::counters();
  run_norm({tempo::NormKind::kLayerNorm, DType::kFloat32, false, 4, 300, true, true, false, false, false, 0.0,
            tempo::DropoutMode::kBits},
           gen);
  const auto after = simt_api::counters();
  EXPECT_GE(after.blocks - before.blocks, 4u);
  EXPECT_GT(after.barriers, before.barriers);
  EXPECT_GT(after.shuffles, before.shuffles);
  // Shared memory past the 48 KiB a launch may take without opting in: the core refuses first.
  tempo::LinearAttentionForwardParams f;
  std::vector<float> buf(16);
  f.q = f.k = f.v = buf.data();
  f.y = buf.data();
  std::vector<float> state(4);
  f.num_out = state.data();
  f.den_out = state.data();
  f.rows = 1;
  f.len = 1;
  f.m = 4096;
  f.d = 1;
  f.workspace = buf.data();
  EXPECT_NE(simt_api::call("linear_attention_forward", &f).find("shared memory"), std::string::npos);
}

}  // namespace
