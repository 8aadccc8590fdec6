// Per-thread accumulation strategy of the CUDA kernels, torch- and CUDA-free so that the host
// unit tests can replay it exactly (tests/cpp/test_core.cpp).
//
// A thread folds its elements into a double-precision State in groups of kGroup elements: each
// group is summed as shifted sums in the block precision, shifted by the running mean (by its
// own first element for a thread's first group), then merged with Chan's rule. Because the shift
// is the running mean or a member of the group, sum (x - shift)^2 <= (kGroup + 1) * M2 of the
// group, so the group's M2 carries a relative error of at most about kGroup * epsilon.
#pragma once

#include "stats_state.h"

namespace gapmon {
namespace core {

constexpr int kGroup = 16;

template <typename block_t>
struct GroupAccumulator {
  State<double> state;
  block_t shift = 0, s1 = 0, s2 = 0, sq = 0, mx = 0;
  int32_t nonfinite = 0, zeros = 0, n = 0;

  GAPMON_HD void push(block_t x, block_t largest) {
    if (n == 0) shift = block_shift(state, x);
    accumulate<block_t>(x, shift, largest, s1, s2, sq, mx, nonfinite, zeros);
    if (++n == kGroup) flush();
  }

  GAPMON_HD void flush() {
    if (n == 0) return;
    state = merge(state, block_to_state<double, block_t>(double(n), shift, double(s1), double(s2), double(sq), mx,
                                                         double(nonfinite), double(zeros)));
    s1 = s2 = sq = mx = 0;
    nonfinite = zeros = n = 0;
  }
};

}  // namespace core
}  // namespace gapmon
