// Internal to the torch layer: argument checks and glue shared by every op's kernel.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "tempo/common.h"
#include "tempo/dropout.h"

namespace tempo::torch_impl {

// x is defined and float32, float64, bfloat16 or float16; errors name op and argument.
void check_floating(const at::Tensor& t, const char* op, const char* arg);
// t is on a CPU, CUDA or Meta device.
void check_device(const at::Tensor& t, const char* op, const char* arg);
// t has x's dtype and device.
void check_like(const at::Tensor& t, const at::Tensor& x, const char* op, const char* arg);
// The current CUDA stream of t's device (a cudaStream_t), or null for other devices.
void* stream_of(const at::Tensor& t);
void raise_if_error(const Status& s, const char* op);

// Dropout probability in [0, 1], else an error naming op and argument.
void check_probability(double p, const char* op, const char* arg);
DropoutMode dropout_mode(c10::string_view mode, const char* op);

// A fresh Philox state {seed, offset} as an int64 tensor of shape [2] on like's device,
// seeded from the default CPU generator (so torch.manual_seed fixes it, and CPU and CUDA
// tensors draw the same masks). On Meta it is only allocated.
at::Tensor draw_philox_state(const at::Tensor& like);
// The core's view of such a tensor: values read on the host for CPU, a device pointer for CUDA.
PhiloxState philox_state_of(const at::Tensor& state, const char* op);

// The typed dispatcher handle of a tempo op, for the C++ API (so autograd and every
// backend apply exactly as from Python).
template <typename Sig>
c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace tempo::torch_impl
