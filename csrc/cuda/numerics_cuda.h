// Torch-free CUDA launchers for the numerics kernels (csrc/core/numerics.h): raw pointers and a
// cudaStream_t. The torch glue is csrc/cuda_ops.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "stats_cuda.h"

namespace gapmon {
namespace cuda {

// Numerics rows ([rows, core::kNumNumericsColumns] float64: exponent histogram, count, mean, M2,
// M3, M4) of every item of every view, in two launches: a block per chunk writes the chunk's row to
// `chunk_rows` ([total_chunks, kNumNumericsColumns] scratch), then a block per item sums its chunks'
// bins and merges their moments in chunk order. Counts are exact; the result does not depend on the
// schedule (bins are integer counts, the moment merges run in a fixed order).
cudaError_t launch_numerics(const ViewTable& views, int64_t total_chunks, int64_t rows, double* chunk_rows, double* out,
                            cudaStream_t stream);

// [parts, n, kNumNumericsColumns] rows -> [n, kNumNumericsColumns], merged over parts in order.
cudaError_t launch_merge_numerics(const double* states, int64_t parts, int64_t n, double* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace gapmon
