// Compiled with tempo=tempo_simt (see api.h): `tempo` below is the emulated build's namespace.
#include "api.h"

#include "cuda_runtime.h"
#include "tempo/activation.h"
#include "tempo/attention.h"
#include "tempo/qkv_split.h"
#include "tempo/rope.h"
#include "tempo/dropout.h"
#include "tempo/gated_mlp.h"
#include "tempo/linear_attention.h"
#include "tempo/linear_cross_entropy.h"
#include "tempo/norm.h"

namespace simt_api {
namespace {
std::string message(const tempo::Status& s) { return s.ok() ? std::string() : s.message(); }
}  // namespace

#define SIMT_API_ENTRY(name, Params)                                                         \
  std::string name(const void* params) {                                                     \
    return message(tempo::name##_cuda(*static_cast<const tempo::Params*>(params), nullptr)); \
  }
SIMT_API_ENTRY(activation_forward, ActivationForwardParams)
SIMT_API_ENTRY(activation_backward, ActivationBackwardParams)
SIMT_API_ENTRY(dropout_forward, DropoutForwardParams)
SIMT_API_ENTRY(dropout_backward, DropoutBackwardParams)
SIMT_API_ENTRY(norm_forward, NormForwardParams)
SIMT_API_ENTRY(norm_backward, NormBackwardParams)
SIMT_API_ENTRY(qkv_split_forward, QkvSplitForwardParams)
SIMT_API_ENTRY(qkv_split_backward, QkvSplitBackwardParams)
SIMT_API_ENTRY(rope_forward, RopeParams)
SIMT_API_ENTRY(rope_backward, RopeParams)
SIMT_API_ENTRY(attention_softmax_forward, AttentionSoftmaxForwardParams)
SIMT_API_ENTRY(attention_softmax_backward, AttentionSoftmaxBackwardParams)
SIMT_API_ENTRY(linear_attention_forward, LinearAttentionForwardParams)
SIMT_API_ENTRY(linear_attention_backward, LinearAttentionBackwardParams)
SIMT_API_ENTRY(linear_cross_entropy_forward, LinearCrossEntropyForwardParams)
SIMT_API_ENTRY(linear_cross_entropy_backward, LinearCrossEntropyBackwardParams)
SIMT_API_ENTRY(gated_mlp_forward, GatedMlpForwardParams)
SIMT_API_ENTRY(gated_mlp_backward, GatedMlpBackwardParams)
#undef SIMT_API_ENTRY

std::string philox_state_store(const void* state, uint64_t* out) {
  return message(tempo::philox_state_store_cuda(*static_cast<const tempo::PhiloxState*>(state), out, nullptr));
}

Counters counters() { return {simt::g_launch.blocks, simt::g_launch.barriers, simt::g_launch.shuffles}; }

}  // namespace simt_api
