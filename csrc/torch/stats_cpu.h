// What the CPU statistics glue (stats_cpu.cpp) lends to the other CPU ops: the chunked, parallel
// computation of the states of a list of views, with an optional hook that runs on each chunk right
// after its state (the numerics of the same chunk, while it is in cache).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

#include "../core/stats_state.h"
#include "../core/strided_view.h"

namespace gapmon {

// hook(view, chunk, item, lo, hi): `chunk` is the global chunk index (core::plan_chunks), [lo, hi) its
// elements in item `item` of the view.
using ChunkHook = std::function<void(const core::StridedView&, int64_t, int64_t, int64_t, int64_t)>;

// States of every item of every view, in output-row order: out[v.out_row + item]; deterministic
// (chunks merged in order, whatever the threads).
std::vector<core::State<double>> compute_states(std::vector<core::StridedView>& views, int64_t rows,
                                                const ChunkHook& hook = {});

// [rows, kNumStateColumns] float64 tensor of states.
at::Tensor states_to_tensor(const std::vector<core::State<double>>& states);

// Folds the finalised statistics of every state, in order, into an instance accumulator row
// (core::InstanceAccColumn): what accumulate_instance_stats does with an activation's rows.
void fold_instances(const std::vector<core::State<double>>& states, int64_t correction, double* acc_row);

}  // namespace gapmon
