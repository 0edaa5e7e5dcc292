// Data parallelism on torch.distributed's c10d: a Communicator over ProcessGroupGloo (CPU) or
// ProcessGroupNCCL (CUDA), with the rendezvous of torchrun's environment (RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT) through c10d's TCPStore. Gloo is built when its headers are present
// (Debian: libgloo-dev; torch's wheels ship its library but not its headers), NCCL when torch
// has CUDA and nccl.h is found (the torch wheel's nvidia-nccl package); otherwise creating one
// raises.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tempo::train {

// Sums tensors across the processes of a data-parallel run, in place. The default is one
// process, where a sum over ranks is the tensor itself.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const { return 0; }
  virtual int world() const { return 1; }
  // A process group (Gloo, NCCL), even of one process: the trainer then sums gradients through
  // it, as torch's DDP does under torchrun with one process.
  virtual bool distributed() const { return false; }
  // Starts summing one tensor and returns at once; calling the result waits for the sum.
  // Every rank must start the same sums in the same order.
  virtual std::function<void()> allreduce_sum_start(at::Tensor tensor) {
    (void)tensor;
    return [] {};
  }
  // Sums every tensor (all in flight at once) and waits for all.
  void allreduce_sum(std::vector<at::Tensor>& tensors) {
    std::vector<std::function<void()>> waits;
    for (auto& t : tensors) waits.push_back(allreduce_sum_start(t));
    for (auto& w : waits) w();
  }
  virtual void barrier() {}
};

bool gloo_available();
// Joins the group `world` processes form at addr:port (rank 0 serves the store).
std::unique_ptr<Communicator> make_gloo_communicator(int rank, int world, const std::string& addr, int port);
bool nccl_available();
// The same over NCCL, on CUDA device `local_rank` (made the current device). Tensors on the CPU
// (the trainer's counts and loss sums) are summed through that device.
std::unique_ptr<Communicator> make_nccl_communicator(int rank, int world, const std::string& addr, int port,
                                                     int local_rank);

// Sums the gradients of `params` over the ranks of `comm`, in buckets of about `bucket_bytes`
// (each bucket one flat collective). With `overlap`, a bucket is started from inside the
// backward pass as soon as all its gradients are final (a hook after each parameter's
// gradient accumulation), so that communication runs while the earlier layers' backward
// computes; buckets start in a fixed order on every rank (the order the gradients became final
// on rank 0's first step, shared with the others), since the collectives must match. The
// first step, and every step without `overlap`, sums everything after the backward.
//
//   GradientReducer r(model->parameters(), comm, 25 << 20, true);
//   for each step: for each micro-batch: { if last: r.prepare(); loss.backward(); }  r.finish();
class GradientReducer {
 public:
  GradientReducer(std::vector<at::Tensor> params, Communicator& comm, int64_t bucket_bytes, bool overlap);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // The next backward completes this step's gradients: start buckets as they fill.
  void prepare();
  // Starts what has not started, waits for every sum, and writes the sums into the gradients.
  void finish();
  // Buckets per step once the order is known (0 before the first finish()); for tests and notes.
  size_t buckets() const { return buckets_.size(); }
  // Buckets of the last step started from inside its backward (0 without overlap).
  size_t started_in_backward() const { return started_in_backward_; }

  // Called by the hook after parameter i's gradient has been accumulated.
  void on_gradient_final(size_t i);

 private:
  struct Bucket {
    std::vector<size_t> members;  // parameter indices
    size_t ready = 0;
    bool started = false;
    at::Tensor flat;
    std::function<void()> wait;
  };
  // Buckets over parameters in `order`; those from position `used` on got no gradient.
  void plan(const std::vector<size_t>& order, size_t used);
  void start(Bucket& b);

  std::vector<at::Tensor> params_;
  Communicator& comm_;
  int64_t bucket_bytes_;
  bool overlap_;
  bool armed_ = false;
  std::vector<size_t> final_order_;  // the order gradients became final on the first step
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;  // parameter index -> bucket (SIZE_MAX: not in any)
  size_t next_ = 0;                // the next bucket to start
  size_t started_in_backward_ = 0;
  std::mutex mutex_;
};

}  // namespace tempo::train
