// Torch-free CPU numerics kernels: the exponent histogram and the moments of a chunk of a StridedView,
// in one read of its elements, with the instruction set the statistics kernels use (select_isa).
#include "numerics_kernels.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <type_traits>

#include "../core/widen.h"
#include "stats_kernels.h"

namespace gapmon {
namespace cpu {
namespace {

using core::Moments;

// Elements per block of power sums: each block is shifted by the running mean of the chunk, so
// that the sums of third and fourth powers do not cancel.
constexpr int64_t kBlock = 1024;

using core::BF16;
using core::Half;
using core::half_to_f32_bits;

// An element as float32 bits (float, bfloat16, half: exact widening).
template <typename T>
inline uint32_t f32_bits(const T* p);
template <>
inline uint32_t f32_bits<float>(const float* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return bits;
}
template <>
inline uint32_t f32_bits<BF16>(const BF16* p) {
  return static_cast<uint32_t>(p->x) << 16;
}
template <>
inline uint32_t f32_bits<Half>(const Half* p) {
  return half_to_f32_bits(p->x);
}

inline float f32_of(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// An element as (value, bin): float64 by its own bits, the others by their float32 bits.
template <typename T>
inline void load(const T* p, double& value, int& bin) {
  if constexpr (std::is_same_v<T, double>) {
    uint64_t bits;
    std::memcpy(&bits, p, sizeof bits);
    bin = core::exponent_bin_f64(bits);
    value = *p;
  } else {
    const uint32_t bits = f32_bits<T>(p);
    bin = core::exponent_bin_f32(bits);
    value = f32_of(bits);
  }
}

// Exponents counted in pairs: the biased exponents (a, b) of two neighbouring elements raise one counter,
// key a | b << 8, of a thread's table of 2^16, so that a chunk takes half the increments (the single-counter
// histogram ran at one element per cycle, bound by its read-modify-writes; pairs 2.4x faster, measured). The
// table is all zero between chunks: a chunk's finish() folds the rows and columns it touched, [lo, hi]^2,
// into the 256 bins and clears them. Heap memory (256 KB) reached through a thread_local pointer, so that
// the extension's TLS stays small.
constexpr int kPairKeys = 1 << 16;
// The pair table is used by blocks of at least kMinPairs pairs whose exponents keep the chunk's range within
// kPairRange values: its fold then reads at most kPairRange^2 counters (2,304) per chunk.
constexpr int64_t kMinPairs = 128;
constexpr uint32_t kPairRange = 48;
uint32_t* pair_table() {
  thread_local std::unique_ptr<uint32_t[]> table(new uint32_t[kPairKeys]());
  return table.get();
}

// The running state of one chunk: its bins, its merged moments, and the open block of power sums.
struct ChunkAccumulator {
  ChunkNumerics out;
  // Biased float32 exponents: pairs in the thread's table, the others (a run's odd last element, the blocks
  // add_pairs counts alone) in `singles`; zeros and NaNs (exponents 0 and 255) are told apart in fix-ups.
  uint32_t* pairs = pair_table();
  uint32_t singles[256] = {};
  uint64_t folded[256] = {};  // the pairs' counts, per exponent, once folded
  uint32_t lo = 255, hi = 0;  // range of the exponents counted in pairs
  int64_t pending = 0;        // pairs counted since the table was last folded
  int64_t zeros = 0, nans = 0;

  ChunkAccumulator() = default;
  ChunkAccumulator(const ChunkAccumulator&) = delete;
  ChunkAccumulator& operator=(const ChunkAccumulator&) = delete;
  ~ChunkAccumulator() { fold_pairs(); }  // leaves the table zero even if a chunk is abandoned

  double shift_for(double first) const {  // a new block: shift by the running mean (or its first element)
    const double running = out.moments.count > 0 ? out.moments.mean : first;
    return core::is_finite(running) ? running : 0.0;
  }
  void add_block(double n, double shift, const double (&s)[4]) {
    out.moments = core::merge(out.moments, core::from_power_sums(n, shift, s[0], s[1], s[2], s[3]));
  }
  // Counts `count` keys with exponents in [key_lo, key_hi]: in the pair table while the range it spans stays
  // within kPairRange exponents and the block is long enough to pay for its share of the fold, else each
  // exponent alone (the fold reads the square of the range: a chunk whose exponents spread over the whole
  // float32 range, or a small tensor, would pay more for it than the pairs save). Folds the table before its
  // 32-bit counters could wrap.
  void add_pairs(const uint16_t* keys, int64_t count, uint32_t key_lo, uint32_t key_hi) {
    const uint32_t new_lo = std::min(lo, key_lo), new_hi = std::max(hi, key_hi);
    if (count < kMinPairs || new_hi - new_lo >= kPairRange) {
      for (int64_t j = 0; j < count; ++j) {
        ++singles[keys[j] & 0xFFu];
        ++singles[keys[j] >> 8];
      }
      return;
    }
    if (pending + count > (int64_t(1) << 31)) fold_pairs();
    int64_t j = 0;
    for (; j + 4 <= count; j += 4) {  // four a step: fewer taken branches per increment
      ++pairs[keys[j]];
      ++pairs[keys[j + 1]];
      ++pairs[keys[j + 2]];
      ++pairs[keys[j + 3]];
    }
    for (; j < count; ++j) ++pairs[keys[j]];
    pending += count;
    lo = new_lo, hi = new_hi;
  }
  void fold_pairs() {
    for (uint32_t b = lo; b <= hi; ++b) {
      uint32_t* row = pairs + (b << 8);
      uint64_t row_sum = 0;
      for (uint32_t a = lo; a <= hi; ++a) {
        row_sum += row[a];
        folded[a] += row[a];
        row[a] = 0;
      }
      folded[b] += row_sum;
    }
    lo = 255, hi = 0, pending = 0;
  }
  ChunkNumerics finish() {
    fold_pairs();
    for (int e = 0; e < 256; ++e) {
      const int64_t c = static_cast<int64_t>(folded[e]) + singles[e];
      if (e == 0) {
        out.bins[core::nZero] += zeros;
        out.bins[core::nSubnormal] += c - zeros;
      } else if (e == 255) {
        out.bins[core::nInf] += c - nans;
        out.bins[core::nNaN] += nans;
      } else {
        out.bins[e + 1] += c;  // core::exponent_bin_f32
      }
    }
    return out;
  }
};

// Power sums of one block of float32-representable values (n <= kBlock) in 16 float64 lanes: lane k sums the
// elements i = k (mod 16) of the block's first 16 * floor(n / 16), in order; the lanes are then added in a fixed
// order and the scalar tail finishes. Every form (generic, AVX2, AVX-512) keeps these lanes and rounds each
// product and each sum apart (no FMA: the generic build has none), so all give the same bits. 16 lanes are
// 16 independent add chains: the AVX-512 form is bound by its adds' throughput, not their latency.
constexpr int kLanes = 16;

// The lanes (l[q][k]: lane k of power q + 1) added in order, then the tail from element i. Not inlined into
// the vector forms: compiled here, it cannot be fused (-ffp-contract) under their instruction sets.
__attribute__((noinline)) void add_lanes_and_tail(const double (&l)[4][kLanes], const uint32_t* bits, int64_t i,
                                                  int64_t n, double shift, double (&s)[4]) {
  for (int q = 0; q < 4; ++q) {
    s[q] = l[q][0];
    for (int k = 1; k < kLanes; ++k) s[q] += l[q][k];
  }
  for (; i < n; ++i) {
    const double d = static_cast<double>(f32_of(bits[i])) - shift, d2 = d * d;
    s[0] += d;
    s[1] += d2;
    s[2] += d2 * d;
    s[3] += d2 * d2;
  }
}

typedef float F4 __attribute__((vector_size(16)));
typedef double D4 __attribute__((vector_size(32)));

void block_sums_generic(const uint32_t* bits, int64_t n, double shift, double (&s)[4]) {
  D4 acc[4][4] = {};  // [power][set of 4 lanes]
  const D4 sh = {shift, shift, shift, shift};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int v = 0; v < 4; ++v) {
      F4 x;
      std::memcpy(&x, bits + i + 4 * v, sizeof x);
      const D4 d = __builtin_convertvector(x, D4) - sh, d2 = d * d;
      acc[0][v] += d;
      acc[1][v] += d2;
      acc[2][v] += d2 * d;
      acc[3][v] += d2 * d2;
    }
  }
  double l[4][kLanes];
  for (int q = 0; q < 4; ++q)
    for (int k = 0; k < kLanes; ++k) l[q][k] = acc[q][k / 4][k % 4];
  add_lanes_and_tail(l, bits, i, n, shift, s);
}

#if defined(__x86_64__)
// The same sums with AVX2 intrinsics (GCC's generic tuning splits the vector extensions' float -> double
// conversion into four 2-lane converts and two inserts), four sets of 4 lanes; "avx2" without "fma": no fusing.
__attribute__((target("avx2"))) void block_sums_avx2(const uint32_t* bits, int64_t n, double shift, double (&s)[4]) {
  __m256d acc[4][4];
  for (auto& power : acc)
    for (auto& set : power) set = _mm256_setzero_pd();
  const __m256d sh = _mm256_set1_pd(shift);
  const float* f = reinterpret_cast<const float*>(bits);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int v = 0; v < 4; ++v) {
      const __m256d d = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(f + i + 4 * v)), sh), d2 = _mm256_mul_pd(d, d);
      acc[0][v] = _mm256_add_pd(acc[0][v], d);
      acc[1][v] = _mm256_add_pd(acc[1][v], d2);
      acc[2][v] = _mm256_add_pd(acc[2][v], _mm256_mul_pd(d2, d));
      acc[3][v] = _mm256_add_pd(acc[3][v], _mm256_mul_pd(d2, d2));
    }
  }
  double l[4][kLanes];
  for (int q = 0; q < 4; ++q)
    for (int v = 0; v < 4; ++v) _mm256_storeu_pd(l[q] + 4 * v, acc[q][v]);
  add_lanes_and_tail(l, bits, i, n, shift, s);
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 intrinsics (their undefined vectors)
#pragma GCC diagnostic ignored "-Wuninitialized"
// The same sums with AVX-512, two sets of 8 lanes (1.7x the AVX2 form's speed on data in cache, measured on the
// AVX-512 EPYC VM). AVX-512F has FMA: fp-contract is off here, so that products and sums still round apart.
__attribute__((target("avx512f"), optimize("fp-contract=off"))) void block_sums_avx512(const uint32_t* bits, int64_t n,
                                                                                       double shift, double (&s)[4]) {
  __m512d acc[4][2];
  for (auto& power : acc)
    for (auto& set : power) set = _mm512_setzero_pd();
  const __m512d sh = _mm512_set1_pd(shift);
  const float* f = reinterpret_cast<const float*>(bits);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int v = 0; v < 2; ++v) {
      const __m512d d = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(f + i + 8 * v)), sh), d2 = _mm512_mul_pd(d, d);
      acc[0][v] = _mm512_add_pd(acc[0][v], d);
      acc[1][v] = _mm512_add_pd(acc[1][v], d2);
      acc[2][v] = _mm512_add_pd(acc[2][v], _mm512_mul_pd(d2, d));
      acc[3][v] = _mm512_add_pd(acc[3][v], _mm512_mul_pd(d2, d2));
    }
  }
  double l[4][kLanes];
  for (int q = 0; q < 4; ++q)
    for (int v = 0; v < 2; ++v) _mm512_storeu_pd(l[q] + 8 * v, acc[q][v]);
  add_lanes_and_tail(l, bits, i, n, shift, s);
}
#pragma GCC diagnostic pop

// float16 values as float32 bits, 8 at a time by F16C (the scalar conversion was a third of the pass).
__attribute__((target("avx2,f16c"))) void half_bits_f16c(const Half* q, int64_t n, uint32_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(reinterpret_cast<float*>(out + i), _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
  }
  for (; i < n; ++i) out[i] = f32_bits<Half>(q + i);
}
#endif

// The pair-table keys of `pairs` pairs of float32 bits (the exponents of bits[2j] and bits[2j + 1]) and
// the range of those exponents.
struct KeyRange {
  uint32_t lo, hi;
};

__attribute__((always_inline)) inline KeyRange pair_keys_body(const uint32_t* bits, int64_t pairs, uint16_t* keys) {
  uint32_t lo = 0xFFu, hi = 0;
  for (int64_t j = 0; j < pairs; ++j) {
    const uint32_t a = (bits[2 * j] >> 23) & 0xFFu, b = (bits[2 * j + 1] >> 23) & 0xFFu;
    keys[j] = static_cast<uint16_t>(a | b << 8);
    lo = std::min(lo, std::min(a, b));
    hi = std::max(hi, std::max(a, b));
  }
  return {lo, hi};
}

KeyRange pair_keys_generic(const uint32_t* bits, int64_t pairs, uint16_t* keys) {
  return pair_keys_body(bits, pairs, keys);
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) KeyRange pair_keys_avx2(const uint32_t* bits, int64_t pairs, uint16_t* keys) {
  return pair_keys_body(bits, pairs, keys);
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 intrinsics (their undefined vectors)
#pragma GCC diagnostic ignored "-Wuninitialized"
// 16 elements (8 pairs) a vector: the exponents as 32-bit lanes; a 64-bit lane (a, b) becomes a | b << 8 in
// its low 16 bits, narrowed by vpmovqw.
__attribute__((target("avx512f"))) KeyRange pair_keys_avx512(const uint32_t* bits, int64_t pairs, uint16_t* keys) {
  const __m512i mask = _mm512_set1_epi32(0xFF);
  __m512i lo = mask, hi = _mm512_setzero_si512();
  int64_t j = 0;
  for (; j + 8 <= pairs; j += 8) {
    const __m512i e = _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512(bits + 2 * j), 23), mask);
    lo = _mm512_min_epu32(lo, e);
    hi = _mm512_max_epu32(hi, e);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(keys + j), _mm512_cvtepi64_epi16(_mm512_or_si512(e, _mm512_srli_epi64(e, 24))));
  }
  const KeyRange tail = pair_keys_body(bits + 2 * j, pairs - j, keys + j);
  return {std::min<uint32_t>(_mm512_reduce_min_epu32(lo), tail.lo), std::max<uint32_t>(_mm512_reduce_max_epu32(hi), tail.hi)};
}
#pragma GCC diagnostic pop
#endif

using PairKeys = KeyRange (*)(const uint32_t*, int64_t, uint16_t*);
PairKeys pair_keys(bool avx2, bool avx512) {
#if defined(__x86_64__)
  if (avx512) return pair_keys_avx512;
  if (avx2) return pair_keys_avx2;
#endif
  return pair_keys_generic;
}

// The instruction set of the statistics kernels (select_isa) decides here too: AVX-512, AVX2 (which the avx512
// selection implies, with F16C) or the generic code; every form of the power sums gives the same bits.
using BlockSums = void (*)(const uint32_t*, int64_t, double, double (&)[4]);
BlockSums block_sums(bool avx2, bool avx512) {
#if defined(__x86_64__)
  if (avx512) return block_sums_avx512;
  if (avx2) return block_sums_avx2;
#endif
  return block_sums_generic;
}

// A contiguous run of float/bfloat16/half values, in blocks of kBlock: the block's float32 bits
// first (exponent histogram, zeros and NaNs), then its power sums from those bits.
template <typename T>
void add_run_f32(const T* p, int64_t len, ChunkAccumulator& acc) {
  uint32_t widened[kBlock];
  uint16_t keys[kBlock / 2];
  const bool avx2 = selected_isa_has_avx2(), avx512 = selected_isa_has_avx512();
  const BlockSums sums = block_sums(avx2, avx512);
  const PairKeys keys_of = pair_keys(avx2, avx512);
  for (int64_t start = 0; start < len; start += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, len - start);
    const T* q = p + start;
    // The block's float32 bits: float32 read in place; bfloat16 and float16 widened into a buffer first
    // (float16 by F16C).
#if defined(__x86_64__)
    if (std::is_same_v<T, Half> && avx2) {
      half_bits_f16c(reinterpret_cast<const Half*>(q), n, widened);
    } else
#endif
    if constexpr (!std::is_same_v<T, float>) {
      for (int64_t i = 0; i < n; ++i) widened[i] = f32_bits<T>(q + i);
    }
    const uint32_t* bits = std::is_same_v<T, float> ? reinterpret_cast<const uint32_t*>(q) : widened;
    const int64_t pairs = n / 2;
    const KeyRange range = keys_of(bits, pairs, keys);
    acc.add_pairs(keys, pairs, range.lo, range.hi);
    bool edges = range.lo == 0 || range.hi == 0xFFu;
    if (n & 1) {
      const uint32_t e = (bits[n - 1] >> 23) & 0xFFu;
      ++acc.singles[e];
      edges = edges || e == 0 || e == 0xFFu;
    }
    // Biased exponent 0 or 255 (zero or subnormal, Inf or NaN): seen in the block's exponent range, not
    // tested element by element.
    if (edges) [[unlikely]] {
      for (int64_t i = 0; i < n; ++i) {
        acc.zeros += (bits[i] & 0x7FFFFFFFu) == 0;
        acc.nans += (bits[i] & 0x7FFFFFFFu) > 0x7F800000u;
      }
    }
    double s[4];
    const double shift = acc.shift_for(static_cast<double>(f32_of(bits[0])));
    sums(bits, n, shift, s);
    acc.add_block(static_cast<double>(n), shift, s);
  }
}

// Any run (strided, or float64), element by element.
template <typename T>
void add_run_scalar(const T* p, int64_t len, int64_t stride, ChunkAccumulator& acc) {
  double n = 0, shift = 0, s[4] = {0, 0, 0, 0};
  for (int64_t i = 0; i < len; ++i, p += stride) {
    double x;
    int bin;
    load<T>(p, x, bin);
    ++acc.out.bins[bin];
    if (n == 0) shift = acc.shift_for(x);
    const double d = x - shift, d2 = d * d;
    n += 1;
    s[0] += d;
    s[1] += d2;
    s[2] += d2 * d;
    s[3] += d2 * d2;
    if (n == kBlock) {
      acc.add_block(n, shift, s);
      n = s[0] = s[1] = s[2] = s[3] = 0;
    }
  }
  if (n > 0) acc.add_block(n, shift, s);
}

template <typename T>
ChunkNumerics chunk_numerics_typed(const core::StridedView& v, int64_t item, int64_t lo, int64_t hi) {
  ChunkAccumulator acc;
  const T* base = static_cast<const T*>(v.data);
  core::RowCursor cursor(v, item, lo, hi);
  int64_t offset, len, stride;
  while (cursor.next(offset, len, stride)) {
    if constexpr (std::is_same_v<T, double>) {
      add_run_scalar<T>(base + offset, len, stride, acc);
    } else if (stride == 1) {
      add_run_f32<T>(base + offset, len, acc);
    } else {
      add_run_scalar<T>(base + offset, len, stride, acc);
    }
  }
  return acc.finish();
}

}  // namespace

ChunkNumerics chunk_numerics(const core::StridedView& v, int64_t item, int64_t lo, int64_t hi) {
  switch (v.dtype) {
    case core::DType::kFloat32: return chunk_numerics_typed<float>(v, item, lo, hi);
    case core::DType::kFloat64: return chunk_numerics_typed<double>(v, item, lo, hi);
    case core::DType::kBFloat16: return chunk_numerics_typed<BF16>(v, item, lo, hi);
    case core::DType::kFloat16: return chunk_numerics_typed<Half>(v, item, lo, hi);
  }
  return {};
}

void merge_chunks_into(const core::StridedView& v, const ChunkNumerics* chunks, int64_t count, double* row) {
  std::array<int64_t, core::kNumBins> bins{};
  Moments m;
  for (int64_t k = 0; k < count; ++k) {
    for (int b = 0; b < core::kNumBins; ++b) bins[b] += chunks[k].bins[b];
    m = core::merge(m, chunks[k].moments);
  }
  for (int b = 0; b < core::kNumBins; ++b) row[b] += static_cast<double>(bins[b] * v.repeat);
  core::store_moments(core::merge(core::load_moments(row), core::repeat(m, static_cast<double>(v.repeat))), row);
}

}  // namespace cpu
}  // namespace gapmon
