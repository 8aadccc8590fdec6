// CUDA statistics kernels. Every thread folds its elements into a double-precision core::State
// with core::GroupAccumulator (groups of about kGroup elements, csrc/core/group_acc.h); the threads
// that share a chunk (a block, or a warp for short items) merge with Chan's rule over warp shuffles
// and shared memory in a fixed order. In the same launch, the group that finishes an item's last
// chunk (counted with an integer atomic) merges the item's chunks in chunk order. No float atomics
// and no order that depends on timing: results are bit-identical run to run.
// Kernels are launched through GAPMON_LAUNCH so that tests/cpp/cuda_emulator.h can run this file.
// The chunk reader (element loops, merge trees, chunk places) is csrc/cuda/chunk_reader.cuh.
#include <cstring>

#include "../core/stats_state.h"
#include "chunk_reader.cuh"
#include "launch.h"
#include "stats_cuda.h"


namespace gapmon {
namespace cuda {
namespace {

// Resident blocks per SM that the statistics kernel is compiled for: 4 x 256 threads caps it at 64
// registers and doubles the loads in flight over the 2 blocks (128 registers) of the first H100
// run, whose ncu profile showed a latency-bound kernel at 25% occupancy. tests/cpp/check_kernels.py
// checks the count and that the element loops use no local memory.
constexpr int kMinBlocksPerSM = 4;

// Statistics of every item, in one launch: kLanes threads per chunk (grid-stride over chunks). An
// item of one chunk is written by the group that reads it. For longer items every group publishes
// its chunk's state and counts it; the group that counts an item's last chunk merges the item's
// chunks in chunk order (lane t merges chunks t, t + kLanes, ..., then the group's fixed merge
// tree), so the result does not depend on which group finishes last. With an accumulator row, the
// group that writes the last row folds all rows, in row order.
template <int kLanes>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM) stats_kernel(const __grid_constant__ ViewTable table, int64_t chunk_begin,
                                                         int64_t chunk_end, int64_t rows, const StatsTargets out) {
  using Group = ChunkGroup<kLanes>;
  // Each thread's running state, in shared memory rather than 14 registers (see group_acc.h).
  __shared__ State<double> thread_states[kThreads];
  const StridedView* views = views_of(table);
  const int64_t stride = int64_t(gridDim.x) * Group::kPerBlock;
  for (int64_t c = chunk_begin + int64_t(blockIdx.x) * Group::kPerBlock + Group::index(); c < chunk_end; c += stride) {
    State<double>& mine = thread_states[threadIdx.x];
    read_chunk<kLanes, NoObserver>(views, table.num, c, mine);
    const ChunkPlace at = place_of(views, table.num, c);
    const StridedView& v = *at.view;
    State<double> s = Group::merge(mine);
    bool item_done = true;
    if (v.chunks_per_item > 1) {
      bool last = false;
      if (Group::lane() == 0) {
        core::store_state(s, out.chunk_states + c * core::kNumStateColumns);
        last = count_and_check_last(out.counters + at.row, v.chunks_per_item);
      }
      item_done = Group::any(last);
      if (item_done) {
        const int64_t first = c - at.index_in_item;
        State<double> merged;
        for (int64_t k = Group::lane(); k < v.chunks_per_item; k += kLanes) {
          merged = core::merge(merged, published_chunk(out.chunk_states, first + k));
        }
        s = Group::merge(merged);
      }
    }
    bool fold = false;
    if (item_done && Group::lane() == 0) {
      write_row(s, v, at.row, out);
      fold = out.acc_row != nullptr && count_and_check_last(out.counters + rows, rows);
    }
    if (out.acc_row != nullptr && Group::any(fold)) fold_rows<kLanes>(out.out_stats, rows, out.acc_row);
    Group::sync();
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

int64_t blocks_for(int64_t n, int64_t threads) { return (n + threads - 1) / threads; }

}  // namespace

cudaError_t launch_stats(const ViewTable& views, const LaunchPlan& plan, int64_t rows, const StatsTargets& targets,
                         cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const bool fold = targets.acc_row != nullptr;
  if ((fold && targets.out_stats == nullptr) ||
      (needs_chunk_states(plan.max_chunks_per_item) && targets.chunk_states == nullptr) ||
      (needs_counters(plan.max_chunks_per_item, fold) && targets.counters == nullptr) ||
      plan.warp_chunks < 0 || plan.warp_chunks > plan.total_chunks) {
    return cudaErrorInvalidValue;
  }
  constexpr int64_t kMaxGrid = int64_t(1) << 20;
  if (plan.warp_chunks > 0) {
    const int64_t blocks = blocks_for(plan.warp_chunks, ChunkGroup<32>::kPerBlock);
    GAPMON_LAUNCH(stats_kernel<32>, static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid), kThreads, stream)(
        views, 0, plan.warp_chunks, rows, targets);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const int64_t block_chunks = plan.total_chunks - plan.warp_chunks;
  if (block_chunks > 0) {
    GAPMON_LAUNCH(stats_kernel<kThreads>, static_cast<unsigned>(block_chunks < kMaxGrid ? block_chunks : kMaxGrid),
                  kThreads, stream)(views, plan.warp_chunks, plan.total_chunks, rows, targets);
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

}  // namespace cuda
}  // namespace gapmon
