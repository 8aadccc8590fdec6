// How a block of CUDA threads casts groups to the block formats and combines its rows (csrc/core/
// block_formats.h), shared by the block kernel (block_cuda.cu) and the fused statistics pass
// (numerics_cuda.cu): each thread casts its groups into its own rows, then the rows are combined over the
// block by fixed-order trees in shared memory (sums; the minimum of min_nonzero, the maximum of
// max_block_ratio), so that the result does not depend on the schedule.
//
// Included by .cu files (or by their host emulation) only; internal linkage, one copy per kernel source.
#pragma once

#include "../core/block_formats.h"
#include "block_cuda.h"

namespace gapmon {
namespace cuda {
namespace {

__device__ __forceinline__ double combine_block_column(int column, double a, double b) {
  if (column == core::bMinNonzero) return b < a ? b : a;
  if (column == core::bMaxBlockRatio) return b > a ? b : a;
  return a + b;
}

// Groups [begin, end) of `op` cast by the block's threads (thread t: begin + t, begin + t + blockDim, ...) into
// `rows` (one per format), then combined over the block into dst ([formats.num, kNumBlockColumns], written by
// thread 0). `partial`: kThreadsPerBlock doubles of shared memory. Every thread of the block must call it.
template <int kThreadsPerBlock>
__device__ void cast_and_combine_groups(const core::BlockOperand& op, int64_t begin, int64_t end,
                                        const BlockFormatList& formats, double amax, double* partial, double* dst) {
  core::BlockRow rows[core::kNumBlockFormats];
  for (int64_t g = begin + threadIdx.x; g < end; g += kThreadsPerBlock) {
    core::cast_groups(op, g, g + 1, formats.codes, formats.num, amax, rows);
  }
  for (int f = 0; f < formats.num; ++f) {
    for (int k = 0; k < core::kNumBlockColumns; ++k) {
      partial[threadIdx.x] = rows[f].v[k];
      __syncthreads();
      for (int width = kThreadsPerBlock / 2; width > 0; width /= 2) {
        if (static_cast<int>(threadIdx.x) < width) {
          partial[threadIdx.x] = combine_block_column(k, partial[threadIdx.x], partial[threadIdx.x + width]);
        }
        __syncthreads();
      }
      if (threadIdx.x == 0) dst[f * core::kNumBlockColumns + k] = partial[0];
      __syncthreads();
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace gapmon
