// The per-block format numerics on CUDA: a block per chunk of groups (32-element MX blocks), a thread per
// group at a time; each thread's rows are combined over the block by fixed-order trees in shared memory
// (block_rows.cuh), then one thread per tensor and format merges its chunks in order.
#include "block_cuda.h"
#include "block_rows.cuh"
#include "launch.h"

namespace gapmon {
namespace cuda {
namespace {

__global__ void __launch_bounds__(kBlockThreads)
    block_chunk_kernel(const core::BlockOperand* __restrict__ ops, int64_t n, const __grid_constant__ BlockFormatList formats,
                       const double* __restrict__ amaxes, double* __restrict__ chunk_rows) {
  __shared__ double partial[kBlockThreads];
  const int64_t chunk = blockIdx.x;
  const int64_t i = core::find_block_operand(ops, n, chunk);
  const core::BlockOperand& op = ops[i];
  const int64_t groups = op.rows * core::groups_per_row(op.cols);
  const int64_t begin = (chunk - op.first_chunk) * core::kGroupsPerChunk;
  const int64_t end = begin + core::kGroupsPerChunk < groups ? begin + core::kGroupsPerChunk : groups;
  cast_and_combine_groups<kBlockThreads>(op, begin, end, formats, amaxes != nullptr ? amaxes[i] : 0.0, partial,
                                         chunk_rows + chunk * formats.num * core::kNumBlockColumns);
}

// Merges each tensor's chunk rows in order: its block chunks (core::block_chunks_for), or with kStatsChunks the
// chunks of the fused statistics pass (core::chunks_for its elements).
template <bool kStatsChunks>
__global__ void block_rows_kernel(const core::BlockOperand* __restrict__ ops, int64_t n, int num_formats,
                                  const double* __restrict__ chunk_rows, double* __restrict__ out) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n * num_formats) return;
  const int64_t i = t / num_formats, f = t % num_formats;
  const core::BlockOperand& op = ops[i];
  const int64_t chunks = kStatsChunks ? core::chunks_for(op.rows * op.cols) : core::block_chunks_for(op);
  core::BlockRow row;
  for (int64_t c = op.first_chunk; c < op.first_chunk + chunks; ++c) {
    core::BlockRow part;
    for (int k = 0; k < core::kNumBlockColumns; ++k) part.v[k] = chunk_rows[(c * num_formats + f) * core::kNumBlockColumns + k];
    row.merge(part);
  }
  for (int k = 0; k < core::kNumBlockColumns; ++k) out[t * core::kNumBlockColumns + k] = row.v[k];
}

// launch_accumulate_fused_block_rows' one block: thread t merges chunks t, t + kBlockThreads, ... in order, the
// block's fixed tree combines the threads' rows, thread 0 merges them into dst after what it holds.
__global__ void __launch_bounds__(kBlockThreads)
    accumulate_block_rows_kernel(const double* __restrict__ chunk_rows, int64_t total_chunks, int num_formats,
                                 double* __restrict__ dst) {
  __shared__ double partial[kBlockThreads];
  __shared__ double fresh[core::kNumBlockFormats * core::kNumBlockColumns];
  core::BlockRow rows[core::kNumBlockFormats];
  for (int64_t c = threadIdx.x; c < total_chunks; c += kBlockThreads) {
    for (int f = 0; f < num_formats; ++f) {
      core::BlockRow part;
      for (int k = 0; k < core::kNumBlockColumns; ++k) part.v[k] = chunk_rows[(c * num_formats + f) * core::kNumBlockColumns + k];
      rows[f].merge(part);
    }
  }
  combine_rows_over_block<kBlockThreads>(rows, num_formats, partial, fresh);
  if (threadIdx.x == 0) {
    for (int f = 0; f < num_formats; ++f) {
      core::BlockRow held, part;
      for (int k = 0; k < core::kNumBlockColumns; ++k) {
        held.v[k] = dst[f * core::kNumBlockColumns + k];
        part.v[k] = fresh[f * core::kNumBlockColumns + k];
      }
      held.merge(part);
      for (int k = 0; k < core::kNumBlockColumns; ++k) dst[f * core::kNumBlockColumns + k] = held.v[k];
    }
  }
}

}  // namespace

cudaError_t launch_block_numerics(const core::BlockOperand* ops, int64_t n, int64_t total_chunks,
                                  const BlockFormatList& formats, const double* amaxes, double* chunk_rows, double* out,
                                  cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (formats.num < 1 || formats.num > core::kNumBlockFormats || total_chunks <= 0 || total_chunks > 0x7FFFFFFF ||
      chunk_rows == nullptr) {
    return cudaErrorInvalidValue;
  }
  GAPMON_LAUNCH(block_chunk_kernel, static_cast<unsigned>(total_chunks), kBlockThreads, stream)(ops, n, formats, amaxes,
                                                                                                chunk_rows);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  constexpr int threads = 128;
  const int64_t rows = n * formats.num;
  GAPMON_LAUNCH(block_rows_kernel<false>, static_cast<unsigned>((rows + threads - 1) / threads), threads, stream)(
      ops, n, formats.num, chunk_rows, out);
  return cudaGetLastError();
}

cudaError_t launch_merge_fused_block_rows(const core::BlockOperand* ops, int64_t n, int num_formats,
                                          const double* chunk_rows, double* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (num_formats < 1 || num_formats > core::kNumBlockFormats || chunk_rows == nullptr) return cudaErrorInvalidValue;
  constexpr int threads = 128;
  const int64_t rows = n * num_formats;
  GAPMON_LAUNCH(block_rows_kernel<true>, static_cast<unsigned>((rows + threads - 1) / threads), threads, stream)(
      ops, n, num_formats, chunk_rows, out);
  return cudaGetLastError();
}

cudaError_t launch_accumulate_fused_block_rows(const double* chunk_rows, int64_t total_chunks, int num_formats,
                                               double* dst, cudaStream_t stream) {
  if (total_chunks <= 0) return cudaSuccess;
  if (num_formats < 1 || num_formats > core::kNumBlockFormats || chunk_rows == nullptr || dst == nullptr) {
    return cudaErrorInvalidValue;
  }
  GAPMON_LAUNCH(accumulate_block_rows_kernel, 1u, kBlockThreads, stream)(chunk_rows, total_chunks, num_formats, dst);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace gapmon
