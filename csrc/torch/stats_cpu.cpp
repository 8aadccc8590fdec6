// CPU implementations of the gapmon ops: build StridedViews, run the chunk kernels in one
// at::parallel_for region over every chunk of every tensor, merge chunk states in order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../core/stats_state.h"
#include "tensor_views.h"
#include "stats_cpu.h"
#include "../cpu/stats_kernels.h"
#include "../cpu/update_kernels.h"

namespace gapmon {

using core::State;

namespace {
// Below this many elements in total, one thread does all the work (no parallel region).
constexpr int64_t kSerialElems = int64_t(1) << 15;
}  // namespace

std::vector<State<double>> compute_states(std::vector<core::StridedView>& views, int64_t rows, const ChunkHook& hook) {
  std::vector<State<double>> out(rows);
  const int64_t num_views = static_cast<int64_t>(views.size());
  if (num_views == 0) return out;
  const int64_t total_chunks = core::plan_chunks(views.data(), num_views);

  // Items that span several chunks keep per-chunk partials, merged in chunk order afterwards so
  // the result does not depend on how chunks were spread over threads.
  std::vector<int64_t> partial_base(num_views, 0);
  int64_t num_partials = 0, total_elems = 0;
  for (int64_t i = 0; i < num_views; ++i) {
    total_elems += views[i].item_numel * views[i].items;
    if (views[i].chunks_per_item > 1) {
      partial_base[i] = num_partials;
      num_partials += views[i].chunks_per_item * views[i].items;
    }
  }
  std::vector<State<double>> partials(num_partials);

  const int64_t grain = total_elems < kSerialElems ? total_chunks : 1;
  at::parallel_for(0, total_chunks, grain, [&](int64_t begin, int64_t end) {
    int64_t vi = core::find_view(views.data(), num_views, begin);
    for (int64_t c = begin; c < end; ++c) {
      while (c >= views[vi].first_chunk + views[vi].chunks_per_item * views[vi].items) ++vi;
      const core::StridedView& v = views[vi];
      const int64_t local = c - v.first_chunk;
      const int64_t item = local / v.chunks_per_item;
      const int64_t lo = (local % v.chunks_per_item) * core::kChunkElems;
      const int64_t hi = std::min(lo + core::kChunkElems, v.item_numel);
      const State<double> s = cpu::chunk_state(v, item, lo, hi);
      if (hook) hook(v, c, item, lo, hi);
      if (v.chunks_per_item == 1) {
        out[v.out_row + item] = core::repeat(s, static_cast<double>(v.repeat));
      } else {
        partials[partial_base[vi] + local] = s;
      }
    }
  });

  for (int64_t i = 0; i < num_views; ++i) {
    const core::StridedView& v = views[i];
    if (v.chunks_per_item == 1) continue;
    for (int64_t item = 0; item < v.items; ++item) {
      State<double> s;
      const State<double>* p = partials.data() + partial_base[i] + item * v.chunks_per_item;
      for (int64_t k = 0; k < v.chunks_per_item; ++k) s = core::merge(s, p[k]);
      out[v.out_row + item] = core::repeat(s, static_cast<double>(v.repeat));
    }
  }
  return out;
}

void fold_instances(const std::vector<State<double>>& states, int64_t correction, double* acc_row) {
  double stats[core::kNumStats];
  for (const auto& s : states) {
    core::finalize(s, correction, stats);
    core::accumulate_instance(stats, acc_row);
  }
}

at::Tensor states_to_tensor(const std::vector<State<double>>& states) {
  at::Tensor t = at::empty({static_cast<int64_t>(states.size()), core::kNumStateColumns}, at::kDouble);
  double* p = t.data_ptr<double>();
  for (const auto& s : states) {
    core::store_state(s, p);
    p += core::kNumStateColumns;
  }
  return t;
}

namespace {

at::Tensor finalize_all(const std::vector<State<double>>& states, int64_t correction) {
  at::Tensor t = at::empty({static_cast<int64_t>(states.size()), core::kNumStats}, at::kDouble);
  double* p = t.data_ptr<double>();
  for (size_t i = 0; i < states.size(); ++i) core::finalize(states[i], correction, p + i * core::kNumStats);
  return t;
}

at::Tensor multi_tensor_states_cpu(at::TensorList xs) {
  std::vector<at::Tensor> keep_alive;
  auto views = views_of(xs, "multi_tensor_states", keep_alive);
  return states_to_tensor(compute_states(views, static_cast<int64_t>(xs.size())));
}

at::Tensor multi_tensor_stats_cpu(at::TensorList xs, int64_t correction) {
  std::vector<at::Tensor> keep_alive;
  auto views = views_of(xs, "multi_tensor_stats", keep_alive);
  return finalize_all(compute_states(views, static_cast<int64_t>(xs.size())), correction);
}

at::Tensor tensor_stats_cpu(const at::Tensor& x, int64_t correction) {
  std::vector<at::Tensor> keep_alive;
  std::vector<core::StridedView> views{make_view(x, 0, "tensor_stats", keep_alive)};
  return finalize_all(compute_states(views, 1), correction).squeeze(0);
}

at::Tensor instance_stats_cpu(const at::Tensor& x, int64_t correction) {
  check_batch_dim(x, "instance_stats");
  std::vector<at::Tensor> keep_alive;
  std::vector<core::StridedView> views{make_view(x, 1, "instance_stats", keep_alive)};
  return finalize_all(compute_states(views, x.size(0)), correction);
}

// [R, N, 7] states (R partial results of N tensors) -> [N, 7] merged in order r = 0..R-1.
at::Tensor merge_states_cpu(const at::Tensor& states) {
  check_states(states, 3, "merge_states");
  const at::Tensor s = states.contiguous();
  const int64_t parts = s.size(0), n = s.size(1);
  std::vector<State<double>> merged(n);
  const double* p = s.data_ptr<double>();
  for (int64_t r = 0; r < parts; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      merged[i] = core::merge(merged[i], core::load_state(p + (r * n + i) * core::kNumStateColumns));
    }
  }
  return states_to_tensor(merged);
}

at::Tensor finalize_states_cpu(const at::Tensor& states, int64_t correction) {
  check_states(states, 2, "finalize_states");
  const at::Tensor s = states.contiguous();
  std::vector<State<double>> rows(s.size(0));
  for (int64_t i = 0; i < s.size(0); ++i) rows[i] = core::load_state(s.data_ptr<double>() + i * core::kNumStateColumns);
  return finalize_all(rows, correction);
}

void accumulate_instance_stats_cpu(const at::Tensor& x, at::Tensor& acc, int64_t row, int64_t correction) {
  check_accumulator(x, acc, row);
  std::vector<at::Tensor> keep_alive;
  std::vector<core::StridedView> views{make_view(x, 1, "accumulate_instance_stats", keep_alive)};
  fold_instances(compute_states(views, x.size(0)), correction, acc.data_ptr<double>() + row * core::kNumAccColumns);
}

// The optimizer-update rows of many parameters: their chunks in one parallel region, each row the sum of
// its chunks in chunk order (the same bits whatever the threads).
at::Tensor update_sums_cpu(at::TensorList before, at::TensorList after, at::TensorList grads) {
  std::vector<at::Tensor> keep_alive;
  std::vector<core::UpdateOperands> ops = update_operands(before, after, grads, keep_alive);
  const int64_t n = static_cast<int64_t>(ops.size());
  at::Tensor out = at::zeros({n, core::kUpdateColumns}, at::kDouble);
  if (n == 0) return out;
  const int64_t total = core::plan_update_chunks(ops.data(), n);
  std::vector<core::UpdateSums> chunks(total);
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const core::UpdateOperands& o = ops[core::find_update_operand(ops.data(), n, c)];
      const int64_t lo = (c - o.first_chunk) * core::kChunkElems;
      chunks[c] = cpu::update_chunk(o, lo, std::min(lo + core::kChunkElems, o.numel));
    }
  });
  double* rows = out.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    core::UpdateSums s;
    for (int64_t c = ops[i].first_chunk; c < ops[i].first_chunk + core::chunks_for(ops[i].numel); ++c) s.merge(chunks[c]);
    core::store_update_row(s, ops[i].numel, rows + i * core::kUpdateColumns);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gapmon, CPU, m) {
  m.impl("update_sums", &update_sums_cpu);
  m.impl("accumulate_instance_stats", &accumulate_instance_stats_cpu);
  m.impl("tensor_stats", &tensor_stats_cpu);
  m.impl("instance_stats", &instance_stats_cpu);
  m.impl("multi_tensor_stats", &multi_tensor_stats_cpu);
  m.impl("multi_tensor_states", &multi_tensor_states_cpu);
  m.impl("merge_states", &merge_states_cpu);
  m.impl("finalize_states", &finalize_states_cpu);
}

}  // namespace gapmon
