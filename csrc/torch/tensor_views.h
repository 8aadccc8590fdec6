// Torch glue shared by the CPU and CUDA ops: turns tensors into torch-free StridedViews
// (csrc/core) after checking that a kernel can read them.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "../core/block_formats.h"
#include "../core/numerics.h"
#include "../core/strided_view.h"
#include "../core/update_stats.h"
#include "message.h"

namespace gapmon {

// The kernel dtype of `t`; raises TypeError (naming dtype or layout) for anything else.
inline core::DType checked_dtype(const at::Tensor& t, const char* op) {
  TORCH_CHECK_TYPE(t.layout() == at::kStrided,
                   message("gapmon.", op, ": expected a dense (strided) tensor, got layout ", t.layout(),
                           "; call .to_dense() first"));
  TORCH_CHECK_TYPE(!t.is_quantized(),
                   message("gapmon.", op, ": quantized tensors (torch.", c10::getDtypeNames(t.scalar_type()).first,
                           ") are not supported; call .dequantize() first"));
  switch (t.scalar_type()) {
    case at::kFloat: return core::DType::kFloat32;
    case at::kDouble: return core::DType::kFloat64;
    case at::kHalf: return core::DType::kFloat16;
    case at::kBFloat16: return core::DType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false,
                       message("gapmon.", op, ": expected a floating-point tensor (float16, bfloat16, float32 or ",
                               "float64), got dtype torch.", c10::getDtypeNames(t.scalar_type()).first));
  }
  return core::DType::kFloat32;
}

// Describes dims [first_item_dim, ndim) of `t` as one item (first_item_dim == 1: dim 0 is a
// batch of items). Size-1 dims are dropped, stride-0 dims become `repeat`, the rest are sorted
// by decreasing stride and coalesced, so any dense layout (transposed, channels_last) becomes a
// single unit-stride run. Layouts that still need more than kMaxDims dims are copied once;
// `keep_alive` owns such copies until the kernels have run.
inline core::StridedView make_view(at::Tensor t, int64_t first_item_dim, const char* op,
                                   std::vector<at::Tensor>& keep_alive) {
  core::StridedView v;
  v.dtype = checked_dtype(t, op);
  if (first_item_dim == 1) {
    v.items = t.size(0);
    v.item_stride = t.stride(0);
  }
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  int64_t numel = 1;
  for (int64_t d = first_item_dim; d < t.dim(); ++d) {
    const int64_t size = t.size(d), stride = t.stride(d);
    numel *= size;
    if (size == 1) continue;
    if (stride == 0) {
      v.repeat *= size;
      continue;
    }
    dims.emplace_back(stride, size);
  }
  std::stable_sort(dims.begin(), dims.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::pair<int64_t, int64_t>> merged;
  for (const auto& d : dims) {
    if (!merged.empty() && merged.back().first == d.first * d.second) {
      merged.back() = {d.first, merged.back().second * d.second};
    } else {
      merged.push_back(d);
    }
  }
  if (merged.size() > static_cast<size_t>(core::kMaxDims)) {
    keep_alive.push_back(t.contiguous());
    return make_view(keep_alive.back(), first_item_dim, op, keep_alive);
  }
  v.data = t.data_ptr();
  v.ndim = static_cast<int32_t>(merged.size());
  for (size_t i = 0; i < merged.size(); ++i) {
    v.strides[i] = merged[i].first;
    v.sizes[i] = merged[i].second;
  }
  v.item_numel = numel / v.repeat;
  if (numel == 0) {  // empty items: nothing to read
    v.item_numel = 0;
    v.repeat = 1;
    v.ndim = 0;
  }
  return v;
}

inline void check_same_device(at::TensorList xs, const char* op) {
  for (const auto& x : xs) {
    TORCH_CHECK(x.device() == xs[0].device(),
                message("gapmon.", op, ": all tensors must be on one device, got ", xs[0].device(), " and ", x.device(),
                        "; group them by device first"));
  }
}

// One view per tensor, output row i for xs[i].
inline std::vector<core::StridedView> views_of(at::TensorList xs, const char* op, std::vector<at::Tensor>& keep_alive) {
  check_same_device(xs, op);
  std::vector<core::StridedView> views;
  views.reserve(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    views.push_back(make_view(xs[i], 0, op, keep_alive));
    views.back().out_row = static_cast<int64_t>(i);
  }
  return views;
}

// Raises ValueError unless x has a batch dimension (the per-instance ops).
inline void check_batch_dim(const at::Tensor& x, const char* op) {
  TORCH_CHECK_VALUE(x.dim() >= 1, message("gapmon.", op, ": expected a tensor with a batch dimension (ndim >= 1), ",
                                          "got a 0-dim tensor; use gapmon.tensor_stats for a single value"));
}

// Raises ValueError unless `states` are float64 partial states (multi_tensor_states rows) with
// `dims` dims: 3 for merge_states ([parts, tensors, 7]), 2 for finalize_states ([tensors, 7]).
inline void check_states(const at::Tensor& states, int64_t dims, const char* op) {
  TORCH_CHECK_VALUE(
      states.scalar_type() == at::kDouble && states.dim() == dims && states.size(-1) == core::kNumStateColumns,
      message("gapmon.", op, ": expected float64 ", dims == 3 ? "[parts, tensors, " : "[tensors, ",
              core::kNumStateColumns, "] states (from multi_tensor_states), got ", states.scalar_type(), " ",
              states.sizes()));
}

// Raises ValueError unless `states` are float64 [parts, tensors, kNumNumericsColumns] numerics rows.
inline void check_numerics_states(const at::Tensor& states) {
  TORCH_CHECK_VALUE(
      states.scalar_type() == at::kDouble && states.dim() == 3 && states.size(2) == core::kNumNumericsColumns,
      message("gapmon.merge_numerics_states: expected float64 [parts, tensors, ", core::kNumNumericsColumns,
              "] rows (from numerics_states), got ", states.scalar_type(), " ", states.sizes()));
}

// Checks the arguments of accumulate_instance_stats (GAPMonitor activation accumulators).
inline void check_accumulator(const at::Tensor& x, const at::Tensor& acc, int64_t row,
                              const char* op = "accumulate_instance_stats") {
  check_batch_dim(x, op);
  TORCH_CHECK_VALUE(
      acc.dim() == 2 && acc.size(1) == core::kNumAccColumns && acc.scalar_type() == at::kDouble &&
          acc.is_contiguous() && acc.device() == x.device(),
      message("gapmon.", op, ": expected a contiguous float64 [rows, ", core::kNumAccColumns, "] accumulator on ",
              x.device(), ", got ", acc.scalar_type(), " ", acc.sizes(), " on ", acc.device()));
  TORCH_CHECK_INDEX(
      row >= 0 && row < acc.size(0),
      message("gapmon.", op, ": row ", row, " out of range for an accumulator of ", acc.size(0), " rows"));
}

// Checks the numerics table of accumulate_instance_stats_and_numerics: rows merged into in place.
inline void check_numerics_table(const at::Tensor& x, const at::Tensor& table, int64_t row) {
  TORCH_CHECK_VALUE(table.dim() == 2 && table.size(1) == core::kNumNumericsColumns &&
                        table.scalar_type() == at::kDouble && table.is_contiguous() && table.device() == x.device(),
                    message("gapmon.accumulate_instance_stats_and_numerics: expected a contiguous float64 [rows, ",
                            core::kNumNumericsColumns, "] numerics table on ", x.device(), ", got ",
                            table.scalar_type(), " ", table.sizes(), " on ", table.device()));
  TORCH_CHECK_INDEX(row >= 0 && row < table.size(0),
                    message("gapmon.accumulate_instance_stats_and_numerics: numerics row ", row,
                            " out of range for a table of ", table.size(0), " rows"));
}

// Checks the per-block table of accumulate_instance_stats_numerics_blocks: float64 [rows, F, kNumBlockColumns] on
// x's device, row `row` merged into in place.
inline void check_block_table(const at::Tensor& x, const at::Tensor& table, int64_t row, int64_t num_formats,
                              const char* op) {
  TORCH_CHECK_VALUE(table.dim() == 3 && table.size(1) == num_formats && table.size(2) == core::kNumBlockColumns &&
                        table.scalar_type() == at::kDouble && table.is_contiguous() && table.device() == x.device(),
                    message("gapmon.", op, ": expected a contiguous float64 [rows, ", num_formats, ", ",
                            core::kNumBlockColumns, "] block table on ", x.device(), ", got ", table.scalar_type(), " ",
                            table.sizes(), " on ", table.device()));
  TORCH_CHECK_INDEX(row >= 0 && row < table.size(0), message("gapmon.", op, ": block row ", row,
                                                             " out of range for a table of ", table.size(0), " rows"));
}

// The operands of update_sums: per parameter the weights before and after the step (same shape and
// dtype) and its gradient (same shape), all on one device; contiguous copies (`keep_alive`) of any
// that are not. Raises ValueError/TypeError naming the parameter's index otherwise.
inline std::vector<core::UpdateOperands> update_operands(at::TensorList before, at::TensorList after,
                                                         at::TensorList grads, std::vector<at::Tensor>& keep_alive) {
  const char* op = "update_sums";
  TORCH_CHECK_VALUE(before.size() == after.size() && before.size() == grads.size(),
                    message("gapmon.update_sums: expected ",
                            "as many weights after the step and gradients as weights before it, got ", before.size(),
                            ", ", after.size(), " and ", grads.size()));
  std::vector<core::UpdateOperands> ops(before.size());
  auto contiguous = [&](const at::Tensor& t) {
    if (t.is_contiguous()) return t;
    keep_alive.push_back(t.contiguous());
    return keep_alive.back();
  };
  for (size_t i = 0; i < before.size(); ++i) {
    const at::Tensor &b = before[i], &a = after[i], &g = grads[i];
    core::UpdateOperands& o = ops[i];
    o.weight_dtype = checked_dtype(b, op);
    o.grad_dtype = checked_dtype(g, op);
    TORCH_CHECK_VALUE(checked_dtype(a, op) == o.weight_dtype,
                      message("gapmon.update_sums: parameter ", i, ": the weights ", "before (", b.scalar_type(),
                              ") and after (", a.scalar_type(), ") the step differ in dtype"));
    TORCH_CHECK_VALUE(a.sizes() == b.sizes() && g.sizes() == b.sizes(),
                      message("gapmon.update_sums: parameter ", i, ": shapes differ (before ", b.sizes(), ", after ",
                              a.sizes(), ", gradient ", g.sizes(), ")"));
    TORCH_CHECK_VALUE(a.device() == b.device() && g.device() == b.device() && b.device() == before[0].device(),
                      message("gapmon.update_sums: parameter ", i, ": expected every tensor on ", before[0].device(),
                              ", got ", b.device(), ", ", a.device(), " and ", g.device()));
    o.before = contiguous(b).data_ptr();
    o.after = contiguous(a).data_ptr();
    o.grad = contiguous(g).data_ptr();
    o.numel = b.numel();
  }
  return ops;
}

// The formats of block_numerics, checked: ValueError naming an unknown code.
inline std::vector<core::BlockFormat> block_formats_of(at::IntArrayRef formats, const char* op = "block_numerics") {
  TORCH_CHECK_VALUE(
      !formats.empty() && formats.size() <= static_cast<size_t>(core::kNumBlockFormats),
      message("gapmon.", op, ": expected 1 to ", core::kNumBlockFormats, " format codes, got ", formats.size()));
  std::vector<core::BlockFormat> out;
  for (int64_t f : formats) {
    TORCH_CHECK_VALUE(f >= 0 && f < core::kNumBlockFormats,
                      message("gapmon.", op, ": unknown format code ", f, " (0..", core::kNumBlockFormats - 1, ")"));
    out.push_back(static_cast<core::BlockFormat>(f));
  }
  return out;
}

// Whether any of the formats scales by the tensor's amax (NVFP4, current scaling): the ops then read `amaxes`.
inline bool any_needs_amax(const std::vector<core::BlockFormat>& formats) {
  for (core::BlockFormat f : formats) {
    if (core::needs_tensor_amax(f)) return true;
  }
  return false;
}

// The operands of block_numerics: each tensor as contiguous [rows, last dim] (a 0-dim tensor: [1, 1]);
// contiguous copies in `keep_alive`. `amaxes`: float64 [N] on the tensors' device when a format needs the
// tensor's amax (NVFP4, current scaling), else ignored.
inline std::vector<core::BlockOperand> block_operands(at::TensorList xs, const std::vector<core::BlockFormat>& formats,
                                                      const at::Tensor& amaxes, std::vector<at::Tensor>& keep_alive,
                                                      const char* op = "block_numerics") {
  std::vector<core::BlockOperand> ops(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    const at::Tensor& x = xs[i];
    ops[i].dtype = checked_dtype(x, op);
    TORCH_CHECK_VALUE(x.device() == xs[0].device(), message("gapmon.", op, ": expected every tensor on ",
                                                            xs[0].device(), ", got ", x.device(), " for tensor ", i));
    const at::Tensor c = x.is_contiguous() ? x : keep_alive.emplace_back(x.contiguous());
    ops[i].data = c.data_ptr();
    ops[i].cols = x.dim() == 0 ? 1 : x.size(-1);
    ops[i].rows = ops[i].cols == 0 ? 0 : x.numel() / ops[i].cols;
  }
  bool need_amax = false;
  for (core::BlockFormat f : formats) need_amax = need_amax || core::needs_tensor_amax(f);
  if (need_amax && !xs.empty()) {
    TORCH_CHECK_VALUE(
        amaxes.scalar_type() == at::kDouble && amaxes.dim() == 1 && amaxes.size(0) == static_cast<int64_t>(xs.size()) &&
            amaxes.device() == xs[0].device() && amaxes.is_contiguous(),
        message("gapmon.", op, ": NVFP4 and current scaling need each tensor's amax: a contiguous float64 [", xs.size(),
                "] tensor on ", xs[0].device(), ", got ", amaxes.scalar_type(), " ", amaxes.sizes(), " on ",
                amaxes.device()));
  }
  return ops;
}

}  // namespace gapmon
