// How a block of CUDA threads casts groups to the block formats and combines its rows (csrc/core/
// block_formats.h), shared by the block kernel (block_cuda.cu) and the fused statistics pass
// (numerics_cuda.cu): a warp per 32-element group (a lane per element, the core's float32 path element by
// element), or a thread per group for float64 tensors; then the threads' rows are combined over the block by
// fixed-order trees in shared memory (sums; the minimum of min_nonzero, the maximum of max_block_ratio), so
// that the result does not depend on the schedule.
//
// Included by .cu files (or by their host emulation) only; internal linkage, one copy per kernel source.
#pragma once

#include "../core/block_formats.h"
#include "block_cuda.h"

namespace gapmon {
namespace cuda {
namespace {

__device__ __forceinline__ double combine_block_column(int column, double a, double b) {
  if (column == core::bMinNonzero) return b < a ? b : a;
  if (column == core::bMaxBlockRatio) return b > a ? b : a;
  return a + b;
}

// Combines the block's threads' rows (one per format) over fixed-order trees into dst ([num, kNumBlockColumns],
// written by thread 0). `partial`: kThreadsPerBlock doubles of shared memory. Every thread of the block calls it.
template <int kThreadsPerBlock>
__device__ void combine_rows_over_block(const core::BlockRow* rows, int num, double* partial, double* dst) {
  for (int f = 0; f < num; ++f) {
    for (int k = 0; k < core::kNumBlockColumns; ++k) {
      partial[threadIdx.x] = rows[f].v[k];
      __syncthreads();
      for (int width = kThreadsPerBlock / 2; width > 0; width /= 2) {
        if (static_cast<int>(threadIdx.x) < width) {
          partial[threadIdx.x] = combine_block_column(k, partial[threadIdx.x], partial[threadIdx.x + width]);
        }
        __syncthreads();
      }
      if (threadIdx.x == 0) dst[f * core::kNumBlockColumns + k] = partial[0];
      __syncthreads();
    }
  }
}

// One lane's sums of one format over the groups its warp casts (warp_cast_groups).
struct LaneSums {
  double error_sq = 0, signal_sq = 0, max_ratio = 0;
  float min_nonzero = INFINITY;
  int64_t nonzero = 0, to_zero = 0, subnormal = 0, saturated = 0, blocks = 0, under = 0, over = 0, nonfinite = 0;

  __device__ core::BlockRow row() const {
    core::BlockRow r;
    r.v[core::bNonzero] = static_cast<double>(nonzero);
    r.v[core::bToZero] = static_cast<double>(to_zero);
    r.v[core::bSubnormal] = static_cast<double>(subnormal);
    r.v[core::bSaturated] = static_cast<double>(saturated);
    r.v[core::bBlocks] = static_cast<double>(blocks);
    r.v[core::bScaleUnderflow] = static_cast<double>(under);
    r.v[core::bScaleOverflow] = static_cast<double>(over);
    r.v[core::bErrorSq] = error_sq;
    r.v[core::bSignalSq] = signal_sq;
    r.v[core::bMinNonzero] = min_nonzero;
    r.v[core::bMaxBlockRatio] = max_ratio;
    r.v[core::bNonfinite] = static_cast<double>(nonfinite);
    return r;
  }
};

// Format c's sums over groups [begin, end) of a float32, float16 or bfloat16 tensor, cast a warp per group: lane i
// holds element i of the group (coalesced loads, no per-thread arrays), the block's largest and smallest non-zero
// magnitudes come from butterfly shuffles over the block's lanes (a 16-lane half for NVFP4), every lane of a block
// computes its scale (core::block_scale_of) and the block's first lane counts it, each lane casts its element
// (core::cast_element_f32): the core's float32 path, element by element. Warp w of the block takes groups
// begin + w, begin + w + warps, ...
template <typename T, int kThreadsPerBlock>
__device__ LaneSums warp_cast_groups(const core::BlockOperand& op, int64_t begin, int64_t end,
                                     const core::FormatConsts& c) {
  constexpr int kWarps = kThreadsPerBlock / 32;
  const int lane = threadIdx.x % 32, block = c.block;
  const int64_t per_row = core::groups_per_row(op.cols);
  const T* data = static_cast<const T*>(op.data);
  LaneSums sums;
  for (int64_t g = begin + threadIdx.x / 32; g < end; g += kWarps) {
    const int64_t row = g / per_row, first = (g % per_row) * core::kGroupElems;
    const int n = static_cast<int>(op.cols - first < core::kGroupElems ? op.cols - first : core::kGroupElems);
    float a = 0;
    if (lane < n) {
      a = fabsf(static_cast<float>(core::widen(data[row * op.cols + first + lane])));
      if (!(a <= 3.4028234663852886e38f)) {
        sums.nonfinite += 1;
        a = 0;
      }
    }
    // Non-negative floats order as their bits; a zero (bits - 1 wraps) is left out of the smallest.
    const uint32_t bits = core::bits_of(a);
    uint32_t top = bits, low = bits - 1u < 0x7F800000u ? bits : 0x7F800000u;
    for (int d = block / 2; d > 0; d /= 2) {
      const uint32_t t = __shfl_xor_sync(0xffffffffu, top, d), l = __shfl_xor_sync(0xffffffffu, low, d);
      top = t > top ? t : top;
      low = l < low ? l : low;
    }
    const float amax = core::f32_from_bits(top), amin = core::f32_from_bits(low);
    const core::BlockScale s = core::block_scale_of(amax, c);
    if (lane % block == 0 && lane < n) {  // the block's first lane counts the block (one that has elements)
      sums.blocks += 1;
      sums.under += s.under ? 1 : 0;
      sums.over += s.over ? 1 : 0;
      if (amax > 0) {
        const double ratio = static_cast<double>(amax) / amin;
        sums.max_ratio = ratio > sums.max_ratio ? ratio : sums.max_ratio;
        sums.min_nonzero = amin < sums.min_nonzero ? amin : sums.min_nonzero;
      }
    }
    double err;
    int flags;
    if (c.format == core::BlockFormat::kNvfp4) {
      flags = core::cast_element_f32<1>(a, s.mul, s.dq_mul, s.dq_div, c, err);
    } else if (c.format == core::BlockFormat::kCurrentE4m3 || c.format == core::BlockFormat::kCurrentE5m2) {
      flags = core::cast_element_f32<2>(a, s.mul, s.dq_mul, s.dq_div, c, err);
    } else {
      flags = core::cast_element_f32<0>(a, s.mul, s.dq_mul, s.dq_div, c, err);
    }
    sums.nonzero += flags & 0xFF, sums.to_zero += (flags >> 8) & 0xFF, sums.subnormal += (flags >> 16) & 0xFF;
    sums.saturated += (flags >> 24) & 0xFF;
    sums.error_sq += err * err;
    sums.signal_sq += static_cast<double>(a) * a;
  }
  return sums;
}

// Groups [begin, end) of `op` cast to every format by the block's threads, combined over the block into dst
// ([formats.num, kNumBlockColumns], written by thread 0). float32/float16/bfloat16 tensors a warp per group, one
// format after another (the group is read again from L1/L2 for each); float64 tensors a thread per group (the
// core's float64 path). `partial`: kThreadsPerBlock doubles of shared memory. Every thread of the block calls it.
template <int kThreadsPerBlock>
__device__ void cast_and_combine_groups(const core::BlockOperand& op, int64_t begin, int64_t end,
                                        const BlockFormatList& formats, double amax, double* partial, double* dst) {
  core::BlockRow rows[core::kNumBlockFormats];
  if (op.dtype == core::DType::kFloat64) {
    for (int64_t g = begin + threadIdx.x; g < end; g += kThreadsPerBlock) {
      core::cast_groups(op, g, g + 1, formats.codes, formats.num, amax, rows);
    }
  } else {
    for (int f = 0; f < formats.num; ++f) {
      const core::FormatConsts c = core::format_consts(formats.codes[f], core::tensor_scale(formats.codes[f], amax));
      LaneSums sums;
      if (op.dtype == core::DType::kFloat32) sums = warp_cast_groups<float, kThreadsPerBlock>(op, begin, end, c);
      else if (op.dtype == core::DType::kBFloat16) sums = warp_cast_groups<core::BF16, kThreadsPerBlock>(op, begin, end, c);
      else sums = warp_cast_groups<core::Half, kThreadsPerBlock>(op, begin, end, c);
      rows[f] = sums.row();
    }
  }
  combine_rows_over_block<kThreadsPerBlock>(rows, formats.num, partial, dst);
}

}  // namespace
}  // namespace cuda
}  // namespace gapmon
