// CUDA numerics kernels: the exponent histogram of |x| and the central moments to the 4th of every
// item (csrc/core/numerics.h holds the math, shared with the CPU kernel). A block reads a chunk:
// each thread bins its elements with integer atomics in shared memory (exact in any order) and
// sums the powers of its elements' deviations from its first element in double; the threads'
// moments merge over a fixed tree. A second launch merges each item's chunks in chunk order, so
// the rows are bit-identical run to run. Launched through GAPMON_LAUNCH so that
// tests/cpp/cuda_emulator.h can run this file on the host.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>

#include "../core/numerics.h"
#include "launch.h"
#include "numerics_cuda.h"


namespace gapmon {
namespace cuda {
namespace {

using core::DType;
using core::Moments;
using core::StridedView;

constexpr int kThreads = 256;
constexpr int kColumns = core::kNumNumericsColumns;

// (value, bin) of a float32 value given by its bits.
__device__ __forceinline__ void from_f32_bits(uint32_t bits, double& value, int& bin) {
  float f;
  memcpy(&f, &bits, sizeof f);
  bin = core::exponent_bin_f32(bits);
  value = f;
}

// (value, bin) of one element; float16/bfloat16 widen to float32 exactly.
__device__ __forceinline__ void load_element(const void* p, DType dtype, double& value, int& bin) {
  switch (dtype) {
    case DType::kFloat32: {
      uint32_t bits;
      memcpy(&bits, p, sizeof bits);
      return from_f32_bits(bits, value, bin);
    }
    case DType::kFloat64: {
      uint64_t bits;
      memcpy(&bits, p, sizeof bits);
      double d;
      memcpy(&d, &bits, sizeof d);
      bin = core::exponent_bin_f64(bits);
      value = d;
      return;
    }
    case DType::kBFloat16: {
      uint16_t raw;
      memcpy(&raw, p, sizeof raw);
      return from_f32_bits(static_cast<uint32_t>(raw) << 16, value, bin);  // bfloat16 is float32's top half
    }
    case DType::kFloat16: {
      __half h;
      memcpy(&h, p, sizeof h);
      const float f = __half2float(h);
      uint32_t bits;
      memcpy(&bits, &f, sizeof bits);
      return from_f32_bits(bits, value, bin);
    }
  }
}

__device__ __forceinline__ int64_t element_bytes(DType dtype) {
  return dtype == DType::kFloat64 ? 8 : dtype == DType::kFloat32 ? 4 : 2;
}

struct Chunk {
  const StridedView* view;
  int64_t item, lo, hi;
};

__device__ __forceinline__ Chunk chunk_at(const StridedView* views, int64_t num_views, int64_t c) {
  Chunk k;
  k.view = views + core::find_view(views, num_views, c);
  const int64_t local = c - k.view->first_chunk;
  k.item = local / k.view->chunks_per_item;
  k.lo = (local % k.view->chunks_per_item) * core::kChunkElems;
  k.hi = k.lo + core::kChunkElems < k.view->item_numel ? k.lo + core::kChunkElems : k.view->item_numel;
  return k;
}

// This thread's elements of a chunk (every kThreads-th of each run): bins into `bins` (shared), and
// its moments, as power sums of deviations from its first element (at most kChunkElems / kThreads
// = 256 elements: one block of sums, as the CPU kernel's).
__device__ Moments thread_numerics(const Chunk& k, unsigned* bins) {
  const StridedView& v = *k.view;
  const char* base = static_cast<const char*>(v.data);
  const int64_t size = element_bytes(v.dtype);
  double n = 0, shift = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0;
  core::RowCursor cursor(v, k.item, k.lo, k.hi);
  int64_t offset, len, stride;
  while (cursor.next(offset, len, stride)) {
    for (int64_t i = threadIdx.x; i < len; i += kThreads) {
      double x = 0;
      int bin = core::nNaN;
      load_element(base + (offset + i * stride) * size, v.dtype, x, bin);
      atomicAdd(bins + bin, 1u);
      if (n == 0) shift = core::is_finite(x) ? x : 0.0;
      const double d = x - shift, d2 = d * d;
      n += 1;
      s1 += d;
      s2 += d2;
      s3 += d2 * d;
      s4 += d2 * d2;
    }
  }
  return core::from_power_sums(n, shift, s1, s2, s3, s4);
}

__global__ void __launch_bounds__(kThreads) numerics_chunk_kernel(const __grid_constant__ ViewTable table,
                                                                    int64_t total_chunks, double* chunk_rows) {
  __shared__ unsigned bins[core::kNumBins];
  __shared__ Moments moments[kThreads];
  const StridedView* views = table.device != nullptr ? table.device : table.inline_views;
  for (int64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    for (int b = threadIdx.x; b < core::kNumBins; b += kThreads) bins[b] = 0u;
    __syncthreads();
    moments[threadIdx.x] = thread_numerics(chunk_at(views, table.num, c), bins);
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half /= 2) {  // a fixed merge tree
      if (static_cast<int>(threadIdx.x) < half) moments[threadIdx.x] = core::merge(moments[threadIdx.x], moments[threadIdx.x + half]);
      __syncthreads();
    }
    double* row = chunk_rows + c * kColumns;
    for (int b = threadIdx.x; b < core::kNumBins; b += kThreads) row[b] = static_cast<double>(bins[b]);
    if (threadIdx.x == 0) core::store_moments(moments[0], row);
    __syncthreads();  // bins and moments are reused by the next chunk
  }
}

// Row r of the output from its item's chunks: bins summed (exact integers), moments merged in
// chunk order by one thread, all times the view's repeat.
__global__ void __launch_bounds__(kThreads) numerics_rows_kernel(const __grid_constant__ ViewTable table, int64_t rows,
                                                                   const double* chunk_rows, double* out) {
  const StridedView* views = table.device != nullptr ? table.device : table.inline_views;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const StridedView& v = views[core::find_view_by_row(views, table.num, r)];
    const int64_t first = v.first_chunk + (r - v.out_row) * v.chunks_per_item;
    const double* chunks = chunk_rows + first * kColumns;
    double* row = out + r * kColumns;
    for (int b = threadIdx.x; b < core::kNumBins; b += kThreads) {
      double total = 0;
      for (int64_t k = 0; k < v.chunks_per_item; ++k) total += chunks[k * kColumns + b];
      row[b] = total * static_cast<double>(v.repeat);
    }
    if (threadIdx.x == 0) {
      Moments m;
      for (int64_t k = 0; k < v.chunks_per_item; ++k) m = core::merge(m, core::load_moments(chunks + k * kColumns));
      core::store_moments(core::repeat(m, static_cast<double>(v.repeat)), row);
    }
  }
}

__global__ void merge_numerics_kernel(const double* states, int64_t parts, int64_t n, double* out) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  double* row = out + i * kColumns;
  for (int b = 0; b < core::kNumBins; ++b) row[b] = 0;
  Moments m;
  for (int64_t r = 0; r < parts; ++r) {
    const double* part = states + (r * n + i) * kColumns;
    for (int b = 0; b < core::kNumBins; ++b) row[b] += part[b];
    m = core::merge(m, core::load_moments(part));
  }
  core::store_moments(m, row);
}

unsigned grid_for(int64_t n) {
  constexpr int64_t kMaxGrid = int64_t(1) << 20;
  return static_cast<unsigned>(n < kMaxGrid ? n : kMaxGrid);
}

}  // namespace

cudaError_t launch_numerics(const ViewTable& views, int64_t total_chunks, int64_t rows, double* chunk_rows, double* out,
                            cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (chunk_rows == nullptr || out == nullptr) return cudaErrorInvalidValue;
  GAPMON_LAUNCH(numerics_chunk_kernel, grid_for(total_chunks), kThreads, stream)(views, total_chunks, chunk_rows);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  GAPMON_LAUNCH(numerics_rows_kernel, grid_for(rows), kThreads, stream)(views, rows, chunk_rows, out);
  return cudaGetLastError();
}

cudaError_t launch_merge_numerics(const double* states, int64_t parts, int64_t n, double* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  GAPMON_LAUNCH(merge_numerics_kernel, static_cast<unsigned>((n + 127) / 128), 128, stream)(states, parts, n, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace gapmon
