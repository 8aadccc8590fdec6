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

#include "../../csrc/core/group_acc.h"
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
  float out[core::kNumStats];
  core::finalize(State<double>(), 1, out);
  CHECK(out[core::kCount] == 0 && std::isnan(out[core::kMean]) && std::isnan(out[core::kVar]) &&
            out[core::kMaxAbs] == 0 && out[core::kNorm] == 0,
        "empty finalize");
  core::finalize(fold({3.0}, 1), 1, out);
  CHECK(std::isnan(out[core::kVar]) && out[core::kMean] == 3.0f, "single element var must be NaN with correction 1");
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

// block_merge of the CUDA kernels: a __shfl_down_sync tree within each warp (lane i merges lane
// i + delta; lanes past the end keep their own value, as the hardware does), then the same tree
// over the warps' results.
static State<double> replay_block_merge(std::vector<State<double>> s) {
  auto warp_tree = [](State<double>* lanes) {
    for (int delta = 16; delta > 0; delta >>= 1) {
      State<double> next[32];
      for (int i = 0; i < 32; ++i) next[i] = core::merge(lanes[i], i + delta < 32 ? lanes[i + delta] : lanes[i]);
      for (int i = 0; i < 32; ++i) lanes[i] = next[i];
    }
  };
  State<double> warp0[32];
  const int warps = static_cast<int>(s.size()) / 32;
  for (int w = 0; w < warps; ++w) {
    warp_tree(&s[w * 32]);
    warp0[w] = s[w * 32];
  }
  for (int i = warps; i < 32; ++i) warp0[i] = State<double>();
  warp_tree(warp0);
  return warp0[0];
}

// Replays the CUDA chunk kernel on the host: `lanes` threads (a block of 256 or a warp of 32) walk
// the 16-byte vectors of a chunk in core::walk_vectors order (scalar tail), each with a
// GroupAccumulator in block precision block_t; reports whether any thread overflowed, as the
// kernel's __syncthreads_or / __any_sync does.
template <typename block_t>
static std::vector<State<double>> replay_cuda_threads(const float* p, int64_t len, int kThreads, bool& any_overflow) {
  constexpr int kPerVec = 4;
  const block_t largest = 3.40282346638528859812e+38f;
  const int64_t nvec = len / kPerVec;  // p is 16-byte aligned: no head
  std::vector<State<double>> states(kThreads);
  any_overflow = false;
  for (int t = 0; t < kThreads; ++t) {
    gapmon::core::GroupAccumulator<block_t> acc;
    gapmon::core::walk_vectors(
        nvec, t, kThreads, [&](int64_t v) { return v; },
        [&](int64_t v) {
          block_t xs[kPerVec];
          for (int k = 0; k < kPerVec; ++k) xs[k] = p[v * kPerVec + k];
          acc.push(xs, largest);
        });
    for (int64_t i = nvec * kPerVec + t; i < len; i += kThreads) acc.push(block_t(p[i]), largest);
    acc.flush();
    states[t] = acc.state;
    any_overflow = any_overflow || acc.overflow;
  }
  return states;
}

// Replays chunk_kernel for one chunk: the threads (redone in double, as the kernel does, when any
// overflowed), then block_merge (for a warp, replay_block_merge reduces to the warp tree). The
// device code runs the same core functions in this order.
static State<double> replay_cuda_chunk(const float* p, int64_t len, bool* redone = nullptr, int lanes = 256) {
  bool overflow = false, overflow_in_double = false;
  std::vector<State<double>> s = replay_cuda_threads<float>(p, len, lanes, overflow);
  if (overflow) s = replay_cuda_threads<double>(p, len, lanes, overflow_in_double);
  if (redone != nullptr) *redone = overflow;
  return replay_block_merge(s);
}

// Replays merge_long_items_kernel for one row: thread t merges chunks t, t + 256, ... in order,
// then the block tree merges the threads.
static State<double> replay_long_row_merge(const std::vector<State<double>>& chunks) {
  constexpr int kThreads = 256;
  std::vector<State<double>> s(kThreads);
  for (int t = 0; t < kThreads; ++t)
    for (size_t k = t; k < chunks.size(); k += kThreads) s[t] = core::merge(s[t], chunks[k]);
  return replay_block_merge(s);
}

static void test_cuda_strategy_on_host() {
  std::mt19937 g(5);
  std::normal_distribution<float> d(1e4f, 1e-2f);
  for (int lanes : {256, 32})
  for (bool outliers : {false, true}) {
    for (int64_t len : {int64_t(65536), int64_t(5000), int64_t(1000), int64_t(37), int64_t(1)}) {
      std::vector<float> xs(len + 4);
      float* p = xs.data();
      while (reinterpret_cast<uintptr_t>(p) % 16) ++p;
      for (int64_t i = 0; i < len; ++i) p[i] = d(g);
      // Outliers as the first element of thread 0's first group: that group is shifted by the
      // outlier, so its float sums carry an error of about kGroup * eps * sum (x - shift)^2,
      // a few 1e-6 of the chunk's M2 (within the 1e-5 the Python oracles allow).
      if (outliers)
        for (int64_t i = 0; i < len; i += 4096) p[i] = 0.f;
      std::vector<double> seen(p, p + len);
      const std::string what = "cuda replay, " + std::to_string(lanes) + " lanes, " + std::to_string(len) +
                               (outliers ? " elements with outliers" : " elements");
      bool redone = true;
      expect_state(replay_cuda_chunk(p, len, &redone, lanes), reference(seen), outliers ? 1e-5 : 1e-6, what.c_str());
      CHECK(!redone, "cuda replay: no overflow redo for ordinary values");
    }
  }
  std::vector<float> nan(4096, 1.f);
  nan[777] = NAN;
  State<double> s = replay_cuda_chunk(nan.data(), 4096);
  CHECK(std::isnan(s.max_abs) && std::isnan(s.mean) && s.nonfinite == 1, "cuda replay NaN");

  // Finite values whose squares overflow float32: the chunk is redone in double and stays exact.
  std::vector<float> big(8200);
  for (size_t i = 0; i < big.size(); ++i) big[i] = (i % 3 ? 3e20f : -1e19f) * (1.f + 1e-3f * float(i % 7));
  for (int lanes : {256, 32}) {
    bool redone = false;
    const State<double> b = replay_cuda_chunk(big.data(), int64_t(big.size()), &redone, lanes);
    CHECK(redone, "cuda replay: overflow detected");
    expect_state(b, reference(std::vector<double>(big.begin(), big.end())), 1e-9, "cuda replay, overflow redo");
  }
  bool redone = false;
  // A long row: 1,000 chunk states (uneven sizes, shifted means) merged in the kernel's order.
  std::vector<State<double>> chunks;
  std::vector<double> all;
  std::uniform_int_distribution<int> size(1, 40);
  for (int c = 0; c < 1000; ++c) {
    std::vector<double> part(size(g));
    for (double& x : part) x = d(g) + 0.5 * c;
    chunks.push_back(reference(part));
    all.insert(all.end(), part.begin(), part.end());
  }
  expect_state(replay_long_row_merge(chunks), reference(all), 1e-12, "cuda replay, long row merge");
  // An Inf element is non-finite, not an overflow: no redo, and the norm is Inf.
  big[5] = INFINITY;
  const State<double> inf = replay_cuda_chunk(big.data(), int64_t(big.size()), &redone);
  CHECK(!std::isfinite(inf.sumsq) && inf.nonfinite == 1, "cuda replay Inf");
}

int main() {
  test_merge_rules();
  test_cuda_strategy_on_host();
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
