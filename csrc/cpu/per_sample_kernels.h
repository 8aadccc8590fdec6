// Torch-free CPU kernels of the per-sample norms (csrc/torch/per_sample.cpp): book-keeping's per-sample gradients
// read once for both their sum over the samples (the layer's weight gradient) and each one's squared norm; an
// embedding table's per-sample gradient norms from its rows; an affine normalisation's per-sample gradients.
#pragma once

#include <cstdint>

namespace gapmon {
namespace cpu {

// Over elements [lo, hi) of the n rows x + b * stride (b = 0 .. n-1): out[e] = the rows' sum at e, added
// in row order from row 0 (out is written, not accumulated; null: not formed), and sq[b] = the sum over [lo, hi) of
// x_b[e]^2 in float64, elements in a fixed order (the same bits on every run).
void sum_rows_and_squares(const float* x, int64_t n, int64_t stride, int64_t lo, int64_t hi, float* out, double* sq);
void sum_rows_and_squares(const double* x, int64_t n, int64_t stride, int64_t lo, int64_t hi, double* out, double* sq);

// Squared norms of the per-sample gradients of an embedding table, for samples [b0, b1) of ids [B, t] (row-major)
// and their output gradients g [B, t, d] (contiguous): out[b] = the sum over the distinct ids v != padding_idx of
// sample b of ||sum_{s: ids[b, s] == v} g[b, s]||^2. A sample's positions are sorted (stably) by id, each run of one
// id summed in position order in float64, the runs' squares added in id order: the same bits on every run, no
// [T, T] pairs. False when an id lies outside [0, 2^32) (nothing written then for that sample).
bool embedding_row_norms(const int64_t* ids, const float* g, int64_t t, int64_t d, int64_t padding_idx, int64_t b0,
                         int64_t b1, double* out);
bool embedding_row_norms(const int64_t* ids, const double* g, int64_t t, int64_t d, int64_t padding_idx, int64_t b0,
                         int64_t b1, double* out);

// Each sample's gradients of an affine normalisation over the last dim (LayerNorm, RMSNorm: y = x̂ ⊙ w + b), for
// samples [b0, b1) of its input x and output gradient g [B, t, n] (contiguous): weight[b, e] = sum_s g[b, s, e] x̂[b, s, e]
// and bias[b, e] = sum_s g[b, s, e] ([B, n] each, written), x̂ = (x - mean) / sqrt(var + eps) (var biased) or, with
// `rms`, x / sqrt(mean(x^2) + eps), over each position's n elements. In float64, positions added in order: one read of
// x and g, the same bits on every run.
void affine_norm_sums(const float* x, const float* g, int64_t t, int64_t n, double eps, bool rms, int64_t b0,
                      int64_t b1, double* weight, double* bias);
void affine_norm_sums(const double* x, const double* g, int64_t t, int64_t n, double eps, bool rms, int64_t b0,
                      int64_t b1, double* weight, double* bias);

}  // namespace cpu
}  // namespace gapmon
