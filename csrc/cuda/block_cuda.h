// Torch-free CUDA launcher of the per-block format numerics (csrc/core/block_formats.h): raw pointers and
// a cudaStream_t. The torch glue is csrc/torch/cuda_ops.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../core/block_formats.h"

namespace gapmon {
namespace cuda {

constexpr int kBlockThreads = 256;

// The formats of a launch, by value in the kernel parameters.
struct BlockFormatList {
  core::BlockFormat codes[core::kNumBlockFormats];
  int num = 0;
};

// Rows [n, formats.num, core::kNumBlockColumns] of `out` for the tensors `ops` (a device array, chunks planned
// by core::plan_block_chunks; amaxes: device float64 [n] when a format needs the tensor's amax, else
// nullptr): one block per chunk of core::kGroupsPerChunk groups (a thread per group at a time, each element
// read once and cast to every format), reduced over its threads in a fixed tree order into chunk_rows
// ([total_chunks, formats.num, kNumBlockColumns] scratch); a second launch merges each tensor's chunks in
// order. No atomics: the rows do not depend on the schedule.
cudaError_t launch_block_numerics(const core::BlockOperand* ops, int64_t n, int64_t total_chunks,
                                  const BlockFormatList& formats, const double* amaxes, double* chunk_rows, double* out,
                                  cudaStream_t stream);

}  // namespace cuda
}  // namespace gapmon
