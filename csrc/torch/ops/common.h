// Internal to the torch layer: argument checks and glue shared by every op's kernel.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "tempo/common.h"
#include "tempo/dropout.h"

namespace tempo::torch_impl {

// The tensor an optional argument holds, or nullptr (absent or undefined).
inline const at::Tensor* get(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? &*t : nullptr;
}

// x is defined and float32, float64, bfloat16 or float16; errors name op and argument.
void check_floating(const at::Tensor& t, const char* op, const char* arg);
// t is on a CPU, CUDA or Meta device.
void check_device(const at::Tensor& t, const char* op, const char* arg);
// t has x's dtype and device.
void check_like(const at::Tensor& t, const at::Tensor& x, const char* op, const char* arg);
// The current CUDA stream of t's device (a cudaStream_t), or null for other devices.
void* stream_of(const at::Tensor& t);
// Whether t is a CUDA tensor whose current stream is being captured into a CUDA graph: no
// host read of device memory and no seed drawn on the host, since replays would share it.
bool capturing(const at::Tensor& t);
void raise_if_error(const Status& s, const char* op);

// Dropout probability in [0, 1], else an error naming op and argument.
void check_probability(double p, const char* op, const char* arg);
DropoutMode dropout_mode(c10::string_view mode, const char* op);

// What a dropout forward keeps for its backward ("keep"): the packed keep bits (bits mode,
// ceil(numel / 8) uint8), the int64 Philox state {seed, offset} on x's device (philox
// mode), or nothing (p = 0: an empty uint8 tensor). The seed is drawn from the default CPU
// generator, so torch.manual_seed fixes the masks and CPU and CUDA tensors draw the same
// ones; except in a CUDA graph being captured, where `rng` points to the CUDA generator's
// state in device memory, read at each replay (a drawn seed would be frozen into the graph).
// `rng` has the drawn values on the host, `mask` points into the bits (null on Meta).
struct DropoutKeep {
  at::Tensor keep;
  PhiloxState rng;
  uint8_t* mask = nullptr;
};
DropoutKeep new_dropout_keep(const at::Tensor& x, double p, DropoutMode mode);
// The backward's view of `keep` for a tensor like `like`: checks it, sets the mask or rng.
void read_dropout_keep(const at::Tensor& keep, const at::Tensor& like, double p, DropoutMode mode, const char* op,
                       const uint8_t** mask, PhiloxState* rng);

// The typed dispatcher handle of a tempo op, for the C++ API (so autograd and every
// backend apply exactly as from Python).
template <typename Sig>
c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The handle of the op whose C++ API function is Fn, typed by Fn's own signature (when the
// function and the schema take the same arguments), found once.
template <typename F>
struct signature_of;
template <typename R, typename... A>
struct signature_of<R (*)(A...)> {
  using type = R(A...);
};
template <auto Fn>
const c10::TypedOperatorHandle<typename signature_of<decltype(Fn)>::type>& op_for(const char* name) {
  static const auto handle = op_handle<typename signature_of<decltype(Fn)>::type>(name);
  return handle;
}

// tempo.plan (csrc/torch/memory/plan.cpp) runs the kernels on meta tensors of concrete sizes:
// there they make every allocation the real kernel makes, in the same order, and skip the
// core's work. With symbolic sizes (torch.compile's tracing) they make their outputs alone.
bool shapes_only(const at::Tensor& t);  // a meta tensor with a symbolic size, or outside a plan
// A CUDA tensor, or a meta one while tempo.plan plans for CUDA: where a kernel allocates
// differently on CUDA (workspaces, chunk sizes), it decides by this.
bool on_cuda(const at::Tensor& t);

// GEMMs into a tensor that exists (out = x w^T + b; acc = a b or acc += a b, batched): on meta
// tensors (tempo.plan) the meta kernels of these out= and in-place forms make a temporary the
// real kernels do not, so there the GEMM is not run: its FLOPs are noted instead.
void linear_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b);
// at::linear(x, w, b) of 2-D x: on meta tensors (tempo.plan) with a bias, as one product (the meta
// kernel of addmm makes two temporaries the real one does not; the bias' addition is no GEMM).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b);
void bmm_into(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool accumulate);

// A kernel's loop over blocks of equal size (the last may be shorter), counted by tempo.plan on
// meta tensors: blocks 2 to count - 2 make the allocations block 1 makes, in the same order, so
// they are not run there; block 1's FLOPs are noted for each. `if (blocks.skip(b)) continue;`
// begins block b's body and `blocks.done(b)` ends it.
class PlannedBlocks {
 public:
  PlannedBlocks(const at::Tensor& on, int64_t count);
  bool skip(int64_t b);
  void done(int64_t b);

 private:
  bool meta_;
  int64_t count_;
  double start_ = 0, block_ = 0;
};
inline int64_t blocks_of(int64_t n, int64_t size) { return size > 0 ? (n + size - 1) / size : 0; }

// acc += a b (2-D matmul) into an accumulator of the math type (float32 for 16-bit data,
// `low`): on CUDA one 16-bit GEMM (tensor cores) with its float32 accumulation written into the
// float32 sum (addmm's out_dtype, torch >= 2.9), rather than a float32 GEMM of float32 copies;
// where that is refused, and on the CPU, float32 copies.
void add_matmul(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool low);

// Runs the core kernel for the device of `on`: cpu(params), or cuda(params, its stream);
// an error from the core is raised naming op.
template <typename P>
void run_core(const at::Tensor& on, const P& params, Status (*cpu)(const P&), Status (*cuda)(const P&, void*),
              const char* op) {
  if (on.is_meta()) return;  // tempo.plan's count: the allocations were the point
  raise_if_error(on.is_cuda() ? cuda(params, stream_of(on)) : cpu(params), op);
}

}  // namespace tempo::torch_impl
