// Torch-free CUDA launcher of the optimizer-update sums (csrc/core/update_stats.h): raw pointers and a
// cudaStream_t. The torch glue is csrc/torch/cuda_ops.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../core/update_stats.h"

namespace gapmon {
namespace cuda {

constexpr int kUpdateThreads = 256;

// Rows [n, core::kUpdateColumns] of `out` for the parameters `ops` (a device array, chunks planned by
// core::plan_update_chunks): one block per chunk writes its sums to chunk_sums ([total_chunks,
// core::kUpdateSums] scratch) after a fixed-order tree reduction over its threads; a second launch adds
// each parameter's chunks in chunk order. No atomics: the rows do not depend on the schedule.
cudaError_t launch_update_sums(const core::UpdateOperands* ops, int64_t n, int64_t total_chunks, double* chunk_sums,
                               double* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace gapmon
