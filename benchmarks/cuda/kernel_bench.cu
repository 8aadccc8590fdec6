// Times the statistics kernels, and the statistics-and-numerics kernel (alone and fused with MX/NVFP4 block
// formats, cast from the reader's registers or, in the "reread" cases, from each chunk read again: ncu's DRAM
// bytes of the pass alone and fused show whether the re-read came from L2), through their
// launchers, without torch: for comparing compile-time variants (GAPMON_CUDA_GROUP, GAPMON_CUDA_VEC_UNROLL;
// see tune.sh) and for profiling with ncu. Checks every case against a float64 host computation before
// timing it (and a numerics case's histogram against the element count, a fused case's block rows against
// the element and block counts), so a fast but wrong variant fails instead of winning.
//
//   nvcc -O3 -std=c++20 --expt-relaxed-constexpr -arch=sm_90 -I csrc benchmarks/cuda/kernel_bench.cu \
//        csrc/cuda/stats_cuda.cu csrc/cuda/numerics_cuda.cu csrc/cuda/block_cuda.cu -o kernel_bench && ./kernel_bench
//
// Prints one line per case: elements, time per call (median of CUDA-event timed runs of 20
// back-to-back calls), GB/s read, and the device-to-device copy bandwidth (bytes read + written).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/block_formats.h"
#include "core/group_acc.h"
#include "core/numerics.h"
#include "core/strided_view.h"
#include "cuda/block_cuda.h"
#include "cuda/numerics_cuda.h"
#include "cuda/stats_cuda.h"

namespace {

using gapmon::core::DType;
using gapmon::core::StridedView;
namespace core = gapmon::core;
namespace cuda = gapmon::cuda;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

struct Case {
  const char* name;
  DType dtype;
  int64_t rows, row_numel;
  bool numerics = false;  // launch_stats_and_numerics (statistics and numerics rows in one pass)
  bool mx = false;        // ... with MXFP8 e4m3 blocks of rows of 4096 in the same launch (a single item)
  bool nvfp4 = false;     // ... and NVFP4 (with the tensor's amax)
  bool reread = false;    // ... cast from each chunk read again (FusedBlocks::in_reader false)
};

double median(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  return xs[xs.size() / 2];
}

// Milliseconds per call of fn(), back-to-back calls timed with events.
template <typename Fn>
double time_ms(Fn fn) {
  for (int i = 0; i < 3; ++i) fn();
  check(cudaDeviceSynchronize(), "warm-up");
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> times;
  for (int rep = 0; rep < 15; ++rep) {
    cudaEventRecord(start);
    for (int i = 0; i < 20; ++i) fn();
    cudaEventRecord(stop);
    check(cudaEventSynchronize(stop), "timing");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms / 20);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(times);
}

void report(const Case& c, int64_t numel, double ms, size_t nbytes, double copy_gbps) {
  const double gbps = nbytes / ms / 1e6;
  std::printf("%-28s %12lld elements  %9.4f ms  %7.1f GB/s  %5.1f%% of copy bandwidth\n", c.name, (long long)numel, ms,
              gbps, 100 * gbps / copy_gbps);
}

void run(const Case& c, double copy_gbps, bool once) {
  const int64_t numel = c.rows * c.row_numel;
  const size_t elem = c.dtype == DType::kFloat32 ? 4 : 2;
  // Host data: normal(3, 2), rounded to the dtype; float64 statistics of row 0 and of the last row.
  std::vector<float> host(numel);
  std::mt19937 g(1);
  std::normal_distribution<float> d(3.f, 2.f);
  for (auto& x : host) x = d(g);
  std::vector<unsigned char> bytes(numel * elem);
  if (c.dtype == DType::kFloat32) {
    std::copy(host.begin(), host.end(), reinterpret_cast<float*>(bytes.data()));
  } else {
    auto* b = reinterpret_cast<__nv_bfloat16*>(bytes.data());
    for (int64_t i = 0; i < numel; ++i) {
      b[i] = __float2bfloat16(host[i]);
      host[i] = __bfloat162float(b[i]);
    }
  }
  void* data = nullptr;
  check(cudaMalloc(&data, bytes.size()), "cudaMalloc data");
  check(cudaMemcpy(data, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), "copy data");

  StridedView v;
  v.data = data;
  v.dtype = c.dtype;
  v.ndim = 1;
  v.sizes[0] = c.row_numel;
  v.strides[0] = 1;
  v.item_numel = c.row_numel;
  v.items = c.rows;
  v.item_stride = c.row_numel;
  const cuda::LaunchPlan plan = cuda::plan_launch(&v, 1);
  const int64_t chunks = plan.total_chunks;
  cuda::ViewTable table;
  table.num = 1;
  table.inline_views[0] = v;
  double* scratch = nullptr;
  double* out = nullptr;
  double* numerics_out = nullptr;
  double* numerics_scratch = nullptr;
  unsigned* counters = nullptr;
  const int64_t columns = core::kNumNumericsColumns;
  check(cudaMalloc(&scratch, chunks * core::kNumStateColumns * sizeof(double)), "cudaMalloc scratch");
  check(cudaMalloc(&numerics_out, c.rows * columns * sizeof(double)), "cudaMalloc numerics out");
  check(cudaMalloc(&numerics_scratch, chunks * columns * sizeof(double)), "cudaMalloc numerics scratch");
  check(cudaMalloc(&out, c.rows * core::kNumStats * sizeof(double)), "cudaMalloc out");
  check(cudaMalloc(&counters, (c.rows + 1) * sizeof(unsigned)), "cudaMalloc counters");
  cuda::StatsTargets targets;
  targets.out_stats = out;
  targets.correction = 1;
  targets.chunk_states = scratch;
  targets.counters = counters;
  // As csrc/torch/cuda_ops.cpp does: the counters are zeroed once; every launch leaves them at zero (the
  // group that counts an item's last chunk resets its counter), so a call is one launch, no memset.
  check(cudaMemset(counters, 0, (c.rows + 1) * sizeof(unsigned)), "memset counters");
  cuda::NumericsTargets numerics;
  numerics.out = numerics_out;
  numerics.chunk_rows = numerics_scratch;
  // The fused case: the tensor as [numel / 4096, 4096] cast to MXFP8 e4m3 (as csrc/torch/cuda_ops.cpp sets it up).
  gapmon::core::BlockOperand op;
  op.data = data, op.dtype = c.dtype, op.cols = 4096, op.rows = numel / 4096, op.first_chunk = v.first_chunk;
  gapmon::core::BlockOperand* op_device = nullptr;
  double *block_scratch = nullptr, *block_out = nullptr, *amax_device = nullptr;
  cuda::FusedBlocks fused;
  const int num_formats = c.nvfp4 ? 2 : 1;
  if (c.mx) {
    check(cudaMalloc(&op_device, sizeof op), "cudaMalloc operand");
    check(cudaMemcpy(op_device, &op, sizeof op, cudaMemcpyHostToDevice), "copy operand");
    check(cudaMalloc(&block_scratch, chunks * num_formats * core::kNumBlockColumns * sizeof(double)),
          "cudaMalloc block scratch");
    check(cudaMalloc(&block_out, num_formats * core::kNumBlockColumns * sizeof(double)), "cudaMalloc block out");
    double amax = 0;
    for (float x : host) amax = std::max(amax, double(std::fabs(x)));
    check(cudaMalloc(&amax_device, sizeof amax), "cudaMalloc amax");
    check(cudaMemcpy(amax_device, &amax, sizeof amax, cudaMemcpyHostToDevice), "copy amax");
    fused.ops = op_device, fused.chunk_rows = block_scratch, fused.amaxes = amax_device;
    fused.formats.num = num_formats, fused.formats.codes[0] = core::BlockFormat::kMxfp8E4m3;
    fused.formats.codes[1] = core::BlockFormat::kNvfp4;
    fused.in_reader = !c.reread;
  }
  auto call = [&] {
    if (c.mx) {
      check(cuda::launch_stats_and_numerics(table, plan, c.rows, targets, numerics, nullptr, fused),
            "launch_stats_and_numerics with blocks");
      check(cuda::launch_merge_fused_block_rows(op_device, 1, num_formats, block_scratch, block_out, nullptr),
            "merge block rows");
    } else if (c.numerics) {
      check(cuda::launch_stats_and_numerics(table, plan, c.rows, targets, numerics, nullptr), "launch_stats_and_numerics");
    } else {
      check(cuda::launch_stats(table, plan, c.rows, targets, nullptr), "launch_stats");
    }
  };
  call();
  if (c.numerics) {  // every element in exactly one bin of its row
    std::vector<double> rows(c.rows * columns);
    check(cudaMemcpy(rows.data(), numerics_out, rows.size() * sizeof(double), cudaMemcpyDeviceToHost), "copy numerics");
    for (int64_t r = 0; r < c.rows; ++r) {
      double binned = 0;
      for (int b = 0; b < core::kNumBins; ++b) binned += rows[r * columns + b];
      if (binned != double(c.row_numel) || rows[r * columns + core::nCount] != double(c.row_numel)) {
        std::fprintf(stderr, "%s row %lld: %g elements binned, %g counted, want %lld\n", c.name, (long long)r, binned,
                     rows[r * columns + core::nCount], (long long)c.row_numel);
        std::exit(1);
      }
    }
  }
  if (c.mx) {  // every element seen once (normal(3, 2) data: finite, non-zero), every block once
    for (int f = 0; f < num_formats; ++f) {
      double row[core::kNumBlockColumns];
      check(cudaMemcpy(row, block_out + f * core::kNumBlockColumns, sizeof row, cudaMemcpyDeviceToHost), "copy block row");
      const int64_t blocks = numel / (f == 0 ? 32 : 16);
      if (row[core::bNonzero] + row[core::bNonfinite] > double(numel) || row[core::bBlocks] != double(blocks) ||
          row[core::bNonzero] < 0.99 * double(numel)) {
        std::fprintf(stderr, "%s: block row %d counts %g elements and %g blocks, want %lld and %lld\n", c.name, f,
                     row[core::bNonzero], row[core::bBlocks], (long long)numel, (long long)blocks);
        std::exit(1);
      }
    }
  }
  std::vector<double> got(c.rows * core::kNumStats);
  check(cudaMemcpy(got.data(), out, got.size() * sizeof(double), cudaMemcpyDeviceToHost), "copy out");
  for (int64_t r : {int64_t(0), c.rows - 1}) {
    double sum = 0, m2 = 0, sq = 0;
    for (int64_t i = 0; i < c.row_numel; ++i) sum += host[r * c.row_numel + i];
    const double mean = sum / c.row_numel;
    for (int64_t i = 0; i < c.row_numel; ++i) {
      const double x = host[r * c.row_numel + i];
      m2 += (x - mean) * (x - mean);
      sq += x * x;
    }
    const double* s = got.data() + r * core::kNumStats;
    const double var = m2 / (c.row_numel - 1);
    if (std::fabs(s[core::kVar] - var) > 1e-5 * var || std::fabs(s[core::kNorm] - std::sqrt(sq)) > 1e-5 * std::sqrt(sq) ||
        std::fabs(s[core::kMean] - mean) > 1e-5 * (std::fabs(mean) + std::sqrt(var))) {
      std::fprintf(stderr, "%s row %lld: wrong statistics (var %g vs %g)\n", c.name, (long long)r, s[core::kVar], var);
      std::exit(1);
    }
  }
  if (once) {  // one checked launch per case (for ncu: one profile per case)
    std::printf("%-28s %12lld elements  checked\n", c.name, (long long)numel);
  } else {
    report(c, numel, time_ms(call), bytes.size(), copy_gbps);
  }
  cudaFree(data);
  cudaFree(scratch);
  cudaFree(out);
  cudaFree(counters);
  cudaFree(numerics_out);
  cudaFree(numerics_scratch);
  cudaFree(op_device);
  cudaFree(block_scratch);
  cudaFree(block_out);
  cudaFree(amax_device);
}


}  // namespace

int main(int argc, char** argv) {
  // kernel_bench [--once]: --once makes one checked launch per case and times nothing (ncu profiles
  // every case a target names, one launch each).
  const bool once = argc > 1 && std::string(argv[1]) == "--once";
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "device");
  // Device-to-device copy of 1 GiB: bytes read + written per second.
  const size_t copy_bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  check(cudaMalloc(&a, copy_bytes), "cudaMalloc copy");
  check(cudaMalloc(&b, copy_bytes), "cudaMalloc copy");
  check(cudaMemset(a, 1, copy_bytes), "memset");
  const double copy_ms = time_ms([&] { check(cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice), "copy"); });
  const double copy_gbps = 2.0 * copy_bytes / copy_ms / 1e6;
  cudaFree(a);
  cudaFree(b);
  std::printf("# %s, %d SMs, kGroup %d, kVecUnroll %d; device copy %.0f GB/s (read + write)\n", prop.name,
              prop.multiProcessorCount, core::kGroup, core::kVecUnroll, copy_gbps);
  const Case cases[] = {
      {"tensor_stats fp32 2^20", DType::kFloat32, 1, int64_t(1) << 20},
      {"tensor_stats fp32 2^26", DType::kFloat32, 1, int64_t(1) << 26},
      {"tensor_stats bf16 2^26", DType::kBFloat16, 1, int64_t(1) << 26},
      {"tensor_stats fp32 2^28", DType::kFloat32, 1, int64_t(1) << 28},
      {"instance_stats [64, 2^20]", DType::kFloat32, 64, int64_t(1) << 20},
      {"instance_stats [8192, 4096]", DType::kFloat32, 8192, 4096},
      {"instance_stats [65536, 64]", DType::kFloat32, 65536, 64},
      {"stats+numerics fp32 2^26", DType::kFloat32, 1, int64_t(1) << 26, true},
      {"stats+numerics bf16 2^26", DType::kBFloat16, 1, int64_t(1) << 26, true},
      {"stats+numerics+mxfp8 fp32 2^26", DType::kFloat32, 1, int64_t(1) << 26, true, true},
      {"stats+numerics+mxfp8 bf16 2^26", DType::kBFloat16, 1, int64_t(1) << 26, true, true},
      {"...+mxfp8 reread fp32 2^26", DType::kFloat32, 1, int64_t(1) << 26, true, true, false, true},
      {"...+mxfp8 reread bf16 2^26", DType::kBFloat16, 1, int64_t(1) << 26, true, true, false, true},
      {"...+mxfp8+nvfp4 fp32 2^26", DType::kFloat32, 1, int64_t(1) << 26, true, true, true},
      {"...+mxfp8+nvfp4 reread fp32 2^26", DType::kFloat32, 1, int64_t(1) << 26, true, true, true, true},
  };
  for (const Case& c : cases) run(c, copy_gbps, once);
  return 0;
}
