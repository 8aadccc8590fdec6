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
  test_row_cursor();
  if (failures) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("all core checks passed\n");
  return 0;
}
