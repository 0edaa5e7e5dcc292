// tempo.plan's model of CUDA's caching allocator (c10/cuda/CUDACachingAllocator.cpp, the version
// torch 2.13 ships): a planned step's record of storages allocated and freed, replayed through the
// allocator's rules to give what torch.cuda.max_memory_allocated() and max_memory_reserved()
// report, and whether the step runs within a budget. Two configurations:
//   default     requests rounded to 512 bytes; up to 1 MiB from a small pool of 2 MiB segments,
//               larger from segments of 20 MiB (10 MiB and more: their own, rounded to 2 MiB);
//               best fit, lowest address on a tie; a block split when what remains is worth
//               keeping (512 bytes small, more than 1 MiB large); freed blocks merge within their
//               segment. When a new segment would pass the budget, every cached segment that is
//               wholly free is released (release_cached_blocks) and the segment tried again; out
//               of memory if it still does not fit.
//   expandable  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: one growing address range per
//               pool, mapped in pages (2 MiB small, 20 MiB large) as the blocks need them; a block
//               is split whenever 512 bytes remain; on running out, the pages inside free blocks
//               are unmapped and the mapping tried again.
// Not modelled: the CUDA context and library workspaces (outside both counts), streams other than
// one, max_split_size and garbage_collection_threshold (not set by default).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <iterator>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace tempo::memory {
namespace {

constexpr int64_t kMinBlock = 512;
constexpr int64_t kSmall = int64_t{1} << 20;           // requests up to this: the small pool
constexpr int64_t kSmallBuffer = int64_t{2} << 20;     // the small pool's segments (and pages)
constexpr int64_t kMinLargeAlloc = int64_t{10} << 20;  // from this size: a segment of its own
constexpr int64_t kLargeBuffer = int64_t{20} << 20;    // large segments (and expandable pages)
constexpr int64_t kRoundLarge = int64_t{2} << 20;      // own segments round up to this
constexpr int64_t kLargeBase = int64_t{1} << 61;       // where the large pool's addresses start
constexpr int64_t kAddressSpace = int64_t{1} << 60;    // an expandable pool's address range

int64_t round_size(int64_t n) { return n < kMinBlock ? kMinBlock : kMinBlock * ((n + kMinBlock - 1) / kMinBlock); }

int64_t segment_size(int64_t n) {
  if (n <= kSmall) return kSmallBuffer;
  if (n < kMinLargeAlloc) return kLargeBuffer;
  return kRoundLarge * ((n + kRoundLarge - 1) / kRoundLarge);
}

struct Block {
  int64_t size = 0;
  int64_t segment = 0;  // default: the segment's address; expandable: the pool's base
  bool small = false;
  bool allocated = false;
  bool mapped = true;
};

class CachingModel {
 public:
  CachingModel(int64_t budget, bool expandable) : budget_(budget), expandable_(expandable) {
    if (expandable_)
      for (bool small : {true, false}) {
        const int64_t base = small ? 0 : kLargeBase;
        blocks_[base] = Block{kAddressSpace, base, small, false, false};
      }
  }

  int64_t allocated = 0, reserved = 0, peak_allocated = 0, peak_reserved = 0;
  bool out_of_memory = false;  // a request that did not fit the budget (made past it, to go on)
  int64_t excess = 0;          // by how much the first such request passed the budget

  void reset_peak() { peak_allocated = allocated, peak_reserved = reserved; }

  void alloc(int64_t id, int64_t bytes) {
    const int64_t size = round_size(bytes);
    const bool small = size <= kSmall;
    int64_t addr = take_free(small, size);
    if (addr < 0) addr = expandable_ ? expand(small, size) : new_segment(small, size);
    Block& b = blocks_.at(addr);
    const int64_t remaining = b.size - size;
    if ((expandable_ || small) ? remaining >= kMinBlock : remaining > kSmall) {
      blocks_[addr + size] = Block{remaining, b.segment, small, false, true};
      free_[small].insert({remaining, addr + size});
      b.size = size;
    }
    b.allocated = true;
    allocated += b.size;
    peak_allocated = std::max(peak_allocated, allocated);
    by_id_[id] = addr;
  }

  void release(int64_t id) {
    const auto it = by_id_.find(id);
    if (it == by_id_.end()) return;
    const int64_t addr = it->second;
    by_id_.erase(it);
    Block& b = blocks_.at(addr);
    b.allocated = false;
    allocated -= b.size;
    const bool small = b.small;
    const int64_t merged = merge(addr);  // may take b into the block before it
    free_[small].insert({blocks_.at(merged).size, merged});
  }

 private:
  const int64_t budget_;
  const bool expandable_;
  std::map<int64_t, Block> blocks_;                       // by address
  std::set<std::pair<int64_t, int64_t>> free_[2];         // [small?]: (size, address) of free mapped blocks
  std::unordered_map<int64_t, int64_t> by_id_;            // allocation id -> its block's address
  std::map<int64_t, std::pair<int64_t, bool>> segments_;  // default: address -> (size, small?)
  int64_t next_segment_ = kSmallBuffer;

  // The smallest cached free block that fits (lowest address on a tie), taken out of the pool.
  int64_t take_free(bool small, int64_t size) {
    auto& pool = free_[small];
    const auto it = pool.lower_bound({size, -1});
    if (it == pool.end()) return -1;
    const int64_t addr = it->second;
    pool.erase(it);
    return addr;
  }

  bool over(int64_t more) const { return budget_ > 0 && reserved + more > budget_; }

  void fail(int64_t more) {
    if (!out_of_memory) excess = reserved + more - budget_;
    out_of_memory = true;
  }

  void grow(int64_t more) {
    reserved += more;
    peak_reserved = std::max(peak_reserved, reserved);
  }

  // default: a new segment for the request (cached whole-free segments released first when it
  // would pass the budget); its one block's address.
  int64_t new_segment(bool small, int64_t size) {
    const int64_t seg = segment_size(size);
    if (over(seg)) release_cached();
    if (over(seg)) fail(seg);
    const int64_t addr = next_segment_;
    next_segment_ += seg + kSmallBuffer;  // a gap: segments never merge
    segments_[addr] = {seg, small};
    blocks_[addr] = Block{seg, addr, small, false, true};
    grow(seg);
    return addr;
  }

  // Freed block at `addr` merged with its free neighbours of the same segment (mapped with
  // mapped only); the merged block's address, out of the free sets.
  int64_t merge(int64_t addr) {
    auto it = blocks_.find(addr);
    auto next = std::next(it);
    if (next != blocks_.end() && mergeable(it->second, next->first, next->second, addr + it->second.size)) {
      if (next->second.mapped) free_[next->second.small].erase({next->second.size, next->first});
      it->second.size += next->second.size;
      blocks_.erase(next);
    }
    if (it != blocks_.begin()) {
      auto prev = std::prev(it);
      if (mergeable(it->second, prev->first + prev->second.size, prev->second, addr)) {
        if (prev->second.mapped) free_[prev->second.small].erase({prev->second.size, prev->first});
        prev->second.size += it->second.size;
        blocks_.erase(it);
        return prev->first;
      }
    }
    return addr;
  }

  static bool mergeable(const Block& b, int64_t at, const Block& other, int64_t expected) {
    return at == expected && !other.allocated && other.segment == b.segment && other.mapped == b.mapped;
  }

  // default: every segment wholly free given back; expandable: the pages inside free blocks unmapped.
  void release_cached() {
    if (!expandable_) {
      for (auto it = segments_.begin(); it != segments_.end();) {
        const Block& b = blocks_.at(it->first);
        if (!b.allocated && b.size == it->second.first) {
          free_[b.small].erase({b.size, it->first});
          blocks_.erase(it->first);
          reserved -= it->second.first;
          it = segments_.erase(it);
        } else {
          ++it;
        }
      }
      return;
    }
    std::vector<std::pair<int64_t, int64_t>> frees;
    for (int small = 0; small < 2; ++small)
      for (const auto& [size, addr] : free_[small]) frees.push_back({addr, size});
    for (const auto& [addr, size] : frees) {
      const Block b = blocks_.at(addr);
      const int64_t page = b.small ? kSmallBuffer : kLargeBuffer;
      const int64_t lo = b.segment + (addr - b.segment + page - 1) / page * page;
      const int64_t hi = b.segment + (addr + size - b.segment) / page * page;
      if (hi <= lo) continue;
      free_[b.small].erase({size, addr});
      blocks_.erase(addr);
      if (lo > addr) {
        blocks_[addr] = Block{lo - addr, b.segment, b.small, false, true};
        free_[b.small].insert({lo - addr, addr});
      }
      if (addr + size > hi) {
        blocks_[hi] = Block{addr + size - hi, b.segment, b.small, false, true};
        free_[b.small].insert({addr + size - hi, hi});
      }
      blocks_[lo] = Block{hi - lo, b.segment, b.small, false, false};
      reserved -= hi - lo;
      merge(lo);  // with unmapped neighbours only (mergeable compares mapped)
    }
  }

  // expandable: pages mapped after the lowest unmapped range with room for the request (from a
  // free block just before it), merged into one free block; its address. When the pages would
  // pass the budget, the pages inside free blocks are unmapped and the search made again.
  int64_t expand(bool small, int64_t size) {
    const int64_t base = small ? 0 : kLargeBase;
    const int64_t page = small ? kSmallBuffer : kLargeBuffer;
    for (int attempt = 0;; ++attempt) {
      const auto first = blocks_.lower_bound(base);
      for (auto it = first; it != blocks_.end() && it->second.segment == base; ++it) {
        if (it->second.mapped) continue;
        auto start = it;
        if (start != first) {
          const auto prev = std::prev(start);
          if (!prev->second.allocated && prev->second.mapped) start = prev;  // blocks of a pool are contiguous
        }
        int64_t room = 0, need = 0;
        for (auto r = start; r != blocks_.end() && room < size && !r->second.allocated && r->second.segment == base;
             ++r) {
          if (!r->second.mapped) need += round_up(std::min(r->second.size, size - room), page);
          room += r->second.size;
        }
        if (room < size) continue;
        if (over(need) && attempt == 0) break;
        if (over(need)) fail(need);
        return map_from(start, size, page);
      }
      TORCH_CHECK(attempt == 0, "tempo::memory_plan_replay: an expandable pool ran out of addresses");
      release_cached();
    }
  }

  static int64_t round_up(int64_t n, int64_t page) { return (n + page - 1) / page * page; }

  // The free and unmapped blocks from `start` on, mapped as needed and merged until one free
  // mapped block of at least `size` begins there (out of the free sets); its address.
  int64_t map_from(std::map<int64_t, Block>::iterator start, int64_t size, int64_t page) {
    const int64_t addr = start->first;
    if (start->second.mapped)
      free_[start->second.small].erase({start->second.size, addr});
    else
      map_head(addr, size, page);
    while (blocks_.at(addr).size < size) {
      const auto next = std::next(blocks_.find(addr));
      if (next->second.mapped)
        free_[next->second.small].erase({next->second.size, next->first});
      else
        map_head(next->first, size - blocks_.at(addr).size, page);
      blocks_.at(addr).size += next->second.size;
      blocks_.erase(next);
    }
    return addr;
  }

  // The first pages of the unmapped block at `addr` covering `want` bytes mapped: it becomes a
  // mapped block of whole pages, the rest stays unmapped after it.
  void map_head(int64_t addr, int64_t want, int64_t page) {
    Block& u = blocks_.at(addr);
    const int64_t map = std::min(u.size, round_up(want, page));
    if (map < u.size) blocks_[addr + map] = Block{u.size - map, u.segment, u.small, false, false};
    u.size = map;
    u.mapped = true;
    grow(map);
  }
};

// (allocated bytes after each event from build_end, reserved bytes after each, [peak allocated
// from mark, peak reserved from mark, the first event out of memory or -1, reserved at the end,
// by how many bytes the first request out of memory passed the budget])
std::tuple<at::Tensor, at::Tensor, at::Tensor> replay(const at::Tensor& events, int64_t build_end, int64_t mark,
                                                      int64_t budget, bool expandable) {
  TORCH_CHECK(events.device().is_cpu(), "tempo::memory_plan_replay: 'events' must be on the CPU, got ",
              events.device());
  TORCH_CHECK(events.dim() == 2 && events.size(1) >= 2 && events.scalar_type() == at::kLong,
              "tempo::memory_plan_replay: 'events' must be [N, >= 2] int64 (id, bytes), got ", events.sizes(), " ",
              events.scalar_type());
  const at::Tensor ev = events.narrow(1, 0, 2).contiguous();
  const int64_t n = ev.size(0);
  TORCH_CHECK(build_end >= 0 && build_end <= n && mark >= 0 && mark <= n, "tempo::memory_plan_replay: bad marks");
  const int64_t* e = ev.data_ptr<int64_t>();
  CachingModel model(budget, expandable);
  // The build as a model loaded onto the device: its surviving tensors, in order.
  std::unordered_set<int64_t> freed;
  for (int64_t k = 0; k < build_end; ++k)
    if (e[2 * k + 1] < 0) freed.insert(e[2 * k]);
  for (int64_t k = 0; k < build_end; ++k)
    if (e[2 * k + 1] > 0 && !freed.count(e[2 * k])) model.alloc(e[2 * k], e[2 * k + 1]);
  at::Tensor allocated = at::empty({n - build_end}, at::kLong), reserved = at::empty({n - build_end}, at::kLong);
  int64_t* a = allocated.data_ptr<int64_t>();
  int64_t* r = reserved.data_ptr<int64_t>();
  int64_t first_oom = model.out_of_memory ? 0 : -1;
  for (int64_t k = build_end; k < n; ++k) {
    if (k == mark) model.reset_peak();
    if (e[2 * k + 1] > 0)
      model.alloc(e[2 * k], e[2 * k + 1]);
    else
      model.release(e[2 * k]);
    if (model.out_of_memory && first_oom < 0) first_oom = k;
    a[k - build_end] = model.allocated;
    r[k - build_end] = model.reserved;
  }
  if (mark >= n) model.reset_peak();
  at::Tensor stats =
      at::tensor({model.peak_allocated, model.peak_reserved, first_oom, model.reserved, model.excess}, at::kLong);
  return {allocated, reserved, stats};
}

}  // namespace
}  // namespace tempo::memory

TORCH_LIBRARY_FRAGMENT(tempo, m) {
  m.def(
      "memory_plan_replay(Tensor events, int build_end, int mark, int budget, bool expandable) -> (Tensor, Tensor, "
      "Tensor)",
      &tempo::memory::replay);
}
