// The optimizer-update sums on CUDA: a block per chunk of kChunkElems elements of one parameter (each
// thread strides the chunk, so a warp's loads are coalesced), a tree reduction over the block's threads in
// a fixed order, then one thread per parameter adds its chunks in order.
#include "launch.h"
#include "update_cuda.h"

namespace gapmon {
namespace cuda {
namespace {

__global__ void __launch_bounds__(kUpdateThreads)
    update_chunk_kernel(const core::UpdateOperands* __restrict__ ops, int64_t n, double* __restrict__ chunk_sums) {
  __shared__ double partial[core::kUpdateSums][kUpdateThreads];
  const int64_t chunk = blockIdx.x;
  const core::UpdateOperands& op = ops[core::find_update_operand(ops, n, chunk)];
  const int64_t lo = (chunk - op.first_chunk) * core::kChunkElems;
  const int64_t hi = lo + core::kChunkElems < op.numel ? lo + core::kChunkElems : op.numel;
  core::UpdateSums s;
  core::with_update_types(op.weight_dtype, op.grad_dtype, [&](auto w, auto g) {
    s = core::update_sums_strided<decltype(w), decltype(g)>(op, lo + threadIdx.x, hi, kUpdateThreads);
  });
  for (int k = 0; k < core::kUpdateSums; ++k) partial[k][threadIdx.x] = s.v[k];
  __syncthreads();
  for (int width = kUpdateThreads / 2; width > 0; width /= 2) {
    if (static_cast<int>(threadIdx.x) < width) {
      for (int k = 0; k < core::kUpdateSums; ++k) partial[k][threadIdx.x] += partial[k][threadIdx.x + width];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    for (int k = 0; k < core::kUpdateSums; ++k) chunk_sums[chunk * core::kUpdateSums + k] = partial[k][0];
  }
}

__global__ void update_rows_kernel(const core::UpdateOperands* __restrict__ ops, int64_t n,
                                   const double* __restrict__ chunk_sums, double* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const core::UpdateOperands& op = ops[i];
  core::UpdateSums s;
  const int64_t end = op.first_chunk + core::chunks_for(op.numel);
  for (int64_t c = op.first_chunk; c < end; ++c) {
    for (int k = 0; k < core::kUpdateSums; ++k) s.v[k] += chunk_sums[c * core::kUpdateSums + k];
  }
  core::store_update_row(s, op.numel, out + i * core::kUpdateColumns);
}

}  // namespace

cudaError_t launch_update_sums(const core::UpdateOperands* ops, int64_t n, int64_t total_chunks, double* chunk_sums,
                               double* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (total_chunks <= 0 || total_chunks > 0x7FFFFFFF || chunk_sums == nullptr) return cudaErrorInvalidValue;
  GAPMON_LAUNCH(update_chunk_kernel, static_cast<unsigned>(total_chunks), kUpdateThreads, stream)(ops, n, chunk_sums);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int threads = 128;
  GAPMON_LAUNCH(update_rows_kernel, static_cast<unsigned>((n + threads - 1) / threads), threads, stream)(
      ops, n, chunk_sums, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace gapmon
