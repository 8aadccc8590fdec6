// Book-keeping's reduction of the per-sample gradients [n, p, d]: one read for the weight gradient (their
// sum over samples) and the squared norms, instead of one read for each (ATen's sum over dim 0, gapmon's
// instance statistics); 16 floats (8 doubles) a step in GCC vector types, compiled for the instruction set
// select_isa chose (AVX-512, AVX2 or the baseline).
#include "per_sample_kernels.h"

#include <cstring>

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

template <typename T>
using Kernel = void (*)(const T*, int64_t, int64_t, int64_t, int64_t, T*, double*);

template <typename T, typename V>
void generic(const T* x, int64_t n, int64_t stride, int64_t lo, int64_t hi, T* out, double* sq) {
  body<T, V>(x, n, stride, lo, hi, out, sq);
}
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
template <typename T, typename V>
__attribute__((target("avx2,fma"))) void avx2(const T* x, int64_t n, int64_t stride, int64_t lo, int64_t hi, T* out,
                                              double* sq) {
  body<T, V>(x, n, stride, lo, hi, out, sq);
}
template <typename T, typename V>
__attribute__((target("avx512f,avx512dq,avx2,fma"))) void avx512(const T* x, int64_t n, int64_t stride, int64_t lo,
                                                                 int64_t hi, T* out, double* sq) {
  body<T, V>(x, n, stride, lo, hi, out, sq);
}
#endif

template <typename T, typename V>
Kernel<T> kernel() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if (selected_isa_has_avx512()) return avx512<T, V>;
  if (selected_isa_has_avx2()) return avx2<T, V>;
#endif
  return generic<T, V>;
}

}  // namespace

void sum_rows_and_squares(const float* x, int64_t n, int64_t stride, int64_t lo, int64_t hi, float* out, double* sq) {
  kernel<float, F16v>()(x, n, stride, lo, hi, out, sq);
}

void sum_rows_and_squares(const double* x, int64_t n, int64_t stride, int64_t lo, int64_t hi, double* out, double* sq) {
  kernel<double, D8v>()(x, n, stride, lo, hi, out, sq);
}

}  // namespace cpu
}  // namespace gapmon
