// Torch-free CUDA launchers for the statistics kernels (raw pointers + cudaStream_t).
// The torch glue that allocates buffers and picks the stream is csrc/cuda_ops.cpp.
#pragma once

#include <cuda_runtime.h>

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

// Statistics (or partial states) of every item of every view.
//   max_chunks_per_item: the largest chunks_per_item of the views (picks the merge kernel)
//   max_item_numel:      the largest item_numel of the views (picks a block or a warp per chunk)
//   chunk_states:        device scratch of total_chunks * 7 doubles
//   out_stats:           [rows, 7] float64 finalised rows, or nullptr
//   out_states:          [rows, 7] float64 partial states, or nullptr
// Two launches on `stream`: a block (or, for many short items, a warp) per chunk, grid-stride;
// then a fixed-order merge of each row's chunks (a thread per row when rows have few chunks, a
// block per row when they have many).
cudaError_t launch_stats(const ViewTable& views, int64_t total_chunks, int64_t rows, int64_t max_chunks_per_item,
                         int64_t max_item_numel, double* chunk_states, double* out_stats, double* out_states,
                         int64_t correction, cudaStream_t stream);

// Copies `bytes` of host memory to device memory `dst` through kernel parameters (a few KB per
// launch). Unlike a copy from pinned memory, this is safe while `stream` is being captured into a
// CUDA graph: the graph keeps the bytes, not a pointer to host memory that may be reused.
cudaError_t launch_upload(const void* src, int64_t bytes, void* dst, cudaStream_t stream);

// [parts, n, 7] float64 states -> [n, 7] merged over parts in order.
cudaError_t launch_merge_states(const double* states, int64_t parts, int64_t n, double* out, cudaStream_t stream);

// [n, 7] float64 states -> [n, 7] float64 statistics rows.
cudaError_t launch_finalize_states(const double* states, int64_t n, int64_t correction, double* out,
                                   cudaStream_t stream);

// Folds [rows, 7] float64 statistics rows (one per instance) into one float64 accumulator row
// (core::InstanceAccColumn), in row order.
cudaError_t launch_accumulate_instances(const double* stats, int64_t rows, double* acc_row, cudaStream_t stream);

}  // namespace cuda
}  // namespace gapmon
