// The `tempo` operator namespace. Each op file adds its schemas with TORCH_LIBRARY_FRAGMENT;
// here: the build's facts, from the core (the version is CMake's project version, defined
// once), so Python and the command line read the same ones.
#include <torch/library.h>

#include <string>
#include <tuple>

#include "tempo/common.h"

namespace {
// (version, CUDA kernels compiled in, OpenMP, OpenMP threads)
std::tuple<std::string, bool, bool, int64_t> build_info_op() {
  const tempo::BuildInfo info = tempo::build_info();
  return {info.version, info.cuda_compiled, info.openmp, info.max_threads};
}
}  // namespace

TORCH_LIBRARY(tempo, m) {
  m.def("build_info() -> (str, bool, bool, int)");
  m.impl("build_info", c10::DispatchKey::CatchAll, TORCH_FN(build_info_op));
}
