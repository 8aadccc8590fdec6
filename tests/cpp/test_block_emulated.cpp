// Runs the per-block format kernels of csrc/cuda/block_cuda.cu on the host emulator against the CPU kernel
// (csrc/cpu/block_kernels.cpp, the same core math in another order): every format, every dtype, tensors of
// one row and of many, partial blocks, several chunks, an empty tensor; counts, minima and maxima equal,
// sums within 1e-12; the bits independent of the block schedule. No GPU and no torch needed.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "../../csrc/core/block_formats.h"
#include "../../csrc/cpu/block_kernels.h"
#include "../../csrc/cuda/block_cuda.h"
#include "checks.h"
#include "stored_values.h"

extern "C" cudaError_t cudaGetLastError(void) { return cudaSuccess; }
void gapmon_emu_set_block_schedule(unsigned seed);  // tests/cpp/block_cuda_emulated.cpp

namespace {

using core::BlockFormat;
using core::DType;


void run_case(DType dt, const char* what) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t shapes[][2] = {{1, 70}, {3, 33}, {0, 32}, {4100, 40}, {1, 3 * 65536 + 7}, {2, 16}};
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
  gapmon::cuda::BlockFormatList formats;
  formats.num = core::kNumBlockFormats;
  for (int f = 0; f < formats.num; ++f) formats.codes[f] = static_cast<BlockFormat>(f);
  const int64_t width = formats.num * core::kNumBlockColumns;
  // The CPU kernel, chunk by chunk in order, as csrc/torch/numerics_cpu.cpp merges them.
  std::vector<double> want(n * width);
  for (int64_t i = 0; i < n; ++i) {
    std::vector<core::BlockRow> rows(formats.num);
    for (int64_t c = 0; c < core::block_chunks_for(ops[i]); ++c) {
      std::vector<core::BlockRow> part(formats.num);
      gapmon::cpu::block_chunk(ops[i], c, formats.codes, formats.num, amaxes[i], part.data());
      for (int f = 0; f < formats.num; ++f) rows[f].merge(part[f]);
    }
    for (int f = 0; f < formats.num; ++f) {
      std::memcpy(want.data() + i * width + f * core::kNumBlockColumns, rows[f].v, sizeof rows[f].v);
    }
  }
  std::vector<double> chunk_rows(total * width, -7.0), got(n * width, -7.0), first;
  for (unsigned seed : {0u, 5u, 9u}) {
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

}  // namespace

int main() {
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
