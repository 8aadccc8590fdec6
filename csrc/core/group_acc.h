// Per-thread accumulation strategy of the CUDA kernels, torch- and CUDA-free (host + device).
//
// A thread folds its elements into a double-precision State in groups of about kGroup elements:
// each group is summed as shifted sums in the block precision, shifted by the running mean (by
// its own first element for a thread's first group), then merged with Chan's rule. Because the
// shift is the running mean or a member of the group, sum (x - shift)^2 <= (g + 1) * M2 of a
// group of g elements, so the group's M2 carries a relative error of at most about g * epsilon
// (g < kGroup + 8: groups grow by whole 16-byte vectors).
//
// kGroup sets the share of double-precision work: a group costs one Chan merge (two float64
// divisions, ~100 instructions, half-rate units) against ~10 float instructions per element.
// At 32 that is about 6 issue slots per element on top of ~10, which by estimate keeps 16-bit
// inputs (the most elements per byte) near the memory time on an H100; not yet measured.
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

template <typename block_t>
struct GroupAccumulator {
  State<double> state;
  block_t shift = 0, s1 = 0, s2 = 0, sq = 0, mx = 0;
  int32_t nonfinite = 0, zeros = 0, n = 0;
  // Set when a group of finite elements overflowed the block precision (sums_overflowed): the
  // caller then redoes its elements with a double-precision accumulator.
  bool overflow = false;

  // Adds K elements (one loaded vector) to the current group; the group is merged into `state`
  // once it holds kGroup or more, so groups hold kGroup to kGroup + K - 1 elements and the
  // merge code runs once per vector rather than once per element.
  template <int K>
  GAPMON_HD void push(const block_t (&xs)[K], block_t largest) {
    if (n == 0) shift = block_shift(state, xs[0]);
    GAPMON_UNROLL
    for (int k = 0; k < K; ++k) accumulate<block_t>(xs[k], shift, largest, s1, s2, sq, mx, nonfinite, zeros);
    n += K;
    if (n >= kGroup) flush();
  }

  GAPMON_HD void push(block_t x, block_t largest) {
    const block_t xs[1] = {x};
    push(xs, largest);
  }

  GAPMON_HD void flush() {
    if (n == 0) return;
    overflow = overflow || sums_overflowed(nonfinite == 0, s1, s2, sq);
    state = merge(state, block_to_state<double, block_t>(double(n), shift, double(s1), double(s2), double(sq), mx,
                                                         double(nonfinite), double(zeros)));
    s1 = s2 = sq = mx = 0;
    nonfinite = zeros = n = 0;
  }
};

// The order in which thread `tid` of `nthreads` visits the `nvec` vectors of a unit-stride run:
// vectors v = tid, tid + nthreads, ..., loaded kVecUnroll at a time (load(v) for each before
// consume() of the first), so that a warp's loads stay coalesced and several are in flight.
template <typename Load, typename Consume>
GAPMON_HD void walk_vectors(int64_t nvec, int64_t tid, int64_t nthreads, Load&& load, Consume&& consume) {
  int64_t v = tid;
  for (; v + (kVecUnroll - 1) * nthreads < nvec; v += kVecUnroll * nthreads) {
    decltype(load(v)) vecs[kVecUnroll];
    GAPMON_UNROLL
    for (int u = 0; u < kVecUnroll; ++u) vecs[u] = load(v + u * nthreads);
    GAPMON_UNROLL
    for (int u = 0; u < kVecUnroll; ++u) consume(vecs[u]);
  }
  for (; v < nvec; v += nthreads) consume(load(v));
}

}  // namespace core
}  // namespace gapmon
