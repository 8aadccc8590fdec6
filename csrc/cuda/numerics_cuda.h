// Torch-free CUDA launchers for the numerics kernels (csrc/core/numerics.h): raw pointers and a
// cudaStream_t. The torch glue is csrc/cuda_ops.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "stats_cuda.h"

namespace gapmon {
namespace cuda {

// Where launch_stats_and_numerics writes its numerics rows, and the scratch it needs.
struct NumericsTargets {
  double* out = nullptr;         // [rows, core::kNumNumericsColumns] float64: exponent histogram, count, mean, M2..M4
  double* chunk_rows = nullptr;  // [total_chunks, kNumNumericsColumns] scratch; needed when an item has > 1 chunk
  bool accumulate = false;       // merge each item's row into `out`'s row (after what it holds), not overwrite it
};

// Numerics rows of every item of every view, and in the same pass (each chunk is read once) its
// statistics into `stats` (out_states and/or out_stats, or neither), with the bits launch_stats
// gives: one launch, a block per chunk. An item of several chunks is finished by the block that
// counts its last chunk (stats.chunk_states, stats.counters and numerics.chunk_rows are then
// needed). Counts are exact; the rows do not depend on the schedule (bins are integer counts, the
// moment and state merges run in a fixed order). The plan must read every view by blocks
// (plan.warp_chunks == 0: tensors rather than many short instances), and no instance fold
// (stats.acc_row) is done here; either is cudaErrorInvalidValue.
cudaError_t launch_stats_and_numerics(const ViewTable& views, const LaunchPlan& plan, int64_t rows,
                                      const StatsTargets& stats, const NumericsTargets& numerics, cudaStream_t stream);

// [parts, n, kNumNumericsColumns] rows -> [n, kNumNumericsColumns], merged over parts in order.
cudaError_t launch_merge_numerics(const double* states, int64_t parts, int64_t n, double* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace gapmon
