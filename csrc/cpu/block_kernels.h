// Torch-free CPU kernel of the per-block format numerics (csrc/core/block_formats.h): one chunk of one
// tensor; the glue (csrc/torch/numerics_cpu.cpp) runs the chunks in parallel and merges them in order.
#pragma once

#include <cstdint>

#include "../core/block_formats.h"

namespace gapmon {
namespace cpu {

// The rows of formats[0, num_formats) over chunk `chunk_in_tensor` of `op` (tensor amax `amax`) into rows.
void block_chunk(const core::BlockOperand& op, int64_t chunk_in_tensor, const core::BlockFormat* formats,
                 int num_formats, double amax, core::BlockRow* rows);

}  // namespace cpu
}  // namespace gapmon
