// CPU kernel support shared by every op: the parallel threshold and the loop over element
// blocks (the dtype switch is math::by_dtype).
#pragma once

#include <algorithm>
#include <cstdint>

namespace tempo::cpu {

// Elements below which a kernel runs on one thread: for fewer, starting the OpenMP team costs
// more than the work it would share.
constexpr int64_t kParallelMinElems = 1 << 15;

// block(begin, end) over [0, numel) in blocks of block_elems elements, spread over OpenMP
// threads when numel >= kParallelMinElems.
template <typename Block>
void run_blocks(int64_t numel, int64_t block_elems, Block&& block) {
  const int64_t blocks = (numel + block_elems - 1) / block_elems;
#pragma omp parallel for schedule(static) if (numel >= kParallelMinElems)
  for (int64_t b = 0; b < blocks; ++b) block(b * block_elems, std::min(numel, (b + 1) * block_elems));
}

}  // namespace tempo::cpu
