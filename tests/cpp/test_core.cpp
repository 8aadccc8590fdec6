// Unit tests of the torch-free statistics math (csrc/core) and of every CPU code path
// (csrc/cpu), against long-double references. Run by ctest; no torch needed.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../csrc/core/stats_state.h"
#include "../../csrc/core/strided_view.h"
#include "../../csrc/cpu/numerics_kernels.h"
#include "../../csrc/cpu/stats_kernels.h"
#include "checks.h"

// Scalar fold of a sequence with the core primitives only: block shift, accumulate, block_to_state, merge.
static State<double> fold(const std::vector<double>& xs, size_t block) {
  State<double> s;
  for (size_t start = 0; start < xs.size(); start += block) {
    const size_t end = std::min(xs.size(), start + block);
    const double shift = core::block_shift(s, xs[start]);
    double s1 = 0, s2 = 0, sq = 0, mx = 0;
    int32_t nf = 0, nz = 0;
    for (size_t i = start; i < end; ++i) core::accumulate(xs[i], shift, 1.7976931348623157e308, s1, s2, sq, mx, nf, nz);
    s = core::merge(s, core::block_to_state<double, double>(double(end - start), shift, s1, s2, sq, mx, nf, nz));
  }
  return s;
}

static void test_merge_rules() {
  std::mt19937 g(1);
  std::normal_distribution<double> d(1e6, 1.0);
  std::vector<double> xs(10001);
  for (auto& x : xs) x = d(g);
  expect_state(fold(xs, 7), reference(xs), 1e-9, "fold blocks of 7");
  // Merging with empty states on either side is the identity.
  State<double> a = fold(xs, 64), empty;
  expect_state(core::merge(a, empty), a, 0, "merge(a, empty)");
  expect_state(core::merge(empty, a), a, 0, "merge(empty, a)");
  // repeat() equals folding the sequence several times.
  std::vector<double> thrice;
  for (int k = 0; k < 3; ++k) thrice.insert(thrice.end(), xs.begin(), xs.begin() + 100);
  std::vector<double> first(xs.begin(), xs.begin() + 100);
  expect_state(core::repeat(reference(first), 3.0), reference(thrice), 1e-9, "repeat");
}

static void test_nan_inf_and_finalize() {
  std::vector<double> xs = {1.0, 2.0, NAN, 0.0};
  State<double> s = fold(xs, 2);
  CHECK(std::isnan(s.mean) && std::isnan(s.max_abs) && std::isnan(s.sumsq), "NaN must propagate");
  CHECK(s.nonfinite == 1 && s.zeros == 1, "counts %g %g", s.nonfinite, s.zeros);
  std::vector<double> inf = {INFINITY, 1.0, INFINITY};
  s = fold(inf, 1);
  CHECK(s.mean == INFINITY && std::isnan(s.m2) && s.max_abs == INFINITY && s.sumsq == INFINITY, "+inf mean %g", s.mean);
  double out[core::kNumStats];
  core::finalize(State<double>(), 1, out);
  CHECK(out[core::kCount] == 0 && std::isnan(out[core::kMean]) && std::isnan(out[core::kVar]) &&
            out[core::kMaxAbs] == 0 && out[core::kNorm] == 0,
        "empty finalize");
  core::finalize(fold({3.0}, 1), 1, out);
  CHECK(std::isnan(out[core::kVar]) && out[core::kMean] == 3.0, "single element var must be NaN with correction 1");
  core::finalize(fold({1.0, 2.0}, 1), 2, out);
  CHECK(std::isinf(out[core::kVar]), "dof 0 with m2 > 0 gives inf like torch");
}

static void test_cpu_paths() {
  // Every instruction set and both the unit-stride (vector) and strided (scalar) paths agree with
  // the long-double reference on data with zeros, a NaN-free tail, and large offsets.
  std::mt19937 g(2);
  std::normal_distribution<float> d(1000.f, 0.5f);
  const int64_t n = 150001;
  std::vector<float> xs(n);
  for (auto& x : xs) x = d(g);
  for (int64_t i = 0; i < n; i += 1013) xs[i] = 0.f;
  for (const char* isa : {"generic", "avx2", "avx512"}) {
    try {
      gapmon::cpu::select_isa(isa);
    } catch (const std::invalid_argument&) {
      std::printf("skip %s (not supported by this CPU)\n", isa);
      continue;
    }
    for (int64_t stride : {1, 3}) {
      core::StridedView v;
      v.data = xs.data();
      v.dtype = core::DType::kFloat32;
      v.ndim = 1;
      v.sizes[0] = (n + stride - 1) / stride;
      v.strides[0] = stride;
      v.item_numel = v.sizes[0];
      core::plan_chunks(&v, 1);
      State<double> s;
      for (int64_t c = 0; c < v.chunks_per_item; ++c) {
        const int64_t lo = c * core::kChunkElems, hi = std::min(lo + core::kChunkElems, v.item_numel);
        s = core::merge(s, gapmon::cpu::chunk_state(v, 0, lo, hi));
      }
      std::vector<double> seen;
      for (int64_t i = 0; i < n; i += stride) seen.push_back(xs[i]);
      std::string what = std::string(isa) + (stride == 1 ? " unit stride" : " stride 3");
      expect_state(s, reference(seen), 2e-6, what.c_str());
    }
  }
  gapmon::cpu::select_isa("auto");
}

// The numerics of one unit-stride view of 16-bit or 32-bit elements, its chunks merged in order.
static gapmon::cpu::ChunkNumerics numerics_of(const void* data, core::DType dtype, int64_t n) {
  core::StridedView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = 1;
  v.sizes[0] = n;
  v.strides[0] = 1;
  v.item_numel = n;
  core::plan_chunks(&v, 1);
  std::vector<gapmon::cpu::ChunkNumerics> chunks;
  for (int64_t c = 0; c < v.chunks_per_item; ++c) {
    const int64_t lo = c * core::kChunkElems, hi = std::min(lo + core::kChunkElems, n);
    chunks.push_back(gapmon::cpu::chunk_numerics(v, 0, lo, hi));
  }
  std::vector<double> row(core::kNumNumericsColumns, 0.0);
  gapmon::cpu::merge_chunks_into(v, chunks.data(), static_cast<int64_t>(chunks.size()), row.data());
  gapmon::cpu::ChunkNumerics out;
  for (int b = 0; b < core::kNumBins; ++b) out.bins[b] = static_cast<int64_t>(row[b]);
  out.moments = core::load_moments(row.data());
  return out;
}

// IEEE half -> double by its definition (no bit tricks), for the reference.
static double half_value(uint16_t h) {
  const int exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (exp == 0x1F) return man ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (exp == 0) return sign * std::ldexp(man, -24);
  return sign * std::ldexp(1024 + man, exp - 25);
}

static void test_numerics_paths() {
  // Every instruction set gives the same numerics (bins exact, moments the same bits), and they agree
  // with a long-double reference: float32 data, and every one of the 65536 half bit patterns but NaNs.
  std::mt19937 g(3);
  std::normal_distribution<float> d(0.f, 3.f);
  std::vector<float> xs(70001);
  for (auto& x : xs) x = d(g);
  xs[5] = 0.f, xs[6] = 1e-40f, xs[7] = INFINITY;
  std::vector<uint16_t> halves;
  for (uint32_t h = 0; h < 65536; ++h) {
    if (!std::isnan(half_value(static_cast<uint16_t>(h))) && !std::isinf(half_value(static_cast<uint16_t>(h)))) {
      halves.push_back(static_cast<uint16_t>(h));
    }
  }
  long double sum = 0, sq = 0;
  for (uint16_t h : halves) sum += half_value(h);
  const long double mean = sum / halves.size();
  for (uint16_t h : halves) sq += (half_value(h) - mean) * (half_value(h) - mean);
  std::vector<gapmon::cpu::ChunkNumerics> f32s, f16s;
  for (const char* isa : {"generic", "avx2", "avx512"}) {
    try {
      gapmon::cpu::select_isa(isa);
    } catch (const std::invalid_argument&) {
      std::printf("skip %s (not supported by this CPU)\n", isa);
      continue;
    }
    f32s.push_back(numerics_of(xs.data(), core::DType::kFloat32, static_cast<int64_t>(xs.size())));
    f16s.push_back(numerics_of(halves.data(), core::DType::kFloat16, static_cast<int64_t>(halves.size())));
    const auto& h = f16s.back();
    CHECK(h.moments.count == static_cast<double>(halves.size()), "%s: half count %g", isa, h.moments.count);
    // The exact mean is 0 (the set is symmetric): its rounding is relative to the largest value, 65504.
    CHECK(std::fabs(h.moments.mean - static_cast<double>(mean)) <= 1e-15 * 65504, "%s: half mean %g vs %Lg", isa,
          h.moments.mean, mean);
    CHECK(close(h.moments.m2, static_cast<double>(sq), 1e-10), "%s: half m2 %g vs %Lg", isa, h.moments.m2, sq);
    CHECK(h.bins[core::nZero] == 2 && h.bins[core::nSubnormal] == 0, "%s: half zeros %lld (+0 and -0)", isa,
          static_cast<long long>(h.bins[core::nZero]));
    CHECK(f32s.back().bins[core::nInf] == 1 && f32s.back().bins[core::nSubnormal] == 1 && f32s.back().bins[core::nZero] == 1,
          "%s: float32 edge bins", isa);
  }
  for (size_t k = 1; k < f32s.size(); ++k) {
    CHECK(f32s[k].bins == f32s[0].bins && std::memcmp(&f32s[k].moments, &f32s[0].moments, sizeof(f32s[0].moments)) == 0,
          "float32 numerics differ between instruction sets (%zu)", k);
    CHECK(f16s[k].bins == f16s[0].bins && std::memcmp(&f16s[k].moments, &f16s[0].moments, sizeof(f16s[0].moments)) == 0,
          "half numerics differ between instruction sets (%zu)", k);
  }
  gapmon::cpu::select_isa("auto");
}

static void test_row_cursor() {
  // A [3, 4] item with strides (10, 2) starting mid-row visits the right runs.
  core::StridedView v;
  v.ndim = 2;
  v.sizes[0] = 3;
  v.sizes[1] = 4;
  v.strides[0] = 10;
  v.strides[1] = 2;
  v.item_numel = 12;
  core::RowCursor rows(v, 0, 2, 11);
  int64_t off, len, stride;
  std::vector<int64_t> got;
  while (rows.next(off, len, stride)) {
    got.push_back(off);
    got.push_back(len);
  }
  const std::vector<int64_t> want = {4, 2, 10, 4, 20, 3};
  CHECK(got == want, "row cursor runs");
}

int main() {
  test_merge_rules();
  test_nan_inf_and_finalize();
  test_cpu_paths();
  test_numerics_paths();
  test_row_cursor();
  if (failures) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("all core checks passed\n");
  return 0;
}
