// The instruction-set copies of the CPU statistics kernel (x86-64 with GCC), each in a translation unit
// of its own compiled for its target by `#pragma GCC target`: stats_kernels_avx2.cpp and
// stats_kernels_avx512.cpp. Other compilers (Clang ignores that pragma) build the baseline copy only.
#pragma once

#include <cstdint>

#include "../core/strided_view.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GAPMON_HAS_X86_ISAS 1
namespace gapmon {
namespace cpu {
namespace isa {

core::State<double> chunk_state_avx2(const core::StridedView& v, int64_t item, int64_t lo, int64_t hi);
core::State<double> chunk_state_avx512(const core::StridedView& v, int64_t item, int64_t lo, int64_t hi);

}  // namespace isa
}  // namespace cpu
}  // namespace gapmon
#endif
