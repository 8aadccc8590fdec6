// Runs the optimizer-update kernels of csrc/cuda/update_cuda.cu on the host emulator against long-double
// references: every weight and gradient dtype, parameters of one element, of none and of several chunks,
// the bits independent of the block schedule; and the CPU kernel (csrc/cpu/update_kernels.cpp) on the same
// data. No GPU and no torch needed.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "../../csrc/core/update_stats.h"
#include "../../csrc/cpu/update_kernels.h"
#include "../../csrc/cuda/update_cuda.h"
#include "checks.h"
#include "stored_values.h"

extern "C" cudaError_t cudaGetLastError(void) { return cudaSuccess; }
void gapmon_emu_set_update_schedule(unsigned seed);  // tests/cpp/update_cuda_emulated.cpp

namespace {

using core::DType;


// Values exact in every dtype: k / 128 with |k| < 256 (8 significant bits).
std::vector<float> values(int64_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int> k(-255, 255);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(k(rng)) / 128.0f;
  return v;
}

struct Param {
  std::vector<float> before, after, grad;
  std::vector<uint8_t> b, a, g;
};

void check_rows(const std::vector<Param>& params, const double* rows, const char* what) {
  for (size_t i = 0; i < params.size(); ++i) {
    long double dd = 0, ww = 0, gg = 0, dg = 0;
    for (size_t k = 0; k < params[i].before.size(); ++k) {
      const long double d = (long double)params[i].after[k] - params[i].before[k];
      dd += d * d, ww += (long double)params[i].before[k] * params[i].before[k];
      gg += (long double)params[i].grad[k] * params[i].grad[k], dg += d * params[i].grad[k];
    }
    const double* r = rows + i * core::kUpdateColumns;
    // Every product is exact in double and the sums small integers times 2^-14: exact in any order.
    CHECK(r[core::kUpdateSq] == (double)dd && r[core::kWeightSq] == (double)ww && r[core::kGradSq] == (double)gg &&
              r[core::kUpdateDotGrad] == (double)dg && r[core::kUpdateCount] == (double)params[i].before.size(),
          "%s: parameter %zu: got %g %g %g %g %g", what, i, r[0], r[1], r[2], r[3], r[4]);
  }
}

void test_dtypes(DType wdt, DType gdt, const char* what) {
  std::mt19937 rng(7);
  const int64_t sizes[] = {1, 0, 3 * core::kChunkElems + 17, 1000, core::kChunkElems};
  std::vector<Param> params;
  for (int64_t n : sizes) {
    Param p{values(n, rng), values(n, rng), values(n, rng), {}, {}, {}};
    p.b = store(p.before, wdt), p.a = store(p.after, wdt), p.g = store(p.grad, gdt);
    params.push_back(std::move(p));
  }
  std::vector<core::UpdateOperands> ops(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    ops[i].before = params[i].b.data(), ops[i].after = params[i].a.data(), ops[i].grad = params[i].g.data();
    ops[i].weight_dtype = wdt, ops[i].grad_dtype = gdt, ops[i].numel = static_cast<int64_t>(params[i].before.size());
  }
  const int64_t n = static_cast<int64_t>(ops.size());
  const int64_t total = core::plan_update_chunks(ops.data(), n);
  std::vector<double> chunk_sums(total * core::kUpdateSums, -7.0), rows(n * core::kUpdateColumns, -7.0);
  std::vector<double> first;
  for (unsigned seed : {0u, 3u, 11u}) {  // in order, then two shuffled, interleaved schedules
    gapmon_emu_set_update_schedule(seed);
    CHECK(gapmon::cuda::launch_update_sums(ops.data(), n, total, chunk_sums.data(), rows.data(), nullptr) == cudaSuccess,
          "%s: launch", what);
    check_rows(params, rows.data(), what);
    if (first.empty()) first = rows;
    CHECK(std::memcmp(first.data(), rows.data(), rows.size() * sizeof(double)) == 0, "%s: schedule %u changed the bits",
          what, seed);
  }
  gapmon_emu_set_update_schedule(0);
  // The CPU kernel, chunk by chunk as csrc/torch/stats_cpu.cpp runs it.
  std::vector<double> cpu_rows(n * core::kUpdateColumns);
  for (int64_t i = 0; i < n; ++i) {
    core::UpdateSums s;
    for (int64_t lo = 0; lo < ops[i].numel; lo += core::kChunkElems) {
      s.merge(gapmon::cpu::update_chunk(ops[i], lo, std::min(lo + core::kChunkElems, ops[i].numel)));
    }
    core::store_update_row(s, ops[i].numel, cpu_rows.data() + i * core::kUpdateColumns);
  }
  check_rows(params, cpu_rows.data(), what);
}

void test_refusals() {
  double out[core::kUpdateColumns];
  core::UpdateOperands op;
  CHECK(gapmon::cuda::launch_update_sums(&op, 1, 1, nullptr, out, nullptr) == cudaErrorInvalidValue,
        "a launch without chunk scratch is refused");
  CHECK(gapmon::cuda::launch_update_sums(&op, 0, 0, nullptr, out, nullptr) == cudaSuccess, "no parameters: nothing");
}

}  // namespace

int main() {
  const DType all[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16};
  const char* names[] = {"float32", "float64", "float16", "bfloat16"};
  for (int w = 0; w < 4; ++w) {
    for (int g = 0; g < 4; ++g) {
      const std::string what = std::string("weights ") + names[w] + ", gradient " + names[g];
      test_dtypes(all[w], all[g], what.c_str());
    }
  }
  test_refusals();
  if (failures) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("all emulated update-kernel checks passed\n");
  return 0;
}
