// Per-thread accumulation strategy of the CUDA kernels, torch- and CUDA-free (host + device).
//
// A thread folds its elements into a double-precision State in groups of about kGroup elements:
// each group is summed as shifted sums in the block precision, shifted by the running mean (by
// its own first element for a thread's first group), then merged with Chan's rule. Because the
// shift is the running mean or a member of the group, sum (x - shift)^2 <= (g + 1) * M2 of a
// group of g elements, so the group's M2 carries a relative error of at most about g * epsilon
// (g < kGroup + one batch of vectors).
//
// Registers decide the speed on a GPU (more resident threads keep more loads in flight), so:
// - the thread's State<double> lives where the caller puts it (shared memory in the kernels), not
//   in 14 registers;
// - groups are merged between batches of loaded vectors, when those vectors are dead;
// - float groups do not count non-finite elements one by one: NaN or Inf make the group's float
//   sums non-finite, and so does an overflow of finite elements (|x| above ~1e19 in float32).
//   Either way the accumulator sets `redo`, and the caller reads the chunk again with a double
//   accumulator, which counts non-finite elements one by one (kCountNonfinite).
//
// kGroup sets the share of double-precision work: a group costs one Chan merge (two float64
// divisions, ~100 instructions, half-rate units) against ~8 float instructions per element.
#pragma once

#include "stats_state.h"

#if defined(__CUDACC__)
#define GAPMON_UNROLL _Pragma("unroll")
#else
#define GAPMON_UNROLL _Pragma("GCC unroll 8")
#endif

namespace gapmon {
namespace core {

// Both constants can be overridden at compile time (benchmarks/cuda/tune.sh builds variants).
#ifndef GAPMON_CUDA_GROUP
#define GAPMON_CUDA_GROUP 32
#endif
#ifndef GAPMON_CUDA_VEC_UNROLL
#define GAPMON_CUDA_VEC_UNROLL 4
#endif

constexpr int kGroup = GAPMON_CUDA_GROUP;

// Vectors a thread loads before it consumes the first of them: enough independent 16-byte loads
// in flight per thread to cover the memory latency at the occupancy the kernel reaches.
constexpr int kVecUnroll = GAPMON_CUDA_VEC_UNROLL;

// kCountNonfinite: count NaN/Inf elements one by one (double precision) rather than detect them
// from the group's sums (float precision; see the header comment). kGroupElems: the group size
// (16-bit inputs use 2 * kGroup: twice the elements per byte, so the merge's share doubles, while
// their values carry far less precision than the float sums lose over 64 elements).
template <typename block_t, bool kCountNonfinite = false, int kGroupElems = kGroup>
struct GroupAccumulator {
  State<double>& state;
  // Zeros are counted in block_t (exact: a group holds far fewer than 2^24 elements).
  block_t shift = 0, s1 = 0, s2 = 0, sq = 0, mx = 0, zeros = 0;
  int32_t nonfinite = 0, n = 0;
  // Set when a float group's sums are not finite (NaN/Inf elements, or finite elements whose
  // squares overflowed): the caller must redo the elements with kCountNonfinite and double.
  bool redo = false;

  // Starts from `into` (typically empty) and keeps folding into it.
  GAPMON_HD explicit GroupAccumulator(State<double>& into) : state(into) {}

  // Adds K elements (one loaded vector) to the current group. The group is merged into `state` by
  // end_batch(), once it holds kGroupElems or more; so a group can only start with the first vector of
  // a batch, and only that one (`may_start`) checks whether it does and picks the group's shift.
  template <int K>
  GAPMON_HD void push(const block_t (&xs)[K], block_t largest, bool may_start = true) {
    if (may_start && n == 0) shift = block_shift(state, xs[0]);
    GAPMON_UNROLL
    for (int k = 0; k < K; ++k) {
      if constexpr (kCountNonfinite) {
        accumulate<block_t>(xs[k], shift, largest, s1, s2, sq, mx, nonfinite, zeros);
      } else {
        accumulate_finite<block_t>(xs[k], shift, s1, s2, sq, mx, zeros);
      }
    }
    n += K;
  }

  GAPMON_HD void push(block_t x, block_t largest) {
    const block_t xs[1] = {x};
    push(xs, largest);
    end_batch();
  }

  // Call between batches of vectors: merges the group once it is full.
  GAPMON_HD void end_batch() {
    if (n >= kGroupElems) flush();
  }

  GAPMON_HD void flush() {
    if (n == 0) return;
    if constexpr (!kCountNonfinite) {
      redo = redo || !(is_finite(s1) && is_finite(s2) && is_finite(sq));
    }
    state = merge(state, block_to_state<double, block_t>(double(n), shift, double(s1), double(s2), double(sq), mx,
                                                         double(nonfinite), double(zeros)));
    s1 = s2 = sq = mx = zeros = 0;
    nonfinite = n = 0;
  }
};

// The order in which thread `tid` of `nthreads` visits the `nvec` vectors of a unit-stride run:
// vectors v = tid, tid + nthreads, ..., loaded kVecUnroll at a time (load(v) for each before
// consume() of the first), so that a warp's loads stay coalesced and several are in flight.
// consume(vector, first_of_batch); batch_done() after each batch (kVecUnroll vectors, or one in
// the tail).
template <typename Load, typename Consume, typename BatchDone>
GAPMON_HD void walk_vectors(int64_t nvec, int64_t tid, int64_t nthreads, Load&& load, Consume&& consume,
                            BatchDone&& batch_done) {
  int64_t v = tid;
  for (; v + (kVecUnroll - 1) * nthreads < nvec; v += kVecUnroll * nthreads) {
    decltype(load(v)) vecs[kVecUnroll];
    GAPMON_UNROLL
    for (int u = 0; u < kVecUnroll; ++u) vecs[u] = load(v + u * nthreads);
    GAPMON_UNROLL
    for (int u = 0; u < kVecUnroll; ++u) consume(vecs[u], u == 0);
    batch_done();
  }
  for (; v < nvec; v += nthreads) {
    consume(load(v), true);
    batch_done();
  }
}

}  // namespace core
}  // namespace gapmon
