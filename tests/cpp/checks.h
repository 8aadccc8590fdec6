// Checks shared by the C++ test programs: a CHECK macro that counts failures, and a long-double
// reference State of a sequence of values.
#pragma once

#include <cmath>
#include <cstdio>
#include <vector>

#include "../../csrc/core/stats_state.h"

using gapmon::core::State;
namespace core = gapmon::core;

inline int failures = 0;

#define CHECK(cond, ...)                                          \
  do {                                                            \
    if (!(cond)) {                                                \
      ++failures;                                                 \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                   \
      std::printf("\n");                                          \
    }                                                             \
  } while (0)

inline bool close(double got, double want, double rtol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= rtol * std::fabs(want) + 1e-300;
}

// Exact state of a sequence, two passes in long double.
inline State<double> reference(const std::vector<double>& xs) {
  State<double> s;
  if (xs.empty()) return s;
  long double sum = 0, sq = 0, m2 = 0, mx = 0;
  bool nan = false;
  for (double x : xs) {
    sum += x;
    sq += (long double)x * x;
    nan |= std::isnan(x);
    mx = std::fabs(x) > mx ? std::fabs(x) : mx;
    s.nonfinite += std::isfinite(x) ? 0 : 1;
    s.zeros += x == 0 ? 1 : 0;
  }
  const long double mean = sum / xs.size();
  for (double x : xs) m2 += (x - mean) * (x - mean);
  s.count = xs.size();
  s.mean = (double)mean;
  s.m2 = (double)m2;
  s.sumsq = (double)sq;
  s.max_abs = nan ? NAN : (double)mx;
  return s;
}

inline void expect_state(const State<double>& got, const State<double>& want, double rtol, const char* what) {
  CHECK(got.count == want.count, "%s count %g vs %g", what, got.count, want.count);
  CHECK(close(got.mean, want.mean, rtol) || std::fabs(got.mean - want.mean) < rtol * std::sqrt(want.m2 / want.count),
        "%s mean %.17g vs %.17g", what, got.mean, want.mean);
  CHECK(close(got.m2, want.m2, rtol), "%s m2 %.17g vs %.17g", what, got.m2, want.m2);
  CHECK(close(got.sumsq, want.sumsq, rtol), "%s sumsq %.17g vs %.17g", what, got.sumsq, want.sumsq);
  CHECK((std::isnan(want.max_abs) && std::isnan(got.max_abs)) || got.max_abs == want.max_abs, "%s max %g vs %g", what,
        got.max_abs, want.max_abs);
  CHECK(got.nonfinite == want.nonfinite && got.zeros == want.zeros, "%s counts %g/%g vs %g/%g", what, got.nonfinite,
        got.zeros, want.nonfinite, want.zeros);
}

