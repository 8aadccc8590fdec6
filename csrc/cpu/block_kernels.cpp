// The per-block format numerics of a chunk on the CPU: the groups of the chunk in order, each read once
// (widened to double) and cast to every requested format (csrc/core/block_formats.h).
#include "block_kernels.h"

#include <algorithm>

namespace gapmon {
namespace cpu {

void block_chunk(const core::BlockOperand& op, int64_t chunk_in_tensor, const core::BlockFormat* formats,
                 int num_formats, double amax, core::BlockRow* rows) {
  const int64_t groups = op.rows * core::groups_per_row(op.cols);
  const int64_t begin = chunk_in_tensor * core::kGroupsPerChunk;
  core::cast_groups(op, begin, std::min(begin + core::kGroupsPerChunk, groups), formats, num_formats, amax, rows);
}

}  // namespace cpu
}  // namespace gapmon
