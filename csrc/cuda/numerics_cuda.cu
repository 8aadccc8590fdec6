// CUDA numerics kernel: the exponent histogram of |x| and the central moments to the 4th of every
// item (csrc/core/numerics.h holds the math, shared with the CPU kernel), read in the same pass as
// the item's statistics state. A block reads a chunk with the statistics kernel's chunk reader
// (csrc/cuda/chunk_reader.cuh), so the states have the bits launch_stats gives; a numerics observer
// sees each element once: it bins it with an integer atomic in shared memory (exact in any order)
// and adds the powers of its deviation from the thread's first element to double sums. The threads'
// moments merge over a fixed tree. An item of several chunks is finished in the same launch by the
// block that counts its last chunk, which sums the chunks' bins and merges their moments and states
// in a fixed order, so the rows are bit-identical run to run. Launched through GAPMON_LAUNCH so that
// tests/cpp/cuda_emulator.h can run this file on the host.
#include <cstring>
#include <type_traits>

#include "../core/numerics.h"
#include "block_rows.cuh"
#include "chunk_reader.cuh"
#include "launch.h"
#include "numerics_cuda.h"


namespace gapmon {
namespace cuda {
namespace {

using core::Moments;

constexpr int kColumns = core::kNumNumericsColumns;
// Resident blocks per SM the kernel is compiled for (at most 128 registers a thread): the observer's
// six double sums come on top of the statistics reader's registers, and the numerics arithmetic, not
// the loads in flight, bounds this kernel (tests/cpp/check_kernels.py checks the budget).
constexpr int kMinBlocksPerSM = 2;

// Sees each element of a thread's share of a chunk: its exponent bin, counted in the block's shared
// `bins`, and its power sums of deviations from the thread's first element (at most about
// kChunkElems / kThreads = 256 elements: one block of sums, as the CPU kernel's), left as Moments in
// `out` by finish().
struct NumericsObserver {
  static constexpr bool kSeesElements = true;
  unsigned* bins;
  Moments* out;
  double n = 0, shift = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0;

  __device__ __forceinline__ NumericsObserver(unsigned* shared_bins, Moments* slot) : bins(shared_bins), out(slot) {}

  // float32, and float16/bfloat16 widened to float32 exactly.
  __device__ __forceinline__ void see(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    atomicAdd(bins + core::exponent_bin_f32(bits), 1u);
    add(x);
  }

  __device__ __forceinline__ void see(double x) {
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    atomicAdd(bins + core::exponent_bin_f64(bits), 1u);
    add(x);
  }

  template <typename block_t, int K>
  __device__ __forceinline__ void see_vector(const block_t (&xs)[K]) {
#pragma unroll
    for (int k = 0; k < K; ++k) see(xs[k]);
  }

  __device__ __forceinline__ void add(double x) {
    if (n == 0) shift = core::is_finite(x) ? x : 0.0;
    const double d = x - shift, d2 = d * d;
    n += 1;
    s1 += d;
    s2 += d2;
    s3 += d2 * d;
    s4 += d2 * d2;
  }

  __device__ __forceinline__ void finish() { *out = core::from_power_sums(n, shift, s1, s2, s3, s4); }
};

// The observer of the fused pass: the numerics of every element, and, when the chunk's groups lie whole in the
// reader's vectors (`sums` set: casts_in_reader), their block formats cast from the same registers.
struct FusedObserver : NumericsObserver {
  ReaderSums<kThreads>* sums;

  __device__ __forceinline__ FusedObserver(unsigned* shared_bins, Moments* slot, ReaderSums<kThreads>* reader_sums)
      : NumericsObserver(shared_bins, slot), sums(reader_sums) {}

  template <int K>
  __device__ __forceinline__ void see_vector(const float (&xs)[K]) {
    NumericsObserver::see_vector(xs);
    if (sums != nullptr) reader_cast_vector<kThreads>(xs, *sums);
  }

  template <int K>
  __device__ __forceinline__ void see_vector(const double (&xs)[K]) {  // float64: cast after the read
    NumericsObserver::see_vector(xs);
  }
};

// Whether chunk `at` of view `v` has its groups whole in the reader's vectors (see block_rows.cuh): the view
// reads its operand's elements in order as one aligned unit-stride run per item, of float32 or 16-bit
// elements, rows of a multiple of 32, the chunk a whole number of groups from a group's start.
__device__ __forceinline__ bool casts_in_reader(const StridedView& v, const ChunkPlace& at, const core::BlockOperand& op,
                                                int num_formats) {
  if (num_formats > kMaxReaderFormats || op.data == nullptr || op.data != v.data || op.dtype != v.dtype ||
      v.dtype == DType::kFloat64 || op.cols <= 0 || op.cols % core::kGroupElems != 0 || v.repeat != 1 ||
      !is_contiguous(v) || (v.items > 1 && v.item_stride != v.item_numel)) {
    return false;
  }
  const int64_t first = at.item * v.item_numel + at.lo;  // the chunk's first element in the operand
  const uintptr_t element_bytes = v.dtype == DType::kFloat32 ? 4u : 2u;
  const uintptr_t address = reinterpret_cast<uintptr_t>(v.data) + static_cast<uintptr_t>(first) * element_bytes;
  return at.lo < at.hi && first % core::kGroupElems == 0 && (at.hi - at.lo) % core::kGroupElems == 0 &&
         address % 16 == 0;
}

// Prepares chunk c's block formats: true (and the block's reader sums emptied, the formats' constants set) when
// they are cast from the reader's vectors. Out of line, as the other per-chunk steps.
__device__ __noinline__ bool start_reader_cast(const FusedBlocks& blocks, const StridedView* views, int64_t num_views,
                                               int64_t c, ReaderSums<kThreads>& sums) {
  const ChunkPlace at = place_of(views, num_views, c);
  const int64_t view_index = at.view - views;
  if (!blocks.in_reader || !casts_in_reader(*at.view, at, blocks.ops[view_index], blocks.formats.num)) return false;
  reader_sums_start(sums, blocks.formats, blocks.amaxes != nullptr ? blocks.amaxes[view_index] : 0.0);
  return true;
}

// Chunk c's block rows from the reader's sums (combine_reader_sums), out of line as fused_block_chunk.
__device__ __noinline__ void finish_reader_cast(const FusedBlocks& blocks, const ReaderSums<kThreads>& sums, int64_t c,
                                                double* partial) {
  combine_reader_sums(sums, partial, blocks.chunk_rows + c * blocks.formats.num * core::kNumBlockColumns);
}

// Merges the block's per-thread moments in `slots` over a fixed tree; slots[0] holds the result.
__device__ void block_merge_moments(Moments* slots) {
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) slots[threadIdx.x] = core::merge(slots[threadIdx.x], slots[threadIdx.x + half]);
    __syncthreads();
  }
}

// Writes row `row` of the numerics output, or merges into it (after what it holds) if `accumulate`:
// bins (this thread's share) and moments (thread 0), times the view's repeat. `bin_count(b)` gives
// the item's count of bin b. One block finishes each item, so the merge needs no atomics.
template <typename BinCount>
__device__ __forceinline__ void write_numerics_row(BinCount&& bin_count, const Moments& m, const StridedView& v,
                                                   int64_t row, const NumericsTargets& numerics) {
  double* dst = numerics.out + row * kColumns;
  const double times = static_cast<double>(v.repeat);
  for (int b = threadIdx.x; b < core::kNumBins; b += kThreads) {
    dst[b] = (numerics.accumulate ? dst[b] : 0.0) + bin_count(b) * times;
  }
  if (threadIdx.x == 0) {
    const Moments mine = core::repeat(m, times);
    core::store_moments(numerics.accumulate ? core::merge(core::load_moments(dst), mine) : mine, dst);
  }
}

// Another block's chunk moments, published before its count (as published_chunk's states).
__device__ __forceinline__ Moments published_moments(const double* chunk_rows, int64_t c) {
  double columns[5];
  load_from_l2(chunk_rows + c * kColumns + core::nCount, columns);
  static_assert(core::nMean == core::nCount + 1 && core::nM4 == core::nCount + 4, "moments follow the count");
  Moments m;
  m.count = columns[0];
  m.mean = columns[1];
  m.m2 = columns[2];
  m.m3 = columns[3];
  m.m4 = columns[4];
  return m;
}

// Row `row` of numerics.out from the published chunks [first, first + count) of view `v`: bins summed
// over the chunks by thread b (exact integers), moments merged lane-strided (thread t: chunks first + t,
// first + t + kThreads, ...) and then over the block's fixed tree, times the view's repeat. A fixed
// order: the same bits on every run. Run by the block that finishes an item of several chunks, or
// (NumericsTargets::merge_items) the last row, for every chunk of the view.
__device__ void write_published_chunks(const NumericsTargets& numerics, int64_t first, int64_t count,
                                       const StridedView& v, int64_t row, Moments* thread_moments) {
  Moments m;
  for (int64_t k = threadIdx.x; k < count; k += kThreads) m = core::merge(m, published_moments(numerics.chunk_rows, first + k));
  thread_moments[threadIdx.x] = m;
  block_merge_moments(thread_moments);
  const double* chunk_rows = numerics.chunk_rows + first * kColumns;
  write_numerics_row(
      [&](int b) {
        double total = 0;  // exact: integer counts far below 2^53
        for (int64_t k = 0; k < count; ++k) total += __ldcg(chunk_rows + k * kColumns + b);
        return total;
      },
      thread_moments[0], v, row, numerics);
}

// The fused pass's block formats of chunk c (at `at`, of view `view_index`) when they are not cast in the reader: the
// groups of its tensor that start in the chunk's elements, read again right after the statistics reader read them
// (from L2, if they are still there), cast by the block's
// threads and combined into the chunk's rows. The view's operand is its tensor as contiguous [rows, cols], its
// items (an activation's instances, whole rows each) in order: item `at.item`'s element lo is the operand's
// element at.item * item_numel + lo. Out of line: the rows live in this call's frame, not in the registers of
// the statistics reader.
__device__ __noinline__ void fused_block_chunk(const FusedBlocks& blocks, int64_t view_index, const ChunkPlace& at,
                                               int64_t c, double* partial) {
  const core::BlockOperand& op = blocks.ops[view_index];
  const bool cast = op.data != nullptr && op.cols > 0 && at.lo < at.hi;
  const int64_t base = at.item * at.view->item_numel;
  const int64_t begin = cast ? core::group_at(base + at.lo, op.cols) : 0;
  const int64_t end = cast ? core::group_at(base + at.hi, op.cols) : 0;
  cast_and_combine_groups<kThreads>(op, begin, end, blocks.formats,
                                    blocks.amaxes != nullptr ? blocks.amaxes[view_index] : 0.0, partial,
                                    blocks.chunk_rows + c * blocks.formats.num * core::kNumBlockColumns);
}

// Statistics and numerics of every item, a block per chunk (grid-stride over chunks). Each item's
// statistics go where `stats` says (rows, states, and the instance fold by the block that writes the
// last row, as launch_stats does); its numerics to its row of numerics.out, or, with merge_items,
// every chunk's numerics are published and the block that finishes the last row merges them all
// into one row.
// kFused: with the block formats of `blocks` (a kernel of its own, so that the plain pass keeps its registers): cast
// by the reader's observer where the chunk allows it (start_reader_cast), else after the read (fused_block_chunk).
template <bool kFused>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)
    stats_numerics_kernel(const __grid_constant__ ViewTable table, int64_t total_chunks, int64_t rows,
                          const StatsTargets stats, const NumericsTargets numerics, const __grid_constant__ FusedBlocks blocks) {
  using Group = ChunkGroup<kThreads>;
  __shared__ double block_partial[kFused ? kThreads : 1];
  __shared__ State<double> thread_states[kThreads];
  __shared__ Moments thread_moments[kThreads];
  __shared__ unsigned bins[core::kNumBins];
  __shared__ std::conditional_t<kFused, ReaderSums<kThreads>, char> reader_sums;
  const StridedView* views = views_of(table);
  const bool count_rows = stats.acc_row != nullptr || numerics.merge_items;
  for (int64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    for (int b = threadIdx.x; b < core::kNumBins; b += kThreads) bins[b] = 0u;
    bool in_reader = false;
    if constexpr (kFused) in_reader = start_reader_cast(blocks, views, table.num, c, reader_sums);
    __syncthreads();
    if constexpr (kFused) {
      read_chunk<kThreads, FusedObserver>(views, table.num, c, thread_states[threadIdx.x], bins,
                                          thread_moments + threadIdx.x, in_reader ? &reader_sums : nullptr);
    } else {
      read_chunk<kThreads, NumericsObserver>(views, table.num, c, thread_states[threadIdx.x], bins,
                                             thread_moments + threadIdx.x);
    }
    const ChunkPlace at = place_of(views, table.num, c);
    const StridedView& v = *at.view;
    State<double> s = Group::merge(thread_states[threadIdx.x]);
    block_merge_moments(thread_moments);  // after it, every thread's bin counts are in `bins` too
    const bool several = v.chunks_per_item > 1;
    if (several || numerics.merge_items) {
      // Publish the chunk's numerics (and state), fenced by every thread that wrote, before any count.
      double* chunk_row = numerics.chunk_rows + c * kColumns;
      for (int b = threadIdx.x; b < core::kNumBins; b += kThreads) chunk_row[b] = static_cast<double>(bins[b]);
      if (threadIdx.x == 0) {
        core::store_moments(thread_moments[0], chunk_row);
        if (several) core::store_state(s, stats.chunk_states + c * core::kNumStateColumns);
      }
      __threadfence();
      __syncthreads();
    }
    bool item_done = true;
    if (!several) {
      if (!numerics.merge_items) {
        write_numerics_row([&](int b) { return static_cast<double>(bins[b]); }, thread_moments[0], v, at.row, numerics);
      }
    } else {
      bool last = false;
      if (threadIdx.x == 0) last = count_and_check_last(stats.counters + at.row, v.chunks_per_item);
      item_done = Group::any(last);
      if (item_done) {  // this block counted the item's last chunk: merge all of them in a fixed order
        const int64_t first = c - at.index_in_item;
        State<double> merged;
        for (int64_t k = Group::lane(); k < v.chunks_per_item; k += kThreads) {
          merged = core::merge(merged, published_chunk(stats.chunk_states, first + k));
        }
        s = Group::merge(merged);
        if (!numerics.merge_items) write_published_chunks(numerics, first, v.chunks_per_item, v, at.row, thread_moments);
      }
    }
    bool last_row = false;
    if (item_done && threadIdx.x == 0) {
      write_row(s, v, at.row, stats);
      last_row = count_rows && count_and_check_last(stats.counters + rows, rows);
    }
    if (count_rows && Group::any(last_row)) {  // every row is written: fold them, merge every chunk's numerics
      if (stats.acc_row != nullptr) fold_rows<kThreads>(stats.out_stats, rows, stats.acc_row);
      if (numerics.merge_items) write_published_chunks(numerics, 0, total_chunks, v, 0, thread_moments);
    }
    if constexpr (kFused) {
      if (in_reader) {
        finish_reader_cast(blocks, reader_sums, c, block_partial);
      } else {
        fused_block_chunk(blocks, at.view - views, at, c, block_partial);
      }
    }
    __syncthreads();  // bins, moments and states are reused by the next chunk
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

}  // namespace

cudaError_t launch_stats_and_numerics(const ViewTable& views, const LaunchPlan& plan, int64_t rows,
                                      const StatsTargets& stats, const NumericsTargets& numerics, cudaStream_t stream,
                                      const FusedBlocks& fused) {
  if (rows == 0) return cudaSuccess;
  const bool several = needs_chunk_states(plan.max_chunks_per_item);
  const bool fold = stats.acc_row != nullptr;
  if (numerics.out == nullptr || plan.warp_chunks != 0 || (fold && stats.out_stats == nullptr) ||
      ((several || numerics.merge_items) && numerics.chunk_rows == nullptr) ||
      (several && stats.chunk_states == nullptr) ||
      ((several || fold || numerics.merge_items) && stats.counters == nullptr) ||
      (numerics.merge_items && views.num != 1) ||
      (fused.ops != nullptr && (fused.chunk_rows == nullptr || fused.formats.num < 1 ||
                                fused.formats.num > core::kNumBlockFormats))) {
    return cudaErrorInvalidValue;
  }
  constexpr int64_t kMaxGrid = int64_t(1) << 20;
  const int64_t blocks = plan.total_chunks < kMaxGrid ? plan.total_chunks : kMaxGrid;
  if (fused.ops != nullptr) {
    GAPMON_LAUNCH(stats_numerics_kernel<true>, static_cast<unsigned>(blocks), kThreads, stream)(
        views, plan.total_chunks, rows, stats, numerics, fused);
  } else {
    GAPMON_LAUNCH(stats_numerics_kernel<false>, static_cast<unsigned>(blocks), kThreads, stream)(
        views, plan.total_chunks, rows, stats, numerics, fused);
  }
  return cudaGetLastError();
}

cudaError_t launch_merge_numerics(const double* states, int64_t parts, int64_t n, double* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  GAPMON_LAUNCH(merge_numerics_kernel, static_cast<unsigned>((n + 127) / 128), 128, stream)(states, parts, n, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace gapmon
