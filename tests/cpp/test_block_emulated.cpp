// Runs the per-block format kernels of csrc/cuda/block_cuda.cu on the host emulator against the CPU kernel
// (csrc/cpu/block_kernels.cpp, the same core math in another order): every format, every dtype, tensors of
// one row and of many, partial blocks, several chunks, an empty tensor; counts, minima and maxima equal,
// sums within 1e-12; the bits independent of the block schedule. No GPU and no torch needed.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "../../csrc/core/block_formats.h"
#include "../../csrc/core/numerics.h"
#include "../../csrc/cpu/block_kernels.h"
#include "../../csrc/cuda/block_cuda.h"
#include "../../csrc/cuda/numerics_cuda.h"
#include "checks.h"
#include "stored_values.h"

extern "C" cudaError_t cudaGetLastError(void) { return cudaSuccess; }
void gapmon_emu_set_block_schedule(unsigned seed);  // tests/cpp/block_cuda_emulated.cpp
void gapmon_emu_set_numerics_schedule(unsigned seed);  // tests/cpp/numerics_cuda_emulated.cpp
long long gapmon_emu_global_bytes_read();               // tests/cpp/numerics_cuda_emulated.cpp

namespace {

using core::BlockFormat;
using core::DType;


gapmon::cuda::BlockFormatList all_formats() {
  gapmon::cuda::BlockFormatList formats;
  formats.num = core::kNumBlockFormats;
  for (int f = 0; f < formats.num; ++f) formats.codes[f] = static_cast<BlockFormat>(f);
  return formats;
}

gapmon::cuda::BlockFormatList formats_of(std::initializer_list<BlockFormat> codes) {
  gapmon::cuda::BlockFormatList formats;
  for (BlockFormat f : codes) formats.codes[formats.num++] = f;
  return formats;
}

// Few enough formats for the fused pass to cast from the reader's vectors (block_rows.cuh): each pair of kinds.
const gapmon::cuda::BlockFormatList kReaderFormatSets[] = {
    formats_of({BlockFormat::kMxfp8E4m3}),
    formats_of({BlockFormat::kNvfp4, BlockFormat::kCurrentE5m2}),
    formats_of({BlockFormat::kMxfp4, BlockFormat::kMxfp8E5m2}),
    formats_of({BlockFormat::kCurrentE4m3, BlockFormat::kNvfp4}),
};

// The CPU kernel's rows of one tensor, chunk by chunk in order (as csrc/torch/numerics_cpu.cpp merges them),
// into dst ([formats.num, kNumBlockColumns]).
void cpu_rows(const core::BlockOperand& op, const gapmon::cuda::BlockFormatList& formats, double amax, double* dst) {
  std::vector<core::BlockRow> rows(formats.num);
  for (int64_t c = 0; c < core::block_chunks_for(op); ++c) {
    std::vector<core::BlockRow> part(formats.num);
    gapmon::cpu::block_chunk(op, c, formats.codes, formats.num, amax, part.data());
    for (int f = 0; f < formats.num; ++f) rows[f].merge(part[f]);
  }
  for (int f = 0; f < formats.num; ++f) std::memcpy(dst + f * core::kNumBlockColumns, rows[f].v, sizeof rows[f].v);
}

void run_case(DType dt, const char* what) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t shapes[][2] = {{1, 70}, {3, 33}, {0, 32}, {2100, 40}, {1, 65536 + 7}, {2, 16}};
  std::vector<std::vector<uint8_t>> data;
  std::vector<core::BlockOperand> ops;
  std::vector<double> amaxes;
  for (const auto& s : shapes) {
    std::vector<float> v(s[0] * s[1]);
    for (auto& x : v) x = normal(rng) * std::exp(3.0f * normal(rng));
    if (!v.empty()) v[v.size() / 2] = INFINITY;
    data.push_back(store(v, dt));
    core::BlockOperand op;
    op.dtype = dt, op.rows = s[0], op.cols = s[1];
    ops.push_back(op);
    double amax = 0;
    // The amax of the stored values: widen them back.
    for (int64_t k = 0; k < s[0] * s[1]; ++k) {
      double x;
      if (dt == DType::kFloat32) x = reinterpret_cast<const float*>(data.back().data())[k];
      else if (dt == DType::kFloat64) x = reinterpret_cast<const double*>(data.back().data())[k];
      else if (dt == DType::kBFloat16) x = core::widen(reinterpret_cast<const core::BF16*>(data.back().data())[k]);
      else x = core::widen(reinterpret_cast<const core::Half*>(data.back().data())[k]);
      if (std::isfinite(x) && std::fabs(x) > amax) amax = std::fabs(x);
    }
    amaxes.push_back(amax);
  }
  for (size_t i = 0; i < ops.size(); ++i) ops[i].data = data[i].data();
  const int64_t n = static_cast<int64_t>(ops.size());
  const int64_t total = core::plan_block_chunks(ops.data(), n);
  const gapmon::cuda::BlockFormatList formats = all_formats();
  const int64_t width = formats.num * core::kNumBlockColumns;
  std::vector<double> want(n * width);
  for (int64_t i = 0; i < n; ++i) cpu_rows(ops[i], formats, amaxes[i], want.data() + i * width);
  std::vector<double> chunk_rows(total * width, -7.0), got(n * width, -7.0), first;
  for (unsigned seed : {0u, 5u}) {
    gapmon_emu_set_block_schedule(seed);
    CHECK(gapmon::cuda::launch_block_numerics(ops.data(), n, total, formats, amaxes.data(), chunk_rows.data(),
                                              got.data(), nullptr) == cudaSuccess, "%s: launch", what);
    for (int64_t r = 0; r < n * formats.num; ++r) {
      for (int k = 0; k < core::kNumBlockColumns; ++k) {
        const double g = got[r * core::kNumBlockColumns + k], w = want[r * core::kNumBlockColumns + k];
        const bool sum = k == core::bErrorSq || k == core::bSignalSq;
        CHECK(sum ? close(g, w, 1e-12) : g == w, "%s: row %lld column %d: %g vs %g", what, static_cast<long long>(r), k, g, w);
      }
    }
    if (first.empty()) first = got;
    CHECK(std::memcmp(first.data(), got.data(), got.size() * sizeof(double)) == 0, "%s: schedule %u changed the bits",
          what, seed);
  }
  gapmon_emu_set_block_schedule(0);
}

// Runs `pass(fused, first, second, blocks)` without the block formats, then with them under two block schedules: its
// first two outputs (statistics and numerics) keep the bits of the pass without them, the block rows equal `want`
// (counts and extremes exactly, error and signal sums within 1e-12), and the schedules give the same bits.
template <typename Pass>
void check_fused_pass(const Pass& pass, const std::vector<double>& want, const char* what) {
  std::vector<double> plain_first, plain_second, unused;
  pass(false, plain_first, plain_second, unused);
  std::vector<double> bits;
  for (unsigned seed : {0u, 4u}) {
    gapmon_emu_set_numerics_schedule(seed);
    gapmon_emu_set_block_schedule(seed);
    std::vector<double> first, second, got;
    pass(true, first, second, got);
    CHECK(std::memcmp(first.data(), plain_first.data(), first.size() * sizeof(double)) == 0 &&
              std::memcmp(second.data(), plain_second.data(), second.size() * sizeof(double)) == 0,
          "%s: the block formats changed the statistics or the numerics", what);
    CHECK(got.size() == want.size(), "%s: %zu block values, want %zu", what, got.size(), want.size());
    for (size_t r = 0; r < want.size() && r < got.size(); ++r) {
      const int k = static_cast<int>(r % core::kNumBlockColumns);
      const bool sum = k == core::bErrorSq || k == core::bSignalSq;
      CHECK(sum ? close(got[r], want[r], 1e-12) : got[r] == want[r], "%s: block row %zu column %d: %g vs %g", what,
            r / core::kNumBlockColumns, k, got[r], want[r]);
    }
    if (bits.empty()) bits = got;
    CHECK(std::memcmp(bits.data(), got.data(), got.size() * sizeof(double)) == 0, "%s: schedule %u changed the bits",
          what, seed);
  }
  gapmon_emu_set_numerics_schedule(0);
  gapmon_emu_set_block_schedule(0);
}

// The fused pass (launch_stats_and_numerics with FusedBlocks, then launch_merge_fused_block_rows): the block
// rows of the CPU kernel (counts equal, sums within 1e-12) although the groups are taken per statistics chunk
// (a group straddling two chunks counted once, in the first), a tensor left out of the pass gets empty rows,
// and the statistics states and numerics rows have the bits of the pass without block formats; the same bits
// under shuffled block schedules.
// Rows of a multiple of 32 (several chunks, a short last chunk) are cast from the reader's vectors when the launch
// has at most two formats, the others after the read.
void run_fused_case(DType dt, const gapmon::cuda::BlockFormatList& formats, const char* what) {
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // (the reader casts rows of a multiple of 32: a tensor of three such chunks for it, a straddling group otherwise)
  const bool reader = formats.num <= 2;
  const int64_t shapes[][2] = {{1, 70}, {3, 33}, {0, 32},  {2100, 40}, {1, reader ? 2 * 65536 + 96 : 65536 + 7},
                               {2, 16}, {40, 64}, {5, 64}};
  const int64_t n = sizeof shapes / sizeof shapes[0];
  const int64_t left_out = n - 1;  // as a non-contiguous tensor: cast by the block kernel, not in the pass
  std::vector<std::vector<uint8_t>> data;
  std::vector<core::BlockOperand> ops(n);
  std::vector<core::StridedView> views(n);
  std::vector<double> amaxes(n, 3.5);
  for (int64_t i = 0; i < n; ++i) {
    std::vector<float> v(shapes[i][0] * shapes[i][1]);
    for (auto& x : v) x = normal(rng) * std::exp(3.0f * normal(rng));
    if (v.size() > 2) v[v.size() / 3] = INFINITY;
    data.push_back(store(v, dt));
    const int64_t numel = static_cast<int64_t>(v.size());
    core::StridedView& view = views[i];
    view.data = data.back().data(), view.dtype = dt, view.out_row = i, view.item_numel = numel;
    view.ndim = numel == 0 ? 0 : 1, view.sizes[0] = numel, view.strides[0] = 1;
  }
  const gapmon::cuda::LaunchPlan plan = gapmon::cuda::plan_launch(views.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    ops[i].dtype = dt;
    if (i != left_out) ops[i].data = views[i].data, ops[i].rows = shapes[i][0], ops[i].cols = shapes[i][1];
    ops[i].first_chunk = views[i].first_chunk;
  }
  const int64_t width = formats.num * core::kNumBlockColumns;
  std::vector<double> want(n * width);
  for (int64_t i = 0; i < n; ++i) {
    core::BlockOperand whole = ops[i];  // the tensor left out of the pass: empty rows there
    if (i != left_out) whole.data = views[i].data, whole.rows = shapes[i][0], whole.cols = shapes[i][1];
    cpu_rows(whole, formats, amaxes[i], want.data() + i * width);
  }
  gapmon::cuda::ViewTable table;
  table.num = n;
  for (int64_t i = 0; i < n; ++i) table.inline_views[i] = views[i];
  auto pass = [&](bool fused, std::vector<double>& states, std::vector<double>& numerics, std::vector<double>& blocks) {
    std::vector<double> chunk_states(plan.total_chunks * core::kNumStateColumns, -7.0);
    std::vector<double> chunk_numerics(plan.total_chunks * core::kNumNumericsColumns, -7.0);
    std::vector<double> chunk_rows(plan.total_chunks * width, -7.0);
    std::vector<unsigned> counters(n + 1, 0u);
    states.assign(n * core::kNumStateColumns, -7.0), numerics.assign(n * core::kNumNumericsColumns, -7.0);
    blocks.assign(n * width, -7.0);
    gapmon::cuda::StatsTargets stats;
    stats.out_states = states.data(), stats.chunk_states = chunk_states.data(), stats.counters = counters.data();
    gapmon::cuda::NumericsTargets targets;
    targets.out = numerics.data(), targets.chunk_rows = chunk_numerics.data();
    gapmon::cuda::FusedBlocks fused_blocks;
    if (fused) {
      fused_blocks.ops = ops.data(), fused_blocks.formats = formats, fused_blocks.amaxes = amaxes.data();
      fused_blocks.chunk_rows = chunk_rows.data();
    }
    CHECK(gapmon::cuda::launch_stats_and_numerics(table, plan, n, stats, targets, nullptr, fused_blocks) == cudaSuccess,
          "%s: fused launch", what);
    if (fused) {
      CHECK(gapmon::cuda::launch_merge_fused_block_rows(ops.data(), n, formats.num, chunk_rows.data(), blocks.data(),
                                                        nullptr) == cudaSuccess, "%s: merge launch", what);
    }
  };
  check_fused_pass(pass, want, what);
}

// An activation's hook in one read (launch_stats_and_numerics with merge_items and FusedBlocks, then
// launch_accumulate_fused_block_rows): x's instances are whole rows of its operand, so the groups of every instance's
// chunks are cast once; the merged rows equal the CPU kernel's rows of the whole tensor merged into the rows the
// table held (counts equal, sums within 1e-12), the instance fold and numerics row keep the bits of the pass without
// block formats, and shuffled block schedules give the same bits. Instances of two chunks each (a group straddles
// the chunk boundary), rows of 33 (a short last group), and single-row instances.
void run_fused_instances_case(DType dt, const gapmon::cuda::BlockFormatList& formats, const char* what) {
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // instances, rows each, cols: rows of a multiple of 32 are cast from the reader's vectors (at most two formats;
  // instances of two such chunks then)
  const int64_t shapes[][3] = {{2, 1700, 40}, {3, 5, 33}, {4, 1, 64}, {2, formats.num <= 2 ? 1100 : 1, 64}};
  const int64_t width = formats.num * core::kNumBlockColumns;
  for (const auto& shape : shapes) {
    const int64_t items = shape[0], item_numel = shape[1] * shape[2];
    std::vector<float> v(items * item_numel);
    for (auto& x : v) x = normal(rng) * std::exp(3.0f * normal(rng));
    v[v.size() / 3] = INFINITY;
    const std::vector<uint8_t> data = store(v, dt);
    core::StridedView view;
    view.data = data.data(), view.dtype = dt, view.out_row = 0, view.item_numel = item_numel;
    view.items = items, view.item_stride = item_numel;
    view.ndim = 1, view.sizes[0] = item_numel, view.strides[0] = 1;
    const gapmon::cuda::LaunchPlan plan = gapmon::cuda::plan_launch(&view, 1);
    CHECK(plan.warp_chunks == 0, "%s: instances of %lld elements are read by blocks", what, static_cast<long long>(item_numel));
    core::BlockOperand op;
    op.dtype = dt, op.data = data.data(), op.rows = items * shape[1], op.cols = shape[2], op.first_chunk = 0;
    const double amax = 2.5;
    // What the table row held (another tensor's rows), then the whole tensor's rows by the CPU kernel merged in.
    std::vector<double> held(width), fresh(width), want(width);
    std::vector<float> earlier(96);
    for (auto& x : earlier) x = normal(rng);
    const std::vector<uint8_t> earlier_data = store(earlier, dt);
    core::BlockOperand earlier_op;
    earlier_op.dtype = dt, earlier_op.data = earlier_data.data(), earlier_op.rows = 3, earlier_op.cols = 32;
    cpu_rows(earlier_op, formats, amax, held.data());
    cpu_rows(op, formats, amax, fresh.data());
    for (int f = 0; f < formats.num; ++f) {
      core::BlockRow h, r;
      std::memcpy(h.v, held.data() + f * core::kNumBlockColumns, sizeof h.v);
      std::memcpy(r.v, fresh.data() + f * core::kNumBlockColumns, sizeof r.v);
      h.merge(r);
      std::memcpy(want.data() + f * core::kNumBlockColumns, h.v, sizeof h.v);
    }
    gapmon::cuda::ViewTable table;
    table.num = 1;
    table.inline_views[0] = view;
    auto pass = [&](bool fused, std::vector<double>& acc, std::vector<double>& numerics, std::vector<double>& blocks) {
      std::vector<double> chunk_states(plan.total_chunks * core::kNumStateColumns, -7.0);
      std::vector<double> chunk_numerics(plan.total_chunks * core::kNumNumericsColumns, -7.0);
      std::vector<double> chunk_rows(plan.total_chunks * width, -7.0), rows(items * core::kNumStats, -7.0);
      std::vector<unsigned> counters(items + 1, 0u);
      acc.assign(core::kNumAccColumns, 0.0), numerics.assign(core::kNumNumericsColumns, 0.0), blocks = held;
      gapmon::cuda::StatsTargets stats;
      stats.out_stats = rows.data(), stats.correction = 1, stats.acc_row = acc.data();
      stats.chunk_states = chunk_states.data(), stats.counters = counters.data();
      gapmon::cuda::NumericsTargets targets;
      targets.out = numerics.data(), targets.chunk_rows = chunk_numerics.data();
      targets.accumulate = true, targets.merge_items = true;
      gapmon::cuda::FusedBlocks fused_blocks;
      if (fused) {
        fused_blocks.ops = &op, fused_blocks.formats = formats, fused_blocks.amaxes = &amax;
        fused_blocks.chunk_rows = chunk_rows.data();
      }
      CHECK(gapmon::cuda::launch_stats_and_numerics(table, plan, items, stats, targets, nullptr, fused_blocks) ==
                cudaSuccess, "%s: launch", what);
      if (fused) {
        CHECK(gapmon::cuda::launch_accumulate_fused_block_rows(chunk_rows.data(), plan.total_chunks, formats.num,
                                                               blocks.data(), nullptr) == cudaSuccess,
              "%s: merge launch", what);
      }
    };
    const std::string label = std::string(what) + " [" + std::to_string(shape[0]) + ", " + std::to_string(shape[1]) + ", " +
                              std::to_string(shape[2]) + "]";
    check_fused_pass(pass, want, label.c_str());
  }
}

// The fused pass reads each element of a tensor whose groups lie whole in the reader's vectors once: as many bytes
// through __ldg as the pass without block formats (the emulator counts them), while with more formats than the
// reader casts, or FusedBlocks::in_reader off, the groups are read again. A finite tensor, so that no chunk is read again in double.
void check_one_read(DType dt, const char* what) {
  std::mt19937 rng(19);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(600 * 64);
  for (auto& x : v) x = normal(rng);
  const std::vector<uint8_t> data = store(v, dt);
  core::StridedView view;
  view.data = data.data(), view.dtype = dt, view.item_numel = static_cast<int64_t>(v.size());
  view.ndim = 1, view.sizes[0] = view.item_numel, view.strides[0] = 1;
  const gapmon::cuda::LaunchPlan plan = gapmon::cuda::plan_launch(&view, 1);
  core::BlockOperand op;
  op.dtype = dt, op.data = data.data(), op.rows = 600, op.cols = 64, op.first_chunk = 0;
  gapmon::cuda::ViewTable table;
  table.num = 1;
  table.inline_views[0] = view;
  const double amax = 4.0;
  auto bytes_read = [&](const gapmon::cuda::BlockFormatList* formats, bool in_reader = true) {
    std::vector<double> states(core::kNumStateColumns), numerics(core::kNumNumericsColumns);
    std::vector<double> chunk_states(plan.total_chunks * core::kNumStateColumns);
    std::vector<double> chunk_numerics(plan.total_chunks * core::kNumNumericsColumns);
    std::vector<double> chunk_rows(plan.total_chunks * core::kNumBlockFormats * core::kNumBlockColumns);
    std::vector<unsigned> counters(2, 0u);
    gapmon::cuda::StatsTargets stats;
    stats.out_states = states.data(), stats.chunk_states = chunk_states.data(), stats.counters = counters.data();
    gapmon::cuda::NumericsTargets targets;
    targets.out = numerics.data(), targets.chunk_rows = chunk_numerics.data();
    gapmon::cuda::FusedBlocks fused;
    if (formats != nullptr) fused.ops = &op, fused.formats = *formats, fused.amaxes = &amax, fused.chunk_rows = chunk_rows.data();
    fused.in_reader = in_reader;
    const long long before = gapmon_emu_global_bytes_read();
    CHECK(gapmon::cuda::launch_stats_and_numerics(table, plan, 1, stats, targets, nullptr, fused) == cudaSuccess,
          "%s: launch", what);
    return gapmon_emu_global_bytes_read() - before;
  };
  const long long plain = bytes_read(nullptr), tensor = static_cast<long long>(data.size());
  CHECK(plain == tensor, "%s: the plain pass read %lld bytes of a %lld-byte tensor", what, plain, tensor);
  for (const auto& formats : kReaderFormatSets) {
    const long long fused = bytes_read(&formats);
    CHECK(fused == plain, "%s: the fused pass with %d format(s) read %lld bytes, the plain pass %lld", what, formats.num,
          fused, plain);
  }
  const long long asked = bytes_read(&kReaderFormatSets[0], false);
  CHECK(asked == 2 * plain, "%s: asked to read each chunk again, the fused pass read %lld bytes, want %lld", what, asked,
        2 * plain);
  const gapmon::cuda::BlockFormatList six = all_formats();
  const long long reread = bytes_read(&six);
  CHECK(reread == plain * (1 + six.num), "%s: with six formats each group is read again per format: %lld bytes, want %lld",
        what, reread, plain * (1 + six.num));
}

}  // namespace

int main() {
  check_one_read(DType::kFloat32, "one read float32");
  check_one_read(DType::kBFloat16, "one read bfloat16");
  check_one_read(DType::kFloat16, "one read float16");
  const gapmon::cuda::BlockFormatList six = all_formats();
  // The re-read path with every format (float16 takes bfloat16's 16-bit path there; it is run through the reader's
  // cast below and through the block kernel).
  run_fused_instances_case(DType::kFloat32, six, "instances float32");
  run_fused_instances_case(DType::kFloat64, six, "instances float64");
  run_fused_instances_case(DType::kBFloat16, six, "instances bfloat16");
  run_fused_case(DType::kFloat32, six, "fused float32");
  run_fused_case(DType::kFloat64, six, "fused float64");
  run_fused_case(DType::kBFloat16, six, "fused bfloat16");
  int set = 0;
  for (const auto& formats : kReaderFormatSets) {  // each set on one 32-bit and one 16-bit dtype, in turn
    const std::string n = std::to_string(formats.num) + " format(s), first " +
                          std::to_string(static_cast<int>(formats.codes[0]));
    const bool odd = set++ % 2 == 1;
    run_fused_case(odd ? DType::kBFloat16 : DType::kFloat32, formats, ("fused, " + n).c_str());
    run_fused_instances_case(odd ? DType::kFloat32 : DType::kFloat16, formats, ("instances, " + n).c_str());
  }
  run_case(DType::kFloat32, "float32");
  run_case(DType::kFloat64, "float64");
  run_case(DType::kBFloat16, "bfloat16");
  run_case(DType::kFloat16, "float16");
  core::BlockOperand op;
  gapmon::cuda::BlockFormatList none;
  double out[core::kNumBlockColumns];
  CHECK(gapmon::cuda::launch_block_numerics(&op, 1, 1, none, nullptr, out, out, nullptr) == cudaErrorInvalidValue,
        "a launch without formats is refused");
  if (failures) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("all emulated block-format checks passed\n");
  return 0;
}
