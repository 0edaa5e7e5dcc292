#include "tempo/common.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef TEMPO_VERSION
#define TEMPO_VERSION "0.0.0"
#endif

namespace tempo {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
  }
  return "unknown";
}

#if defined(TEMPO_WITH_CUDA) && !TEMPO_WITH_CUDA
bool cuda_compiled() { return false; }
bool cuda_stream_capturing(void*) { return false; }
#else
bool cuda_compiled();  // defined by the CUDA sources, as is cuda_stream_capturing
#endif

BuildInfo build_info() {
  BuildInfo info{TEMPO_VERSION, cuda_compiled(), false, 1};
#ifdef _OPENMP
  info.openmp = true;
  info.max_threads = omp_get_max_threads();
#endif
  return info;
}

}  // namespace tempo
