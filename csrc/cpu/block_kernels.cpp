// The per-block format numerics of a chunk on the CPU: the groups of the chunk in order, each read once
// and cast to every requested format (csrc/core/block_formats.h), compiled for the instruction set the
// statistics kernels use (select_isa): the core's element loops vectorise to its width.
#include "block_kernels.h"

#include <algorithm>
#include <cstring>
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

// The form of a kernel for the instruction set the statistics kernels use (select_isa).
template <typename Fn>
Fn* for_isa(Fn* generic, [[maybe_unused]] Fn* avx2, [[maybe_unused]] Fn* avx512) {
#ifdef GAPMON_HAS_X86_ISAS
  const std::string isa = active_isa();
  if (isa == "avx512") return avx512;
  if (isa == "avx2") return avx2;
#endif
  return generic;
}

ChunkArgs* groups_for_isa() {
#ifdef GAPMON_HAS_X86_ISAS
  return for_isa<ChunkArgs>(groups_generic, groups_avx2, groups_avx512);
#else
  return groups_generic;
#endif
}

// The largest magnitude bits below `inf` (the exponent-all-ones pattern: Inf and NaN left out) of n elements.
template <typename U>
U finite_magnitude_bits(const U* p, int64_t n, U abs_mask, U inf) {
  U m = 0;  // a mask and an unsigned max per element (as written with selects, GCC kept it scalar)
  for (int64_t i = 0; i < n; ++i) {
    const U a = static_cast<U>(p[i] & abs_mask);
    const U finite = static_cast<U>(U(0) - static_cast<U>(a < inf));
    m = std::max(m, static_cast<U>(a & finite));
  }
  return m;
}

using AmaxArgs = double(const core::BlockOperand&, int64_t, int64_t);

__attribute__((flatten)) double finite_amax_generic(const core::BlockOperand& op, int64_t begin, int64_t end) {
  const int64_t n = end - begin;
  switch (op.dtype) {
    case core::DType::kFloat32: {
      const uint32_t m = finite_magnitude_bits(static_cast<const uint32_t*>(op.data) + begin, n, 0x7FFFFFFFu, 0x7F800000u);
      return core::f32_from_bits(m);
    }
    case core::DType::kBFloat16: {
      const uint16_t m = finite_magnitude_bits(static_cast<const uint16_t*>(op.data) + begin, n, uint16_t(0x7FFF), uint16_t(0x7F80));
      return core::widen(core::BF16{m});
    }
    case core::DType::kFloat16: {
      const uint16_t m = finite_magnitude_bits(static_cast<const uint16_t*>(op.data) + begin, n, uint16_t(0x7FFF), uint16_t(0x7C00));
      return core::widen(core::Half{m});
    }
    case core::DType::kFloat64: {
      const uint64_t m = finite_magnitude_bits<uint64_t>(static_cast<const uint64_t*>(op.data) + begin, n, 0x7FFFFFFFFFFFFFFFull,
                                               0x7FF0000000000000ull);
      double d;
      std::memcpy(&d, &m, sizeof d);
      return d;
    }
  }
  return 0.0;
}

#ifdef GAPMON_HAS_X86_ISAS
__attribute__((flatten, target("avx512f,avx512bw,avx512vl,avx2"))) double finite_amax_avx512(const core::BlockOperand& op,
                                                                                              int64_t begin, int64_t end) {
  return finite_amax_generic(op, begin, end);
}
__attribute__((flatten, target("avx2"))) double finite_amax_avx2(const core::BlockOperand& op, int64_t begin, int64_t end) {
  return finite_amax_generic(op, begin, end);
}
#endif

}  // namespace

double finite_amax(const core::BlockOperand& op, int64_t begin, int64_t end) {
  if (begin >= end) return 0.0;
#ifdef GAPMON_HAS_X86_ISAS
  return for_isa<AmaxArgs>(finite_amax_generic, finite_amax_avx2, finite_amax_avx512)(op, begin, end);
#else
  return finite_amax_generic(op, begin, end);
#endif
}

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
