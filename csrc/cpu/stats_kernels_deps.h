// Everything the CPU statistics kernel's body (stats_kernels_body.h) includes. The instruction-set
// units (stats_kernels_avx2.cpp, stats_kernels_avx512.cpp) include it before their target pragma, so
// that no inline function of these headers gets a copy compiled for their target that the baseline
// could share.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "../core/stats_state.h"
#include "../core/strided_view.h"
