// Runs the CUDA kernels of csrc/cuda/stats_cuda.cu on the host (tests/cpp/cuda_emulator.h, force-
// included into that source) against long-double references: every launcher, a block or a warp per
// chunk, the in-launch merge of multi-chunk items and the instance fold, inline and uploaded view
// tables, misaligned, strided and expanded views, every dtype, NaN/Inf, empty items and the float
// overflow redo. No GPU and no torch needed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../../csrc/core/strided_view.h"
#include "../../csrc/cuda/stats_cuda.h"
#include "checks.h"
#include "emulated_views.h"

extern "C" cudaError_t cudaGetLastError(void) { return cudaSuccess; }
void gapmon_emu_set_schedule(unsigned seed);  // tests/cpp/stats_cuda_emulated.cpp

namespace {

namespace cuda = gapmon::cuda;
using core::DType;
using core::StridedView;
using namespace emulated;

// Partial states of every output row, through launch_stats as csrc/torch/cuda_ops.cpp runs it: views
// inline in the kernel parameters when they fit, else uploaded with launch_upload.
std::vector<State<double>> run(std::vector<StridedView> views, int64_t rows, bool force_upload = false) {
  const cuda::LaunchPlan plan = cuda::plan_launch(views.data(), static_cast<int64_t>(views.size()));
  const int64_t total_chunks = plan.total_chunks;
  cuda::ViewTable table;
  table.num = static_cast<int64_t>(views.size());
  std::vector<uint64_t> device_table(views.size() * sizeof(StridedView) / sizeof(uint64_t));
  if (views.size() <= static_cast<size_t>(cuda::kInlineViews) && !force_upload) {
    for (size_t i = 0; i < views.size(); ++i) table.inline_views[i] = views[i];
  } else {
    CHECK(cuda::launch_upload(views.data(), static_cast<int64_t>(views.size() * sizeof(StridedView)),
                              device_table.data(), nullptr) == cudaSuccess, "upload");
    table.device = reinterpret_cast<const StridedView*>(device_table.data());
  }
  const int64_t max_chunks = plan.max_chunks_per_item;
  // Scratch as csrc/torch/cuda_ops.cpp allocates it: chunk states only for items of several chunks,
  // counters zeroed; garbage in what the kernel must overwrite.
  std::vector<double> scratch(total_chunks * core::kNumStateColumns, -7.0);
  std::vector<unsigned> counters(rows + 1, 0u);
  std::vector<double> states(rows * core::kNumStateColumns, -7.0);
  cuda::StatsTargets targets;
  targets.out_states = states.data();
  if (cuda::needs_chunk_states(max_chunks)) targets.chunk_states = scratch.data();
  if (cuda::needs_counters(max_chunks, false)) targets.counters = counters.data();
  CHECK(cuda::launch_stats(table, plan, rows, targets, nullptr) == cudaSuccess, "launch_stats");
  // The launch leaves its counters zeroed (csrc/torch/cuda_ops.cpp reuses them without a memset), and a
  // second launch on the same counters gives the same bits.
  for (int64_t r = 0; r <= rows; ++r) CHECK(counters[r] == 0u, "counter %lld left at %u", static_cast<long long>(r), counters[r]);
  if (targets.counters != nullptr) {
    const std::vector<double> first = states;
    std::fill(states.begin(), states.end(), -7.0);
    std::fill(scratch.begin(), scratch.end(), -7.0);
    CHECK(cuda::launch_stats(table, plan, rows, targets, nullptr) == cudaSuccess, "launch_stats on reused counters");
    CHECK(std::memcmp(first.data(), states.data(), first.size() * sizeof(double)) == 0,
          "a launch on reused counters changed the bits");
  }
  std::vector<State<double>> out;
  for (int64_t r = 0; r < rows; ++r) out.push_back(core::load_state(states.data() + r * core::kNumStateColumns));
  return out;
}

// accumulate_instance_stats as csrc/torch/cuda_ops.cpp runs it: the items of `v` folded, in the same
// launch, into accumulator row 1 of 2, which already holds one instance (mean 0.5, max 100).
// Returns row 1, after checking that row 0 is untouched and every row was counted.
std::vector<double> fold_instances(StridedView v) {
  const cuda::LaunchPlan plan = cuda::plan_launch(&v, 1);
  const int64_t chunks = plan.total_chunks;
  cuda::ViewTable table;
  table.num = 1;
  table.inline_views[0] = v;
  std::vector<double> scratch(chunks * core::kNumStateColumns), instance_rows(v.items * core::kNumStats);
  std::vector<double> acc(2 * core::kNumAccColumns, 0.0);
  acc[core::kNumAccColumns + core::aInstances] = 1;
  acc[core::kNumAccColumns + core::aSumMean] = 0.5;
  acc[core::kNumAccColumns + core::aMaxAbs] = 100;
  std::vector<unsigned> counters(v.items + 1, 0u);
  cuda::StatsTargets targets;
  targets.out_stats = instance_rows.data();
  targets.correction = 1;
  targets.acc_row = acc.data() + core::kNumAccColumns;
  CHECK(cuda::launch_stats(table, plan, v.items, targets, nullptr) == cudaErrorInvalidValue,
        "a fold without scratch is refused");
  targets.chunk_states = scratch.data();
  targets.counters = counters.data();
  CHECK(cuda::launch_stats(table, plan, v.items, targets, nullptr) == cudaSuccess, "fold");
  for (int k = 0; k < core::kNumAccColumns; ++k) CHECK(acc[k] == 0.0, "the fold wrote accumulator row 0");
  for (int64_t r = 0; r <= v.items; ++r) CHECK(counters[r] == 0u, "the fold left counter %lld at %u", static_cast<long long>(r), counters[r]);
  return std::vector<double>(acc.begin() + core::kNumAccColumns, acc.end());
}

template <typename T>
void expect_view(const StridedView& v, const std::string& what, double rtol = 1e-5) {
  const auto got = run({v}, v.items);
  for (int64_t b = 0; b < v.items; ++b) {
    expect_state(got[b], reference(values_of<T>(v, b)), rtol, (what + ", item " + std::to_string(b)).c_str());
  }
}

template <typename T>
std::vector<T> random_values(size_t n, float mean, float std, unsigned seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(mean, std);
  std::vector<T> xs(n);
  for (auto& x : xs) x = from_float<T>(d(g));
  return xs;
}

template <typename T>
void test_dtype(const char* name, double rtol) {
  // One item: empty, tiny, chunk-sized, several chunks, many chunks (merged by the last group),
  // and a misaligned start (scalar head before the 16-byte loads).
  const auto xs = random_values<T>(65536 * 9 + 100, 3.f, 2.f, 1);
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(37), int64_t(65536), int64_t(65536 * 2 + 77), int64_t(65536 * 9 + 3)}) {
    expect_view<T>(view(xs.data(), {n}, {1}), std::string(name) + " contiguous " + std::to_string(n), rtol);
  }
  expect_view<T>(view(xs.data() + 1, {70001}, {1}), std::string(name) + " misaligned", rtol);
  // Strided and expanded layouts: a column slice of a [300, 70] matrix, and a stride-0 repeat.
  expect_view<T>(view(xs.data(), {300, 35}, {70, 2}), std::string(name) + " strided", rtol);
  expect_view<T>(view(xs.data() + 3, {5, 33}, {40, 1}, 1, 0, 4), std::string(name) + " expanded", rtol);
}

void test_instances() {
  // Many short rows: a warp per chunk (>= 2048 chunks of <= 8192 elements), each row written by its warp.
  const auto xs = random_values<float>(2100 * 40, -1.f, 5.f, 2);
  expect_view<float>(view(xs.data(), {37}, {1}, 2100, 40), "2100 rows of 37 (warp per chunk)");
  // Transposed rows (strided inside each item) and few long rows (a block per chunk).
  expect_view<float>(view(xs.data(), {40}, {2100}, 2100, 1), "2100 transposed rows of 40 (warp per chunk)");
  expect_view<float>(view(xs.data(), {28000}, {1}, 3, 28000), "3 rows of 28000 (block per chunk)");
  // Packed rows of 37: most rows start off a 16-byte boundary (scalar head, then vectors).
  expect_view<float>(view(xs.data(), {37}, {1}, 2100, 37), "2100 packed rows of 37 (misaligned starts)");
  const auto bs = random_values<__nv_bfloat16>(2100 * 41, 2.f, 1.f, 11);
  expect_view<__nv_bfloat16>(view(bs.data(), {41}, {1}, 2100, 41), "2100 packed bfloat16 rows of 41");
}

void test_accuracy() {
  // Cancellation: mean 1e4 with std 1e-2, in a block per chunk and in a warp per chunk.
  auto xs = random_values<float>(2100 * 64, 1e4f, 1e-2f, 10);
  expect_view<float>(view(xs.data(), {2100 * 64}, {1}), "cancellation, block per chunk", 1e-6);
  expect_view<float>(view(xs.data(), {64}, {1}, 2100, 64), "cancellation, warp per chunk", 1e-6);
  // Outliers that are the first element a thread sees: its first group is shifted by the outlier,
  // so the float sums carry about kGroup * eps * sum (x - shift)^2, a few 1e-6 of M2.
  for (size_t i = 0; i < xs.size(); i += 64) xs[i] = 0.f;
  expect_view<float>(view(xs.data(), {2100 * 64}, {1}), "outliers, block per chunk", 1e-5);
  expect_view<float>(view(xs.data(), {64}, {1}, 2100, 64), "outliers, warp per chunk", 1e-5);
}

void test_many_views_and_special_values() {
  // More views than travel inline: mixed dtypes and sizes, one empty, read through an uploaded table.
  const auto f = random_values<float>(200000, 0.5f, 1.f, 3);
  const auto h = random_values<__half>(5000, -2.f, 0.1f, 4);
  const auto b = random_values<__nv_bfloat16>(5000, 100.f, 3.f, 5);
  const auto d = random_values<double>(5000, 1e3f, 1e-3f, 6);
  std::vector<StridedView> views;
  std::vector<std::vector<double>> want;
  for (int i = 0; i < 12; ++i) {
    StridedView v;
    switch (i % 4) {
      case 0: v = view(f.data() + i, {int64_t(i) * 15000}, {1}); break;
      case 1: v = view(h.data() + i, {int64_t(i) * 300 + 1}, {1}); break;
      case 2: v = view(b.data(), {int64_t(i) * 100}, {3}); break;
      default: v = view(d.data() + i, {int64_t(i) * 400}, {1}); break;
    }
    v.out_row = i;
    views.push_back(v);
  }
  for (bool upload : {false, true}) {
    std::vector<StridedView> vs(views.begin(), views.begin() + (upload ? 12 : cuda::kInlineViews));
    const auto got = run(vs, static_cast<int64_t>(vs.size()), upload);
    for (size_t i = 0; i < vs.size(); ++i) {
      std::vector<double> values;
      switch (i % 4) {
        case 0: values = values_of<float>(vs[i], 0); break;
        case 1: values = values_of<__half>(vs[i], 0); break;
        case 2: values = values_of<__nv_bfloat16>(vs[i], 0); break;
        default: values = values_of<double>(vs[i], 0); break;
      }
      expect_state(got[i], reference(values), 1e-5, (std::string(upload ? "uploaded" : "inline") + " view " +
                                                       std::to_string(i)).c_str());
    }
  }
  // NaN and Inf propagate and are counted; finite values above ~1e19 overflow float sums and are
  // redone in double, in both chunk shapes.
  auto special = random_values<float>(70000, 0.f, 1.f, 7);
  special[100] = NAN;
  special[65600] = INFINITY;
  expect_view<float>(view(special.data(), {70000}, {1}), "NaN and Inf");
  auto big = random_values<float>(2100 * 8, 0.f, 1.f, 8);
  for (auto& x : big) x *= 3e20f;
  expect_view<float>(view(big.data(), {2100 * 8}, {1}), "overflow, block per chunk", 1e-9);
  expect_view<float>(view(big.data(), {8}, {1}, 2100, 8), "overflow, warp per chunk", 1e-9);
}

void test_state_launchers() {
  // merge_states over parts, finalize_states, and the per-instance accumulator.
  const auto xs = random_values<float>(3000, 7.f, 2.f, 9);
  std::vector<StridedView> parts = {view(xs.data(), {1000}, {1}), view(xs.data() + 1000, {0}, {1}),
                                    view(xs.data() + 1000, {2000}, {1})};
  for (int i = 0; i < 3; ++i) parts[i].out_row = i;
  const auto states = run(parts, 3);
  std::vector<double> rows(3 * core::kNumStateColumns), merged(core::kNumStateColumns);
  for (int i = 0; i < 3; ++i) core::store_state(states[i], rows.data() + i * core::kNumStateColumns);
  CHECK(cuda::launch_merge_states(rows.data(), 3, 1, merged.data(), nullptr) == cudaSuccess, "merge_states");
  std::vector<double> all(xs.begin(), xs.end());
  expect_state(core::load_state(merged.data()), reference(all), 1e-6, "merge_states of pieces");
  double stats[core::kNumStats];
  CHECK(cuda::launch_finalize_states(merged.data(), 1, 1, stats, nullptr) == cudaSuccess, "finalize_states");
  const State<double> want = reference(all);
  CHECK(close(stats[core::kVar], want.m2 / (want.count - 1), 1e-5), "finalize var %g", stats[core::kVar]);

  // The per-instance fold of accumulate_instance_stats, in the same launch: 3 instances of a
  // [3, 70000] tensor (two chunks each), folded into an accumulator row that already holds one.
  const auto big = random_values<float>(3 * 70000, -2.f, 3.f, 12);
  const StridedView instances = view(big.data(), {70000}, {1}, 3, 70000);
  const std::vector<double> acc = fold_instances(instances);
  double want_acc[core::kNumAccColumns] = {1, 0.5, 0, 0, 0, 100};
  for (int b = 0; b < 3; ++b) {
    double row[core::kNumStats];
    core::finalize(reference(values_of<float>(instances, b)), 1, row);
    core::accumulate_instance(row, want_acc);
  }
  for (int k = 0; k < core::kNumAccColumns; ++k) {
    CHECK(close(acc[k], want_acc[k], 1e-6), "fold column %d: %g, want %g", k, acc[k], want_acc[k]);
  }

  // 2100 short rows ([B*T, d] activations): a warp per chunk, and the fold shared by the 32 lanes of
  // the warp that writes the last row, their parts combined over the shuffle tree.
  const auto many = random_values<float>(2100 * 37, -1.f, 2.f, 13);
  const StridedView short_rows = view(many.data(), {37}, {1}, 2100, 37);
  const std::vector<double> acc_many = fold_instances(short_rows);
  double want_many[core::kNumAccColumns] = {1, 0.5, 0, 0, 0, 100};
  for (int b = 0; b < 2100; ++b) {
    double row[core::kNumStats];
    core::finalize(reference(values_of<float>(short_rows, b)), 1, row);
    core::accumulate_instance(row, want_many);
  }
  for (int k = 0; k < core::kNumAccColumns; ++k) {
    CHECK(close(acc_many[k], want_many[k], 1e-6), "fold of 2100 rows, column %d: %g, want %g", k, acc_many[k], want_many[k]);
  }
}

// The same launch under the in-order schedule and under shuffled, interleaved block schedules
// (and shuffled fiber order inside blocks) must give the same bits: nothing may depend on which
// block finishes first.
void expect_schedule_independent(const std::vector<StridedView>& views, int64_t rows, bool upload, const char* what) {
  gapmon_emu_set_schedule(0);
  const auto want = run(views, rows, upload);
  for (unsigned seed : {1u, 2u, 3u}) {
    gapmon_emu_set_schedule(seed);
    const auto got = run(views, rows, upload);
    CHECK(std::memcmp(got.data(), want.data(), sizeof(State<double>) * want.size()) == 0,
          "%s: block schedule %u changes the result bits", what, seed);
  }
  gapmon_emu_set_schedule(0);
}

void test_schedule_independence() {
  // The shapes of a GPT-2 layer list, scaled down: square and tall matrices, a bias, a long item
  // (merged by whichever block finishes its last chunk), one element and an empty tensor, plus a bfloat16 one.
  const auto f = random_values<float>(65536 * 10, 0.02f, 1.f, 21);
  const auto b = random_values<__nv_bfloat16>(20000, -3.f, 0.5f, 22);
  std::vector<StridedView> views = {view(f.data(), {96 * 96}, {1}), view(f.data() + 5, {384, 96}, {96, 1}),
                                    view(f.data() + 7, {96}, {1}), view(f.data(), {65536 * 9 + 1000}, {1}),
                                    view(f.data() + 3, {1}, {1}), view(f.data(), {0}, {1}),
                                    view(b.data(), {128 * 96}, {1})};
  for (size_t i = 0; i < views.size(); ++i) views[i].out_row = static_cast<int64_t>(i);
  expect_schedule_independent(views, static_cast<int64_t>(views.size()), false, "7 mixed tensors, inline table");
  expect_schedule_independent(views, static_cast<int64_t>(views.size()), true, "7 mixed tensors, uploaded table");
  // Many short rows: a warp per chunk.
  expect_schedule_independent({view(f.data(), {37}, {1}, 2100, 37)}, 2100, false, "2100 rows of 37");
  // A tensor's bits do not depend on the other tensors of the call: 2100 short rows (read by warps)
  // and a long tensor (by blocks), each alone and together in one list (two launches).
  {
    const StridedView rows_view = view(f.data(), {37}, {1}, 2100, 37), long_view = view(f.data(), {65536 * 2 + 9}, {1});
    std::vector<StridedView> alone_rows{rows_view}, alone_long{long_view}, both{long_view, rows_view};
    alone_rows[0].out_row = 0;
    alone_long[0].out_row = 0;
    both[0].out_row = 0;
    both[1].out_row = 1;
    const auto a = run(alone_rows, 2100), b = run(alone_long, 1);
    both[1].out_row = 1;
    const auto together = run(both, 2101);
    CHECK(std::memcmp(&together[0], &b[0], sizeof(State<double>)) == 0, "the long tensor's bits change in a list");
    CHECK(std::memcmp(&together[1], &a[0], sizeof(State<double>) * 2100) == 0, "the short rows' bits change in a list");
  }
  // A few rows of several chunks each, merged in the launch.
  expect_schedule_independent({view(f.data(), {65536 * 3 + 5}, {1}, 3, 65536 * 3 + 5)}, 3, false, "3 rows of 3 chunks");
  // The instance fold, by whichever group writes the last row: 2100 rows of one chunk (a warp per
  // chunk) and 3 rows of 3 chunks.
  for (const StridedView& v : {view(f.data(), {37}, {1}, 2100, 37), view(f.data(), {65536 * 3 + 5}, {1}, 3, 65536 * 3 + 5)}) {
    gapmon_emu_set_schedule(0);
    const auto want = fold_instances(v);
    for (unsigned seed : {1u, 2u, 3u}) {
      gapmon_emu_set_schedule(seed);
      const auto got = fold_instances(v);
      CHECK(std::memcmp(got.data(), want.data(), sizeof(double) * want.size()) == 0,
            "fold of %lld rows: block schedule %u changes the result bits", static_cast<long long>(v.items), seed);
    }
  }
  gapmon_emu_set_schedule(0);
}

}  // namespace

int main() {
  test_schedule_independence();
  test_dtype<float>("float32", 1e-5);
  test_dtype<__nv_bfloat16>("bfloat16", 1e-5);
  test_dtype<__half>("float16", 1e-5);
  test_dtype<double>("float64", 1e-12);
  test_instances();
  test_accuracy();
  test_many_views_and_special_values();
  test_state_launchers();
  if (failures) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("all emulated CUDA kernel checks passed\n");
  return 0;
}
