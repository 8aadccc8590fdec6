// Book-keeping's reduction of the per-sample gradients [n, p, d]: one read for the weight gradient (their
// sum over samples) and the squared norms, instead of one read for each (ATen's sum over dim 0, gapmon's
// instance statistics); 16 floats (8 doubles) a step in GCC vector types, compiled for the instruction set
// select_isa chose (AVX-512, AVX2 or the baseline).
#include "per_sample_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "stats_kernels.h"

namespace gapmon {
namespace cpu {
namespace {

typedef float F16v __attribute__((vector_size(64)));
typedef double D8v __attribute__((vector_size(64)));

inline double lanes_sum(D8v v) {
  double s = 0;
  for (int k = 0; k < 8; ++k) s += v[k];
  return s;
}

// 16 elements as two float64 vectors.
inline void widen(F16v v, D8v& lo, D8v& hi) {
  lo = __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7), D8v);
  hi = __builtin_convertvector(__builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15), D8v);
}
inline void widen(D8v v, D8v& lo, D8v& hi) { lo = v, hi = D8v{}; }

template <typename T, typename V>
__attribute__((always_inline)) inline void body(const T* x, int64_t n, int64_t stride, int64_t lo, int64_t hi, T* out, double* sq) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(T);
  for (int64_t b = 0; b < n; ++b) {
    const T* row = x + b * stride;
    D8v acc_lo = {}, acc_hi = {};
    int64_t e = lo;
    for (; e + kLanes <= hi; e += kLanes) {
      V v;
      std::memcpy(&v, row + e, sizeof v);
      if (out != nullptr) {
        V o = v;
        if (b > 0) {
          std::memcpy(&o, out + e, sizeof o);
          o += v;
        }
        std::memcpy(out + e, &o, sizeof o);
      }
      D8v w_lo, w_hi;
      widen(v, w_lo, w_hi);
      acc_lo += w_lo * w_lo;
      acc_hi += w_hi * w_hi;
    }
    double s = lanes_sum(acc_lo) + lanes_sum(acc_hi);
    for (; e < hi; ++e) {
      const double w = static_cast<double>(row[e]);
      if (out != nullptr) out[e] = b == 0 ? row[e] : out[e] + row[e];
      s += w * w;
    }
    sq[b] = s;
  }
}

// Runs `kernel` (a lambda over the always_inline bodies above and below) compiled for the instruction set select_isa
// chose: each kernel defined once, compiled three times.
template <typename K>
auto on_generic(const K& kernel) {
  return kernel();
}
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
template <typename K>
__attribute__((target("avx2,fma"))) auto on_avx2(const K& kernel) {
  return kernel();
}
template <typename K>
__attribute__((target("avx512f,avx512dq,avx2,fma"))) auto on_avx512(const K& kernel) {
  return kernel();
}
#endif

template <typename K>
auto on_selected_isa(const K& kernel) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if (selected_isa_has_avx512()) return on_avx512(kernel);
  if (selected_isa_has_avx2()) return on_avx2(kernel);
#endif
  return on_generic(kernel);
}

template <typename T>
__attribute__((always_inline)) inline bool row_norms(const int64_t* ids, const T* g, int64_t t, int64_t d, int64_t padding_idx, int64_t b0, int64_t b1,
               double* out) {
  std::vector<int32_t> order(static_cast<size_t>(t));
  std::vector<double> row(static_cast<size_t>(d));
  bool ok = true;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t* id = ids + b * t;
    const T* gb = g + b * t * d;
    bool in_range = true;
    for (int64_t s = 0; s < t; ++s) in_range &= id[s] >= 0 && id[s] < (int64_t(1) << 32);
    if (!in_range) {
      ok = false;
      continue;
    }
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [id](int32_t x, int32_t y) { return id[x] < id[y]; });
    double total = 0;
    for (int64_t start = 0; start < t;) {
      const int64_t v = id[order[start]];
      int64_t end = start + 1;
      while (end < t && id[order[end]] == v) ++end;
      if (v != padding_idx) {
        const T* first = gb + order[start] * d;
        for (int64_t e = 0; e < d; ++e) row[e] = static_cast<double>(first[e]);
        for (int64_t k = start + 1; k < end; ++k) {
          const T* next = gb + order[k] * d;
          for (int64_t e = 0; e < d; ++e) row[e] += static_cast<double>(next[e]);
        }
        double s = 0;
        for (int64_t e = 0; e < d; ++e) s += row[e] * row[e];
        total += s;
      }
      start = end;
    }
    out[b] = total;
  }
  return ok;
}

// 8 elements of x as float64 lanes.
template <typename T>
__attribute__((always_inline)) inline D8v load8(const T* x) {
  D8v v;
  for (int k = 0; k < 8; ++k) v[k] = static_cast<double>(x[k]);
  return v;
}

// The sum of x[0..n) and of (x - shift)^2 in 8 float64 lanes, then the tail: a fixed order (the same bits on every
// run), and no serial chain of n adds.
template <typename T>
__attribute__((always_inline)) inline double lane_sum(const T* x, int64_t n, double shift, bool squares) {
  D8v acc = {};
  int64_t e = 0;
  for (; e + 8 <= n; e += 8) {
    const D8v c = load8(x + e) - shift;
    acc += squares ? c * c : c;
  }
  double s = lanes_sum(acc);
  for (; e < n; ++e) {
    const double c = static_cast<double>(x[e]) - shift;
    s += squares ? c * c : c;
  }
  return s;
}

template <typename T>
__attribute__((always_inline)) inline void norm_sums(const T* x, const T* g, int64_t t, int64_t n, double eps, bool rms, int64_t b0, int64_t b1,
               double* weight, double* bias) {
  for (int64_t b = b0; b < b1; ++b) {
    double* w = weight + b * n;
    double* s = bias + b * n;
    std::fill(w, w + n, 0.0);
    std::fill(s, s + n, 0.0);
    for (int64_t p = 0; p < t; ++p) {
      const T* xr = x + (b * t + p) * n;
      const T* gr = g + (b * t + p) * n;
      const double mean = rms ? 0.0 : lane_sum(xr, n, 0.0, false) / static_cast<double>(n);
      const double rstd = 1.0 / std::sqrt(lane_sum(xr, n, mean, true) / static_cast<double>(n) + eps);
      for (int64_t e = 0; e < n; ++e) {
        const double ge = static_cast<double>(gr[e]);
        w[e] += ge * ((static_cast<double>(xr[e]) - mean) * rstd);
        s[e] += ge;
      }
    }
  }
}

}  // namespace

void affine_norm_sums(const float* x, const float* g, int64_t t, int64_t n, double eps, bool rms, int64_t b0,
                      int64_t b1, double* weight, double* bias) {
  on_selected_isa([&]() __attribute__((always_inline)) { norm_sums(x, g, t, n, eps, rms, b0, b1, weight, bias); });
}

void affine_norm_sums(const double* x, const double* g, int64_t t, int64_t n, double eps, bool rms, int64_t b0,
                      int64_t b1, double* weight, double* bias) {
  on_selected_isa([&]() __attribute__((always_inline)) { norm_sums(x, g, t, n, eps, rms, b0, b1, weight, bias); });
}

bool embedding_row_norms(const int64_t* ids, const float* g, int64_t t, int64_t d, int64_t padding_idx, int64_t b0,
                         int64_t b1, double* out) {
  return on_selected_isa([&]() __attribute__((always_inline)) { return row_norms(ids, g, t, d, padding_idx, b0, b1, out); });
}

bool embedding_row_norms(const int64_t* ids, const double* g, int64_t t, int64_t d, int64_t padding_idx, int64_t b0,
                         int64_t b1, double* out) {
  return on_selected_isa([&]() __attribute__((always_inline)) { return row_norms(ids, g, t, d, padding_idx, b0, b1, out); });
}

void sum_rows_and_squares(const float* x, int64_t n, int64_t stride, int64_t lo, int64_t hi, float* out, double* sq) {
  on_selected_isa([&]() __attribute__((always_inline)) { body<float, F16v>(x, n, stride, lo, hi, out, sq); });
}

void sum_rows_and_squares(const double* x, int64_t n, int64_t stride, int64_t lo, int64_t hi, double* out, double* sq) {
  on_selected_isa([&]() __attribute__((always_inline)) { body<double, D8v>(x, n, stride, lo, hi, out, sq); });
}

}  // namespace cpu
}  // namespace gapmon
