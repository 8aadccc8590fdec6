// Torch-free CUDA launchers for the statistics kernels (raw pointers + cudaStream_t).
// The torch glue that allocates buffers and picks the stream is csrc/torch/cuda_ops.cpp.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../core/strided_view.h"

namespace gapmon {
namespace cuda {

// Views that travel inside the kernel parameters (ViewTable::inline_views).
constexpr int kInlineViews = 8;

// Where the kernels find their planned views (core::plan_chunks, ordered by out_row): up to
// kInlineViews inside the kernel parameters, so a single-tensor call copies nothing and a CUDA
// graph records them by value; more in device memory (`device`, filled e.g. by launch_upload).
struct ViewTable {
  const core::StridedView* device = nullptr;  // nullptr: the views are inline_views[0, num)
  int64_t num = 0;
  core::StridedView inline_views[kInlineViews];
};

// Where launch_stats writes, and the scratch it needs.
struct StatsTargets {
  double* out_stats = nullptr;     // [rows, 7] float64 finalised rows, or nullptr
  double* out_states = nullptr;    // [rows, 7] float64 partial states, or nullptr
  int64_t correction = 0;          // of out_stats' variance
  double* acc_row = nullptr;       // if set, out_stats' rows are folded into this accumulator row
                                   // (core::InstanceAccColumn), in row order, by the last chunk to finish
  double* chunk_states = nullptr;  // [total_chunks, 7] scratch; needed when an item has > 1 chunk
  unsigned* counters = nullptr;    // [rows + 1] zeroed; needed when an item has > 1 chunk or acc_row.
                                   // The launch leaves them zeroed: they can serve the next launch.
};

// How a view's chunks are read: by a warp each when its items are short and many (a short row then
// costs a warp's merge tree rather than a block's barriers), else by a block. Decided by the view
// alone, so a tensor's result bits are the same measured alone or in a list with other tensors.
constexpr int64_t kWarpItemElems = 8192;
constexpr int64_t kWarpMinItems = 2048;
inline bool read_by_warps(const core::StridedView& v) {
  return v.item_numel <= kWarpItemElems && v.items >= kWarpMinItems;
}

struct LaunchPlan {
  int64_t total_chunks = 0;
  int64_t warp_chunks = 0;          // chunks [0, warp_chunks) are read by warps, the rest by blocks
  int64_t max_chunks_per_item = 0;  // the largest chunks_per_item of the views
};

// Orders the views for launch_stats (those read by warps first, each group in its given order) and
// plans their chunks (core::plan_chunks).
inline LaunchPlan plan_launch(core::StridedView* views, int64_t num_views) {
  std::stable_partition(views, views + num_views, read_by_warps);
  LaunchPlan plan;
  plan.total_chunks = core::plan_chunks(views, num_views);
  for (int64_t i = 0; i < num_views; ++i) {
    if (read_by_warps(views[i])) plan.warp_chunks += views[i].chunks_per_item * views[i].items;
    plan.max_chunks_per_item = std::max(plan.max_chunks_per_item, views[i].chunks_per_item);
  }
  return plan;
}

// Whether launch_stats needs StatsTargets::chunk_states and ::counters for this plan.
inline bool needs_chunk_states(int64_t max_chunks_per_item) { return max_chunks_per_item > 1; }
inline bool needs_counters(int64_t max_chunks_per_item, bool fold) { return fold || max_chunks_per_item > 1; }

// Statistics (or partial states) of every item of every view, planned by plan_launch: one kernel
// launch per way of reading (warps, blocks) that the plan uses. Each group reads chunks, grid-stride.
// An item of one chunk is written at once; otherwise each chunk's state goes to chunk_states and the
// group that finishes an item's last chunk (an atomic count per item) merges all its chunks in chunk
// order. Which group that is depends on timing, the merge order does not: results are bit-identical
// run to run. The counters (and the instance fold) span both launches: they run in order on `stream`.
cudaError_t launch_stats(const ViewTable& views, const LaunchPlan& plan, int64_t rows, const StatsTargets& targets,
                         cudaStream_t stream);

// Copies `bytes` of host memory to device memory `dst` through kernel parameters (a few KB per
// launch). Unlike a copy from pinned memory, this is safe while `stream` is being captured into a
// CUDA graph: the graph keeps the bytes, not a pointer to host memory that may be reused.
cudaError_t launch_upload(const void* src, int64_t bytes, void* dst, cudaStream_t stream);

// [parts, n, 7] float64 states -> [n, 7] merged over parts in order.
cudaError_t launch_merge_states(const double* states, int64_t parts, int64_t n, double* out, cudaStream_t stream);

// [n, 7] float64 states -> [n, 7] float64 statistics rows.
cudaError_t launch_finalize_states(const double* states, int64_t n, int64_t correction, double* out,
                                   cudaStream_t stream);

}  // namespace cuda
}  // namespace gapmon
