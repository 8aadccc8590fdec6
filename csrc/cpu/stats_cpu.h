// What the CPU statistics glue (stats_cpu.cpp) lends to the other CPU ops: the chunked, parallel
// computation of the states of a list of views, with an optional hook that runs on each chunk of a
// single-item view right after its state (the numerics of the same chunk, while it is in cache).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

#include "../core/stats_state.h"
#include "../core/strided_view.h"

namespace gapmon {

// hook(view, chunk, lo, hi): `chunk` is the global chunk index (core::plan_chunks), [lo, hi) its elements.
using ChunkHook = std::function<void(const core::StridedView&, int64_t, int64_t, int64_t)>;

// States of every item of every view, in output-row order: out[v.out_row + item]; deterministic
// (chunks merged in order, whatever the threads).
std::vector<core::State<double>> compute_states(std::vector<core::StridedView>& views, int64_t rows,
                                                const ChunkHook& hook = {});

// [rows, kNumStateColumns] float64 tensor of states.
at::Tensor states_to_tensor(const std::vector<core::State<double>>& states);

}  // namespace gapmon
