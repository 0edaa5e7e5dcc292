// CPU kernel support shared by every op: the parallel threshold and the loop over element
// blocks (the dtype switch is math::by_dtype).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

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

// Reductions that must not depend on the thread count: the work items [0, items) are cut into
// a fixed number of contiguous groups (at most kReductionGroups, whatever the threads), each
// group is reduced by one thread in item order into its own partial, and the caller adds the
// partials in group order. group(g, begin, end) runs items [begin, end) of group g.
constexpr int64_t kReductionGroups = 32;
inline int64_t reduction_groups(int64_t items) { return std::max<int64_t>(1, std::min(items, kReductionGroups)); }
template <typename Group>
void run_groups(int64_t items, bool parallel, Group&& group) {
  const int64_t groups = reduction_groups(items);
  const int64_t per = (items + groups - 1) / groups;
#pragma omp parallel for schedule(static) if (parallel && groups > 1)
  for (int64_t g = 0; g < groups; ++g) group(g, std::min(items, g * per), std::min(items, (g + 1) * per));
}

// The caller's last step: `parts` holds one partial row of `width` sums per group; adds groups
// 1, 2, ... into group 0's row, in that order.
inline void add_group_partials(std::vector<double>& parts, int64_t groups, int64_t width) {
  for (int64_t g = 1; g < groups; ++g) {
    const double* src = parts.data() + static_cast<size_t>(g * width);
    for (int64_t j = 0; j < width; ++j) parts[static_cast<size_t>(j)] += src[j];
  }
}

}  // namespace tempo::cpu
