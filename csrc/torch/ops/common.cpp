#include "common.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <torch/version.h>

#include <atomic>
#include <mutex>

#if TEMPO_TORCH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include "dtype.h"
#include "tempo/memory.h"

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

bool capturing(const at::Tensor& t) { return t.is_cuda() && cuda_stream_capturing(stream_of(t)); }

void raise_if_error(const Status& s, const char* op) { TORCH_CHECK(s.ok(), op, ": ", s.message()); }

void check_probability(double p, const char* op, const char* arg) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, op, ": argument '", arg, "' must be a probability in [0, 1], got ", p);
}

DropoutMode dropout_mode(c10::string_view mode, const char* op) {
  if (mode == "bits") return DropoutMode::kBits;
  if (mode == "philox") return DropoutMode::kPhilox;
  TORCH_CHECK(false, op, ": argument 'mode' must be 'bits' or 'philox', got '", std::string(mode), "'");
}

DropoutKeep new_dropout_keep(const at::Tensor& x, double p, DropoutMode mode) {
  DropoutKeep k;
  const auto opts = x.options();
  if (p <= 0.0) {
    k.keep = at::empty({0}, opts.dtype(at::kByte));
    return k;
  }
  if (mode == DropoutMode::kBits) {
    k.keep = at::empty_symint({bit_mask_bytes(x.sym_numel())}, opts.dtype(at::kByte));
  } else {
    k.keep = at::empty({2}, opts.dtype(at::kLong));
  }
  if (x.is_meta()) return k;
  if (mode == DropoutMode::kBits) k.mask = k.keep.mutable_data_ptr<uint8_t>();
#if TEMPO_TORCH_CUDA
  if (capturing(x)) {
    // A CUDA graph being captured: a seed drawn here would be frozen into the graph and every
    // replay would drop the same elements. The kernels read the CUDA generator's state from
    // device memory instead, as torch's dropout does, so each replay draws anew (the masks
    // then follow torch.cuda.manual_seed, not the CPU generator). (Without the CUDA kernels
    // nothing is ever captured.)
    {
      auto gen = at::cuda::detail::getDefaultCUDAGenerator(x.device().index());
      std::lock_guard<std::mutex> lock(gen.mutex());
      const at::PhiloxCudaState st = gen.get<at::CUDAGeneratorImpl>()->philox_cuda_state(4);
      TORCH_CHECK(st.captured_,
                  "tempo dropout: the CUDA generator is not in graph-capture mode while the stream "
                  "is being captured");
      k.rng.graph_seed = st.seed_.ptr;
      k.rng.graph_offset = st.offset_.ptr;
      k.rng.graph_offset_add = st.offset_intragraph_;
    }
    if (mode == DropoutMode::kPhilox) {
      // The backward reads the state this replay drew, stored by a recorded kernel.
      raise_if_error(
          philox_state_store_cuda(k.rng, reinterpret_cast<uint64_t*>(k.keep.mutable_data_ptr<int64_t>()), stream_of(x)),
          "tempo dropout");
    }
    return k;
  }
#endif
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    k.rng.seed = gen.get<at::CPUGeneratorImpl>()->random64();
  }
  k.rng.offset = 0;
  if (mode == DropoutMode::kPhilox) {
    at::Tensor host = at::empty({2}, opts.dtype(at::kLong).device(at::kCPU));
    host.mutable_data_ptr<int64_t>()[0] = static_cast<int64_t>(k.rng.seed);
    host.mutable_data_ptr<int64_t>()[1] = static_cast<int64_t>(k.rng.offset);
    k.keep.copy_(host);
  }
  return k;
}

void read_dropout_keep(const at::Tensor& keep, const at::Tensor& like, double p, DropoutMode mode, const char* op,
                       const uint8_t** mask, PhiloxState* rng) {
  *mask = nullptr;
  *rng = PhiloxState{};
  if (p <= 0.0) return;
  TORCH_CHECK(keep.device() == like.device(), op, ": argument 'keep' must be on the device of ", like.device(),
              ", got ", keep.device());
  if (mode == DropoutMode::kBits) {
    TORCH_CHECK(
        keep.scalar_type() == at::kByte && keep.dim() == 1 && keep.sym_numel() == bit_mask_bytes(like.sym_numel()), op,
        ": argument 'keep' must hold the ceil(numel / 8) = ", bit_mask_bytes(like.sym_numel()),
        " uint8 keep bits of the forward, got ", keep.scalar_type(), " of shape ", keep.sym_sizes());
    if (!keep.is_meta()) *mask = keep.const_data_ptr<uint8_t>();
    return;
  }
  TORCH_CHECK(keep.scalar_type() == at::kLong && keep.sym_numel() == 2, op,
              ": argument 'keep' must be the int64 Philox state {seed, offset} of the forward, got ",
              keep.scalar_type(), " of shape ", keep.sym_sizes());
  if (keep.is_meta()) return;
  TORCH_CHECK(keep.is_contiguous(), op, ": argument 'keep' must be contiguous");
  if (keep.is_cuda()) {
    rng->device = reinterpret_cast<const uint64_t*>(keep.const_data_ptr<int64_t>());
  } else {
    rng->seed = static_cast<uint64_t>(keep.const_data_ptr<int64_t>()[0]);
    rng->offset = static_cast<uint64_t>(keep.const_data_ptr<int64_t>()[1]);
  }
}

bool shapes_only(const at::Tensor& t) {
  // Outside a tempo.plan trace a meta tensor is torch.compile's tracing, where any argument's
  // sizes may be symbolic (not only the one a kernel asks about): shapes alone.
  return t.is_meta() && (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
                         memory::planned_device() == memory::PlannedDevice::kNone);
}

bool on_cuda(const at::Tensor& t) {
  return t.is_cuda() || (t.is_meta() && memory::planned_device() == memory::PlannedDevice::kCuda);
}

PlannedBlocks::PlannedBlocks(const at::Tensor& on, int64_t count) : meta_(on.is_meta()), count_(count) {}

bool PlannedBlocks::skip(int64_t b) {
  if (!meta_ || count_ <= 3) return false;
  if (b == 1) start_ = memory::plan_flops_now();
  if (b < 2 || b >= count_ - 1) return false;
  memory::plan_note_flops(block_);
  return true;
}

void PlannedBlocks::done(int64_t b) {
  if (meta_ && b == 1) block_ = memory::plan_flops_now() - start_;
}

void linear_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  if (out.is_meta()) {
    memory::plan_note_flops(2.0 * static_cast<double>(x.numel()) * static_cast<double>(w.size(0)));
    return;
  }
  at::linear_out(out, x, w, b);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  if (x.is_meta() && b.has_value() && b->defined()) return at::mm(x, w.t());
  return at::linear(x, w, b);
}

void bmm_into(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  if (acc.is_meta()) {
    memory::plan_note_flops(2.0 * static_cast<double>(a.numel()) * static_cast<double>(b.size(-1)));
    return;
  }
  if (accumulate)
    acc.baddbmm_(a, b);
  else
    at::bmm_out(acc, a, b);
}

void add_matmul(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool low) {
  const double flops = 2.0 * static_cast<double>(a.numel()) * static_cast<double>(b.size(1));
  if (acc.is_meta()) {  // tempo.plan: the float32 copies the CPU makes of 16-bit data, and the FLOPs
    if (low && !on_cuda(acc)) (void)a.to(at::kFloat), (void)b.to(at::kFloat);
    memory::plan_note_flops(flops);
    return;
  }
  if (!low) {
    acc.addmm_(a, b);
    return;
  }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
  static std::atomic<bool> refused{false};
  if (a.is_cuda() && !refused.load()) {
    try {
      at::addmm_out(acc, acc, a, b, at::kFloat);
      return;
    } catch (const c10::Error&) {
      refused.store(true);  // this torch's CUDA addmm does not take out_dtype here: float32 from now on
    }
  }
#endif
  acc.addmm_(a.to(at::kFloat), b.to(at::kFloat));
}

}  // namespace tempo::torch_impl
