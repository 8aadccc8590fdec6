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
// nullptr): one block per chunk of core::kGroupsPerChunk groups (a warp per group, a lane per element, one format
// after another; float64 tensors a thread per group: block_rows.cuh), reduced over its threads in a fixed tree
// order into chunk_rows
// ([total_chunks, formats.num, kNumBlockColumns] scratch); a second launch merges each tensor's chunks in
// order. No atomics: the rows do not depend on the schedule.
cudaError_t launch_block_numerics(const core::BlockOperand* ops, int64_t n, int64_t total_chunks,
                                  const BlockFormatList& formats, const double* amaxes, double* chunk_rows, double* out,
                                  cudaStream_t stream);

// The block formats of the fused statistics pass (launch_stats_and_numerics). Where a chunk's groups lie whole in
// the vectors the statistics reader loads (a float32/16-bit view read as one aligned unit-stride run of rows of a
// multiple of 32 elements; at most kMaxReaderFormats = 2 formats), they are cast from those registers: the tensor
// is read once. Otherwise the chunk the reader has just read is read again by the same block right away (from L2,
// if it is still there), and the groups that start in it (core::group_at) are cast. ops: a device array, one operand per view
// (view i's tensor as contiguous [rows, cols]; a null `data`, rows = cols = 0: not cast in the pass, its
// rows left empty); amaxes: device float64 [views] when a format needs the tensor's amax, else nullptr;
// chunk_rows: [total_chunks, formats.num, kNumBlockColumns] scratch, every chunk's rows written.
struct FusedBlocks {
  const core::BlockOperand* ops = nullptr;  // nullptr: no block formats in the pass
  BlockFormatList formats;
  const double* amaxes = nullptr;
  double* chunk_rows = nullptr;
  bool in_reader = true;  // false: every chunk read again, as where the groups do not lie whole in the vectors
                          // (benchmarks/cuda/kernel_bench.cu compares the two)
};

// Rows [n, num_formats, kNumBlockColumns] of `out` from the fused pass's chunk rows: tensor i's merged in order
// over its statistics chunks [ops[i].first_chunk, + core::chunks_for(ops[i].rows * ops[i].cols)) (the glue sets
// first_chunk to its view's).
cudaError_t launch_merge_fused_block_rows(const core::BlockOperand* ops, int64_t n, int num_formats,
                                          const double* chunk_rows, double* out, cudaStream_t stream);

// The fused pass's chunk rows [total_chunks, num_formats, kNumBlockColumns] of one view (an activation's instances,
// merge_items) merged into dst ([num_formats, kNumBlockColumns], a row of the step's table), after what it holds:
// one block, its threads each merging a strided share of the chunks in order, then a fixed tree over the threads
// (the same bits on every run).
cudaError_t launch_accumulate_fused_block_rows(const double* chunk_rows, int64_t total_chunks, int num_formats,
                                               double* dst, cudaStream_t stream);

}  // namespace cuda
}  // namespace gapmon
