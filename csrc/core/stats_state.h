// Mergeable one-pass statistics of a tensor: the single source of the statistics math.
//
// Torch-free and usable from host C++ and CUDA device code. A `State` summarises any
// set of elements (count, mean, M2, max|x|, sum of squares, non-finite and zero counts);
// two states merge exactly with Chan's rule, so partial results from blocks, threads,
// chunks and ranks combine without ever forming E[x^2] - E[x]^2 over a whole tensor.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define GAPMON_HD __host__ __device__ __forceinline__
#else
#define GAPMON_HD inline
#endif

namespace gapmon {
namespace core {

// Column order of a finalised statistics row (the `[..., kNumStats]` float32 output).
enum StatColumn : int {
  kCount = 0,
  kMean = 1,
  kVar = 2,
  kMaxAbs = 3,
  kNorm = 4,
  kNonfinite = 5,
  kZeros = 6,
  kNumStats = 7,
};

// Column order of a serialised partial state (the `[..., kNumStateColumns]` float64 rows
// exchanged between ranks).
enum StateColumn : int {
  sCount = 0,
  sMean = 1,
  sM2 = 2,
  sMaxAbs = 3,
  sSumSq = 4,
  sNonfinite = 5,
  sZeros = 6,
  kNumStateColumns = 7,
};

// Columns of a per-module activation accumulator row (GAPMonitor): statistics of many instances
// folded together; sums are divided by the instance count when the step ends.
enum InstanceAccColumn : int {
  aInstances = 0,   // number of instances folded in
  aSumMean = 1,     // sum over instances of their mean
  aSumVar = 2,      // sum over instances of their variance
  aSumNorm = 3,     // sum over instances of their L2 norm
  aNonfinite = 4,   // non-finite elements over all instances
  aMaxAbs = 5,      // max |x| over all instances (NaN if any element is NaN)
  kNumAccColumns = 6,
};

// The column names, in enum order: what gapmon._C reports to Python (gapmon.stats names them too,
// and refuses a build whose layout differs).
inline constexpr const char* kStatNames[kNumStats] = {"count", "mean", "var", "max_abs", "norm", "nonfinite", "zeros"};
inline constexpr const char* kStateNames[kNumStateColumns] = {"count", "mean", "m2", "max_abs", "sumsq", "nonfinite",
                                                              "zeros"};
inline constexpr const char* kAccNames[kNumAccColumns] = {"instances", "sum_mean", "sum_var", "sum_norm", "nonfinite",
                                                          "max_abs"};

template <typename T>
GAPMON_HD T quiet_nan() {
  return static_cast<T>(__builtin_nan(""));
}

GAPMON_HD double sqrt_of(double x) { return sqrt(x); }
GAPMON_HD float sqrt_of(float x) { return sqrtf(x); }

template <typename T>
GAPMON_HD bool is_nan(T x) {
  return x != x;
}

template <typename T>
GAPMON_HD bool is_finite(T x) {
  // NaN fails the first test, +-Inf the second.
  return x == x && (x - x) == (x - x);
}

// max that propagates NaN from either side (unlike fmax, which drops it).
template <typename T>
GAPMON_HD T nan_max(T a, T b) {
  return (a > b || is_nan(a)) ? a : b;
}

template <typename acc_t>
struct State {
  acc_t count = 0;      // number of elements
  acc_t mean = 0;       // running mean (0 while empty)
  acc_t m2 = 0;         // sum of squared deviations from the mean
  acc_t max_abs = 0;    // max |x|; NaN if any element is NaN
  acc_t sumsq = 0;      // sum of x^2 (kept separately so that +-Inf gives norm Inf)
  acc_t nonfinite = 0;  // NaN and +-Inf elements
  acc_t zeros = 0;      // exact zeros (+0 and -0)
};

// Chan et al.'s parallel merge. Exact for empty sides; Inf/NaN means propagate as torch.mean does.
template <typename acc_t>
GAPMON_HD State<acc_t> merge(const State<acc_t>& a, const State<acc_t>& b) {
  if (b.count == 0) return a;
  if (a.count == 0) return b;
  State<acc_t> r;
  r.count = a.count + b.count;
  const acc_t delta = b.mean - a.mean;
  const acc_t frac_b = b.count / r.count;
  if (is_finite(delta)) {
    r.mean = a.mean + delta * frac_b;
  } else {
    // Infinite or NaN means: the weighted sum gives torch's answer (Inf stays Inf, Inf-Inf is NaN).
    r.mean = (a.count * a.mean + b.count * b.mean) / r.count;
  }
  r.m2 = a.m2 + b.m2 + delta * delta * a.count * frac_b;
  r.max_abs = nan_max(a.max_abs, b.max_abs);
  r.sumsq = a.sumsq + b.sumsq;
  r.nonfinite = a.nonfinite + b.nonfinite;
  r.zeros = a.zeros + b.zeros;
  return r;
}

// The state of `times` copies of the same elements (a stride-0, expanded dimension).
template <typename acc_t>
GAPMON_HD State<acc_t> repeat(State<acc_t> s, acc_t times) {
  s.count *= times;
  s.m2 *= times;
  s.sumsq *= times;
  s.nonfinite *= times;
  s.zeros *= times;
  return s;
}

// Shift used for the next block of shifted sums: the running mean when it is finite
// (keeps the deviations small, so the block's sum of squares does not cancel), else 0.
template <typename acc_t, typename block_t>
GAPMON_HD block_t block_shift(const State<acc_t>& running, block_t first_element) {
  if (running.count > 0) {
    return is_finite(running.mean) ? static_cast<block_t>(running.mean) : block_t(0);
  }
  return is_finite(first_element) ? first_element : block_t(0);
}

// max(mx, |x|), ignoring a NaN x (block_to_state restores NaN from the sum of squares). On a GPU one
// FMNMX with an |x| operand; on the CPU a form that compilers vectorise.
template <typename T>
GAPMON_HD T max_abs_update(T mx, T x) {
#if defined(__CUDA_ARCH__)
  return fmax(mx, fabs(x));
#else
  const T a = x < T(0) ? -x : x;
  return a > mx ? a : mx;
#endif
}

// Per-lane accumulation of one element into shifted sums, without the non-finite count: for
// callers that detect NaN/Inf afterwards from the sums, which they make non-finite (the CUDA
// kernels, core::GroupAccumulator). Written branch-free so that compilers vectorise lanes of it
// (CPU) and it maps to a few instructions per thread (CUDA). count_t may be a float type when the
// caller's groups are short enough to count exactly in it (a select and an add on a GPU).
template <typename block_t, typename count_t>
GAPMON_HD void accumulate_finite(block_t x, block_t shift, block_t& s1, block_t& s2, block_t& sq, block_t& mx,
                                 count_t& zeros) {
  const block_t d = x - shift;
  s1 += d;
  s2 += d * d;
  sq += x * x;
  mx = max_abs_update(mx, x);
  zeros += (x == block_t(0)) ? count_t(1) : count_t(0);
}

// accumulate_finite, and the non-finite count. `largest` is the largest finite value of block_t:
// |x| > largest (or NaN) counts as non-finite.
template <typename block_t, typename count_t>
GAPMON_HD void accumulate(block_t x, block_t shift, block_t largest, block_t& s1, block_t& s2,
                          block_t& sq, block_t& mx, int32_t& nonfinite, count_t& zeros) {
  accumulate_finite(x, shift, s1, s2, sq, mx, zeros);
  const block_t a = x < block_t(0) ? -x : x;
  nonfinite += (a <= largest) ? 0 : 1;
}

// Converts the shifted sums of n elements (all accumulated with the same shift) into a State.
template <typename acc_t, typename block_t>
GAPMON_HD State<acc_t> block_to_state(acc_t n, block_t shift, acc_t s1, acc_t s2, acc_t sq, block_t mx,
                                      acc_t nonfinite, acc_t zeros) {
  State<acc_t> s;
  if (n == 0) return s;
  s.count = n;
  s.mean = static_cast<acc_t>(shift) + s1 / n;
  const acc_t m2 = s2 - s1 * (s1 / n);
  s.m2 = m2 < acc_t(0) ? acc_t(0) : m2;  // rounding can go slightly negative; NaN is kept
  s.sumsq = sq;
  // A NaN element makes the sum of squares NaN (and nothing else does): restore it in max.
  s.max_abs = is_nan(sq) ? sq : static_cast<acc_t>(mx);
  s.nonfinite = nonfinite;
  s.zeros = zeros;
  return s;
}

// True when the shifted sums of a block of finite elements overflowed the block precision
// (|x| above ~1e19 in float32): the block must then be redone in double.
template <typename block_t>
GAPMON_HD bool sums_overflowed(bool elements_finite, block_t s1, block_t s2, block_t sq) {
  return elements_finite && !(is_finite(s1) && is_finite(s2) && is_finite(sq));
}

// Finalised statistics, torch semantics: var = M2 / max(0, n - correction); empty -> mean/var NaN.
template <typename acc_t, typename out_t>
GAPMON_HD void finalize(const State<acc_t>& s, int64_t correction, out_t* out) {
  const acc_t nan = quiet_nan<acc_t>();
  acc_t dof = s.count - static_cast<acc_t>(correction);
  if (dof < acc_t(0)) dof = acc_t(0);
  out[kCount] = static_cast<out_t>(s.count);
  out[kMean] = static_cast<out_t>(s.count > 0 ? s.mean : nan);
  out[kVar] = static_cast<out_t>(s.count > 0 ? s.m2 / dof : nan);
  out[kMaxAbs] = static_cast<out_t>(s.max_abs);
  out[kNorm] = static_cast<out_t>(sqrt_of(s.sumsq));
  out[kNonfinite] = static_cast<out_t>(s.nonfinite);
  out[kZeros] = static_cast<out_t>(s.zeros);
}

// A State as a row of kNumStateColumns doubles (the layout exchanged between ranks), and back.
template <typename acc_t>
GAPMON_HD void store_state(const State<acc_t>& s, double* row) {
  row[sCount] = s.count;
  row[sMean] = s.mean;
  row[sM2] = s.m2;
  row[sMaxAbs] = s.max_abs;
  row[sSumSq] = s.sumsq;
  row[sNonfinite] = s.nonfinite;
  row[sZeros] = s.zeros;
}

GAPMON_HD State<double> load_state(const double* row) {
  State<double> s;
  s.count = row[sCount];
  s.mean = row[sMean];
  s.m2 = row[sM2];
  s.max_abs = row[sMaxAbs];
  s.sumsq = row[sSumSq];
  s.nonfinite = row[sNonfinite];
  s.zeros = row[sZeros];
  return s;
}

// Folds one finalised statistics row (one instance) into an accumulator row.
template <typename stat_t, typename acc_t>
GAPMON_HD void accumulate_instance(const stat_t* stats, acc_t* acc) {
  acc[aInstances] += acc_t(1);
  acc[aSumMean] += static_cast<acc_t>(stats[kMean]);
  acc[aSumVar] += static_cast<acc_t>(stats[kVar]);
  acc[aSumNorm] += static_cast<acc_t>(stats[kNorm]);
  acc[aNonfinite] += static_cast<acc_t>(stats[kNonfinite]);
  acc[aMaxAbs] = nan_max(acc[aMaxAbs], static_cast<acc_t>(stats[kMaxAbs]));
}

// Adds accumulator `part` (instances folded elsewhere) into `acc`: sums add, maxima take the max.
template <typename acc_t>
GAPMON_HD void combine_instance_acc(const acc_t* part, acc_t* acc) {
  for (int k = 0; k < kNumAccColumns; ++k) {
    acc[k] = k == aMaxAbs ? nan_max(acc[k], part[k]) : acc[k] + part[k];
  }
}

}  // namespace core
}  // namespace gapmon
