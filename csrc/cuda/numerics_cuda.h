// Torch-free CUDA launchers for the numerics kernels (csrc/core/numerics.h): raw pointers and a
// cudaStream_t. The torch glue is csrc/torch/cuda_ops.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "block_cuda.h"
#include "stats_cuda.h"

namespace gapmon {
namespace cuda {

// Where launch_stats_and_numerics writes its numerics rows, and the scratch it needs.
struct NumericsTargets {
  double* out = nullptr;         // [rows, core::kNumNumericsColumns] float64: exponent histogram, count, mean, M2..M4
                                 // (with merge_items: one row)
  double* chunk_rows = nullptr;  // [total_chunks, kNumNumericsColumns] scratch; needed when an item has > 1 chunk,
                                 // or with merge_items
  bool accumulate = false;       // merge into `out`'s rows (after what they hold) rather than overwrite them
  bool merge_items = false;      // one row for all items of the single view (an activation's instances): every
                                 // chunk's numerics merged by the block that finishes the last row
};

// Numerics rows of every item of every view, and in the same pass (each chunk is read once) its
// statistics into `stats` with the bits launch_stats gives: out_states and/or out_stats, and the
// instance fold into acc_row (by the block that writes the last row). One launch, a block per chunk.
// An item of several chunks is finished by the block that counts its last chunk. Scratch as for
// launch_stats (stats.chunk_states, stats.counters: rows + 1), and numerics.chunk_rows (see
// NumericsTargets). Counts are exact; the rows do not depend on the schedule (bins are integer
// counts, the moment and state merges run in a fixed order). The plan must read every view by blocks
// (plan.warp_chunks == 0: tensors, or instances that are not many short rows), and merge_items needs a
// single view; anything else, or missing scratch, is cudaErrorInvalidValue.
//
// With `blocks` (FusedBlocks::ops not null), each chunk's block-format rows too: cast from the reader's vectors as
// they are loaded where the chunk's groups lie whole in them (one read; see FusedBlocks), else from the chunk read
// again right after the statistics reader read it; launch_merge_fused_block_rows then merges each tensor's chunks (with
// merge_items, the single view's instances, whole rows of its operand each: launch_accumulate_fused_block_rows
// merges all chunks into one row).
cudaError_t launch_stats_and_numerics(const ViewTable& views, const LaunchPlan& plan, int64_t rows,
                                      const StatsTargets& stats, const NumericsTargets& numerics, cudaStream_t stream,
                                      const FusedBlocks& blocks = FusedBlocks());

// [parts, n, kNumNumericsColumns] rows -> [n, kNumNumericsColumns], merged over parts in order.
cudaError_t launch_merge_numerics(const double* states, int64_t parts, int64_t n, double* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace gapmon
