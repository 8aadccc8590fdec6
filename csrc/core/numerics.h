// Low-precision numerics of a tensor, mergeable: an exponent histogram of |x| and the central
// moments up to the fourth (kurtosis). The single source of this math, torch-free, host and device.
//
// Histogram bins (kNumBins, in this order): exact zeros; float32 subnormals (2^-149 <= |x| < 2^-126);
// one bin per frexp exponent e = kExpMin..kExpMax, holding |x| in [2^(e-1), 2^e); +-Inf; NaN; then
// two bins only float64 values reach: "tiny", 0 < |x| < 2^-149 (below float32's subnormals), and
// "huge", finite |x| >= 2^128 (beyond float32's range). float16/bfloat16 values are widened to
// float32 exactly, so their own subnormals land in the bins of their exponents. Counts are integers
// (exact, any order).
//
// Moments: count, mean and the sums of 2nd, 3rd and 4th powers of deviations (M2, M3, M4) in
// float64, merged with Pebay's pairwise formulas, so chunks, shards and ranks combine exactly
// as the statistics State does. Non-finite values propagate (NaN moments), as torch's would.
#pragma once

#include <cstdint>

#include "stats_state.h"

namespace gapmon {
namespace core {

constexpr int kExpMin = -125;  // frexp exponent of float32's smallest normal, 2^-126 = 0.5 * 2^-125
constexpr int kExpMax = 128;   // frexp exponent of float32's largest finite values, [2^127, 2^128)

// Column order of a numerics row (`[..., kNumNumericsColumns]` float64).
enum NumericsColumn : int {
  nZero = 0,
  nSubnormal = 1,
  nFirstExponent = 2,  // bin of e = kExpMin; e's bin is nFirstExponent + e - kExpMin
  nInf = nFirstExponent + (kExpMax - kExpMin + 1),
  nNaN = nInf + 1,
  nTiny = nNaN + 1,  // float64 only: 0 < |x| < 2^-149
  nHuge = nNaN + 2,  // float64 only: finite |x| >= 2^128
  kNumBins = nNaN + 3,
  nCount = kNumBins,
  nMean = kNumBins + 1,
  nM2 = kNumBins + 2,
  nM3 = kNumBins + 3,
  nM4 = kNumBins + 4,
  kNumNumericsColumns = kNumBins + 5,
};

inline constexpr const char* kMomentNames[5] = {"count", "mean", "m2", "m3", "m4"};
// The bins after the exponent bins, in column order (nInf .. nHuge).
inline constexpr const char* kTrailingBinNames[4] = {"inf", "nan", "tiny", "huge"};
static_assert(nInf + 4 == kNumBins, "kTrailingBinNames names every bin after the exponents");

// Bin of a float32 value from its bits: the biased exponent E gives frexp's e = E - 126.
GAPMON_HD int exponent_bin_f32(uint32_t bits) {
  const uint32_t biased = (bits >> 23) & 0xFFu, mantissa = bits & 0x7FFFFFu;
  if (biased == 0) return mantissa == 0 ? nZero : nSubnormal;
  if (biased == 0xFFu) return mantissa == 0 ? nInf : nNaN;
  return static_cast<int>(biased) + 1;  // nFirstExponent + (E - 126) - kExpMin
}

// Bin of a float64 value from its bits (frexp's e = E - 1022): float32's bins where its range holds
// the value, else "tiny" or "huge".
GAPMON_HD int exponent_bin_f64(uint64_t bits) {
  const int biased = static_cast<int>((bits >> 52) & 0x7FFu);
  const uint64_t mantissa = bits & 0xFFFFFFFFFFFFFull;
  if (biased == 0) return mantissa == 0 ? nZero : nTiny;  // float64 subnormals: below 2^-1022
  if (biased == 0x7FF) return mantissa == 0 ? nInf : nNaN;
  const int e = biased - 1022;  // |x| in [2^(e-1), 2^e)
  if (e > kExpMax) return nHuge;
  if (e >= kExpMin) return nFirstExponent + e - kExpMin;
  return e >= -148 ? nSubnormal : nTiny;  // float32's subnormals are [2^-149, 2^-126)
}

struct Moments {
  double count = 0, mean = 0, m2 = 0, m3 = 0, m4 = 0;
};

// Pebay's pairwise merge of central moments (exact for empty sides).
GAPMON_HD Moments merge(const Moments& a, const Moments& b) {
  if (b.count == 0) return a;
  if (a.count == 0) return b;
  Moments r;
  const double na = a.count, nb = b.count, n = na + nb;
  const double delta = b.mean - a.mean, dn = delta / n, dn2 = dn * dn;
  r.count = n;
  r.mean = a.mean + nb * dn;
  r.m2 = a.m2 + b.m2 + delta * dn * na * nb;
  r.m3 = a.m3 + b.m3 + delta * dn2 * na * nb * (na - nb) + 3.0 * dn * (na * b.m2 - nb * a.m2);
  r.m4 = a.m4 + b.m4 + delta * dn2 * dn * na * nb * (na * na - na * nb + nb * nb) +
         6.0 * dn2 * (na * na * b.m2 + nb * nb * a.m2) + 4.0 * dn * (na * b.m3 - nb * a.m3);
  return r;
}

// Central moments of n values from their power sums s_k = sum (x - shift)^k. Accurate while the
// shift is within a few standard deviations of the values' mean (callers pass the running mean).
GAPMON_HD Moments from_power_sums(double n, double shift, double s1, double s2, double s3, double s4) {
  Moments m;
  if (n == 0) return m;
  const double mu = s1 / n, mu2 = mu * mu;
  m.count = n;
  m.mean = shift + mu;
  const double m2 = s2 - n * mu2;
  m.m2 = m2 < 0 ? 0 : m2;  // rounding can go slightly negative; NaN is kept
  m.m3 = s3 - 3.0 * mu * s2 + 2.0 * n * mu2 * mu;
  const double m4 = s4 - 4.0 * mu * s3 + 6.0 * mu2 * s2 - 3.0 * n * mu2 * mu2;
  m.m4 = m4 < 0 ? 0 : m4;
  return m;
}

// Moments of `times` copies of the same values (an expanded, stride-0 dimension).
GAPMON_HD Moments repeat(Moments m, double times) {
  m.count *= times;
  m.m2 *= times;
  m.m3 *= times;
  m.m4 *= times;
  return m;
}

GAPMON_HD void store_moments(const Moments& m, double* row) {
  row[nCount] = m.count;
  row[nMean] = m.mean;
  row[nM2] = m.m2;
  row[nM3] = m.m3;
  row[nM4] = m.m4;
}

GAPMON_HD Moments load_moments(const double* row) {
  Moments m;
  m.count = row[nCount];
  m.mean = row[nMean];
  m.m2 = row[nM2];
  m.m3 = row[nM3];
  m.m4 = row[nM4];
  return m;
}

}  // namespace core
}  // namespace gapmon
