// Compiled instead of the CUDA sources when the build has no CUDA: the CUDA entry points
// exist and say why they cannot run.
#include "tempo/activation.h"

namespace tempo {

bool cuda_compiled() { return false; }

Status activation_forward_cuda(const ActivationForwardParams&, void*) {
  return Status::Error("activation forward: this build of tempo has no CUDA kernels");
}
Status activation_backward_cuda(const ActivationBackwardParams&, void*) {
  return Status::Error("activation backward: this build of tempo has no CUDA kernels");
}

}  // namespace tempo
