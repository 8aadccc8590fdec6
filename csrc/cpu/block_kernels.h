// Torch-free CPU kernel of the per-block format numerics (csrc/core/block_formats.h): one chunk of one
// tensor; the glue (csrc/torch/numerics_cpu.cpp) runs the chunks in parallel and merges them in order.
#pragma once

#include <cstdint>

#include "../core/block_formats.h"
#include "stats_kernels_isa.h"

namespace gapmon {
namespace cpu {

// The rows of formats[0, num_formats) over groups [begin, end) of `op` (tensor amax `amax`), added to rows.
void block_groups(const core::BlockOperand& op, int64_t begin, int64_t end, const core::BlockFormat* formats,
                  int num_formats, double amax, core::BlockRow* rows);

// The rows of formats[0, num_formats) over chunk `chunk_in_tensor` of `op` (tensor amax `amax`) into rows.
void block_chunk(const core::BlockOperand& op, int64_t chunk_in_tensor, const core::BlockFormat* formats,
                 int num_formats, double amax, core::BlockRow* rows);

// The largest finite |x| over elements [begin, end) of `op` (0 when none): what the formats scaled per tensor take
// as the tensor's amax. Compared as magnitude bits (monotonic for IEEE values), so that every dtype vectorises.
double finite_amax(const core::BlockOperand& op, int64_t begin, int64_t end);

#ifdef GAPMON_HAS_X86_ISAS
namespace isa {
// Groups [begin, end) of `op` cast with AVX-512 (block_kernels_avx512.cpp: whole groups 16 at a time, a row's
// shorter last group by the core), added to rows; false, with nothing done, for float64 tensors (the core's).
bool cast_groups_avx512(const core::BlockOperand& op, int64_t begin, int64_t end, const core::BlockFormat* formats,
                        int num_formats, double amax, core::BlockRow* rows);
}  // namespace isa
#endif

}  // namespace cpu
}  // namespace gapmon
