// The chunk reader shared by the CUDA kernels (csrc/cuda/stats_cuda.cu, csrc/cuda/numerics_cuda.cu):
// how the threads of a group (a block, or a warp) read one chunk of a view and fold their elements
// into double-precision statistics states (csrc/core/group_acc.h), merge those states in a fixed
// order, locate chunks and rows, and publish and count the pieces of items of several chunks.
//
// An Observer sees every element as it is folded (widened to the block precision: float, or double
// for float64 inputs), in the same pass: NoObserver for the statistics kernel, where it compiles
// away, or the numerics observer of numerics_cuda.cu, which reads each chunk once for both.
// Elements are folded in the same order with or without an observer, so the states' bits are too.
//
// Included by .cu files (or by their host emulation, tests/cpp/cuda_emulator.h) only; everything here
// has internal linkage, one copy per kernel source, as when it lived in stats_cuda.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <type_traits>

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
  // Whether any thread of the group has `v` set (a barrier for the group). A warp vote converges the
  // lanes but does not order their memory accesses: __syncwarp does (shared memory written before
  // the vote is visible to every lane after it).
  __device__ static bool any(bool v) {
    if constexpr (kLanes == kThreads) {
      return __syncthreads_or(v);
    } else {
      const bool found = __any_sync(0xffffffffu, v);
      __syncwarp();
      return found;
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
    if constexpr (kLanes == kThreads) {
      __syncthreads();
    } else {
      __syncwarp();
    }
  }
};

// The observer of the statistics kernel: sees nothing, and compiles away. An observer sees a scalar
// element with see(x) and a loaded 16-byte vector's elements with see_vector(xs), in order.
struct NoObserver {
  static constexpr bool kSeesElements = false;
  template <typename block_t>
  __device__ __forceinline__ void see(block_t) {}
  template <typename block_t, int K>
  __device__ __forceinline__ void see_vector(const block_t (&)[K]) {}
  __device__ __forceinline__ void finish() {}
};

// Accumulates lane `lane` (of kLanes)'s share of one run of `len` elements with element stride
// `stride` into `acc`, whose block precision (float, or double when redoing a chunk) may exceed
// T's, and shows each element to `observer`. Unit-stride runs use 16-byte loads on the aligned body
// (core::walk_vectors) and scalar loads on the head and tail.
template <int kLanes, typename T, typename Acc, typename Observer>
__device__ __forceinline__ void accumulate_run(const T* p, int64_t len, int64_t stride, int lane, Acc& acc,
                                               Observer& observer) {
  using block_t = decltype(acc.s1);
  const auto largest = static_cast<block_t>(Elem<T>::largest);
  auto push = [&](T x) {  // head, tail, strided
    const block_t value = static_cast<block_t>(Elem<T>::load(x));
    observer.see(value);
    acc.push(value, largest);
  };
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
      [&](const uint4& bits, bool first_of_batch) {
        T vals[kPerVec];
        memcpy(static_cast<void*>(vals), &bits, 16);
        block_t xs[kPerVec];
#pragma unroll
        for (int k = 0; k < kPerVec; ++k) xs[k] = static_cast<block_t>(Elem<T>::load(vals[k]));
        observer.see_vector(xs);
        acc.push(xs, largest, first_of_batch);
      },
      [&] { acc.end_batch(); });
  for (int64_t i = head + nvec * kPerVec + lane; i < len; i += kLanes) push(p[i]);
}

// Whether an item's elements are one unit-stride run (or a single element, or none).
__device__ __forceinline__ bool is_contiguous(const StridedView& v) {
  return v.ndim == 0 || (v.ndim == 1 && v.strides[0] == 1);
}

// Folds this thread's share of the elements [lo, hi) of `item` into `state`, in block precision
// block_t, showing each to `observer`. Returns whether the float sums must be redone
// (core::GroupAccumulator::redo).
template <int kLanes, typename T, typename block_t, bool kCountNonfinite, typename Observer = NoObserver>
__device__ __forceinline__ bool accumulate_chunk(const StridedView& v, int64_t item, int64_t lo, int64_t hi,
                                                 State<double>& state, Observer&& observer = NoObserver()) {
  core::GroupAccumulator<block_t, kCountNonfinite, sizeof(T) == 2 ? 2 * core::kGroup : core::kGroup> acc(state);
  const T* data = static_cast<const T*>(v.data);
  const int lane = ChunkGroup<kLanes>::lane();
  if (is_contiguous(v)) {
    accumulate_run<kLanes, T>(data + item * v.item_stride + lo, hi - lo, 1, lane, acc, observer);
  } else {
    core::RowCursor rows(v, item, lo, hi);
    int64_t offset, len, stride;
    while (rows.next(offset, len, stride)) accumulate_run<kLanes, T>(data + offset, len, stride, lane, acc, observer);
  }
  acc.flush();
  return acc.redo;
}

// The double-precision pass that counts non-finite elements one by one: the first pass of float64
// inputs, and the second pass of a chunk whose float sums were not finite. Kept out of line so that
// its registers do not weigh on the float pass.
template <int kLanes, typename T>
__device__ __noinline__ void accumulate_chunk_in_double(const StridedView& v, int64_t item, int64_t lo, int64_t hi,
                                                        State<double>& state) {
  state = State<double>();
  accumulate_chunk<kLanes, T, double, true>(v, item, lo, hi, state);
}

// Folds this thread's share of a chunk into `state` (this thread's slot in shared memory). If any
// thread of the group saw non-finite float sums (NaN/Inf elements, or finite ones above ~1e19 whose
// squares overflow), the whole group reads the chunk again in double, counting non-finite elements
// one by one: non-finite chunks cost a second read, finite ones skip that count per element. The
// observer sees each element once, in the first read (float64 inputs: in line, so that an observer's
// sums stay in registers).
template <int kLanes, typename T, typename Observer>
__device__ __forceinline__ void chunk_thread_state(const StridedView& v, int64_t item, int64_t lo, int64_t hi,
                                                   State<double>& state, Observer& observer) {
  using block_t = typename Elem<T>::block;
  if constexpr (std::is_same<block_t, double>::value && Observer::kSeesElements) {
    state = State<double>();
    accumulate_chunk<kLanes, T, double, true>(v, item, lo, hi, state, observer);
  } else if constexpr (std::is_same<block_t, double>::value) {
    accumulate_chunk_in_double<kLanes, T>(v, item, lo, hi, state);
  } else {
    state = State<double>();
    const bool redo = accumulate_chunk<kLanes, T, block_t, false>(v, item, lo, hi, state, observer);
    if (ChunkGroup<kLanes>::any(redo)) accumulate_chunk_in_double<kLanes, T>(v, item, lo, hi, state);
  }
}

__device__ __forceinline__ const StridedView* views_of(const ViewTable& table) {
  return table.device != nullptr ? table.device : table.inline_views;
}

// Where chunk `c` lies: its view, output row, element range in its item, and index in the item.
struct ChunkPlace {
  const StridedView* view;
  int64_t item, row, lo, hi, index_in_item;
};

__device__ __forceinline__ ChunkPlace place_of(const StridedView* views, int64_t num_views, int64_t c) {
  ChunkPlace p;
  p.view = views + core::find_view(views, num_views, c);
  const int64_t local = c - p.view->first_chunk;
  p.item = local / p.view->chunks_per_item;
  p.row = p.view->out_row + p.item;
  p.index_in_item = local % p.view->chunks_per_item;
  p.lo = p.index_in_item * core::kChunkElems;
  p.hi = p.lo + core::kChunkElems < p.view->item_numel ? p.lo + core::kChunkElems : p.view->item_numel;
  return p;
}

// Folds this thread's share of chunk `c` into `state`, and shows its elements to an Observer made
// from `sink` (where it leaves its result, in finish()). Out of line, and given only what locates
// the chunk: the kernel's own loop state then waits in the call's saved registers rather than
// competing with the element loop for registers.
template <int kLanes, typename Observer, typename... Sink>
__device__ __noinline__ void read_chunk(const StridedView* views, int64_t num_views, int64_t c, State<double>& state,
                                        Sink... sink) {
  const ChunkPlace at = place_of(views, num_views, c);
  const StridedView& v = *at.view;
  Observer observer(sink...);
  switch (v.dtype) {
    case DType::kFloat32: chunk_thread_state<kLanes, float>(v, at.item, at.lo, at.hi, state, observer); break;
    case DType::kFloat64: chunk_thread_state<kLanes, double>(v, at.item, at.lo, at.hi, state, observer); break;
    case DType::kFloat16: chunk_thread_state<kLanes, __half>(v, at.item, at.lo, at.hi, state, observer); break;
    case DType::kBFloat16:
      chunk_thread_state<kLanes, __nv_bfloat16>(v, at.item, at.lo, at.hi, state, observer);
      break;
  }
  observer.finish();
}

// Writes row `row`'s merged state: finalised statistics and/or the raw state.
__device__ __forceinline__ void write_row(State<double> s, const StridedView& v, int64_t row, const StatsTargets& out) {
  s = core::repeat(s, double(v.repeat));
  if (out.out_stats != nullptr) core::finalize(s, out.correction, out.out_stats + row * core::kNumStats);
  if (out.out_states != nullptr) core::store_state(s, out.out_states + row * core::kNumStateColumns);
}

// Reads `n` doubles that other blocks of this launch wrote, from L2 (L1 is not coherent).
template <int n>
__device__ __forceinline__ void load_from_l2(const double* src, double (&dst)[n]) {
#pragma unroll
  for (int k = 0; k < n; ++k) dst[k] = __ldcg(src + k);
}

// Another group's chunk state, published before its count (see publish_and_count).
__device__ __forceinline__ State<double> published_chunk(const double* chunk_states, int64_t c) {
  double row[core::kNumStateColumns];
  load_from_l2(chunk_states + c * core::kNumStateColumns, row);
  return core::load_state(row);
}

// Counts one more finished piece at `counter` (after a fence, so that what this thread wrote before
// is visible to whoever counts last); true for the thread whose count completes `total`. That
// thread resets the counter (every piece is counted, nobody else touches it in this launch), so the
// counters are zero again for the next launch, and fences before it reads the other pieces.
__device__ __forceinline__ bool count_and_check_last(unsigned* counter, int64_t total) {
  __threadfence();
  const bool last = atomicAdd(counter, 1u) == static_cast<unsigned>(total - 1);
  if (last) {
    *counter = 0u;
    __threadfence();
  }
  return last;
}

// A partial instance accumulator (core::InstanceAccColumn), as the lanes of a group fold rows.
struct AccPart {
  double v[core::kNumAccColumns];
};

__device__ __forceinline__ AccPart shfl_down(const AccPart& a, int delta) {
  AccPart r;
#pragma unroll
  for (int k = 0; k < core::kNumAccColumns; ++k) r.v[k] = __shfl_down_sync(0xffffffffu, a.v[k], delta);
  return r;
}

__device__ __forceinline__ AccPart warp_combine(AccPart a) {
  for (int delta = 16; delta > 0; delta >>= 1) {
    const AccPart b = shfl_down(a, delta);
    core::combine_instance_acc(b.v, a.v);
  }
  return a;
}

// Folds the finalised rows of every item into the accumulator row, with every lane of the group
// that counted the last row: lane t folds rows t, t + kLanes, ... in row order, then the lanes'
// parts combine over a fixed tree (warp shuffles, then the block's warps in order) and lane 0 adds
// the result to the row. Deterministic, and kLanes times shorter than one thread's loop over
// [B*T, d] activations' rows.
template <int kLanes>
__device__ __noinline__ void fold_rows(const double* stats, int64_t rows, double* acc_row) {
  AccPart part = {};
  for (int64_t r = ChunkGroup<kLanes>::lane(); r < rows; r += kLanes) {
    double row[core::kNumStats];
    load_from_l2(stats + r * core::kNumStats, row);
    core::accumulate_instance(row, part.v);
  }
  part = warp_combine(part);
  if constexpr (kLanes == kThreads) {
    __shared__ AccPart warp_parts[kThreads / 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_parts[warp] = part;
    __syncthreads();
    if (warp == 0) part = warp_combine(lane < kThreads / 32 ? warp_parts[lane] : AccPart{});
  }
  if (ChunkGroup<kLanes>::lane() == 0) core::combine_instance_acc(part.v, acc_row);
}

}  // namespace
}  // namespace cuda
}  // namespace gapmon
