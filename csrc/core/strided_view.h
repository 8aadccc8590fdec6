// Torch-free description of the elements a kernel reads, and how they are cut into chunks.
//
// A StridedView is one tensor (or a batch of equally laid-out items, for instance_stats)
// with its dimensions sorted by decreasing stride and coalesced, and stride-0 (expanded)
// dimensions removed and turned into a multiplicity. Chunks of a fixed number of elements
// are the unit of parallel work on every backend: their boundaries depend only on shapes,
// so results are bit-identical run to run and independent of the number of threads.
#pragma once

#include <cstdint>

#include "stats_state.h"

namespace gapmon {
namespace core {

enum class DType : int32_t { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

constexpr int kMaxDims = 8;
constexpr int64_t kChunkElems = int64_t(1) << 16;

struct StridedView {
  const void* data = nullptr;     // element 0 of item 0
  DType dtype = DType::kFloat32;
  int32_t ndim = 0;               // dims of one item after coalescing (0: a single element)
  int64_t sizes[kMaxDims] = {};   // item shape, outermost first
  int64_t strides[kMaxDims] = {}; // in elements, decreasing
  int64_t item_numel = 0;         // elements read per item (product of sizes)
  int64_t repeat = 1;             // how often each element occurs (product of stride-0 dims)
  int64_t items = 1;              // number of items (batch size for instance_stats, else 1)
  int64_t item_stride = 0;        // elements between consecutive items
  int64_t out_row = 0;            // output row of item 0; item b goes to out_row + b
  int64_t chunks_per_item = 0;    // filled by plan_chunks
  int64_t first_chunk = 0;        // filled by plan_chunks
};

GAPMON_HD int64_t chunks_for(int64_t numel) {
  return numel == 0 ? 1 : (numel + kChunkElems - 1) / kChunkElems;  // an empty item still owns a chunk
}

// Assigns chunk ranges to views in order; returns the total number of chunks.
inline int64_t plan_chunks(StridedView* views, int64_t num_views) {
  int64_t next = 0;
  for (int64_t i = 0; i < num_views; ++i) {
    views[i].chunks_per_item = chunks_for(views[i].item_numel);
    views[i].first_chunk = next;
    next += views[i].chunks_per_item * views[i].items;
  }
  return next;
}

// Index of the last view whose `field` is <= value (views are sorted by that field).
GAPMON_HD int64_t last_view_at_most(const StridedView* views, int64_t num_views, int64_t StridedView::*field,
                                    int64_t value) {
  int64_t lo = 0, hi = num_views - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (views[mid].*field <= value) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Index of the last of ops[0, n) (any type with a first_chunk, in increasing order) whose first_chunk is
// <= chunk: the operand that owns global chunk `chunk`.
template <typename Op>
GAPMON_HD int64_t owner_of_chunk(const Op* ops, int64_t n, int64_t chunk) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (ops[mid].first_chunk <= chunk) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Index of the view that owns global chunk `chunk`.
GAPMON_HD int64_t find_view(const StridedView* views, int64_t num_views, int64_t chunk) {
  return last_view_at_most(views, num_views, &StridedView::first_chunk, chunk);
}

// Index of the view that owns output row `row`.
GAPMON_HD int64_t find_view_by_row(const StridedView* views, int64_t num_views, int64_t row) {
  return last_view_at_most(views, num_views, &StridedView::out_row, row);
}

// Walks the runs of elements along the innermost dim that lie in the logical element range
// [lo, hi) of item `item`. An iterator rather than a callback, so that the vectorised loop
// that consumes the runs stays in its caller (and in that caller's instruction set).
class RowCursor {
 public:
  GAPMON_HD RowCursor(const StridedView& v, int64_t item, int64_t lo, int64_t hi)
      : v_(v), base_(item * v.item_stride), pos_(lo), hi_(hi) {
    int64_t rem = lo;
    for (int d = v.ndim - 1; d >= 0; --d) {
      index_[d] = rem % v.sizes[d];
      rem /= v.sizes[d];
    }
  }

  // Next run: offset (elements from view.data), length and stride of its elements.
  GAPMON_HD bool next(int64_t& offset, int64_t& len, int64_t& stride) {
    if (pos_ >= hi_) return false;
    if (v_.ndim == 0) {  // a single element
      offset = base_;
      len = 1;
      stride = 1;
      pos_ = hi_;
      return true;
    }
    const int last = v_.ndim - 1;
    offset = base_;
    for (int d = 0; d <= last; ++d) offset += index_[d] * v_.strides[d];
    len = v_.sizes[last] - index_[last];
    if (len > hi_ - pos_) len = hi_ - pos_;
    stride = v_.strides[last];
    pos_ += len;
    index_[last] += len;
    for (int d = last; d > 0 && index_[d] >= v_.sizes[d]; --d) {
      index_[d] = 0;
      ++index_[d - 1];
    }
    return true;
  }

 private:
  const StridedView& v_;
  int64_t base_, pos_, hi_;
  int64_t index_[kMaxDims] = {};
};

}  // namespace core
}  // namespace gapmon
