// The AVX2 with FMA and F16C copy of the CPU statistics kernel. Every header is included before the
// target pragma, so that only this unit's own copy of the body (an anonymous namespace) is compiled
// for avx2; the dispatcher (stats_kernels.cpp) calls it only on CPUs that have it.
#include "stats_kernels_deps.h"
#include "stats_kernels_isa.h"

#ifdef GAPMON_HAS_X86_ISAS
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define GAPMON_KERNEL_F16C 1
#include "stats_kernels_body.h"

namespace gapmon {
namespace cpu {
namespace isa {

core::State<double> chunk_state_avx2(const core::StridedView& v, int64_t item, int64_t lo, int64_t hi) {
  return chunk_state_body<32>(v, item, lo, hi);
}

}  // namespace isa
}  // namespace cpu
}  // namespace gapmon
#pragma GCC pop_options
#endif
