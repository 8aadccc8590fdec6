// The CPU statistics kernel's body, written once: templates over the vector width (kBytes) and the
// storage type. Each translation unit that includes it compiles its own copy (an anonymous
// namespace: no copy is shared across units) for the instruction set it was compiled for:
// stats_kernels.cpp (baseline), stats_kernels_avx2.cpp and stats_kernels_avx512.cpp, which set
// their target with `#pragma GCC target` after their other includes (and say so with
// GAPMON_KERNEL_F16C / GAPMON_KERNEL_AVX512: the pragma does not define the ISA macros).
#pragma once

#include "stats_kernels_deps.h"

namespace gapmon {
namespace cpu {
namespace {

using core::DType;
using core::State;
using core::StridedView;

#define GAPMON_ALWAYS_INLINE __attribute__((always_inline)) inline

GAPMON_ALWAYS_INLINE float bits_to_float(uint32_t b) {
  float f;
  __builtin_memcpy(&f, &b, sizeof f);
  return f;
}

GAPMON_ALWAYS_INLINE uint32_t float_to_bits(float f) {
  uint32_t b;
  __builtin_memcpy(&b, &f, sizeof b);
  return b;
}

// IEEE half -> float without branches (vectorises): scale the shifted exponent/mantissa by
// 2^112, which is exact for normal and subnormal halves, then force Inf/NaN exponents.
GAPMON_ALWAYS_INLINE float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  uint32_t b = float_to_bits(bits_to_float(em << 13) * 5.192296858534828e33f /* 2^112 */);
  b = em >= 0x7c00u ? (b | 0x7f800000u) : b;
  return bits_to_float(b | sign);
}

GAPMON_ALWAYS_INLINE float bfloat16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// How each storage type is read and in which precision its blocks accumulate.
struct F32 {
  using storage = float;
  using block = float;
  static GAPMON_ALWAYS_INLINE float load(float v) { return v; }
  static constexpr float largest = 3.40282346638528859812e+38f;
};
struct F64 {
  using storage = double;
  using block = double;
  static GAPMON_ALWAYS_INLINE double load(double v) { return v; }
  static constexpr double largest = 1.7976931348623157e308;
};
struct F16 {
  using storage = uint16_t;
  using block = float;
  static GAPMON_ALWAYS_INLINE float load(uint16_t v) { return half_to_float(v); }
  static constexpr float largest = 3.40282346638528859812e+38f;
};
struct BF16 {
  using storage = uint16_t;
  using block = float;
  static GAPMON_ALWAYS_INLINE float load(uint16_t v) { return bfloat16_to_float(v); }
  static constexpr float largest = 3.40282346638528859812e+38f;
};

// Elements per shifted-sums block. A block is summed in the block precision with a shift
// near the running mean (so deviations stay small), then merged into the chunk's
// double-precision state with Chan's rule (csrc/core). Larger blocks amortise the lane
// reductions and merges (measured: 8192 is 25% faster than 2048 on cached fp32 data).
constexpr int64_t kBlockElems = 8192;
constexpr int64_t kPilotElems = 512;

// How far ahead unit-stride loops prefetch: streaming stalls otherwise do not overlap the
// arithmetic (measured on one core: 2^26 fp32 from 29 to 22 ms).
constexpr int kPrefetchBytes = 2048;

// Generic vectors of kBytes bytes: each entry point picks the width of its registers
// (64 for AVX-512, 32 for AVX2, 16 for baseline SSE2/NEON).
template <typename T, int kBytes>
struct VecOf {
  typedef T type __attribute__((vector_size(kBytes)));
};

template <typename V>
GAPMON_ALWAYS_INLINE V load_vec(const void* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// Vector loads of kBytes worth of block-precision values, per storage type.
template <int kBytes>
struct Loads {
  using f32 = typename VecOf<float, kBytes>::type;
  using f64 = typename VecOf<double, kBytes>::type;
  using u32 = typename VecOf<uint32_t, kBytes>::type;
  using u16 = typename VecOf<uint16_t, kBytes / 2>::type;

  static GAPMON_ALWAYS_INLINE f32 load(const float* p, F32) { return load_vec<f32>(p); }
  static GAPMON_ALWAYS_INLINE f64 load(const double* p, F64) { return load_vec<f64>(p); }
  static GAPMON_ALWAYS_INLINE f32 load(const uint16_t* p, BF16) {
    return (f32)(__builtin_convertvector(load_vec<u16>(p), u32) << 16);
  }
  static GAPMON_ALWAYS_INLINE f32 load(const uint16_t* p, F16) {  // vector form of half_to_float
#if defined(GAPMON_KERNEL_F16C)
    // The AVX2 and AVX-512 translation units are compiled with F16C: one conversion instruction.
    if constexpr (kBytes == 32) {
      return (f32)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
#endif
#if defined(GAPMON_KERNEL_AVX512)
    if constexpr (kBytes == 64) {
      return (f32)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
#endif
    const u32 h = __builtin_convertvector(load_vec<u16>(p), u32);
    const u32 em = h & 0x7fffu;
    u32 b = (u32)((f32)(em << 13) * 5.192296858534828e33f);
    b |= (u32)(em >= 0x7c00u) & 0x7f800000u;
    return (f32)(b | ((h & 0x8000u) << 16));
  }

  // Two vectors of block-precision values from 2 * (kBytes / sizeof(block)) consecutive elements,
  // in any order (the sums, min and max do not care). bfloat16 takes the fast path: a 32-bit lane
  // holds two elements, and each is the upper half of its float32, so one load, a shift and a mask
  // give both vectors (odd elements in one, even in the other) with no widening shuffles.
  template <typename T, typename V>
  static GAPMON_ALWAYS_INLINE void load_pair(const typename T::storage* p, T, V& first, V& second) {
    if constexpr (std::is_same<T, BF16>::value) {
      const u32 lanes = load_vec<u32>(p);
      first = (f32)(lanes << 16);
      second = (f32)(lanes & 0xffff0000u);
    } else {
      first = load(p, T{});
      second = load(p + kBytes / sizeof(typename T::block), T{});
    }
  }
};

// Vector accumulators of shifted sums: the lane-parallel form of core::accumulate (same
// formulas). Zeros and non-finite values are rare, so the hot loop only tracks min|x| and
// max|x|; a block is counted exactly (count_block) only when those show it may hold any.
template <typename V>
struct VecSums {
  using M = decltype(V{} < V{});
  using E = typename std::conditional<sizeof(V{}[0]) == 4, int32_t, int64_t>::type;
  static constexpr E kAbsMask = std::numeric_limits<E>::max();
  using F = typename std::remove_reference<decltype(V{}[0])>::type;
  V s1 = {}, s2 = {}, sq = {}, mx = {}, mn = V{} + std::numeric_limits<F>::infinity();

  static GAPMON_ALWAYS_INLINE V abs(V x) { return (V)((M)x & kAbsMask); }  // clear the sign bit

  GAPMON_ALWAYS_INLINE void add_sums(V x, V shift) {
    const V d = x - shift;
    s1 += d;
    s2 += d * d;
    sq += x * x;
  }

  GAPMON_ALWAYS_INLINE void add(V x, V shift) {
    add_sums(x, shift);
    const V a = abs(x);
    mx = a > mx ? a : mx;  // NaN is ignored here and restored from sq, as in core::accumulate
    mn = a < mn ? a : mn;
  }
};

// max|x| and min|x| of 16-bit floats (float16, bfloat16) on their raw bits: with the sign bit
// cleared, the order of the bits is the order of the magnitudes (Inf above every finite value,
// NaN above Inf), so one unsigned 16-bit max and min covers twice the elements of a float32 one,
// and nothing is converted. A NaN makes max|x| NaN; block_to_state gives NaN there anyway, from
// the sum of squares.
template <int kBytes>
struct HalfMagnitudes {
  using H = typename VecOf<uint16_t, kBytes>::type;
  H mx = {}, mn = H{} + uint16_t(0xffffu);

  GAPMON_ALWAYS_INLINE void add(const uint16_t* p) {
    const H m = load_vec<H>(p) & uint16_t(0x7fffu);
    mx = m > mx ? m : mx;
    mn = m < mn ? m : mn;
  }

  // The largest and smallest magnitude bits over the lanes, as values of T.
  template <typename T>
  GAPMON_ALWAYS_INLINE void reduce(float& largest, float& smallest) const {
    uint16_t hi = 0, lo = 0xffffu;
    for (int j = 0; j < int(sizeof(H) / 2); ++j) {
      hi = mx[j] > hi ? mx[j] : hi;
      lo = mn[j] < lo ? mn[j] : lo;
    }
    largest = T::load(hi);
    smallest = T::load(lo);
  }
};

// Exact counts of non-finite elements and zeros among q[0, n), vectorised.
template <int kBytes, typename T>
GAPMON_ALWAYS_INLINE void count_block(const typename T::storage* q, int64_t n, double& nonfinite, double& zeros) {
  using block_t = typename T::block;
  using V = typename VecOf<block_t, kBytes>::type;
  using M = typename VecSums<V>::M;
  constexpr int kVec = kBytes / sizeof(block_t);
  const V largest = V{} + T::largest;
  M finite = {}, nz = {};
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) {
    const V x = Loads<kBytes>::load(q + i, T{});
    finite -= (M)(VecSums<V>::abs(x) <= largest);
    nz -= (M)(x == V{});
  }
  double fin = 0;
  for (int j = 0; j < kVec; ++j) {
    fin += double(finite[j]);
    zeros += double(nz[j]);
  }
  for (; i < n; ++i) {
    const block_t x = T::load(q[i]);
    const block_t a = x < 0 ? -x : x;
    fin += (a <= T::largest) ? 1 : 0;
    zeros += (x == block_t(0)) ? 1 : 0;
  }
  nonfinite += double(n) - fin;
}

constexpr int kLanes = 16;  // lanes of the scalar fallback used for strided rows
constexpr int kSets = 2;    // vector accumulator sets of unit-stride rows (an even number)

// State of q[0, n) (stride `step`) accumulated entirely in double: the rare overflow path.
template <typename T>
State<double> exact_block(const typename T::storage* q, int64_t n, int64_t step, double shift) {
  double s1 = 0, s2 = 0, sq = 0, mx = 0;
  int32_t nf = 0, nz = 0;
  for (int64_t i = 0; i < n; ++i) {
    core::accumulate<double>(double(T::load(q[i * step])), shift, 1.7976931348623157e308, s1, s2, sq, mx, nf, nz);
  }
  return core::block_to_state<double, double>(double(n), shift, s1, s2, sq, mx, double(nf), double(nz));
}

// Accumulates `len` elements starting at p (stride in elements) into `state`, with vectors
// of kBytes bytes on unit-stride runs.
template <int kBytes, typename T, bool kUnitStride>
GAPMON_ALWAYS_INLINE void accumulate_row(const typename T::storage* p, int64_t len, int64_t stride,
                                         State<double>& state) {
  using block_t = typename T::block;
  using V = typename VecOf<block_t, kBytes>::type;
  constexpr int kVec = kBytes / sizeof(block_t);
  const int64_t step = kUnitStride ? 1 : stride;
  for (int64_t start = 0; start < len; start += kBlockElems) {
    const int64_t n_block = (len - start) < kBlockElems ? (len - start) : kBlockElems;
    const typename T::storage* q = p + start * step;
    // The first block of a chunk has no running mean to shift by: a pilot pass over its first
    // kPilotElems elements (from L1) estimates the mean first, so an outlying first element cannot
    // spoil the float sums.
    block_t shift = core::block_shift(state, T::load(q[0]));
    for (int pass = state.count == 0 ? 0 : 1; pass < 2; ++pass) {
      const int64_t n = pass == 0 ? (n_block < kPilotElems ? n_block : kPilotElems) : n_block;
      block_t s1[kLanes] = {}, s2[kLanes] = {}, sq[kLanes] = {}, mx[kLanes] = {};
      int32_t nf[kLanes] = {}, nz[kLanes] = {};
      int64_t i = 0;
      double S1 = 0, S2 = 0, SQ = 0, NF = 0, NZ = 0;
      block_t MX = 0;
      if (kUnitStride) {
        // Independent accumulator sets (kSets) hide the add and FMA latency. 16-bit floats take
        // max|x| and min|x| on their raw bits (HalfMagnitudes), the sums on the widened values.
        constexpr bool kHalf = sizeof(typename T::storage) == 2;
        VecSums<V> acc[kSets];
        [[maybe_unused]] HalfMagnitudes<kBytes> magnitudes;
        const V vshift = V{} + shift;
        for (; i + kSets * kVec <= n; i += kSets * kVec) {
          for (int line = 0; line < int(kSets * kVec * sizeof(*q)); line += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(q + i) + kPrefetchBytes + line);
          }
          for (int set = 0; set < kSets; set += 2) {
            V first, second;
            Loads<kBytes>::load_pair(q + i + set * kVec, T{}, first, second);
            if constexpr (kHalf) {
              magnitudes.add(q + i + set * kVec);
              acc[set].add_sums(first, vshift);
              acc[set + 1].add_sums(second, vshift);
            } else {
              acc[set].add(first, vshift);
              acc[set + 1].add(second, vshift);
            }
          }
        }
        block_t MN = std::numeric_limits<block_t>::max();
        for (int set = 0; set < kSets; ++set) {
          for (int j = 0; j < kVec; ++j) {
            S1 += double(acc[set].s1[j]);
            S2 += double(acc[set].s2[j]);
            SQ += double(acc[set].sq[j]);
            MX = acc[set].mx[j] > MX ? acc[set].mx[j] : MX;
            MN = acc[set].mn[j] < MN ? acc[set].mn[j] : MN;
          }
        }
        if constexpr (kHalf) {
          if (i > 0) magnitudes.template reduce<T>(MX, MN);
        }
        if (i > 0 && (MN == 0 || !(MX <= T::largest) || SQ != SQ)) count_block<kBytes, T>(q, i, NF, NZ);
      } else {
        for (; i + kLanes <= n; i += kLanes) {
          for (int j = 0; j < kLanes; ++j) {
            core::accumulate<block_t>(T::load(q[(i + j) * step]), shift, T::largest, s1[j], s2[j], sq[j],
                                      mx[j], nf[j], nz[j]);
          }
        }
      }
      for (; i < n; ++i) {
        core::accumulate<block_t>(T::load(q[i * step]), shift, T::largest, s1[0], s2[0], sq[0], mx[0],
                                  nf[0], nz[0]);
      }
      for (int j = 0; j < kLanes; ++j) {
        S1 += s1[j];
        S2 += s2[j];
        SQ += sq[j];
        MX = mx[j] > MX ? mx[j] : MX;
        NF += nf[j];
        NZ += nz[j];
      }
      if (pass == 0) {
        const block_t pilot = static_cast<block_t>(double(shift) + S1 / double(n));
        if (core::is_finite(pilot)) shift = pilot;
        continue;
      }
      const bool no_nan_or_inf = MX <= T::largest && SQ == SQ;
      if (core::sums_overflowed(no_nan_or_inf, S1, S2, SQ)) {
        // Finite elements whose squares overflowed the block precision (|x| > ~1e19 in float32):
        // redo this block in double so that var and norm stay exact.
        state = core::merge(state, exact_block<T>(q, n, step, double(shift)));
      } else {
        state = core::merge(state, core::block_to_state<double, block_t>(double(n), shift, S1, S2, SQ, MX, NF, NZ));
      }
    }
  }
}

template <int kBytes, typename T>
GAPMON_ALWAYS_INLINE State<double> chunk_state_typed(const StridedView& v, int64_t item, int64_t lo,
                                                     int64_t hi) {
  const auto* data = static_cast<const typename T::storage*>(v.data);
  State<double> state;
  core::RowCursor rows(v, item, lo, hi);
  int64_t offset, len, stride;
  while (rows.next(offset, len, stride)) {
    if (stride == 1) {
      accumulate_row<kBytes, T, true>(data + offset, len, 1, state);
    } else {
      accumulate_row<kBytes, T, false>(data + offset, len, stride, state);
    }
  }
  return state;
}

template <int kBytes>
GAPMON_ALWAYS_INLINE State<double> chunk_state_body(const StridedView& v, int64_t item, int64_t lo,
                                                    int64_t hi) {
  switch (v.dtype) {
    case DType::kFloat32: return chunk_state_typed<kBytes, F32>(v, item, lo, hi);
    case DType::kFloat64: return chunk_state_typed<kBytes, F64>(v, item, lo, hi);
    case DType::kFloat16: return chunk_state_typed<kBytes, F16>(v, item, lo, hi);
    case DType::kBFloat16: return chunk_state_typed<kBytes, BF16>(v, item, lo, hi);
  }
  return State<double>();
}

}  // namespace
}  // namespace cpu
}  // namespace gapmon
