// The torch glue of the CPU numerics ops (csrc/core/numerics.h): the exponent histogram and central
// moments of many tensors in one at::parallel_for region over fixed-size chunks (the torch-free kernels
// of csrc/cpu/numerics_kernels.h), each chunk's partial merged in chunk order, so the result is the same
// bits whatever the threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "../core/numerics.h"
#include "../cpu/block_kernels.h"
#include "../cpu/numerics_kernels.h"
#include "stats_cpu.h"
#include "tensor_views.h"

namespace gapmon {
namespace {

using core::Moments;
using cpu::ChunkNumerics;
using cpu::merge_chunks_into;

// The [N, kNumNumericsColumns] float64 rows of `views` (single items) from their chunks' results.
at::Tensor numerics_rows_of(const std::vector<core::StridedView>& views, const std::vector<ChunkNumerics>& chunks) {
  const int64_t num_views = static_cast<int64_t>(views.size());
  at::Tensor out = at::zeros({num_views, core::kNumNumericsColumns}, at::kDouble);
  double* rows = out.data_ptr<double>();
  for (const core::StridedView& v : views) {
    merge_chunks_into(v, chunks.data() + v.first_chunk, v.chunks_per_item, rows + v.out_row * core::kNumNumericsColumns);
  }
  return out;
}

at::Tensor numerics_states_cpu(at::TensorList xs) {
  std::vector<at::Tensor> keep_alive;
  auto views = views_of(xs, "numerics_states", keep_alive);
  const int64_t num_views = static_cast<int64_t>(views.size());
  if (num_views == 0) return at::zeros({0, core::kNumNumericsColumns}, at::kDouble);
  const int64_t total_chunks = core::plan_chunks(views.data(), num_views);
  std::vector<ChunkNumerics> chunks(total_chunks);
  at::parallel_for(0, total_chunks, 1, [&](int64_t begin, int64_t end) {
    int64_t vi = core::find_view(views.data(), num_views, begin);
    for (int64_t c = begin; c < end; ++c) {
      while (c >= views[vi].first_chunk + views[vi].chunks_per_item) ++vi;
      const core::StridedView& v = views[vi];
      const int64_t lo = (c - v.first_chunk) * core::kChunkElems;
      const int64_t hi = std::min(lo + core::kChunkElems, v.item_numel);
      if (lo < hi) chunks[c] = cpu::chunk_numerics(v, 0, lo, hi);
    }
  });
  return numerics_rows_of(views, chunks);
}

// The statistics states and the numerics rows of xs in one pass over memory: each chunk's numerics
// are taken right after its state, while the chunk is in cache. The same bits as
// multi_tensor_states and numerics_states.
std::tuple<at::Tensor, at::Tensor> multi_tensor_states_and_numerics_cpu(at::TensorList xs) {
  std::vector<at::Tensor> keep_alive;
  auto views = views_of(xs, "multi_tensor_states_and_numerics", keep_alive);
  const int64_t num_views = static_cast<int64_t>(views.size());
  if (num_views == 0) {
    return {at::zeros({0, core::kNumStateColumns}, at::kDouble), at::zeros({0, core::kNumNumericsColumns}, at::kDouble)};
  }
  std::vector<ChunkNumerics> chunks(core::plan_chunks(views.data(), num_views));
  const auto states = compute_states(views, num_views, [&](const core::StridedView& v, int64_t c, int64_t item,
                                                           int64_t lo, int64_t hi) {
    if (lo < hi) chunks[c] = cpu::chunk_numerics(v, item, lo, hi);
  });
  return {states_to_tensor(states), numerics_rows_of(views, chunks)};
}

// The per-instance statistics of x folded into acc[row], as accumulate_instance_stats does, and x's
// numerics merged into numerics[numerics_row], in one pass over x: each chunk's numerics are taken
// right after its state, while it is in cache. x's numerics are its chunks' merged in order (items,
// then each item's chunks): the bins of numerics_states([x]), its moments within float64 rounding.
void accumulate_instance_stats_and_numerics_cpu(const at::Tensor& x, at::Tensor& acc, int64_t row, int64_t correction,
                                                at::Tensor& numerics, int64_t numerics_row) {
  const char* op = "accumulate_instance_stats_and_numerics";
  check_accumulator(x, acc, row, op);
  check_numerics_table(x, numerics, numerics_row);
  std::vector<at::Tensor> keep_alive;
  std::vector<core::StridedView> views{make_view(x, 1, op, keep_alive)};
  std::vector<ChunkNumerics> chunks(core::plan_chunks(views.data(), 1));
  const auto states = compute_states(views, x.size(0), [&](const core::StridedView& v, int64_t c, int64_t item,
                                                           int64_t lo, int64_t hi) {
    if (lo < hi) chunks[c] = cpu::chunk_numerics(v, item, lo, hi);
  });
  fold_instances(states, correction, acc.data_ptr<double>() + row * core::kNumAccColumns);
  merge_chunks_into(views[0], chunks.data(), static_cast<int64_t>(chunks.size()),
                    numerics.data_ptr<double>() + numerics_row * core::kNumNumericsColumns);
}

// [R, N, kNumNumericsColumns] rows (R partial results of N tensors) -> [N, ...], merged in order.
at::Tensor merge_numerics_states_cpu(const at::Tensor& states) {
  check_numerics_states(states);
  const at::Tensor s = states.contiguous();
  const int64_t parts = s.size(0), n = s.size(1);
  at::Tensor out = at::zeros({n, core::kNumNumericsColumns}, at::kDouble);
  double* o = out.data_ptr<double>();
  const double* p = s.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    Moments m;
    double* row = o + i * core::kNumNumericsColumns;
    for (int64_t r = 0; r < parts; ++r) {
      const double* part = p + (r * n + i) * core::kNumNumericsColumns;
      for (int b = 0; b < core::kNumBins; ++b) row[b] += part[b];
      m = core::merge(m, core::load_moments(part));
    }
    core::store_moments(m, row);
  }
  return out;
}

// The per-block format rows [N, F, kNumBlockColumns] of prepared operands (amax[i]: operand i's tensor amax,
// or null when no format needs one): every chunk of every operand in one parallel region (each element read
// once, cast to every format), each operand's chunks merged in order.
at::Tensor block_rows_of(std::vector<core::BlockOperand>& ops, const std::vector<core::BlockFormat>& formats,
                         const double* amax) {
  const int64_t n = static_cast<int64_t>(ops.size()), num_formats = static_cast<int64_t>(formats.size());
  at::Tensor out = at::empty({n, num_formats, core::kNumBlockColumns}, at::kDouble);
  if (n == 0) return out;
  const int64_t total = core::plan_block_chunks(ops.data(), n);
  std::vector<core::BlockRow> chunks(total * num_formats);
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t i = core::find_block_operand(ops.data(), n, c);
      cpu::block_chunk(ops[i], c - ops[i].first_chunk, formats.data(), static_cast<int>(num_formats),
                       amax ? amax[i] : 0.0, chunks.data() + c * num_formats);
    }
  });
  double* o = out.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t f = 0; f < num_formats; ++f) {
      core::BlockRow row;
      for (int64_t c = ops[i].first_chunk; c < ops[i].first_chunk + core::block_chunks_for(ops[i]); ++c) {
        row.merge(chunks[c * num_formats + f]);
      }
      std::copy(row.v, row.v + core::kNumBlockColumns, o + (i * num_formats + f) * core::kNumBlockColumns);
    }
  }
  return out;
}

// The per-block format rows [N, F, kNumBlockColumns] of xs.
at::Tensor block_numerics_cpu(at::TensorList xs, at::IntArrayRef format_codes, const at::Tensor& amaxes) {
  const std::vector<core::BlockFormat> formats = block_formats_of(format_codes);
  std::vector<at::Tensor> keep_alive;
  std::vector<core::BlockOperand> ops = block_operands(xs, formats, amaxes, keep_alive);
  return block_rows_of(ops, formats, any_needs_amax(formats) && !ops.empty() ? amaxes.data_ptr<double>() : nullptr);
}

// The statistics states, the numerics rows (when `with_numerics`; else [N, 0]) and the per-block format rows
// [N, F, kNumBlockColumns] of xs in one pass over memory: right after each chunk's state, while the chunk is
// in cache, its numerics and the block groups that start in it (core::group_at). Every chunk's partials are
// merged in chunk order: the same bits whatever the threads. A tensor that is not contiguous has its blocks
// cast from its contiguous copy, after the pass.
std::tuple<at::Tensor, at::Tensor, at::Tensor> states_numerics_blocks_cpu(at::TensorList xs, bool with_numerics,
                                                                          at::IntArrayRef format_codes,
                                                                          const at::Tensor& amaxes) {
  const char* op = "states_numerics_blocks";
  const std::vector<core::BlockFormat> formats = block_formats_of(format_codes, op);
  const int64_t n = static_cast<int64_t>(xs.size()), num_formats = static_cast<int64_t>(formats.size());
  std::vector<at::Tensor> keep_alive;
  auto views = views_of(xs, op, keep_alive);
  const std::vector<core::BlockOperand> ops = block_operands(xs, formats, amaxes, keep_alive, op);
  at::Tensor blocks = at::empty({n, num_formats, core::kNumBlockColumns}, at::kDouble);
  const int64_t numerics_width = with_numerics ? core::kNumNumericsColumns : 0;
  if (n == 0) return {at::zeros({0, core::kNumStateColumns}, at::kDouble), at::zeros({0, numerics_width}, at::kDouble), blocks};
  const double* amax = any_needs_amax(formats) ? amaxes.data_ptr<double>() : nullptr;
  std::vector<char> in_pass(n);
  for (int64_t i = 0; i < n; ++i) in_pass[i] = xs[i].is_contiguous() && ops[i].cols > 0;
  const int64_t total = core::plan_chunks(views.data(), n);
  std::vector<ChunkNumerics> chunks(with_numerics ? total : 0);
  std::vector<core::BlockRow> block_chunks(total * num_formats);
  const auto states = compute_states(views, n, [&](const core::StridedView& v, int64_t c, int64_t item, int64_t lo,
                                                   int64_t hi) {
    if (lo >= hi) return;
    if (with_numerics) chunks[c] = cpu::chunk_numerics(v, item, lo, hi);
    const int64_t i = v.out_row;
    if (in_pass[i]) {
      cpu::block_groups(ops[i], core::group_at(lo, ops[i].cols), core::group_at(hi, ops[i].cols), formats.data(),
                        static_cast<int>(num_formats), amax ? amax[i] : 0.0, block_chunks.data() + c * num_formats);
    }
  });
  std::vector<core::BlockOperand> rest;  // cast after the pass, from the operands prepared above (no second copy)
  std::vector<int64_t> rest_index;
  std::vector<double> rest_amax;
  double* b = blocks.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    if (!in_pass[i]) {
      rest.push_back(ops[i]);
      rest_index.push_back(i);
      if (amax) rest_amax.push_back(amax[i]);
      continue;
    }
    const core::StridedView& v = views[i];
    for (int64_t f = 0; f < num_formats; ++f) {
      core::BlockRow row;
      for (int64_t c = v.first_chunk; c < v.first_chunk + v.chunks_per_item; ++c) row.merge(block_chunks[c * num_formats + f]);
      std::copy(row.v, row.v + core::kNumBlockColumns, b + (i * num_formats + f) * core::kNumBlockColumns);
    }
  }
  if (!rest.empty()) {
    blocks.index_copy_(0, at::tensor(rest_index, at::kLong), block_rows_of(rest, formats, amax ? rest_amax.data() : nullptr));
  }
  at::Tensor numerics = with_numerics ? numerics_rows_of(views, chunks) : at::zeros({n, 0}, at::kDouble);
  return {states_to_tensor(states), numerics, blocks};
}

// accumulate_instance_stats (with `with_numerics`, accumulate_instance_stats_and_numerics), and x's per-block format
// rows merged into blocks[blocks_row] ([F, kNumBlockColumns], after what it holds), in one pass over x: right after
// each chunk's state, while the chunk is in cache, its numerics and the block groups that start in it. The chunks'
// block partials are merged in chunk order (the same bits whatever the threads). An x that is not contiguous, or
// has no last dim to cut blocks from, has its blocks cast from its contiguous copy after the pass.
void accumulate_instance_stats_numerics_blocks_cpu(const at::Tensor& x, at::Tensor& acc, int64_t row, int64_t correction,
                                                   bool with_numerics, at::Tensor& numerics, int64_t numerics_row,
                                                   at::IntArrayRef format_codes, const std::optional<at::Tensor>& amax,
                                                   at::Tensor& blocks, int64_t blocks_row) {
  const char* op = "accumulate_instance_stats_numerics_blocks";
  check_accumulator(x, acc, row, op);
  if (with_numerics) check_numerics_table(x, numerics, numerics_row);
  const std::vector<core::BlockFormat> formats = block_formats_of(format_codes, op);
  const int64_t num_formats = static_cast<int64_t>(formats.size());
  check_block_table(x, blocks, blocks_row, num_formats, op);
  std::vector<at::Tensor> keep_alive;
  std::vector<core::StridedView> views{make_view(x, 1, op, keep_alive)};
  const bool need_amax = any_needs_amax(formats);
  const at::Tensor given = amax.has_value() ? *amax : at::zeros({1}, at::kDouble);
  std::vector<core::BlockOperand> ops = block_operands({x}, formats, given, keep_alive, op);
  // The tensor amax of the formats scaled per tensor: given, or measured here (a read before the pass: the scale
  // depends on the whole tensor), in parallel chunks whose maxima combine in any order.
  double tensor_amax = 0.0;
  if (need_amax && amax.has_value()) {
    tensor_amax = given.data_ptr<double>()[0];
  } else if (need_amax) {
    const int64_t numel = ops[0].rows * ops[0].cols;
    const int64_t pieces = std::max<int64_t>(1, (numel + core::kChunkElems - 1) / core::kChunkElems);
    std::vector<double> maxima(pieces, 0.0);
    at::parallel_for(0, pieces, 1, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        maxima[k] = cpu::finite_amax(ops[0], k * core::kChunkElems, std::min(numel, (k + 1) * core::kChunkElems));
      }
    });
    tensor_amax = *std::max_element(maxima.begin(), maxima.end());
  }
  const double* amax_ptr = need_amax ? &tensor_amax : nullptr;
  // In the pass when every instance is whole rows of the last dim, laid out in order: block groups never straddle
  // two instances, and instance `item`'s element lo is element item * item_numel + lo of the operand.
  const bool in_pass = x.is_contiguous() && x.dim() >= 2 && ops[0].cols > 0;
  const int64_t total = core::plan_chunks(views.data(), 1);
  std::vector<ChunkNumerics> chunks(with_numerics ? total : 0);
  std::vector<core::BlockRow> block_chunks(in_pass ? total * num_formats : 0);
  const auto states = compute_states(views, x.size(0), [&](const core::StridedView& v, int64_t c, int64_t item,
                                                           int64_t lo, int64_t hi) {
    if (lo >= hi) return;
    if (with_numerics) chunks[c] = cpu::chunk_numerics(v, item, lo, hi);
    if (in_pass) {
      const int64_t base = item * v.item_numel, cols = ops[0].cols;
      cpu::block_groups(ops[0], core::group_at(base + lo, cols), core::group_at(base + hi, cols), formats.data(),
                        static_cast<int>(num_formats), tensor_amax, block_chunks.data() + c * num_formats);
    }
  });
  fold_instances(states, correction, acc.data_ptr<double>() + row * core::kNumAccColumns);
  if (with_numerics) {
    merge_chunks_into(views[0], chunks.data(), static_cast<int64_t>(chunks.size()),
                      numerics.data_ptr<double>() + numerics_row * core::kNumNumericsColumns);
  }
  const at::Tensor after = in_pass ? at::Tensor() : block_rows_of(ops, formats, amax_ptr);  // [1, F, C]
  double* out = blocks.data_ptr<double>() + blocks_row * num_formats * core::kNumBlockColumns;
  for (int64_t f = 0; f < num_formats; ++f) {
    core::BlockRow fresh;
    if (in_pass) {
      for (int64_t c = 0; c < total; ++c) fresh.merge(block_chunks[c * num_formats + f]);
    } else {
      const double* r = after.data_ptr<double>() + f * core::kNumBlockColumns;
      std::copy(r, r + core::kNumBlockColumns, fresh.v);
    }
    core::BlockRow held;
    double* dst = out + f * core::kNumBlockColumns;
    std::copy(dst, dst + core::kNumBlockColumns, held.v);
    held.merge(fresh);
    std::copy(held.v, held.v + core::kNumBlockColumns, dst);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(gapmon, CPU, m) {
  m.impl("states_numerics_blocks", &states_numerics_blocks_cpu);
  m.impl("block_numerics", &block_numerics_cpu);
  m.impl("numerics_states", &numerics_states_cpu);
  m.impl("multi_tensor_states_and_numerics", &multi_tensor_states_and_numerics_cpu);
  m.impl("merge_numerics_states", &merge_numerics_states_cpu);
  m.impl("accumulate_instance_stats_and_numerics", &accumulate_instance_stats_and_numerics_cpu);
  m.impl("accumulate_instance_stats_numerics_blocks", &accumulate_instance_stats_numerics_blocks_cpu);
}

}  // namespace gapmon
