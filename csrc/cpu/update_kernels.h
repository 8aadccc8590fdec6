// Torch-free CPU kernel of the optimizer-update sums (csrc/core/update_stats.h): one chunk of one
// parameter; the glue (csrc/torch/stats_cpu.cpp) runs the chunks in parallel and adds them in order.
#pragma once

#include <cstdint>

#include "../core/update_stats.h"

namespace gapmon {
namespace cpu {

// The sums of elements [lo, hi) of `op`, in a fixed order (the same bits whatever the threads).
core::UpdateSums update_chunk(const core::UpdateOperands& op, int64_t lo, int64_t hi);

}  // namespace cpu
}  // namespace gapmon
