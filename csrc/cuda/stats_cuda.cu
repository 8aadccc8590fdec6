// CUDA statistics kernels. Every thread folds its elements into a double-precision core::State
// with core::GroupAccumulator (groups of 16 elements, csrc/core/group_acc.h); threads merge with
// Chan's rule over warp shuffles and shared memory in a fixed order, and one block per chunk
// writes the chunk's state. A second kernel merges each item's chunks in order.
// No float atomics: results are bit-identical run to run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../core/group_acc.h"
#include "../core/stats_state.h"
#include "stats_cuda.h"

namespace gapmon {
namespace cuda {
namespace {

using core::DType;
using core::State;
using core::StridedView;

constexpr int kThreads = 256;

template <typename T> struct Elem;
template <> struct Elem<float> {
  using block = float;
  static __device__ __forceinline__ float load(float v) { return v; }
  static constexpr float largest = 3.40282346638528859812e+38f;
};
template <> struct Elem<double> {
  using block = double;
  static __device__ __forceinline__ double load(double v) { return v; }
  static constexpr double largest = 1.7976931348623157e308;
};
template <> struct Elem<__half> {
  using block = float;
  static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
  static constexpr float largest = 3.40282346638528859812e+38f;
};
template <> struct Elem<__nv_bfloat16> {
  using block = float;
  static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static constexpr float largest = 3.40282346638528859812e+38f;
};

__device__ __forceinline__ State<double> shfl_down(const State<double>& s, int delta) {
  State<double> r;
  r.count = __shfl_down_sync(0xffffffffu, s.count, delta);
  r.mean = __shfl_down_sync(0xffffffffu, s.mean, delta);
  r.m2 = __shfl_down_sync(0xffffffffu, s.m2, delta);
  r.max_abs = __shfl_down_sync(0xffffffffu, s.max_abs, delta);
  r.sumsq = __shfl_down_sync(0xffffffffu, s.sumsq, delta);
  r.nonfinite = __shfl_down_sync(0xffffffffu, s.nonfinite, delta);
  r.zeros = __shfl_down_sync(0xffffffffu, s.zeros, delta);
  return r;
}

// Merges the states of all threads of the block in a fixed tree order; thread 0 gets the result.
__device__ State<double> block_merge(State<double> s) {
  __shared__ State<double> warp_states[kThreads / 32];
  for (int delta = 16; delta > 0; delta >>= 1) s = core::merge(s, shfl_down(s, delta));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_states[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < kThreads / 32 ? warp_states[lane] : State<double>();
    for (int delta = 16; delta > 0; delta >>= 1) s = core::merge(s, shfl_down(s, delta));
  }
  return s;
}

// One run of `len` elements with element stride `stride`; unit-stride runs use 16-byte loads on
// the aligned body and scalar loads on the head and tail.
template <typename T>
__device__ void accumulate_run(const T* p, int64_t len, int64_t stride, core::GroupAccumulator<typename Elem<T>::block>& acc) {
  constexpr auto largest = Elem<T>::largest;
  if (stride != 1) {
    for (int64_t i = threadIdx.x; i < len; i += kThreads) acc.push(Elem<T>::load(p[i * stride]), largest);
    return;
  }
  constexpr int kPerVec = 16 / sizeof(T);
  const int64_t misalign = (reinterpret_cast<uintptr_t>(p) % 16) / sizeof(T);
  int64_t head = misalign == 0 ? 0 : kPerVec - misalign;
  if (head > len) head = len;
  if (reinterpret_cast<uintptr_t>(p) % sizeof(T) != 0) head = len;  // not even element-aligned: scalar only
  for (int64_t i = threadIdx.x; i < head; i += kThreads) acc.push(Elem<T>::load(p[i]), largest);
  const int64_t nvec = (len - head) / kPerVec;
  const uint4* vec = reinterpret_cast<const uint4*>(p + head);
  for (int64_t v = threadIdx.x; v < nvec; v += kThreads) {
    const uint4 bits = __ldg(vec + v);
    T vals[kPerVec];
    memcpy(vals, &bits, 16);
#pragma unroll
    for (int k = 0; k < kPerVec; ++k) acc.push(Elem<T>::load(vals[k]), largest);
  }
  for (int64_t i = head + nvec * kPerVec + threadIdx.x; i < len; i += kThreads) acc.push(Elem<T>::load(p[i]), largest);
}

template <typename T>
__device__ State<double> chunk_state(const StridedView& v, int64_t item, int64_t lo, int64_t hi) {
  core::GroupAccumulator<typename Elem<T>::block> acc;
  const T* data = static_cast<const T*>(v.data);
  core::RowCursor rows(v, item, lo, hi);
  int64_t offset, len, stride;
  while (rows.next(offset, len, stride)) accumulate_run<T>(data + offset, len, stride, acc);
  acc.flush();
  return acc.state;
}

__global__ void __launch_bounds__(kThreads) chunk_kernel(const StridedView* views, int64_t num_views,
                                                         int64_t total_chunks, double* chunk_states) {
  for (int64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    const StridedView& v = views[core::find_view(views, num_views, c)];
    const int64_t local = c - v.first_chunk;
    const int64_t item = local / v.chunks_per_item;
    const int64_t lo = (local % v.chunks_per_item) * core::kChunkElems;
    const int64_t hi = lo + core::kChunkElems < v.item_numel ? lo + core::kChunkElems : v.item_numel;
    State<double> s;
    switch (v.dtype) {
      case DType::kFloat32: s = chunk_state<float>(v, item, lo, hi); break;
      case DType::kFloat64: s = chunk_state<double>(v, item, lo, hi); break;
      case DType::kFloat16: s = chunk_state<__half>(v, item, lo, hi); break;
      case DType::kBFloat16: s = chunk_state<__nv_bfloat16>(v, item, lo, hi); break;
    }
    s = block_merge(s);
    if (threadIdx.x == 0) core::store_state(s, chunk_states + c * core::kNumStateColumns);
    __syncthreads();  // warp_states is reused by the next chunk of this block
  }
}

__global__ void merge_items_kernel(const StridedView* views, int64_t num_views, int64_t rows,
                                   const double* chunk_states, float* out_stats, double* out_states,
                                   int64_t correction) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (row >= rows) return;
  const StridedView& v = views[core::find_view_by_row(views, num_views, row)];
  const int64_t first = v.first_chunk + (row - v.out_row) * v.chunks_per_item;
  State<double> s;
  for (int64_t k = 0; k < v.chunks_per_item; ++k) {
    s = core::merge(s, core::load_state(chunk_states + (first + k) * core::kNumStateColumns));
  }
  s = core::repeat(s, double(v.repeat));
  if (out_stats != nullptr) core::finalize(s, correction, out_stats + row * core::kNumStats);
  if (out_states != nullptr) core::store_state(s, out_states + row * core::kNumStateColumns);
}

__global__ void merge_states_kernel(const double* states, int64_t parts, int64_t n, double* out) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  State<double> s;
  for (int64_t r = 0; r < parts; ++r) s = core::merge(s, core::load_state(states + (r * n + i) * core::kNumStateColumns));
  core::store_state(s, out + i * core::kNumStateColumns);
}

__global__ void finalize_states_kernel(const double* states, int64_t n, int64_t correction, float* out) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  core::finalize(core::load_state(states + i * core::kNumStateColumns), correction, out + i * core::kNumStats);
}

// One thread, rows in order: instance counts are small (a batch), and the order is fixed.
__global__ void accumulate_instances_kernel(const float* stats, int64_t rows, double* acc_row) {
  for (int64_t r = 0; r < rows; ++r) core::accumulate_instance(stats + r * core::kNumStats, acc_row);
}

int64_t blocks_for(int64_t n, int64_t threads) { return (n + threads - 1) / threads; }

}  // namespace

cudaError_t launch_stats(const StridedView* views, int64_t num_views, int64_t total_chunks, int64_t rows,
                         double* chunk_states, float* out_stats, double* out_states, int64_t correction,
                         cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t grid = total_chunks < (int64_t(1) << 20) ? total_chunks : (int64_t(1) << 20);
  chunk_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(views, num_views, total_chunks, chunk_states);
  merge_items_kernel<<<static_cast<unsigned>(blocks_for(rows, 128)), 128, 0, stream>>>(
      views, num_views, rows, chunk_states, out_stats, out_states, correction);
  return cudaGetLastError();
}

cudaError_t launch_merge_states(const double* states, int64_t parts, int64_t n, double* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  merge_states_kernel<<<static_cast<unsigned>(blocks_for(n, 128)), 128, 0, stream>>>(states, parts, n, out);
  return cudaGetLastError();
}

cudaError_t launch_finalize_states(const double* states, int64_t n, int64_t correction, float* out,
                                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  finalize_states_kernel<<<static_cast<unsigned>(blocks_for(n, 128)), 128, 0, stream>>>(states, n, correction, out);
  return cudaGetLastError();
}

cudaError_t launch_accumulate_instances(const float* stats, int64_t rows, double* acc_row, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  accumulate_instances_kernel<<<1, 1, 0, stream>>>(stats, rows, acc_row);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace gapmon
