#include "common.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <mutex>

#include "dtype.h"

namespace tempo::torch_impl {

void check_floating(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.defined(), op, ": argument '", arg, "' is undefined");
  TORCH_CHECK(supported_dtype(t.scalar_type()), op, ": argument '", arg,
              "' must be float32, float64, bfloat16 or float16, got ", t.scalar_type());
}

void check_device(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.is_cpu() || t.is_cuda() || t.is_meta(), op, ": argument '", arg,
              "' must be on a CPU or CUDA device, got ", t.device());
}

void check_like(const at::Tensor& t, const at::Tensor& x, const char* op, const char* arg) {
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": argument '", arg, "' must have the dtype of x (",
              x.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.device() == x.device(), op, ": argument '", arg, "' must be on the device of x (", x.device(),
              "), got ", t.device());
}

void* stream_of(const at::Tensor& t) {
  if (!t.is_cuda()) return nullptr;
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return impl.getStream(t.device()).native_handle();
}

void raise_if_error(const Status& s, const char* op) { TORCH_CHECK(s.ok(), op, ": ", s.message()); }

void check_probability(double p, const char* op, const char* arg) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, op, ": argument '", arg, "' must be a probability in [0, 1], got ", p);
}

DropoutMode dropout_mode(c10::string_view mode, const char* op) {
  if (mode == "bits") return DropoutMode::kBits;
  if (mode == "philox") return DropoutMode::kPhilox;
  TORCH_CHECK(false, op, ": argument 'mode' must be 'bits' or 'philox', got '", std::string(mode), "'");
}

at::Tensor draw_philox_state(const at::Tensor& like) {
  const auto opts = like.options().dtype(at::kLong);
  if (like.is_meta()) return at::empty({2}, opts);
  uint64_t seed;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    seed = gen.get<at::CPUGeneratorImpl>()->random64();
  }
  at::Tensor state = at::empty({2}, opts.device(at::kCPU));
  state.mutable_data_ptr<int64_t>()[0] = static_cast<int64_t>(seed);
  state.mutable_data_ptr<int64_t>()[1] = 0;
  return like.is_cpu() ? state : state.to(like.device());
}

PhiloxState philox_state_of(const at::Tensor& state, const char* op) {
  TORCH_CHECK(state.scalar_type() == at::kLong && state.numel() == 2, op,
              ": argument 'seed' must be an int64 tensor of 2 elements (seed, offset), got ", state.scalar_type(),
              " of shape ", state.sizes());
  PhiloxState s;
  if (state.is_meta()) return s;
  const at::Tensor c = state.contiguous();
  if (c.is_cuda()) {
    s.device = reinterpret_cast<const uint64_t*>(c.const_data_ptr<int64_t>());
  } else {
    s.seed = static_cast<uint64_t>(c.const_data_ptr<int64_t>()[0]);
    s.offset = static_cast<uint64_t>(c.const_data_ptr<int64_t>()[1]);
  }
  return s;
}

}  // namespace tempo::torch_impl
