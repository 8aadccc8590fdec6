// How a block of CUDA threads casts groups to the block formats and combines its rows (csrc/core/
// block_formats.h), shared by the block kernel (block_cuda.cu) and the fused statistics pass
// (numerics_cuda.cu): a warp per 32-element group (a lane per element, the core's float32 path element by
// element), or a thread per group for float64 tensors; then the threads' rows are combined over the block by
// fixed-order trees in shared memory (sums; the minimum of min_nonzero, the maximum of max_block_ratio), so
// that the result does not depend on the schedule. The fused statistics pass casts from its reader's vectors
// instead where it can (the last section): one read of the tensor.
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

// An element of a float32, float16 or bfloat16 tensor, read through the read-only cache (and counted by the
// emulator's __ldg, as the statistics reader's vectors are).
__device__ __forceinline__ float read_element(const float* p) { return __ldg(p); }
template <typename T>
__device__ __forceinline__ T read_element(const T* p) {
  static_assert(sizeof(T) == 2, "16-bit storage");
  return T{__ldg(reinterpret_cast<const unsigned short*>(p))};
}

// A magnitude's bits as the key of the smallest non-zero one: non-negative floats order as their bits, and a zero
// (bits - 1 wraps) maps to +inf's bits, out of the minimum.
__device__ __forceinline__ uint32_t nonzero_key(uint32_t bits) { return bits - 1u < 0x7F800000u ? bits : 0x7F800000u; }

// Ranges of the magnitudes' bits over `lanes` lanes (a power of two, from `from`), by butterfly shuffles within the
// lanes' aligned set `mask`: top the largest, low the smallest non-zero (0x7F800000, +inf, when none).
__device__ __forceinline__ void range_over_lanes(uint32_t& top, uint32_t& low, int from, int lanes, unsigned mask) {
  for (int d = from; d < lanes; d *= 2) {
    const uint32_t t = __shfl_xor_sync(mask, top, d), l = __shfl_xor_sync(mask, low, d);
    top = t > top ? t : top;
    low = l < low ? l : low;
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
      a = fabsf(static_cast<float>(core::widen(read_element(data + row * op.cols + first + lane))));
      if (!(a <= 3.4028234663852886e38f)) {
        sums.nonfinite += 1;
        a = 0;
      }
    }
    const uint32_t bits = core::bits_of(a);
    uint32_t top = bits, low = nonzero_key(bits);
    range_over_lanes(top, low, 1, block, 0xffffffffu);
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

// ---------------------------------------------------------------- casting from the reader's registers
// The fused statistics pass casts a chunk's groups from the vectors its reader has just loaded, when they lie
// whole in them: a float32, float16 or bfloat16 tensor read as one aligned unit-stride run, rows of a multiple of
// 32 elements, so that every 32-element group starts on a 16-byte vector and a warp's consecutive lanes hold
// it (the reader gives vector v of a run to thread v mod kThreadsPerBlock): 32 / K lanes of K elements each
// (8 lanes of 4 float32, 4 lanes of 8 16-bit elements), an NVFP4 16-element block half of them. Each group's
// range comes from shuffles over its own lanes (masked to them: a warp's groups may leave the loop apart on a
// run's last vectors), every lane casts its own elements with the group's scale (core::block_scale_of,
// core::cast_element_f32: the core's float32 path), and the lane's sums wait in shared memory until the chunk
// is read; then the block combines them as it combines the re-read path's rows. The tensor is read once.
// Up to kMaxReaderFormats formats (the sums' shared memory); a launch with more re-reads each chunk.
constexpr int kMaxReaderFormats = 2;

// The block's sums of its chunk, a slot per thread, in shared memory (no constructor: a __shared__ variable).
// counts: per format, 10-bit fields of to_zero, subnormal, saturated, blocks, scale underflows and overflows;
// elems: non-zero finite elements | non-finite << 16. A thread's share of a chunk fits every field.
template <int kThreadsPerBlock>
struct ReaderSums {
  static_assert(core::kChunkElems / kThreadsPerBlock < 1024, "a thread's share of a chunk fits a 10-bit count");
  core::FormatConsts consts[kMaxReaderFormats];  // written by thread 0 before the chunk is read
  int num;
  double error_sq[kMaxReaderFormats][kThreadsPerBlock];
  unsigned long long counts[kMaxReaderFormats][kThreadsPerBlock];
  double signal_sq[kThreadsPerBlock], ratio16[kThreadsPerBlock], ratio32[kThreadsPerBlock];
  float min_nonzero[kThreadsPerBlock];
  unsigned elems[kThreadsPerBlock];
};

// Empties the calling thread's slots; thread 0 also sets the formats' constants. A barrier must follow before
// the chunk is read.
template <int kThreadsPerBlock>
__device__ void reader_sums_start(ReaderSums<kThreadsPerBlock>& s, const BlockFormatList& formats, double amax) {
  const int t = threadIdx.x;
  for (int f = 0; f < kMaxReaderFormats; ++f) s.error_sq[f][t] = 0, s.counts[f][t] = 0;
  s.signal_sq[t] = s.ratio16[t] = s.ratio32[t] = 0;
  s.min_nonzero[t] = INFINITY;
  s.elems[t] = 0;
  if (t == 0) {
    s.num = formats.num;
    for (int f = 0; f < formats.num; ++f) {
      s.consts[f] = core::format_consts(formats.codes[f], core::tensor_scale(formats.codes[f], amax));
    }
  }
}

// K magnitudes cast to format c with the scale of their block, into the format's slots. One body for every
// format (the reader's loop holds it once), rounded by core::quantise_f32; the error a - q * dq_mul (/ dq_div) in
// float64 has the bits of core::cast_element_f32's for every kind: for MX (dq_mul = 2^X, dq_div = 1) q * 2^X and
// a - q * 2^X are exact (Sterbenz's lemma), so only NVFP4 and current scaling (`divides`) pay the division.
template <int K>
__device__ __forceinline__ void cast_lane(const float (&a)[K], const core::BlockScale& sc, const core::FormatConsts& c,
                                          bool divides, bool counts_block, double& error_sq, unsigned long long& counts) {
  unsigned long long packed = counts_block ? (1ull << 30) | (static_cast<unsigned long long>(sc.under) << 40) |
                                                 (static_cast<unsigned long long>(sc.over) << 50)
                                           : 0ull;
  double sum = 0;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float q;
    const int flags = core::quantise_f32(a[k], sc.mul, c, q);
    const double back = static_cast<double>(q) * sc.dq_mul;
    const double err = static_cast<double>(a[k]) - (divides ? back / sc.dq_div : back);
    sum += err * err;
    packed += static_cast<unsigned long long>((flags >> 8) & 1) | static_cast<unsigned long long>((flags >> 16) & 1) << 10 |
              static_cast<unsigned long long>(flags >> 24) << 20;
  }
  error_sq += sum;
  counts += packed;
}

// The calling lane's vector of K elements (float32: 4; 16-bit: 8, widened) cast to every format of `s`. The
// 32 / K aligned lanes of its group call together.
template <int kThreadsPerBlock, int K>
__device__ __forceinline__ void reader_cast_vector(const float (&xs)[K], ReaderSums<kThreadsPerBlock>& s) {
  constexpr int kGroupLanes = core::kGroupElems / K, kHalfLanes = kGroupLanes / 2;
  static_assert(kHalfLanes >= 1 && 32 % kGroupLanes == 0, "a group spans whole lanes of one warp");
  const int t = threadIdx.x, lane = t % 32;
  const unsigned mask = kGroupLanes == 32 ? 0xffffffffu : ((1u << kGroupLanes) - 1u) << (lane & ~(kGroupLanes - 1));
  float a[K];
  uint32_t top = 0, low = 0x7F800000u;
  unsigned nonzero = 0, nonfinite = 0;
  double signal = 0;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const float m = fabsf(xs[k]);
    const bool finite = m <= 3.4028234663852886e38f;
    a[k] = finite ? m : 0.0f;
    nonfinite += finite ? 0u : 1u;
    nonzero += a[k] > 0 ? 1u : 0u;
    signal += static_cast<double>(a[k]) * a[k];
    const uint32_t bits = core::bits_of(a[k]), l = nonzero_key(bits);
    top = bits > top ? bits : top;
    low = l < low ? l : low;
  }
  range_over_lanes(top, low, 1, kHalfLanes, mask);
  const float amax16 = core::f32_from_bits(top), amin16 = core::f32_from_bits(low);
  range_over_lanes(top, low, kHalfLanes, kGroupLanes, mask);
  const float amax32 = core::f32_from_bits(top), amin32 = core::f32_from_bits(low);
  const bool first16 = lane % kHalfLanes == 0, first32 = lane % kGroupLanes == 0;
  if (first16 && amax16 > 0) {
    const double ratio = static_cast<double>(amax16) / amin16;
    if (ratio > s.ratio16[t]) s.ratio16[t] = ratio;
  }
  if (first32 && amax32 > 0) {
    const double ratio = static_cast<double>(amax32) / amin32;
    if (ratio > s.ratio32[t]) s.ratio32[t] = ratio;
    if (amin32 < s.min_nonzero[t]) s.min_nonzero[t] = amin32;
  }
  s.signal_sq[t] += signal;
  s.elems[t] += nonzero | nonfinite << 16;
  for (int f = 0; f < s.num; ++f) {
    const core::FormatConsts c = s.consts[f];
    const bool half = c.block == 16;
    const core::BlockScale sc = core::block_scale_of(half ? amax16 : amax32, c);
    const bool divides = c.format == core::BlockFormat::kNvfp4 || c.format == core::BlockFormat::kCurrentE4m3 ||
                         c.format == core::BlockFormat::kCurrentE5m2;
    cast_lane(a, sc, c, divides, half ? first16 : first32, s.error_sq[f][t], s.counts[f][t]);
  }
}

// The chunk's rows from the threads' slots, combined over the block into dst ([num, kNumBlockColumns], written by
// thread 0) as combine_rows_over_block does. Every thread of the block calls it, after the chunk is read.
template <int kThreadsPerBlock>
__device__ void combine_reader_sums(const ReaderSums<kThreadsPerBlock>& s, double* partial, double* dst) {
  const int t = threadIdx.x;
  core::BlockRow rows[kMaxReaderFormats];
  for (int f = 0; f < s.num; ++f) {
    const unsigned long long n = s.counts[f][t];
    const auto field = [n](int k) { return static_cast<double>((n >> (10 * k)) & 0x3FFu); };
    core::BlockRow& r = rows[f];
    r.v[core::bNonzero] = static_cast<double>(s.elems[t] & 0xFFFFu);
    r.v[core::bToZero] = field(0);
    r.v[core::bSubnormal] = field(1);
    r.v[core::bSaturated] = field(2);
    r.v[core::bBlocks] = field(3);
    r.v[core::bScaleUnderflow] = field(4);
    r.v[core::bScaleOverflow] = field(5);
    r.v[core::bErrorSq] = s.error_sq[f][t];
    r.v[core::bSignalSq] = s.signal_sq[t];
    r.v[core::bMinNonzero] = s.min_nonzero[t];
    r.v[core::bMaxBlockRatio] = s.consts[f].block == 16 ? s.ratio16[t] : s.ratio32[t];
    r.v[core::bNonfinite] = static_cast<double>(s.elems[t] >> 16);
  }
  combine_rows_over_block<kThreadsPerBlock>(rows, s.num, partial, dst);
}

}  // namespace
}  // namespace cuda
}  // namespace gapmon
