// Torch-free CPU kernel of book-keeping (csrc/torch/per_sample.cpp): the per-sample gradients read once for
// both their sum over the samples (the layer's weight gradient) and each one's squared norm.
#pragma once

#include <cstdint>

namespace gapmon {
namespace cpu {

// Over elements [lo, hi) of the n rows x + b * stride (b = 0 .. n-1): out[e] = the rows' sum at e, added
// in row order from row 0 (out is written, not accumulated; null: not formed), and sq[b] = the sum over [lo, hi) of
// x_b[e]^2 in float64, elements in a fixed order (the same bits on every run).
void sum_rows_and_squares(const float* x, int64_t n, int64_t stride, int64_t lo, int64_t hi, float* out, double* sq);
void sum_rows_and_squares(const double* x, int64_t n, int64_t stride, int64_t lo, int64_t hi, double* out, double* sq);

}  // namespace cpu
}  // namespace gapmon
