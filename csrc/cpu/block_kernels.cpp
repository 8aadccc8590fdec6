// The per-block format numerics of a chunk on the CPU: the groups of the chunk in order, each read once
// and cast to every requested format (csrc/core/block_formats.h), compiled for the instruction set the
// statistics kernels use (select_isa): the core's element loops vectorise to its width.
#include "block_kernels.h"

#include <algorithm>
#include <string>

#include "stats_kernels.h"
#include "stats_kernels_isa.h"

namespace gapmon {
namespace cpu {
namespace {

using ChunkArgs = void(const core::BlockOperand&, int64_t, int64_t, const core::BlockFormat*, int, double,
                       core::BlockRow*);

__attribute__((flatten)) void groups_generic(const core::BlockOperand& op, int64_t begin, int64_t end,
                                             const core::BlockFormat* formats, int num_formats, double amax,
                                             core::BlockRow* rows) {
  core::cast_groups(op, begin, end, formats, num_formats, amax, rows);
}

#ifdef GAPMON_HAS_X86_ISAS
__attribute__((flatten, target("avx2,fma,f16c"))) void groups_avx2(const core::BlockOperand& op, int64_t begin,
                                                                   int64_t end, const core::BlockFormat* formats,
                                                                   int num_formats, double amax, core::BlockRow* rows) {
  core::cast_groups(op, begin, end, formats, num_formats, amax, rows);
}
__attribute__((flatten, target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))) void groups_avx512(
    const core::BlockOperand& op, int64_t begin, int64_t end, const core::BlockFormat* formats, int num_formats,
    double amax, core::BlockRow* rows) {
  if (!isa::cast_groups_avx512(op, begin, end, formats, num_formats, amax, rows)) {
    core::cast_groups(op, begin, end, formats, num_formats, amax, rows);
  }
}
#endif

ChunkArgs* groups_for_isa() {
#ifdef GAPMON_HAS_X86_ISAS
  const std::string isa = active_isa();
  if (isa == "avx512") return groups_avx512;
  if (isa == "avx2") return groups_avx2;
#endif
  return groups_generic;
}

}  // namespace

void block_groups(const core::BlockOperand& op, int64_t begin, int64_t end, const core::BlockFormat* formats,
                  int num_formats, double amax, core::BlockRow* rows) {
  if (begin < end) groups_for_isa()(op, begin, end, formats, num_formats, amax, rows);
}

void block_chunk(const core::BlockOperand& op, int64_t chunk_in_tensor, const core::BlockFormat* formats,
                 int num_formats, double amax, core::BlockRow* rows) {
  const int64_t groups = op.rows * core::groups_per_row(op.cols);
  const int64_t begin = chunk_in_tensor * core::kGroupsPerChunk;
  block_groups(op, begin, std::min(begin + core::kGroupsPerChunk, groups), formats, num_formats, amax, rows);
}

}  // namespace cpu
}  // namespace gapmon
