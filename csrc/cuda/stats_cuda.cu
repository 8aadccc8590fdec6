// CUDA statistics kernels. Every thread folds its elements into a double-precision core::State
// with core::GroupAccumulator (groups of about kGroup elements, csrc/core/group_acc.h); the threads
// that share a chunk (a block, or a warp for short items) merge with Chan's rule over warp shuffles
// and shared memory in a fixed order, and write the chunk's state. A second kernel merges each
// item's chunks in order. No float atomics: results are bit-identical run to run.
// Kernels are launched through GAPMON_LAUNCH so that tests/cpp/cuda_emulator.h can run this file.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <type_traits>

#include "../core/group_acc.h"
#include "../core/stats_state.h"
#include "stats_cuda.h"

#if defined(GAPMON_CUDA_EMULATION)
// tests/cpp/cuda_emulator.h (force-included) runs these kernels on the host for ctest.
#elif !defined(__CUDACC_VER_MAJOR__) || __CUDACC_VER_MAJOR__ < 12
#error "gapmon's CUDA kernels need CUDA 12 or newer (__grid_constant__ kernel parameters)"
#else
#define GAPMON_LAUNCH(kernel, grid, block, stream) kernel<<<grid, block, 0, stream>>>
#endif

namespace gapmon {
namespace cuda {
namespace {

using core::DType;
using core::State;
using core::StridedView;

constexpr int kThreads = 256;
// Items of at most this many chunks are merged by one thread each, longer ones by a block each.
constexpr int64_t kShortItemChunks = 8;
// When every item holds at most kWarpItemElems elements and there are at least kWarpMinChunks
// chunks (enough warps to fill the GPU), each chunk is read by a warp instead of a block: a short
// row then costs a warp's merge tree rather than a block's barriers and shared-memory round.
constexpr int64_t kWarpItemElems = 8192;
constexpr int64_t kWarpMinChunks = 2048;

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

// Merges the states of a warp's lanes in a fixed tree order; lane 0 gets the result.
__device__ __forceinline__ State<double> warp_merge(State<double> s) {
  for (int delta = 16; delta > 0; delta >>= 1) s = core::merge(s, shfl_down(s, delta));
  return s;
}

// Merges the states of all threads of the block in a fixed tree order; thread 0 gets the result.
__device__ State<double> block_merge(State<double> s) {
  __shared__ State<double> warp_states[kThreads / 32];
  s = warp_merge(s);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_states[warp] = s;
  __syncthreads();
  if (warp == 0) s = warp_merge(lane < kThreads / 32 ? warp_states[lane] : State<double>());
  return s;
}

// The threads that share one chunk: the whole block (kLanes == kThreads) or one warp (kLanes ==
// 32, for short items: a block then reads kThreads / 32 chunks at once).
template <int kLanes>
struct ChunkGroup {
  static_assert(kLanes == kThreads || kLanes == 32, "a chunk is read by a block or by a warp");
  static constexpr int kPerBlock = kThreads / kLanes;
  __device__ static int lane() { return threadIdx.x % kLanes; }
  __device__ static int index() { return threadIdx.x / kLanes; }
  // Whether any thread of the group has `v` set (a barrier for the group).
  __device__ static bool any(bool v) {
    if constexpr (kLanes == kThreads) {
      return __syncthreads_or(v);
    } else {
      return __any_sync(0xffffffffu, v);
    }
  }
  // The group's merged state, in lane 0.
  __device__ static State<double> merge(State<double> s) {
    if constexpr (kLanes == kThreads) {
      return block_merge(s);
    } else {
      return warp_merge(s);
    }
  }
  // Orders the group's reuse of shared memory before its next chunk.
  __device__ static void sync() {
    if constexpr (kLanes == kThreads) __syncthreads();
  }
};

// Accumulates lane `lane` (of kLanes)'s share of one run of `len` elements with element stride
// `stride` into `acc`, whose block precision (float, or double when redoing an overflowed chunk)
// may exceed T's. Unit-stride runs use 16-byte loads on the aligned body (core::walk_vectors) and
// scalar loads on the head and tail.
template <int kLanes, typename T, typename Acc>
__device__ __forceinline__ void accumulate_run(const T* p, int64_t len, int64_t stride, int lane, Acc& acc) {
  using block_t = decltype(acc.s1);
  const auto largest = static_cast<block_t>(Elem<T>::largest);
  auto push = [&](T x) { acc.push(static_cast<block_t>(Elem<T>::load(x)), largest); };  // head, tail, strided
  if (stride != 1) {
    for (int64_t i = lane; i < len; i += kLanes) push(p[i * stride]);
    return;
  }
  constexpr int kPerVec = 16 / sizeof(T);
  const int64_t misalign = (reinterpret_cast<uintptr_t>(p) % 16) / sizeof(T);
  int64_t head = misalign == 0 ? 0 : kPerVec - misalign;
  if (head > len) head = len;
  if (reinterpret_cast<uintptr_t>(p) % sizeof(T) != 0) head = len;  // not even element-aligned: scalar only
  for (int64_t i = lane; i < head; i += kLanes) push(p[i]);
  const int64_t nvec = (len - head) / kPerVec;
  const uint4* vec = reinterpret_cast<const uint4*>(p + head);
  core::walk_vectors(
      nvec, lane, kLanes, [&](int64_t v) { return __ldg(vec + v); },
      [&](const uint4& bits) {
        T vals[kPerVec];
        memcpy(static_cast<void*>(vals), &bits, 16);
        block_t xs[kPerVec];
#pragma unroll
        for (int k = 0; k < kPerVec; ++k) xs[k] = static_cast<block_t>(Elem<T>::load(vals[k]));
        acc.push(xs, largest);
      });
  for (int64_t i = head + nvec * kPerVec + lane; i < len; i += kLanes) push(p[i]);
}

// This thread's share of the elements [lo, hi) of `item`, accumulated in block precision block_t.
template <int kLanes, typename T, typename block_t>
__device__ State<double> thread_state(const StridedView& v, int64_t item, int64_t lo, int64_t hi, bool& overflow) {
  core::GroupAccumulator<block_t> acc;
  const T* data = static_cast<const T*>(v.data);
  const int lane = ChunkGroup<kLanes>::lane();
  core::RowCursor rows(v, item, lo, hi);
  int64_t offset, len, stride;
  while (rows.next(offset, len, stride)) accumulate_run<kLanes, T>(data + offset, len, stride, lane, acc);
  acc.flush();
  overflow = acc.overflow;
  return acc.state;
}

// This thread's share of a chunk. If any thread's float sums overflowed on finite elements
// (|x| above ~1e19), the whole group redoes the chunk in double, as the CPU kernels do.
template <int kLanes, typename T>
__device__ State<double> chunk_thread_state(const StridedView& v, int64_t item, int64_t lo, int64_t hi) {
  using block_t = typename Elem<T>::block;
  bool overflow = false;
  State<double> s = thread_state<kLanes, T, block_t>(v, item, lo, hi, overflow);
  if constexpr (!std::is_same<block_t, double>::value) {
    if (ChunkGroup<kLanes>::any(overflow)) s = thread_state<kLanes, T, double>(v, item, lo, hi, overflow);
  }
  return s;
}

__device__ __forceinline__ const StridedView* views_of(const ViewTable& table) {
  return table.device != nullptr ? table.device : table.inline_views;
}

// The state of every chunk, kLanes threads per chunk (grid-stride over chunks).
template <int kLanes>
__global__ void __launch_bounds__(kThreads, 2) chunk_kernel(const __grid_constant__ ViewTable table, int64_t total_chunks,
                                                         double* chunk_states) {
  using Group = ChunkGroup<kLanes>;
  const StridedView* views = views_of(table);
  const int64_t stride = int64_t(gridDim.x) * Group::kPerBlock;
  for (int64_t c = int64_t(blockIdx.x) * Group::kPerBlock + Group::index(); c < total_chunks; c += stride) {
    const StridedView& v = views[core::find_view(views, table.num, c)];
    const int64_t local = c - v.first_chunk;
    const int64_t item = local / v.chunks_per_item;
    const int64_t lo = (local % v.chunks_per_item) * core::kChunkElems;
    const int64_t hi = lo + core::kChunkElems < v.item_numel ? lo + core::kChunkElems : v.item_numel;
    State<double> s;
    switch (v.dtype) {
      case DType::kFloat32: s = chunk_thread_state<kLanes, float>(v, item, lo, hi); break;
      case DType::kFloat64: s = chunk_thread_state<kLanes, double>(v, item, lo, hi); break;
      case DType::kFloat16: s = chunk_thread_state<kLanes, __half>(v, item, lo, hi); break;
      case DType::kBFloat16: s = chunk_thread_state<kLanes, __nv_bfloat16>(v, item, lo, hi); break;
    }
    s = Group::merge(s);
    if (Group::lane() == 0) core::store_state(s, chunk_states + c * core::kNumStateColumns);
    Group::sync();
  }
}

// Writes row `row`'s merged state: finalised statistics and/or the raw state.
__device__ __forceinline__ void write_row(State<double> s, const StridedView& v, int64_t row, double* out_stats,
                                          double* out_states, int64_t correction) {
  s = core::repeat(s, double(v.repeat));
  if (out_stats != nullptr) core::finalize(s, correction, out_stats + row * core::kNumStats);
  if (out_states != nullptr) core::store_state(s, out_states + row * core::kNumStateColumns);
}

__device__ __forceinline__ State<double> chunk_at(const double* chunk_states, int64_t c) {
  return core::load_state(chunk_states + c * core::kNumStateColumns);
}

// Items of a few chunks each (many small rows): one thread per row merges its chunks in order.
__global__ void merge_short_items_kernel(const __grid_constant__ ViewTable table, int64_t rows,
                                         const double* chunk_states, double* out_stats, double* out_states,
                                         int64_t correction) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (row >= rows) return;
  const StridedView* views = views_of(table);
  const StridedView& v = views[core::find_view_by_row(views, table.num, row)];
  const int64_t first = v.first_chunk + (row - v.out_row) * v.chunks_per_item;
  State<double> s;
  for (int64_t k = 0; k < v.chunks_per_item; ++k) s = core::merge(s, chunk_at(chunk_states, first + k));
  write_row(s, v, row, out_stats, out_states, correction);
}

// Items of many chunks (a large tensor has thousands): one block per row. Thread t merges chunks
// t, t + kThreads, ... in order, then the block tree merges the threads, also in a fixed order,
// so a row of n chunks takes about n / kThreads dependent steps instead of n.
__global__ void __launch_bounds__(kThreads) merge_long_items_kernel(const __grid_constant__ ViewTable table,
                                                                    int64_t rows, const double* chunk_states,
                                                                    double* out_stats, double* out_states,
                                                                    int64_t correction) {
  const StridedView* views = views_of(table);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const StridedView& v = views[core::find_view_by_row(views, table.num, row)];
    const int64_t first = v.first_chunk + (row - v.out_row) * v.chunks_per_item;
    State<double> s;
#pragma unroll 4
    for (int64_t k = threadIdx.x; k < v.chunks_per_item; k += kThreads) s = core::merge(s, chunk_at(chunk_states, first + k));
    s = block_merge(s);
    if (threadIdx.x == 0) write_row(s, v, row, out_stats, out_states, correction);
    __syncthreads();  // warp_states is reused by the next row of this block
  }
}

__global__ void merge_states_kernel(const double* states, int64_t parts, int64_t n, double* out) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  State<double> s;
  for (int64_t r = 0; r < parts; ++r) s = core::merge(s, core::load_state(states + (r * n + i) * core::kNumStateColumns));
  core::store_state(s, out + i * core::kNumStateColumns);
}

__global__ void finalize_states_kernel(const double* states, int64_t n, int64_t correction, double* out) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  core::finalize(core::load_state(states + i * core::kNumStateColumns), correction, out + i * core::kNumStats);
}

// Bytes carried by one upload launch: well inside the 4 KB of kernel parameters every CUDA
// version accepts.
constexpr int kUploadWords = 480;
struct UploadPiece {
  uint64_t words[kUploadWords];
};

__global__ void upload_kernel(const __grid_constant__ UploadPiece piece, int64_t words, uint64_t* dst) {
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) dst[i] = piece.words[i];
}

// One thread, rows in order: instance counts are small (a batch), and the order is fixed.
__global__ void accumulate_instances_kernel(const double* stats, int64_t rows, double* acc_row) {
  for (int64_t r = 0; r < rows; ++r) core::accumulate_instance(stats + r * core::kNumStats, acc_row);
}

int64_t blocks_for(int64_t n, int64_t threads) { return (n + threads - 1) / threads; }

}  // namespace

cudaError_t launch_stats(const ViewTable& views, int64_t total_chunks, int64_t rows, int64_t max_chunks_per_item,
                         int64_t max_item_numel, double* chunk_states, double* out_stats, double* out_states,
                         int64_t correction, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  constexpr int64_t kMaxGrid = int64_t(1) << 20;
  if (max_item_numel <= kWarpItemElems && total_chunks >= kWarpMinChunks) {
    const int64_t blocks = blocks_for(total_chunks, ChunkGroup<32>::kPerBlock);
    GAPMON_LAUNCH(chunk_kernel<32>, static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid), kThreads, stream)(
        views, total_chunks, chunk_states);
  } else {
    GAPMON_LAUNCH(chunk_kernel<kThreads>, static_cast<unsigned>(total_chunks < kMaxGrid ? total_chunks : kMaxGrid),
                  kThreads, stream)(views, total_chunks, chunk_states);
  }
  if (max_chunks_per_item <= kShortItemChunks) {
    GAPMON_LAUNCH(merge_short_items_kernel, static_cast<unsigned>(blocks_for(rows, 128)), 128, stream)(
        views, rows, chunk_states, out_stats, out_states, correction);
  } else {
    GAPMON_LAUNCH(merge_long_items_kernel, static_cast<unsigned>(rows < kMaxGrid ? rows : kMaxGrid), kThreads, stream)(
        views, rows, chunk_states, out_stats, out_states, correction);
  }
  return cudaGetLastError();
}

cudaError_t launch_upload(const void* src, int64_t bytes, void* dst, cudaStream_t stream) {
  if (bytes % sizeof(uint64_t) != 0) return cudaErrorInvalidValue;  // callers upload whole 8-byte words
  const auto* words = static_cast<const uint64_t*>(src);
  auto* out = static_cast<uint64_t*>(dst);
  const int64_t total = bytes / int64_t(sizeof(uint64_t));
  for (int64_t first = 0; first < total; first += kUploadWords) {
    const int64_t n = total - first < kUploadWords ? total - first : kUploadWords;
    UploadPiece piece;
    memcpy(piece.words, words + first, n * sizeof(uint64_t));
    GAPMON_LAUNCH(upload_kernel, 1, 128, stream)(piece, n, out + first);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t launch_merge_states(const double* states, int64_t parts, int64_t n, double* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  GAPMON_LAUNCH(merge_states_kernel, static_cast<unsigned>(blocks_for(n, 128)), 128, stream)(states, parts, n, out);
  return cudaGetLastError();
}

cudaError_t launch_finalize_states(const double* states, int64_t n, int64_t correction, double* out,
                                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  GAPMON_LAUNCH(finalize_states_kernel, static_cast<unsigned>(blocks_for(n, 128)), 128, stream)(states, n, correction,
                                                                                                   out);
  return cudaGetLastError();
}

cudaError_t launch_accumulate_instances(const double* stats, int64_t rows, double* acc_row, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  GAPMON_LAUNCH(accumulate_instances_kernel, 1, 1, stream)(stats, rows, acc_row);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace gapmon
