// The per-block format numerics with AVX-512 for float32, bfloat16 and float16 tensors: the same casts,
// counts and bits of every count as csrc/core/block_formats.h (its float32 path), written for the vector
// unit. The core's loops spend most of their time per 32-element group on scalar work: two horizontal
// reductions, the scale's branches, the counters. Here 16 groups go together: their range (largest and
// smallest non-zero magnitude per 16-element half) is reduced into one vector with a lane per group, the
// scales of all 16 are computed in vector registers, and the elements are cast with a group's scale
// broadcast from its lane; counts are kept per lane and error sums in float64 lanes.
//
// Exact as the core: every cast is the same float32 arithmetic (round to nearest even by adding and
// subtracting a power of two whose float32 spacing is the format's spacing at the value); the float64
// quotients q / s (current scaling) and q * S / g (NVFP4) are correctly rounded by a Markstein step from the
// correctly rounded reciprocal, as a division gives them. Only the order of the error and signal sums
// differs (within float64 rounding). Groups that are not whole (a row's last, shorter group) go through
// the core.
#include "block_kernels.h"
#include "stats_kernels_isa.h"

#ifdef GAPMON_HAS_X86_ISAS
#include <immintrin.h>

#include <cmath>

#pragma GCC push_options
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 intrinsics (their undefined vectors)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

namespace gapmon {
namespace cpu {
namespace isa {
namespace {

using core::BlockFormat;
using core::BlockRow;

constexpr int kBatch = 16;  // groups cast together: a lane each in the batch's range and scale vectors
constexpr uint32_t kInfBits = 0x7F800000u;

// 16 elements as float32 magnitudes (bits; float16 and bfloat16 widened exactly).
inline __m512i magnitudes(const float* p) {
  return _mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(0x7FFFFFFF));
}
inline __m512i magnitudes(const core::BF16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_and_si512(_mm512_slli_epi32(w, 16), _mm512_set1_epi32(0x7FFFFFFF));
}
inline __m512i magnitudes(const core::Half* p) {
  const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_and_si512(_mm512_castps_si512(f), _mm512_set1_epi32(0x7FFFFFFF));
}

// r[j] = reduce(v[j]) over the 16 lanes of each of v[0..16), by a transposing tree (45 operations instead
// of 16 horizontal reductions); `op` is an unsigned max or min.
template <typename Op>
inline __m512i reduce16(const __m512i (&v)[kBatch], Op op) {
  __m512i t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: v[2i]'s partials, 8-15: v[2i+1]'s
    t[i] = op(_mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit chunk k: v[4i + k]'s partials
    u[i] = op(_mm512_shuffle_i32x4(t[2 * i], t[2 * i + 1], 0x88), _mm512_shuffle_i32x4(t[2 * i], t[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // chunk k: lanes 0-1 v[8i + k], lanes 2-3 v[8i + 4 + k]
    w[i] = op(_mm512_unpacklo_epi64(u[2 * i], u[2 * i + 1]), _mm512_unpackhi_epi64(u[2 * i], u[2 * i + 1]));
  }
  const __m512i r = op(_mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(w[0]), _mm512_castsi512_ps(w[1]), 0x88)),
                       _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(w[0]), _mm512_castsi512_ps(w[1]), 0xDD)));
  // lane 4k + p holds v[4p + k]: back to lane j for v[j]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_epi32(order, r);
}

inline __m512i max_u32(__m512i a, __m512i b) { return _mm512_max_epu32(a, b); }
inline __m512i min_u32(__m512i a, __m512i b) { return _mm512_min_epu32(a, b); }

// v (float32, >= 0, +inf included) rounded to nearest even onto an element format's grid (no saturation): the
// vector form of core::round_to_grid, its c capped at 2^127 the same way.
struct Grid {
  __m512i min_normal_bits, shift, cap;  // the smallest normal's bits; (23 - mantissa bits) << 23; 2^127 - shift
  __m512 top, min_normal;

  Grid() = default;
  explicit Grid(const core::ElementFormat& f) {
    const float mn = core::pow2f(f.min_normal_exp);
    min_normal_bits = _mm512_set1_epi32(static_cast<int>(core::bits_of(mn)));
    shift = _mm512_set1_epi32((23 - f.mantissa_bits) << 23);
    cap = _mm512_set1_epi32(static_cast<int>(0x7F000000u - (static_cast<uint32_t>(23 - f.mantissa_bits) << 23)));
    top = _mm512_set1_ps(static_cast<float>(f.max_finite));
    min_normal = _mm512_set1_ps(mn);
  }
  __m512 round(__m512 v) const {
    const __m512i e = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(kInfBits)));
    const __m512i capped = _mm512_min_epu32(_mm512_max_epu32(e, min_normal_bits), cap);
    const __m512 c = _mm512_castsi512_ps(_mm512_add_epi32(capped, shift));
    return _mm512_sub_ps(_mm512_add_ps(v, c), c);
  }
};

inline int popcount(__mmask16 k) { return __builtin_popcount(static_cast<unsigned>(k)); }

// Adds the squares of the 16 float32 values d to two float64 accumulators.
inline void add_squares(__m512 d, __m512d& lo, __m512d& hi) {
  const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(d));
  const __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(d), 1)));
  lo = _mm512_fmadd_pd(a, a, lo);
  hi = _mm512_fmadd_pd(b, b, hi);
}

// Adds (a - p / d)^2 for the 16 float32 values a and p, with p / d the correctly rounded float64 quotient
// (Markstein: y = p * (1/d) is within an ulp; the residual p - y * d is exact by FMA; y + r * (1/d) rounds
// to the quotient), to two float64 accumulators.
inline void add_quotient_errors(__m512 a, __m512 p, __m512d d, __m512d inv, __m512d& lo, __m512d& hi) {
  const __m256 halves_a[2] = {_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))};
  const __m256 halves_p[2] = {_mm512_castps512_ps256(p), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1))};
  __m512d* acc[2] = {&lo, &hi};
  for (int h = 0; h < 2; ++h) {
    const __m512d pd = _mm512_cvtps_pd(halves_p[h]);
    const __m512d y = _mm512_mul_pd(pd, inv);
    const __m512d r = _mm512_fnmadd_pd(y, d, pd);
    const __m512d e = _mm512_sub_pd(_mm512_cvtps_pd(halves_a[h]), _mm512_fmadd_pd(r, inv, y));
    *acc[h] = _mm512_fmadd_pd(e, e, *acc[h]);
  }
}

// One format's sums over the chunk, in lanes.
struct FormatLanes {
  __m512i to_zero, below_normal, saturated;  // below_normal: cast to zero or to a subnormal
  __m512d err_lo, err_hi;
  int64_t scale_under = 0, scale_over = 0;

  FormatLanes() : to_zero(_mm512_setzero_si512()), below_normal(to_zero), saturated(to_zero), err_lo(_mm512_setzero_pd()),
                  err_hi(err_lo) {}
};

// The chunk's sums shared by every format (the range per 32- and 16-element block, the signal).
struct SharedLanes {
  __m512i nonzero;
  __m512d sig_lo, sig_hi, ratio32, ratio16;
  __m512 min_nonzero;
  int64_t nonfinite = 0, groups = 0;

  SharedLanes() : nonzero(_mm512_setzero_si512()), sig_lo(_mm512_setzero_pd()), sig_hi(sig_lo), ratio32(sig_lo),
                  ratio16(sig_lo), min_nonzero(_mm512_set1_ps(INFINITY)) {}
};

// A batch of up to 16 whole groups: their magnitudes (non-finite ones zeroed) and their ranges.
struct Batch {
  __m512 a[kBatch][2];
  // lane j: group j's largest / smallest non-zero magnitude bits (+inf: none), per 16-element half h when the
  // batch was loaded with halves (NVFP4's blocks), else of the whole group in [0] (and [1] the same)
  __m512i amax[2], amin[2];
  __mmask16 valid;
};

// Loads a batch: its magnitudes, ranges, non-zero count and signal, as if every element were finite (a
// non-finite one is seen by the batch's largest magnitude; not tested element by element): the rare batch
// that has one is then taken again from its loaded (L1) copy, non-finite elements zeroed and counted.
template <bool kHalves, typename T>
void load_batch(const T* const* groups, int count, Batch& b, SharedLanes& shared) {
  const __m512i ones = _mm512_set1_epi32(1), inf = _mm512_set1_epi32(static_cast<int>(kInfBits));
  constexpr int kParts = kHalves ? 2 : 1;
  __m512i top[kParts][kBatch], low[kParts][kBatch];
  // the sums in a local copy, kept in registers (through the reference, GCC stored them every element vector:
  // the stores to b may alias them), written back at the end
  const SharedLanes before = shared;
  SharedLanes s = shared;
  auto account = [&](int j, __m512i m0, __m512i m1) {
    const __m512i l0 = _mm512_sub_epi32(m0, ones), l1 = _mm512_sub_epi32(m1, ones);  // zero wraps: not a minimum
    if (kHalves) {
      top[0][j] = m0, top[kParts - 1][j] = m1, low[0][j] = l0, low[kParts - 1][j] = l1;
    } else {
      top[0][j] = _mm512_max_epu32(m0, m1), low[0][j] = _mm512_min_epu32(l0, l1);
    }
    if (j < count) {
      s.nonzero = _mm512_mask_add_epi32(s.nonzero, _mm512_test_epi32_mask(m0, m0), s.nonzero, ones);
      s.nonzero = _mm512_mask_add_epi32(s.nonzero, _mm512_test_epi32_mask(m1, m1), s.nonzero, ones);
      add_squares(_mm512_castsi512_ps(m0), s.sig_lo, s.sig_hi);
      add_squares(_mm512_castsi512_ps(m1), s.sig_lo, s.sig_hi);
    }
  };
  __m512i largest = _mm512_setzero_si512();
  for (int j = 0; j < kBatch; ++j) {
    __m512i m0 = _mm512_setzero_si512(), m1 = m0;
    if (j < count) {
      m0 = magnitudes(groups[j]), m1 = magnitudes(groups[j] + 16);
      largest = _mm512_max_epu32(largest, _mm512_max_epu32(m0, m1));
    }
    b.a[j][0] = _mm512_castsi512_ps(m0), b.a[j][1] = _mm512_castsi512_ps(m1);
    account(j, m0, m1);
  }
  if (_mm512_cmpge_epu32_mask(largest, inf)) [[unlikely]] {
    s = before;
    for (int j = 0; j < count; ++j) {
      __m512i m[2];
      for (int h = 0; h < 2; ++h) {
        const __m512i bits = _mm512_castps_si512(b.a[j][h]);
        const __mmask16 finite = _mm512_cmplt_epu32_mask(bits, inf);
        s.nonfinite += 16 - popcount(finite);
        m[h] = _mm512_maskz_mov_epi32(finite, bits);
        b.a[j][h] = _mm512_castsi512_ps(m[h]);
      }
      account(j, m[0], m[1]);
    }
  }
  b.valid = static_cast<__mmask16>((1u << count) - 1u);
  for (int h = 0; h < kParts; ++h) {
    b.amax[h] = reduce16(top[h], max_u32);
    const __m512i lowest = reduce16(low[h], min_u32);
    const __mmask16 none = _mm512_cmpeq_epi32_mask(lowest, _mm512_set1_epi32(-1));
    b.amin[h] = _mm512_mask_mov_epi32(_mm512_add_epi32(lowest, ones), none, inf);
  }
  if (!kHalves) b.amax[1] = b.amax[0], b.amin[1] = b.amin[0];
  s.groups += count;
  shared = s;
}

// max(ratio, amax / amin) over the lanes in `k` (float64 quotients, as the core's).
inline void max_ratio(__m512i amax, __m512i amin, __mmask16 k, __m512d& ratio) {
  const __m512 hi = _mm512_castsi512_ps(amax), lo = _mm512_castsi512_ps(amin);
  for (int h = 0; h < 2; ++h) {
    const __m256 hh = h == 0 ? _mm512_castps512_ps256(hi) : _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(hi), 1));
    const __m256 ll = h == 0 ? _mm512_castps512_ps256(lo) : _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lo), 1));
    const __mmask8 kk = static_cast<__mmask8>(h == 0 ? k : k >> 8);
    const __m512d q = _mm512_div_pd(_mm512_cvtps_pd(hh), _mm512_cvtps_pd(ll));
    ratio = _mm512_mask_max_pd(ratio, kk, ratio, q);
  }
}

// The range of a batch's blocks (shared by every format).
void batch_ranges(const Batch& b, bool need16, SharedLanes& s) {
  const __m512i amax = _mm512_max_epu32(b.amax[0], b.amax[1]), amin = _mm512_min_epu32(b.amin[0], b.amin[1]);
  const __mmask16 nz = _mm512_mask_test_epi32_mask(b.valid, amax, amax);
  max_ratio(amax, amin, nz, s.ratio32);
  s.min_nonzero = _mm512_mask_min_ps(s.min_nonzero, nz, s.min_nonzero, _mm512_castsi512_ps(amin));
  if (need16) {
    for (int h = 0; h < 2; ++h) {
      max_ratio(b.amax[h], b.amin[h], _mm512_mask_test_epi32_mask(b.valid, b.amax[h], b.amax[h]), s.ratio16);
    }
  }
}

inline __m512 lane(__m512 v, int j) { return _mm512_permutexvar_ps(_mm512_set1_epi32(j), v); }

// Casts the 16 magnitudes a by v = a * mul onto the grid; counts into f; returns q.
inline __m512 cast16(__m512 a, __m512 mul, const Grid& grid, FormatLanes& f) {
  const __m512i ones = _mm512_set1_epi32(1);
  const __m512 r = grid.round(_mm512_mul_ps(a, mul));
  const __mmask16 sat = _mm512_cmp_ps_mask(r, grid.top, _CMP_GT_OQ);
  const __m512 q = _mm512_min_ps(r, grid.top);
  const __mmask16 nz = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __mmask16 zero = _mm512_mask_cmp_ps_mask(nz, q, _mm512_setzero_ps(), _CMP_EQ_OQ);
  const __mmask16 below = _mm512_mask_cmp_ps_mask(nz, q, grid.min_normal, _CMP_LT_OQ);  // zero or subnormal
  f.saturated = _mm512_mask_add_epi32(f.saturated, sat, f.saturated, ones);
  f.to_zero = _mm512_mask_add_epi32(f.to_zero, zero, f.to_zero, ones);
  f.below_normal = _mm512_mask_add_epi32(f.below_normal, below, f.below_normal, ones);
  return q;
}

// MX (E8M0 scale per 32-element group): X = floor(log2(amax)) - emax, clamped to [-127, 127].
void cast_mx(const Batch& b, const core::FormatConsts& c, const Grid& grid_in, FormatLanes& out) {
  const Grid grid = grid_in;  // locals: kept in registers (see load_batch)
  FormatLanes f = out;
  const __m512i amax = _mm512_max_epu32(b.amax[0], b.amax[1]);
  const __mmask16 nz = _mm512_mask_test_epi32_mask(b.valid, amax, amax);
  // float32 magnitudes are below 2^128: X <= 254 - 127 - emax < 127, so no scale overflows here
  const __m512i x = _mm512_sub_epi32(_mm512_srli_epi32(amax, 23), _mm512_set1_epi32(127 + c.max_exp));
  const __mmask16 under = _mm512_mask_cmplt_epi32_mask(nz, x, _mm512_set1_epi32(-127));
  f.scale_under += popcount(under);
  const __m512i xc = _mm512_max_epi32(x, _mm512_set1_epi32(-127));
  const __m512 mul = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(127), xc), 23));
  // 2^X: normal from X = -126 up, 2^-127 the subnormal 0x00400000
  const __m512 inv = _mm512_castsi512_ps(_mm512_mask_mov_epi32(
      _mm512_slli_epi32(_mm512_add_epi32(xc, _mm512_set1_epi32(127)), 23),
      _mm512_cmplt_epi32_mask(xc, _mm512_set1_epi32(-126)), _mm512_set1_epi32(0x00400000)));
  for (int j = 0; j < kBatch; ++j) {
    if (!((b.valid >> j) & 1)) break;
    const __m512 mj = lane(mul, j), ij = lane(inv, j);
    for (int h = 0; h < 2; ++h) {
      const __m512 q = cast16(b.a[j][h], mj, grid, f);
      // a - q * 2^X is exact in float32 (the core's argument), and by FMA rounded once
      add_squares(_mm512_fnmadd_ps(q, ij, b.a[j][h]), f.err_lo, f.err_hi);
    }
  }
  out = f;
}

// Per-tensor current scaling: v = fp32(a * s), dequantised q / s in float64.
void cast_current(const Batch& b, const core::FormatConsts& c, const Grid& grid_in, FormatLanes& out) {
  const Grid grid = grid_in;  // locals: kept in registers (see load_batch)
  FormatLanes f = out;
  const __m512 s = _mm512_set1_ps(static_cast<float>(c.tensor_scale));
  const __m512d sd = _mm512_set1_pd(c.tensor_scale), inv = _mm512_set1_pd(1.0 / c.tensor_scale);
  for (int j = 0; j < kBatch; ++j) {
    if (!((b.valid >> j) & 1)) break;
    for (int h = 0; h < 2; ++h) {
      const __m512 q = cast16(b.a[j][h], s, grid, f);
      add_quotient_errors(b.a[j][h], q, sd, inv, f.err_lo, f.err_hi);
    }
  }
  out = f;
}

// NVFP4: per 16-element half, S = e4m3(fp32(fp32(amax_b / 6) * g)) saturating; v = fp32(a * fp32(g / S));
// dequantised q * S / g in float64 (q * S is exact in float32: 2 and 4 significant bits).
void cast_nvfp4(const Batch& b, const core::FormatConsts& c, const Grid& grid_in, const Grid& scale_grid,
                FormatLanes& out) {
  const Grid grid = grid_in;  // locals: kept in registers (see load_batch)
  FormatLanes f = out;
  const float g = static_cast<float>(c.tensor_scale);
  const __m512 gv = _mm512_set1_ps(g);
  const __m512d gd = _mm512_set1_pd(static_cast<double>(g)), inv = _mm512_set1_pd(1.0 / static_cast<double>(g));
  __m512 mul[2], scale[2];
  for (int h = 0; h < 2; ++h) {
    const __m512 amax = _mm512_castsi512_ps(b.amax[h]);
    const __mmask16 nz = _mm512_mask_cmp_ps_mask(b.valid, amax, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 r = scale_grid.round(_mm512_mul_ps(_mm512_div_ps(amax, _mm512_set1_ps(6.0f)), gv));
    f.scale_over += popcount(_mm512_mask_cmp_ps_mask(b.valid, r, scale_grid.top, _CMP_GT_OQ));
    scale[h] = _mm512_min_ps(r, scale_grid.top);
    f.scale_under += popcount(_mm512_mask_cmp_ps_mask(nz, scale[h], scale_grid.min_normal, _CMP_LT_OQ));
    const __mmask16 zero = _mm512_cmp_ps_mask(scale[h], _mm512_setzero_ps(), _CMP_EQ_OQ);
    // S = 0: the block casts to 0; g / S beyond float32 is clamped (core::finite_scale)
    mul[h] = _mm512_min_ps(_mm512_maskz_div_ps(static_cast<__mmask16>(~zero), gv, scale[h]), _mm512_set1_ps(3.4028234663852886e38f));
  }
  for (int j = 0; j < kBatch; ++j) {
    if (!((b.valid >> j) & 1)) break;
    for (int h = 0; h < 2; ++h) {
      const __m512 q = cast16(b.a[j][h], lane(mul[h], j), grid, f);
      add_quotient_errors(b.a[j][h], _mm512_mul_ps(q, lane(scale[h], j)), gd, inv, f.err_lo, f.err_hi);
    }
  }
  out = f;
}

inline double sum_lanes(__m512d lo, __m512d hi) {
  alignas(64) double l[8], h[8];
  _mm512_store_pd(l, lo);
  _mm512_store_pd(h, hi);
  double s = 0;
  for (int k = 0; k < 8; ++k) s += l[k] + h[k];
  return s;
}
inline int64_t sum_lanes(__m512i v) {
  alignas(64) int32_t l[16];
  _mm512_store_si512(l, v);
  int64_t s = 0;
  for (int k = 0; k < 16; ++k) s += l[k];
  return s;
}
inline double max_lanes(__m512d v) { return _mm512_reduce_max_pd(v); }

template <typename T>
void cast_whole_groups(const core::BlockOperand& op, int64_t begin, int64_t end, const BlockFormat* formats,
                       int num_formats, double amax, BlockRow* rows) {
  core::FormatConsts consts[core::kNumBlockFormats];
  bool need16 = false;
  for (int k = 0; k < num_formats; ++k) {
    consts[k] = core::format_consts(formats[k], core::tensor_scale(formats[k], amax));
    need16 = need16 || formats[k] == BlockFormat::kNvfp4;
  }
  const Grid scale_grid(core::e4m3());
  Grid grids[core::kNumBlockFormats];
  for (int k = 0; k < num_formats; ++k) grids[k] = Grid(core::element_format(formats[k]));
  FormatLanes lanes[core::kNumBlockFormats];
  SharedLanes shared;
  Batch batch;
  const T* pending[kBatch];
  int count = 0;
  auto flush = [&] {
    if (count == 0) return;
    if (need16) load_batch<true>(pending, count, batch, shared);
    else load_batch<false>(pending, count, batch, shared);
    batch_ranges(batch, need16, shared);
    for (int k = 0; k < num_formats; ++k) {
      const BlockFormat f = formats[k];
      if (f == BlockFormat::kNvfp4) cast_nvfp4(batch, consts[k], grids[k], scale_grid, lanes[k]);
      else if (f == BlockFormat::kCurrentE4m3 || f == BlockFormat::kCurrentE5m2) cast_current(batch, consts[k], grids[k], lanes[k]);
      else cast_mx(batch, consts[k], grids[k], lanes[k]);
    }
    count = 0;
  };
  const int64_t per_row = core::groups_per_row(op.cols);
  const T* data = static_cast<const T*>(op.data);
  for (int64_t g = begin; g < end; ++g) {
    const int64_t row = g / per_row, first = (g % per_row) * core::kGroupElems;
    if (first + core::kGroupElems <= op.cols) {
      pending[count++] = data + row * op.cols + first;
      if (count == kBatch) flush();
    } else {
      core::cast_groups(op, g, g + 1, formats, num_formats, amax, rows);  // a row's shorter last group
    }
  }
  flush();
  const double whole = static_cast<double>(shared.groups);
  const double sig = sum_lanes(shared.sig_lo, shared.sig_hi);
  const int64_t nonzero = sum_lanes(shared.nonzero);
  const float min_nonzero = _mm512_reduce_min_ps(shared.min_nonzero);
  for (int k = 0; k < num_formats; ++k) {
    const FormatLanes& f = lanes[k];
    BlockRow r;
    r.v[core::bNonzero] = static_cast<double>(nonzero);
    r.v[core::bToZero] = static_cast<double>(sum_lanes(f.to_zero));
    r.v[core::bSubnormal] = static_cast<double>(sum_lanes(f.below_normal) - sum_lanes(f.to_zero));
    r.v[core::bSaturated] = static_cast<double>(sum_lanes(f.saturated));
    r.v[core::bBlocks] = formats[k] == BlockFormat::kNvfp4 ? 2 * whole : whole;
    r.v[core::bScaleUnderflow] = static_cast<double>(f.scale_under);
    r.v[core::bScaleOverflow] = static_cast<double>(f.scale_over);
    r.v[core::bErrorSq] = sum_lanes(f.err_lo, f.err_hi);
    r.v[core::bSignalSq] = sig;
    r.v[core::bMinNonzero] = min_nonzero;
    r.v[core::bMaxBlockRatio] = max_lanes(formats[k] == BlockFormat::kNvfp4 ? shared.ratio16 : shared.ratio32);
    r.v[core::bNonfinite] = static_cast<double>(shared.nonfinite);
    rows[k].merge(r);
  }
}

}  // namespace

bool cast_groups_avx512(const core::BlockOperand& op, int64_t begin, int64_t end, const BlockFormat* formats,
                        int num_formats, double amax, BlockRow* rows) {
  switch (op.dtype) {
    case core::DType::kFloat32: cast_whole_groups<float>(op, begin, end, formats, num_formats, amax, rows); return true;
    case core::DType::kBFloat16: cast_whole_groups<core::BF16>(op, begin, end, formats, num_formats, amax, rows); return true;
    case core::DType::kFloat16: cast_whole_groups<core::Half>(op, begin, end, formats, num_formats, amax, rows); return true;
    default: return false;
  }
}

}  // namespace isa
}  // namespace cpu
}  // namespace gapmon
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif
