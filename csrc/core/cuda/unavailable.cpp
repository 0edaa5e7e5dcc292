// Compiled instead of the CUDA sources when the build has no CUDA: the CUDA entry points
// exist and say why they cannot run.
#include "tempo/activation.h"
#include "tempo/attention.h"
#include "tempo/dropout.h"
#include "tempo/norm.h"

namespace tempo {

bool cuda_compiled() { return false; }

Status activation_forward_cuda(const ActivationForwardParams&, void*) {
  return Status::Error("activation forward: this build of tempo has no CUDA kernels");
}
Status activation_backward_cuda(const ActivationBackwardParams&, void*) {
  return Status::Error("activation backward: this build of tempo has no CUDA kernels");
}

Status dropout_forward_cuda(const DropoutForwardParams&, void*) {
  return Status::Error("dropout forward: this build of tempo has no CUDA kernels");
}
Status dropout_backward_cuda(const DropoutBackwardParams&, void*) {
  return Status::Error("dropout backward: this build of tempo has no CUDA kernels");
}
Status norm_forward_cuda(const NormForwardParams&, void*) {
  return Status::Error("norm forward: this build of tempo has no CUDA kernels");
}
Status norm_backward_cuda(const NormBackwardParams&, void*) {
  return Status::Error("norm backward: this build of tempo has no CUDA kernels");
}

Status attention_softmax_forward_cuda(const AttentionSoftmaxForwardParams&, void*) {
  return Status::Error("attention softmax forward: this build of tempo has no CUDA kernels");
}
Status attention_softmax_backward_cuda(const AttentionSoftmaxBackwardParams&, void*) {
  return Status::Error("attention softmax backward: this build of tempo has no CUDA kernels");
}

}  // namespace tempo
