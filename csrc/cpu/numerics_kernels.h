// Torch-free CPU numerics kernels (numerics_kernels.cpp): per chunk, the exponent-histogram bins and the
// moments (csrc/core/numerics.h) of a StridedView's elements; the glue (csrc/torch/numerics_cpu.cpp) runs
// the chunks in parallel and merges them in order.
#pragma once

#include <array>
#include <cstdint>

#include "../core/numerics.h"
#include "../core/strided_view.h"

namespace gapmon {
namespace cpu {

struct ChunkNumerics {
  std::array<int64_t, core::kNumBins> bins{};
  core::Moments moments;
};

// The numerics of elements [lo, hi) of item `item` of `v` (multiplicity not applied).
ChunkNumerics chunk_numerics(const core::StridedView& v, int64_t item, int64_t lo, int64_t hi);

// Merges chunks [0, count) of `v` (bins summed: exact integers below 2^53; moments merged in chunk order:
// deterministic), times the view's repeat, into the numerics row `row`.
void merge_chunks_into(const core::StridedView& v, const ChunkNumerics* chunks, int64_t count, double* row);

}  // namespace cpu
}  // namespace gapmon
