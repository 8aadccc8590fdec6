// Runs the CUDA numerics kernel (csrc/cuda/numerics_cuda.cu) on the host emulator against
// references built without csrc/core: bins by std::frexp, moments by long-double two-pass sums; the
// statistics states it reads in the same pass must have the bits of the statistics kernel
// (csrc/cuda/stats_cuda.cu, also on the emulator).
// Every dtype, items of several chunks, strided and expanded views, empty items, zeros, float32
// subnormals, Inf, NaN and float64 values outside float32's range; the rows must not depend on the
// block schedule (shuffled, interleaved blocks give the same bits). No GPU and no torch needed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../../csrc/core/numerics.h"
#include "../../csrc/core/strided_view.h"
#include "../../csrc/cuda/numerics_cuda.h"
#include "checks.h"
#include "emulated_views.h"

extern "C" cudaError_t cudaGetLastError(void) { return cudaSuccess; }
void gapmon_emu_set_numerics_schedule(unsigned seed);  // tests/cpp/numerics_cuda_emulated.cpp

namespace {

namespace cuda = gapmon::cuda;
using core::DType;
using core::StridedView;
using namespace emulated;
constexpr int kColumns = core::kNumNumericsColumns;

template <typename T> T from_double(double x) { return from_float<T>(static_cast<float>(x)); }
template <> double from_double<double>(double x) { return x; }

// The row a reference computes: frexp bins, long-double two-pass moments.
std::vector<double> reference_row(const std::vector<double>& xs) {
  std::vector<double> row(kColumns, 0.0);
  const int first = core::nFirstExponent;
  for (double x : xs) {
    const double a = std::fabs(x);
    int bin;
    if (std::isnan(x)) bin = core::nNaN;
    else if (std::isinf(x)) bin = core::nInf;
    else if (a == 0) bin = core::nZero;
    else if (a < std::ldexp(1.0, -149)) bin = core::nTiny;
    else if (a < std::ldexp(1.0, -126)) bin = core::nSubnormal;
    else if (a >= std::ldexp(1.0, 128)) bin = core::nHuge;
    else {
      int e;
      std::frexp(a, &e);
      bin = first + e - core::kExpMin;
    }
    row[bin] += 1;
  }
  if (xs.empty()) return row;
  long double sum = 0;
  for (double x : xs) sum += x;
  const long double mean = sum / xs.size();
  long double m2 = 0, m3 = 0, m4 = 0;
  for (double x : xs) {
    const long double d = x - mean;
    m2 += d * d;
    m3 += d * d * d;
    m4 += d * d * d * d;
  }
  row[core::nCount] = static_cast<double>(xs.size());
  row[core::nMean] = static_cast<double>(mean);
  row[core::nM2] = static_cast<double>(m2);
  row[core::nM3] = static_cast<double>(m3);
  row[core::nM4] = static_cast<double>(m4);
  return row;
}

cuda::ViewTable table_of(const std::vector<StridedView>& views) {
  cuda::ViewTable table;
  table.num = static_cast<int64_t>(views.size());
  for (size_t i = 0; i < views.size(); ++i) table.inline_views[i] = views[i];
  return table;
}

// The statistics states launch_stats gives for the same planned views (stats_cuda.cu on the emulator).
std::vector<double> stats_states(const std::vector<StridedView>& views, const cuda::LaunchPlan& plan, int64_t rows) {
  std::vector<double> out(rows * core::kNumStateColumns, -7.0), scratch(plan.total_chunks * core::kNumStateColumns);
  std::vector<unsigned> counters(rows + 1, 0u);
  cuda::StatsTargets targets;
  targets.out_states = out.data();
  targets.chunk_states = scratch.data();
  targets.counters = counters.data();
  CHECK(cuda::launch_stats(table_of(views), plan, rows, targets, nullptr) == cudaSuccess, "launch_stats");
  return out;
}

// Numerics rows as csrc/torch/cuda_ops.cpp gets them (scratch full of garbage: the kernel must overwrite
// it), checking on the way that the states of the same pass have launch_stats' bits and that the
// launch leaves its counters zeroed (the glue reuses them without a memset). With `into`, the rows
// are merged into those rows (NumericsTargets::accumulate) rather than written.
std::vector<double> run(std::vector<StridedView> views, const std::vector<double>* into = nullptr) {
  int64_t rows = 0;
  for (auto& v : views) {
    v.out_row = rows;
    rows += v.items;
  }
  const cuda::LaunchPlan plan = cuda::plan_launch(views.data(), static_cast<int64_t>(views.size()));
  std::vector<double> chunk_rows(plan.total_chunks * kColumns, -7.0), out(rows * kColumns, -7.0);
  if (into != nullptr) out = *into;
  std::vector<double> states(rows * core::kNumStateColumns, -7.0), chunk_states(plan.total_chunks * core::kNumStateColumns, -7.0);
  std::vector<unsigned> counters(rows + 1, 0u);
  cuda::StatsTargets stats;
  stats.out_states = states.data();
  cuda::NumericsTargets numerics;
  numerics.out = out.data();
  numerics.accumulate = into != nullptr;
  if (cuda::needs_chunk_states(plan.max_chunks_per_item)) {
    CHECK(cuda::launch_stats_and_numerics(table_of(views), plan, rows, stats, numerics, nullptr) == cudaErrorInvalidValue,
          "items of several chunks without scratch are refused");
    stats.chunk_states = chunk_states.data();
    stats.counters = counters.data();
    numerics.chunk_rows = chunk_rows.data();
  }
  CHECK(cuda::launch_stats_and_numerics(table_of(views), plan, rows, stats, numerics, nullptr) == cudaSuccess,
        "launch_stats_and_numerics");
  for (int64_t r = 0; r <= rows; ++r) CHECK(counters[r] == 0u, "counter %lld left at %u", static_cast<long long>(r), counters[r]);
  const auto want = stats_states(views, plan, rows);
  CHECK(std::memcmp(states.data(), want.data(), want.size() * sizeof(double)) == 0,
        "the states read with the numerics differ from launch_stats' bits");
  return out;
}

void expect_row(const double* got, const std::vector<double>& want, const std::string& what) {
  for (int b = 0; b < core::kNumBins; ++b) {
    CHECK(got[b] == want[b], "%s: bin %d has %.0f, want %.0f", what.c_str(), b, got[b], want[b]);
  }
  CHECK(got[core::nCount] == want[core::nCount], "%s: count %g vs %g", what.c_str(), got[core::nCount], want[core::nCount]);
  if (want[core::nInf] + want[core::nNaN] > 0) {  // non-finite values: NaN/Inf moments (core/numerics.h)
    for (int c : {int(core::nMean), int(core::nM2), int(core::nM4)}) {
      CHECK(!std::isfinite(got[c]), "%s: column %d is %g, want a non-finite value", what.c_str(), c, got[c]);
    }
    return;
  }
  const double scale = std::sqrt(want[core::nM2] / std::max(want[core::nCount], 1.0)) + 1e-300;
  for (int c : {int(core::nMean), int(core::nM2), int(core::nM3), int(core::nM4)}) {
    const double w = want[c], g = got[c];
    const int power = c == core::nMean ? 1 : c - core::nCount;
    // M3 can be near 0 by symmetry: compare it against the size of its terms, n * sigma^3.
    const double tol = c == core::nM3 ? 1e-9 * want[core::nCount] * std::pow(scale, 3) : 1e-9 * std::fabs(w);
    const bool ok = std::isnan(w) ? std::isnan(g) : std::isinf(w) ? g == w : std::fabs(g - w) <= tol + 1e-12 * (power == 1 ? scale : 0);
    CHECK(ok, "%s: column %d is %.17g, want %.17g", what.c_str(), c, g, w);
  }
}

template <typename T>
void test_dtype(const char* name) {
  std::mt19937 gen(7);
  std::normal_distribution<double> normal(0.5, 3.0);
  const int64_t n = 3 * core::kChunkElems / 2 + 17;  // items of two chunks, the second partial
  std::vector<T> data(2 * n);
  for (auto& x : data) x = from_double<T>(normal(gen));
  const double specials[] = {0.0, -0.0, 1e-40, -1e-39, std::numeric_limits<double>::infinity(), 65504.0,
                             std::ldexp(1.0, -126), std::ldexp(1.0, -127), 1.0, 0.5, 0.99999};
  for (size_t i = 0; i < sizeof specials / sizeof specials[0]; ++i) data[i * 1000 + 3] = from_double<T>(specials[i]);
  const StridedView two_items = view(data.data(), {n}, {1}, 2, n);
  const StridedView strided = view(data.data(), {400, 300}, {1, 400}, 1, 0);  // a transposed [300, 400]
  const StridedView expanded = view(data.data() + 11, {2000}, {1}, 1, 0, 3);
  const StridedView empty = view(data.data(), {0}, {1}, 1, 0);
  const std::vector<StridedView> views{two_items, strided, expanded, empty};
  const auto got = run(views);
  const std::vector<std::vector<double>> want{reference_row(values_of<T>(two_items, 0)),
                                              reference_row(values_of<T>(two_items, 1)),
                                              reference_row(values_of<T>(strided, 0)),
                                              reference_row(values_of<T>(expanded, 0)), reference_row({})};
  for (size_t r = 0; r < want.size(); ++r) expect_row(got.data() + r * kColumns, want[r], std::string(name) + " row " + std::to_string(r));
  for (unsigned seed : {1u, 2u, 3u}) {
    gapmon_emu_set_numerics_schedule(seed);
    const auto again = run(views);
    CHECK(std::memcmp(again.data(), got.data(), got.size() * sizeof(double)) == 0,
          "%s: block schedule %u changes the result bits", name, seed);
  }
  gapmon_emu_set_numerics_schedule(0);
}

void test_nan_and_float64_range() {
  // 2^128 and 2^-149 exactly: the first huge value, the smallest float32 subnormal; 5e-324: a float64 subnormal.
  const std::vector<double> data{std::nan(""), 1.0, 1e300, -1e-300, 3e-39, 0.0, 2.0, std::ldexp(1.0, 128),
                                 std::ldexp(1.0, -149), std::ldexp(1.0, -150), 5e-324, std::nextafter(std::ldexp(1.0, 128), 0.0)};
  const StridedView v = view(data.data(), {static_cast<int64_t>(data.size())}, {1}, 1, 0);
  const auto got = run({v});
  const auto want = reference_row(data);
  for (int b = 0; b < core::kNumBins; ++b) CHECK(got[b] == want[b], "float64 range: bin %d %.0f vs %.0f", b, got[b], want[b]);
  CHECK(got[core::nNaN] == 1 && got[core::nSubnormal] == 2 && got[core::nTiny] == 3 && got[core::nHuge] == 2 &&
            got[core::nFirstExponent + core::kExpMax - core::kExpMin] == 1,
        "NaN, float32's subnormal range, below and at or above float32's range have their bins");
  CHECK(std::isnan(got[core::nMean]) && got[core::nCount] == static_cast<double>(data.size()), "NaN propagates to the moments");
}

void test_merging_into_rows() {
  // The rows of a second launch merged into those of the first: the rows of each item's values twice.
  std::mt19937 gen(11);
  std::normal_distribution<double> normal(-1.0, 0.5);
  std::vector<float> data(core::kChunkElems + 500);
  for (auto& x : data) x = static_cast<float>(normal(gen));
  const std::vector<StridedView> views{view(data.data(), {int64_t(data.size())}, {1}), view(data.data() + 7, {300}, {2})};
  const auto first = run(views);
  const auto merged = run(views, &first);
  for (size_t r = 0; r < views.size(); ++r) {
    auto twice = values_of<float>(views[r], 0);
    const auto once = twice;
    twice.insert(twice.end(), once.begin(), once.end());
    expect_row(merged.data() + r * kColumns, reference_row(twice), "merged row " + std::to_string(r));
  }
}

// The activation hook's launch (csrc/torch/cuda_ops.cpp): instances folded into an accumulator row as
// launch_stats folds them (the same bits), and the numerics of all instances merged into one row
// after what it holds, in one launch; instances of one chunk and of several; schedules shuffled.
template <typename T>
void test_instance_fold_with_merged_numerics(int64_t items, int64_t item_numel, const char* name) {
  std::mt19937 gen(static_cast<unsigned>(items));
  std::normal_distribution<double> normal(0.25, 2.0);
  std::vector<T> data(items * item_numel);
  for (auto& x : data) x = from_double<T>(normal(gen));
  std::vector<StridedView> views{view(data.data(), {item_numel}, {1}, items, item_numel)};
  const cuda::LaunchPlan plan = cuda::plan_launch(views.data(), 1);
  CHECK(plan.warp_chunks == 0, "%s: instances read by blocks", name);
  cuda::ViewTable table = table_of(views);
  // What launch_stats folds, from an accumulator row that already holds something.
  const std::vector<double> held_acc{2, 0.5, 1.5, 3.0, 0, 4.0};
  std::vector<double> want_acc(held_acc), stats_rows(items * core::kNumStats), scratch(plan.total_chunks * core::kNumStateColumns);
  std::vector<unsigned> counters(items + 1, 0u);
  cuda::StatsTargets stats;
  stats.out_stats = stats_rows.data();
  stats.correction = 1;
  stats.acc_row = want_acc.data();
  stats.chunk_states = scratch.data();
  stats.counters = counters.data();
  CHECK(cuda::launch_stats(table, plan, items, stats, nullptr) == cudaSuccess, "%s: launch_stats", name);
  std::vector<double> earlier{0.125, -3.0, 7.5};
  const StridedView earlier_view = view(earlier.data(), {3}, {1});
  const std::vector<double> held = run({earlier_view});
  std::vector<double> want_values = earlier;
  for (int64_t b = 0; b < items; ++b) {
    const auto xs = values_of<T>(views[0], b);
    want_values.insert(want_values.end(), xs.begin(), xs.end());
  }
  const std::vector<double> want = reference_row(want_values);
  std::vector<double> first;
  for (unsigned seed : {0u, 1u, 2u}) {
    gapmon_emu_set_numerics_schedule(seed);
    std::vector<double> acc(held_acc), row(held), chunk_rows(plan.total_chunks * kColumns, -7.0);
    std::fill(stats_rows.begin(), stats_rows.end(), -7.0);
    std::fill(scratch.begin(), scratch.end(), -7.0);
    stats.acc_row = acc.data();
    cuda::NumericsTargets numerics;
    numerics.out = row.data();
    numerics.chunk_rows = chunk_rows.data();
    numerics.accumulate = true;
    numerics.merge_items = true;
    CHECK(cuda::launch_stats_and_numerics(table, plan, items, stats, numerics, nullptr) == cudaSuccess,
          "%s: launch_stats_and_numerics with a fold", name);
    CHECK(std::memcmp(acc.data(), want_acc.data(), acc.size() * sizeof(double)) == 0,
          "%s: the fold differs from launch_stats' bits", name);
    for (int64_t r = 0; r <= items; ++r) CHECK(counters[r] == 0u, "%s: counter %lld left at %u", name, static_cast<long long>(r), counters[r]);
    expect_row(row.data(), want, std::string(name) + " merged instances");
    if (seed == 0) first = row;
    CHECK(std::memcmp(row.data(), first.data(), row.size() * sizeof(double)) == 0, "%s: schedule %u changes the bits", name, seed);
  }
  gapmon_emu_set_numerics_schedule(0);
}

void test_refused_plans() {
  // Many short instances are read by warps in launch_stats: the fused kernel reads blocks only, and
  // says so rather than give states with other bits. No instance fold either.
  const std::vector<float> data(4096, 1.0f);
  std::vector<StridedView> views{view(data.data(), {2}, {1}, 2048, 2)};
  const cuda::LaunchPlan plan = cuda::plan_launch(views.data(), 1);
  CHECK(plan.warp_chunks > 0, "2048 items of 2 elements are read by warps");
  std::vector<double> out(2048 * kColumns), states(2048 * core::kNumStateColumns), acc(core::kNumAccColumns);
  cuda::StatsTargets stats;
  stats.out_states = states.data();
  cuda::NumericsTargets numerics;
  numerics.out = out.data();
  CHECK(cuda::launch_stats_and_numerics(table_of(views), plan, 2048, stats, numerics, nullptr) == cudaErrorInvalidValue,
        "a plan with warp chunks is refused");
  std::vector<StridedView> one{view(data.data(), {4096}, {1})};
  const cuda::LaunchPlan single = cuda::plan_launch(one.data(), 1);
  std::vector<unsigned> counters(2, 0u);
  stats.counters = counters.data();
  stats.acc_row = acc.data();
  CHECK(cuda::launch_stats_and_numerics(table_of(one), single, 1, stats, numerics, nullptr) == cudaErrorInvalidValue,
        "an instance fold without statistics rows to fold is refused");
  stats.acc_row = nullptr;
  std::vector<double> chunk_rows(2 * kColumns);
  numerics.chunk_rows = chunk_rows.data();
  numerics.merge_items = true;
  std::vector<StridedView> two{one[0], one[0]};
  two[1].out_row = 1;
  const cuda::LaunchPlan pair = cuda::plan_launch(two.data(), 2);
  CHECK(cuda::launch_stats_and_numerics(table_of(two), pair, 2, stats, numerics, nullptr) == cudaErrorInvalidValue,
        "merging the items of two views into one row is refused");
  numerics.merge_items = false;
  numerics.out = nullptr;
  CHECK(cuda::launch_stats_and_numerics(table_of(one), single, 1, stats, numerics, nullptr) == cudaErrorInvalidValue,
        "no numerics output is refused");
}

void test_merge_launcher() {
  // [2 parts, 1 tensor]: the two halves of one sequence merge to the whole's row.
  std::vector<double> xs;
  for (int i = 0; i < 300; ++i) xs.push_back(std::sin(i * 0.37) * 5 + i * 0.01);
  const std::vector<double> a(xs.begin(), xs.begin() + 120), b(xs.begin() + 120, xs.end());
  const StridedView va = view(a.data(), {120}, {1}, 1, 0), vb = view(b.data(), {180}, {1}, 1, 0);
  const auto ra = run({va}), rb = run({vb});
  std::vector<double> parts(ra);
  parts.insert(parts.end(), rb.begin(), rb.end());
  std::vector<double> out(kColumns, -7.0);
  CHECK(cuda::launch_merge_numerics(parts.data(), 2, 1, out.data(), nullptr) == cudaSuccess, "launch_merge_numerics");
  expect_row(out.data(), reference_row(xs), "merged parts");
}

}  // namespace

int main() {
  test_dtype<float>("float32");
  test_dtype<double>("float64");
  test_dtype<__nv_bfloat16>("bfloat16");
  test_dtype<__half>("float16");
  test_nan_and_float64_range();
  test_merging_into_rows();
  test_instance_fold_with_merged_numerics<float>(5, 3000, "[5, 3000] float32");
  test_instance_fold_with_merged_numerics<__nv_bfloat16>(3, core::kChunkElems + 9, "[3, 65545] bfloat16");
  test_refused_plans();
  test_merge_launcher();
  if (failures) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("all emulated CUDA numerics checks passed\n");
  return 0;
}
