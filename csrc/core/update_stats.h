// What an optimizer step did to one parameter, in one read of the weights before and after it and of its
// gradient: the sums |dw|^2, |w_before|^2, |g|^2 and <dw, g> (dw = after - before), each element widened
// to double and dw formed in double (the difference of two float32/16-bit values is exact there), summed
// in double. Torch-free, the one definition for the CPU and CUDA kernels.
#pragma once

#include <cstdint>

#include "strided_view.h"
#include "widen.h"

namespace gapmon {
namespace core {

// Columns of an update row (the [N, kUpdateColumns] float64 output).
enum UpdateColumn : int {
  kUpdateSq = 0,       // |after - before|^2
  kWeightSq = 1,       // |before|^2
  kGradSq = 2,         // |grad|^2
  kUpdateDotGrad = 3,  // <after - before, grad>
  kUpdateCount = 4,    // elements
  kUpdateColumns = 5,
};
constexpr int kUpdateSums = 4;  // the columns summed over elements

// One parameter: contiguous `numel` elements of before/after (dtype weight_dtype) and grad (grad_dtype).
struct UpdateOperands {
  const void* before = nullptr;
  const void* after = nullptr;
  const void* grad = nullptr;
  DType weight_dtype = DType::kFloat32;
  DType grad_dtype = DType::kFloat32;
  int64_t numel = 0;
  int64_t first_chunk = 0;  // filled by plan_update_chunks
};

// The one element update of the four sums (kept as four scalars so that CPU lanes vectorise it).
GAPMON_HD void add_update(double& update_sq, double& weight_sq, double& grad_sq, double& update_dot_grad,
                          double before, double after, double grad) {
  const double d = after - before;
  update_sq += d * d;
  weight_sq += before * before;
  grad_sq += grad * grad;
  update_dot_grad += d * grad;
}

struct UpdateSums {
  double v[kUpdateSums] = {0, 0, 0, 0};

  GAPMON_HD void add(double before, double after, double grad) {
    add_update(v[kUpdateSq], v[kWeightSq], v[kGradSq], v[kUpdateDotGrad], before, after, grad);
  }
  GAPMON_HD void merge(const UpdateSums& o) {
    for (int k = 0; k < kUpdateSums; ++k) v[k] += o.v[k];
  }
};

// Assigns chunks of kChunkElems elements to the operands in order; returns the total (an empty
// parameter owns one empty chunk, so that every row is written).
inline int64_t plan_update_chunks(UpdateOperands* ops, int64_t n) {
  int64_t next = 0;
  for (int64_t i = 0; i < n; ++i) {
    ops[i].first_chunk = next;
    next += chunks_for(ops[i].numel);
  }
  return next;
}

// Index of the operand that owns global chunk `chunk`.
GAPMON_HD int64_t find_update_operand(const UpdateOperands* ops, int64_t n, int64_t chunk) {
  return owner_of_chunk(ops, n, chunk);
}

// Calls f(W{}, G{}) with the storage types of the weights and the gradient.
template <typename F>
GAPMON_HD void with_update_types(DType weight_dtype, DType grad_dtype, F&& f) {
  auto with_grad = [&](auto w) {
    switch (grad_dtype) {
      case DType::kFloat32: f(w, float{}); break;
      case DType::kFloat64: f(w, double{}); break;
      case DType::kFloat16: f(w, Half{}); break;
      case DType::kBFloat16: f(w, BF16{}); break;
    }
  };
  switch (weight_dtype) {
    case DType::kFloat32: with_grad(float{}); break;
    case DType::kFloat64: with_grad(double{}); break;
    case DType::kFloat16: with_grad(Half{}); break;
    case DType::kBFloat16: with_grad(BF16{}); break;
  }
}

// Sums of elements lo, lo + step, ... below hi of `op` (step 1 on a CPU thread, the block's width on CUDA).
template <typename W, typename G>
GAPMON_HD UpdateSums update_sums_strided(const UpdateOperands& op, int64_t lo, int64_t hi, int64_t step) {
  const W* before = static_cast<const W*>(op.before);
  const W* after = static_cast<const W*>(op.after);
  const G* grad = static_cast<const G*>(op.grad);
  UpdateSums s;
  for (int64_t i = lo; i < hi; i += step) s.add(widen(before[i]), widen(after[i]), widen(grad[i]));
  return s;
}

// Writes row `row` (kUpdateColumns doubles) from the sums of its chunks.
GAPMON_HD void store_update_row(const UpdateSums& s, int64_t numel, double* row) {
  for (int k = 0; k < kUpdateSums; ++k) row[k] = s.v[k];
  row[kUpdateCount] = static_cast<double>(numel);
}

}  // namespace core
}  // namespace gapmon
