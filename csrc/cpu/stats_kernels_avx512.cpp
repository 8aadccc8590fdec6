// The AVX-512 (F, BW, VL, DQ) copy of the CPU statistics kernel. Every header is included before the
// target pragma, so that only this unit's own copy of the body (an anonymous namespace) is compiled
// for avx512; the dispatcher (stats_kernels.cpp) calls it only on CPUs that have it.
#include "stats_kernels_deps.h"
#include "stats_kernels_isa.h"

#ifdef GAPMON_HAS_X86_ISAS
#pragma GCC push_options
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's _mm512_cvtph_ps
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
#define GAPMON_KERNEL_F16C 1
#define GAPMON_KERNEL_AVX512 1
#include "stats_kernels_body.h"

namespace gapmon {
namespace cpu {
namespace isa {

core::State<double> chunk_state_avx512(const core::StridedView& v, int64_t item, int64_t lo, int64_t hi) {
  return chunk_state_body<64>(v, item, lo, hi);
}

}  // namespace isa
}  // namespace cpu
}  // namespace gapmon
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
