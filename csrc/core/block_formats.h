// Per-block low-precision formats, emulated exactly on the bits: what casting a tensor to MXFP8/MXFP4
// (OCP MX v1.0), NVFP4 or per-tensor current-scaled FP8 would do to it. The single source of this math,
// torch-free, host and device (csrc/cpu/block_kernels.cpp, csrc/cuda/block_cuda.cu); gapmon/stats/
// block_formats.py documents it for users and holds the float64 reference tests compare with.
//
// Blocks run along the last dim (rows of `cols` elements; a row's last block may be shorter). Work is cut
// into "groups" of kGroupElems elements, the MX block: an NVFP4 group holds up to two 16-element blocks.
//
// The cast of one element: |v| rounds to nearest, ties to even, on the format's grid (subnormals included);
// a result above the format's largest finite value saturates to it (counted as saturated).
// Scales:
//   MX (E8M0, one per 32-element block): X = floor(log2(amax_b)) - emax_elem, clamped to [-127, 127] (a
//     clamped X counts as a scale under/overflow); v = x * 2^-X exactly; dequantised q * 2^X.
//   NVFP4 (e4m3 per 16-element block, fp32 per tensor): g = fp32(448 * 6 / fp32(amax)); the block scale
//     S = e4m3(fp32(fp32(fp32(amax_b) / 6) * g)), saturating (S below e4m3's smallest normal 2^-6 counts
//     as a scale underflow; S = 0 casts the block to zero); v = fp32(x * fp32(g / S)); dequantised q * S / g.
//   Current scaling (one fp32 scale per tensor, as TransformerEngine's): s = fp32(max_finite / fp32(amax));
//     v = fp32(x * s); dequantised q / s.
// fp32(...) rounds to float32 (nearest even), as the hardware and TE compute scales; float64 tensors keep
// v in float64. Non-finite elements are left out of every count and sum (counted apart); amax and amax_b
// are over the finite elements.
#pragma once

#include <cmath>
#include <cstdint>

#include "stats_state.h"
#include "strided_view.h"
#include "widen.h"

namespace gapmon {
namespace core {

constexpr int kGroupElems = 32;

enum class BlockFormat : int32_t {
  kMxfp8E4m3 = 0,
  kMxfp8E5m2 = 1,
  kMxfp4 = 2,
  kNvfp4 = 3,
  kCurrentE4m3 = 4,
  kCurrentE5m2 = 5,
};
constexpr int kNumBlockFormats = 6;

// Column order of a block-format row (`[..., kNumBlockColumns]` float64). Columns up to kSignalSq and
// kNonfiniteElems are sums; kMinNonzero a minimum, kMaxBlockRatio a maximum.
enum BlockColumn : int {
  bNonzero = 0,         // finite non-zero elements
  bToZero = 1,          // of those, cast to zero
  bSubnormal = 2,       // of those, cast to a non-zero subnormal of the element format
  bSaturated = 3,       // of those, rounded above the largest finite value: clamped to it
  bBlocks = 4,          // blocks (MX: 32, NVFP4: 16, current scaling: 32 elements, for the range)
  bScaleUnderflow = 5,  // blocks whose scale underflows (see above)
  bScaleOverflow = 6,   // blocks whose scale overflows (E8M0 above 2^127; NVFP4 block scale above 448)
  bErrorSq = 7,         // sum of (x - dequantised)^2 over the finite elements
  bSignalSq = 8,        // sum of x^2 over the finite elements
  bMinNonzero = 9,      // smallest finite non-zero |x| (+inf if none)
  bMaxBlockRatio = 10,  // largest amax_b / (smallest non-zero |x| of the block) over blocks (0 if none)
  bNonfinite = 11,      // non-finite elements (left out of the rest)
  kNumBlockColumns = 12,
};
inline constexpr const char* kBlockColumnNames[kNumBlockColumns] = {
    "nonzero", "to_zero",   "subnormal",    "saturated",   "blocks",          "scale_underflow",
    "scale_overflow", "error_sq", "signal_sq", "min_nonzero", "max_block_ratio", "nonfinite"};

// An element format: mantissa bits, the exponent of its smallest normal and of its largest binade,
// and its largest finite value (OCP: E4M3 448 and E5M2 57344 as in torch.float8_e4m3fn/e5m2; E2M1 6).
struct ElementFormat {
  int mantissa_bits;
  int min_normal_exp;
  int max_exp;
  double max_finite;
};
// (Functions, not constants: device code cannot bind references to host constants.)
GAPMON_HD ElementFormat e4m3() { return {3, -6, 8, 448.0}; }
GAPMON_HD ElementFormat e5m2() { return {2, -14, 15, 57344.0}; }
GAPMON_HD ElementFormat e2m1() { return {1, 0, 2, 6.0}; }

GAPMON_HD ElementFormat element_format(BlockFormat f) {
  switch (f) {
    case BlockFormat::kMxfp8E5m2:
    case BlockFormat::kCurrentE5m2: return e5m2();
    case BlockFormat::kMxfp4:
    case BlockFormat::kNvfp4: return e2m1();
    default: return e4m3();
  }
}

GAPMON_HD int block_elems(BlockFormat f) { return f == BlockFormat::kNvfp4 ? 16 : kGroupElems; }
GAPMON_HD bool needs_tensor_amax(BlockFormat f) {
  return f == BlockFormat::kNvfp4 || f == BlockFormat::kCurrentE4m3 || f == BlockFormat::kCurrentE5m2;
}

GAPMON_HD float to_f32(double x) { return static_cast<float>(x); }  // round to nearest even

// floor(log2(a)) of a finite a > 0, exactly.
GAPMON_HD int floor_log2(double a) {
  int e;
  frexp(a, &e);
  return e - 1;
}

// |v| (finite, >= 0) cast to format `f`: rounded to nearest, ties to even, on the format's grid (subnormals
// included, the top binade's grid continued upwards); a result above the largest finite value saturates to
// it (`saturated`: the value was clamped, not merely rounded).
GAPMON_HD double cast_magnitude(double a, const ElementFormat& f, bool& saturated) {
  saturated = false;
  if (a == 0) return 0;
  int exp = floor_log2(a);
  if (exp < f.min_normal_exp) exp = f.min_normal_exp;
  const double ulp = ldexp(1.0, exp - f.mantissa_bits);
  const double r = rint(a / ulp) * ulp;  // a / ulp and the product are exact (powers of two)
  saturated = r > f.max_finite;
  return saturated ? f.max_finite : r;
}

// A float32 scale that overflows is clamped to float32's largest value, as TransformerEngine clamps its scales.
GAPMON_HD float finite_scale(float s) { return s > 3.4028234663852886e38f ? 3.4028234663852886e38f : s; }

// The per-tensor constants of a format: NVFP4's global encode scale g, or current scaling's s (1 when amax
// is 0 or beyond float32: nothing to scale by, as TransformerEngine). `amax` is the tensor's largest finite |x|.
GAPMON_HD double tensor_scale(BlockFormat f, double amax) {
  if (!needs_tensor_amax(f) || !(amax > 0)) return 1.0;
  const float a = to_f32(amax);
  if (!(a <= 3.4028234663852886e38f)) return 1.0;
  if (f == BlockFormat::kNvfp4) return static_cast<double>(finite_scale(448.0f * 6.0f / a));
  return static_cast<double>(finite_scale(static_cast<float>(element_format(f).max_finite) / a));
}

// The row accumulator of one format.
struct BlockRow {
  double v[kNumBlockColumns];
  GAPMON_HD BlockRow() {
    for (int k = 0; k < kNumBlockColumns; ++k) v[k] = 0;
    v[bMinNonzero] = INFINITY;
  }
  GAPMON_HD void merge(const BlockRow& o) {
    for (int k = 0; k < kNumBlockColumns; ++k) {
      if (k == bMinNonzero) v[k] = o.v[k] < v[k] ? o.v[k] : v[k];
      else if (k == bMaxBlockRatio) v[k] = o.v[k] > v[k] ? o.v[k] : v[k];
      else v[k] += o.v[k];
    }
  }
};

// One element x of a block whose elements are scaled by `scale_mul` (v = x * scale_mul, rounded to fp32
// unless `wide`) and dequantised by `dequant` (q * dequant_mul / dequant_div).
GAPMON_HD void cast_element(double x, const ElementFormat& f, double scale_mul, bool round_f32, double dequant_mul,
                            double dequant_div, BlockRow& row) {
  const double a = fabs(x);
  row.v[bSignalSq] += x * x;
  if (a == 0) return;
  double v = a * scale_mul;
  if (round_f32) v = static_cast<double>(static_cast<float>(a) * static_cast<float>(scale_mul));
  bool saturated;
  const double q = cast_magnitude(v, f, saturated);
  row.v[bNonzero] += 1;
  row.v[bToZero] += q == 0 ? 1 : 0;
  row.v[bSubnormal] += (q != 0 && q < ldexp(1.0, f.min_normal_exp)) ? 1 : 0;
  row.v[bSaturated] += saturated ? 1 : 0;
  const double err = a - q * dequant_mul / dequant_div;
  row.v[bErrorSq] += err * err;
  if (a < row.v[bMinNonzero]) row.v[bMinNonzero] = a;
}

// One block: elements xs[0, n) (widened to double; non-finite ones included, and left out here), of a
// tensor whose values are float64 (`wide`) or narrower, with the format's tensor scale.
GAPMON_HD void cast_block(const double* xs, int n, BlockFormat f, bool wide, double tensor_scale_value, BlockRow& row) {
  const ElementFormat ef = element_format(f);
  double amax = 0, amin = INFINITY;
  for (int i = 0; i < n; ++i) {
    const double a = fabs(xs[i]);
    if (!(a <= 1.7976931348623157e308)) continue;  // NaN or Inf
    if (a > amax) amax = a;
    if (a != 0 && a < amin) amin = a;
  }
  row.v[bBlocks] += 1;
  if (amax > 0) {
    const double ratio = amax / amin;
    if (ratio > row.v[bMaxBlockRatio]) row.v[bMaxBlockRatio] = ratio;
  }
  double scale_mul = 1, dequant_mul = 1, dequant_div = 1;
  bool round_f32 = !wide;
  if (f == BlockFormat::kMxfp8E4m3 || f == BlockFormat::kMxfp8E5m2 || f == BlockFormat::kMxfp4) {
    int x_exp = amax > 0 ? floor_log2(amax) - ef.max_exp : -127;
    if (x_exp < -127) row.v[bScaleUnderflow] += 1, x_exp = -127;
    if (x_exp > 127) row.v[bScaleOverflow] += 1, x_exp = 127;
    scale_mul = ldexp(1.0, -x_exp);
    dequant_mul = ldexp(1.0, x_exp);
    round_f32 = false;  // a power-of-two scale is exact
  } else if (f == BlockFormat::kNvfp4) {
    const float g = static_cast<float>(tensor_scale_value);
    bool over = false;
    const double s = cast_magnitude(static_cast<double>((to_f32(amax) / 6.0f) * g), e4m3(), over);
    if (over) row.v[bScaleOverflow] += 1;
    if (amax > 0 && s < ldexp(1.0, e4m3().min_normal_exp)) row.v[bScaleUnderflow] += 1;
    if (s == 0) {
      scale_mul = 0;  // the whole block casts to zero
    } else {
      scale_mul = static_cast<double>(finite_scale(g / static_cast<float>(s)));
      dequant_mul = s;
      dequant_div = g;
    }
  } else {
    scale_mul = tensor_scale_value;
    dequant_div = tensor_scale_value;
  }
  for (int i = 0; i < n; ++i) {
    const double x = xs[i];
    if (!(fabs(x) <= 1.7976931348623157e308)) {
      row.v[bNonfinite] += 1;
      continue;
    }
    cast_element(x, ef, scale_mul, round_f32, dequant_mul, dequant_div, row);
  }
}

// A group of up to kGroupElems elements (a row's 32-element MX block): format `f`'s blocks in it.
GAPMON_HD void cast_group(const double* xs, int n, BlockFormat f, bool wide, double tensor_scale_value, BlockRow& row) {
  const int b = block_elems(f);
  for (int start = 0; start < n; start += b) {
    cast_block(xs + start, n - start < b ? n - start : b, f, wide, tensor_scale_value, row);
  }
}

// The groups of a [rows, cols] tensor: ceil(cols / 32) per row.
GAPMON_HD int64_t groups_per_row(int64_t cols) { return (cols + kGroupElems - 1) / kGroupElems; }

// The first group of a [rows, cols] tensor (cols > 0) that starts at flat element `e` or after: the groups
// that start in a range [lo, hi) of elements are [group_at(lo), group_at(hi)), so that a pass over chunks of
// elements takes each group once, in the chunk its first element is in.
GAPMON_HD int64_t group_at(int64_t e, int64_t cols) {
  return (e / cols) * groups_per_row(cols) + ((e % cols) + kGroupElems - 1) / kGroupElems;
}

constexpr int64_t kGroupsPerChunk = 2048;  // 65536 elements: the unit of parallel work

// One tensor: contiguous [rows, cols] elements (cols = its last dim) of dtype `dtype`.
struct BlockOperand {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t first_chunk = 0;  // filled by plan_block_chunks
};

GAPMON_HD int64_t block_chunks_for(const BlockOperand& op) {
  const int64_t groups = op.rows * groups_per_row(op.cols);
  return groups == 0 ? 1 : (groups + kGroupsPerChunk - 1) / kGroupsPerChunk;  // an empty tensor owns a chunk
}

inline int64_t plan_block_chunks(BlockOperand* ops, int64_t n) {
  int64_t next = 0;
  for (int64_t i = 0; i < n; ++i) {
    ops[i].first_chunk = next;
    next += block_chunks_for(ops[i]);
  }
  return next;
}

GAPMON_HD int64_t find_block_operand(const BlockOperand* ops, int64_t n, int64_t chunk) {
  return owner_of_chunk(ops, n, chunk);
}

// Loads group `group` of `op` (widened to double) into xs; returns its number of elements.
template <typename T>
GAPMON_HD int load_group(const BlockOperand& op, int64_t group, double* xs) {
  const int64_t per_row = groups_per_row(op.cols);
  const int64_t row = group / per_row, first = (group % per_row) * kGroupElems;
  const int n = static_cast<int>(op.cols - first < kGroupElems ? op.cols - first : kGroupElems);
  const T* p = static_cast<const T*>(op.data) + row * op.cols + first;
  for (int i = 0; i < n; ++i) xs[i] = widen(p[i]);
  return n;
}

GAPMON_HD int load_group_any(const BlockOperand& op, int64_t group, double* xs) {
  switch (op.dtype) {
    case DType::kFloat64: return load_group<double>(op, group, xs);
    case DType::kFloat16: return load_group<Half>(op, group, xs);
    case DType::kBFloat16: return load_group<BF16>(op, group, xs);
    default: return load_group<float>(op, group, xs);
  }
}

// ---------------------------------------------------------------- the float32 path
// Tensors of float32 or narrower take this path: the same casts as cast_block (the same counts; the error
// sums in another order), written as fixed-length loops over a group's 32 lanes that vectorise, with the
// rounding done on float32 bits. float64 tensors take cast_block.

// c ? x : y on the bits (no float select, which would keep a loop from vectorising).
GAPMON_HD float select_f32(bool c, float x, float y) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return f32_from_bits((bits_of(x) & m) | (bits_of(y) & ~m));
}

// v >= 0 (float32, +inf included) rounded to nearest even onto the grid of a format with `mantissa_bits` and
// smallest normal `min_normal` (no saturation): v + c, with c = 2^(e + 23 - mantissa_bits) for v's binade e (at
// least the smallest normal's), has the format's spacing at v as its float32 spacing, so the addition rounds v
// to the grid and subtracting c again is exact. c is capped at 2^127 (finite): only values far above every
// format's largest (from 2^105) reach the cap, and they stay above it, so they saturate, +inf included.
GAPMON_HD float round_to_grid(float v, int mantissa_bits, float min_normal) {
  const uint32_t shift = static_cast<uint32_t>(23 - mantissa_bits) << 23, top = 0x7F000000u - shift;
  uint32_t e = bits_of(v) & 0x7F800000u;
  const uint32_t lo = bits_of(min_normal);
  e = e > lo ? e : lo;
  e = e < top ? e : top;
  const float c = f32_from_bits(e + shift);
  return (v + c) - c;
}

constexpr int kLanes = 8;

// A format's sums over many groups, lane by lane (element i of a group in lane i % kLanes), folded into a
// BlockRow at the end in lane order.
struct LaneRow {
  double error_sq[kLanes] = {}, signal_sq[kLanes] = {};
  int64_t nonzero = 0, to_zero = 0, subnormal = 0, saturated = 0, blocks = 0, scale_under = 0, scale_over = 0;
  float min_nonzero = INFINITY;
  double max_ratio = 0;

  GAPMON_HD void fold_into(BlockRow& row) const {
    BlockRow r;
    for (int k = 0; k < kLanes; ++k) r.v[bErrorSq] += error_sq[k], r.v[bSignalSq] += signal_sq[k];
    r.v[bNonzero] = static_cast<double>(nonzero);
    r.v[bToZero] = static_cast<double>(to_zero);
    r.v[bSubnormal] = static_cast<double>(subnormal);
    r.v[bSaturated] = static_cast<double>(saturated);
    r.v[bBlocks] = static_cast<double>(blocks);
    r.v[bScaleUnderflow] = static_cast<double>(scale_under);
    r.v[bScaleOverflow] = static_cast<double>(scale_over);
    r.v[bMinNonzero] = min_nonzero;
    r.v[bMaxBlockRatio] = max_ratio;
    row.merge(r);
  }
};

// 2^k as float32 (k in [-149, 127], subnormals included) and as float64 (k in [-1022, 1023]), on the bits.
GAPMON_HD float pow2f(int k) {
  return k >= -126 ? f32_from_bits(static_cast<uint32_t>(k + 127) << 23) : f32_from_bits(1u << (k + 149));
}
GAPMON_HD double pow2d(int k) {
  union {
    uint64_t u;
    double d;
  } pun{static_cast<uint64_t>(k + 1023) << 52};
  return pun.d;
}

// floor(log2(a)) of a finite float32 a > 0, from its exponent bits (subnormals: frexp).
GAPMON_HD int floor_log2_f32(float a) {
  const int e = static_cast<int>((bits_of(a) >> 23) & 0xFFu);
  return e != 0 ? e - 127 : floor_log2(a);
}

// A format's constants for the float32 path, computed once per chunk.
struct FormatConsts {
  BlockFormat format;
  int mantissa_bits, max_exp, block;
  float top, min_normal;
  double tensor_scale;  // NVFP4: g; current scaling: s
};

GAPMON_HD FormatConsts format_consts(BlockFormat f, double tensor_scale_value) {
  const ElementFormat ef = element_format(f);
  return {f, ef.mantissa_bits, ef.max_exp, block_elems(f), static_cast<float>(ef.max_finite), pow2f(ef.min_normal_exp),
          tensor_scale_value};
}

// The largest and the smallest non-zero magnitude of each 16-element half of a group (the group's loader takes
// them on the bits: non-negative floats order as their bits, and integer min/max reductions vectorise).
struct GroupRange {
  float amax[2], amin[2];  // amin: +inf for a half without a non-zero element
};

// One block's scale (as cast_block computes it) from its largest finite magnitude, for the float32 path: v = a * mul
// (float32), dequantised q * dq_mul / dq_div; whether the scale under- or overflows.
struct BlockScale {
  float mul = 1;
  double dq_mul = 1, dq_div = 1;
  bool under = false, over = false;
};

GAPMON_HD BlockScale block_scale_of(float amax, const FormatConsts& c) {
  BlockScale s;
  if (c.format == BlockFormat::kMxfp8E4m3 || c.format == BlockFormat::kMxfp8E5m2 || c.format == BlockFormat::kMxfp4) {
    int x_exp = amax > 0 ? floor_log2_f32(amax) - c.max_exp : -127;
    if (x_exp < -127) s.under = true, x_exp = -127;
    if (x_exp > 127) s.over = true, x_exp = 127;
    s.mul = pow2f(-x_exp);  // 2^-127 .. 2^127: exact in float32
    s.dq_mul = pow2d(x_exp);
  } else if (c.format == BlockFormat::kNvfp4) {
    const float g = static_cast<float>(c.tensor_scale);
    const double sc = cast_magnitude(static_cast<double>((amax / 6.0f) * g), e4m3(), s.over);
    s.under = amax > 0 && sc < 0.015625;  // e4m3's smallest normal, 2^-6
    if (sc == 0) {
      s.mul = 0;
    } else {
      s.mul = finite_scale(g / static_cast<float>(sc));
      s.dq_mul = sc;
      s.dq_div = g;
    }
  } else {
    s.mul = static_cast<float>(c.tensor_scale);
    s.dq_div = c.tensor_scale;
  }
  return s;
}

// One block's scale from its largest and smallest non-zero magnitudes, counting the block, its scale flags and its
// range into acc.
GAPMON_HD void block_scale_f32(float amax, float amin, const FormatConsts& c, LaneRow& acc, float& mul, double& dq_mul,
                               double& dq_div) {
  acc.blocks += 1;
  if (amax > 0) {
    const double ratio = static_cast<double>(amax) / amin;
    acc.max_ratio = ratio > acc.max_ratio ? ratio : acc.max_ratio;
    acc.min_nonzero = amin < acc.min_nonzero ? amin : acc.min_nonzero;
  }
  const BlockScale s = block_scale_of(amax, c);
  acc.scale_under += s.under ? 1 : 0;
  acc.scale_over += s.over ? 1 : 0;
  mul = s.mul, dq_mul = s.dq_mul, dq_div = s.dq_div;
}

// One element's rounding on the float32 path: v = a * mul rounded to nearest, ties to even, onto the format's grid,
// saturated (q); returns its flags (non-zero | cast to zero << 8 | to a subnormal << 16 | saturated << 24: four
// counts of at most 32 add up a byte each). Branch-free (selects on the bits), so that loops over elements
// vectorise. v <= 2^128 * 2^127 is finite or +inf, and +inf rounds on the bits to itself (its mantissa is zero),
// above top: saturated.
GAPMON_HD int quantise_f32(float a, float mul, const FormatConsts& c, float& q) {
  const float v = a * mul;
  const float r = round_to_grid(v, c.mantissa_bits, c.min_normal);
  const int sat = r > c.top;
  q = select_f32(sat, c.top, r);
  const int nz = a > 0;
  return nz | ((nz & (q == 0)) << 8) | ((nz & (q > 0) & (q < c.min_normal)) << 16) | ((nz & sat) << 24);
}

// One element's cast on the float32 path, kind 0 (MX: q * dq_mul), 1 (NVFP4: q * dq_mul / dq_div) or 2 (current:
// q / dq_div): its flags (quantise_f32), and err = a - dequantised(q) in float64.
template <int kKind>
GAPMON_HD int cast_element_f32(float a, float mul, double dq_mul, double dq_div, const FormatConsts& c, double& err) {
  float q;
  const int flags = quantise_f32(a, mul, c, q);
  if (kKind == 0) {
    // MX: q * 2^X is a float32 (|X| <= 127 and q has at most 4 significant bits; for float32 inputs it stays
    // below 2^128) within a factor 2 of a, so a - q * 2^X is exact in float32 (Sterbenz).
    err = static_cast<double>(a - q * (1.0f / mul));
  } else if (kKind == 1) {
    err = static_cast<double>(a) - static_cast<double>(q) * dq_mul / dq_div;
  } else {
    err = static_cast<double>(a) - static_cast<double>(q) / dq_div;
  }
  return flags;
}

// The element loop of a group: kind 0 (MX: q * dq_mul), 1 (NVFP4: q * dq_mul / dq_div), 2 (current: q / s).
// A group's scales: one per lane (NVFP4's two blocks), or one for the whole group (a 32-element block), which
// the element loop then reads from registers.
struct LaneScales {
  const float* m;
  const double *dm, *dd;
  GAPMON_HD float mul(int i) const { return m[i]; }
  GAPMON_HD double dq_mul(int i) const { return dm[i]; }
  GAPMON_HD double dq_div(int i) const { return dd[i]; }
};
struct GroupScale {
  float m;
  double dm, dd;
  GAPMON_HD float mul(int) const { return m; }
  GAPMON_HD double dq_mul(int) const { return dm; }
  GAPMON_HD double dq_div(int) const { return dd; }
};

template <int kKind, typename Scales>
GAPMON_HD void cast_lanes(const float (&a)[kGroupElems], const Scales& sc, const FormatConsts& c, LaneRow& acc) {
  // Element-wise (cast_element_f32), then the squares added lane by lane.
  int flags[kGroupElems];
  double err_sq[kGroupElems], sig_sq[kGroupElems];
  for (int i = 0; i < kGroupElems; ++i) {
    double err;
    flags[i] = cast_element_f32<kKind>(a[i], sc.mul(i), sc.dq_mul(i), sc.dq_div(i), c, err);
    err_sq[i] = err * err;
    sig_sq[i] = static_cast<double>(a[i]) * a[i];
  }
  int packed = 0;  // four counts of at most 32, a byte each
  for (int i = 0; i < kGroupElems; ++i) packed += flags[i];
  acc.nonzero += packed & 0xFF, acc.to_zero += (packed >> 8) & 0xFF, acc.subnormal += (packed >> 16) & 0xFF;
  acc.saturated += (packed >> 24) & 0xFF;
  for (int j = 0; j < kGroupElems; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) acc.error_sq[k] += err_sq[j + k], acc.signal_sq[k] += sig_sq[j + k];
  }
}

// A group of n <= 32 magnitudes (a[n..32) zero; non-finite elements already zeroed and counted) cast to c's
// format.
GAPMON_HD void cast_group_f32(const float (&a)[kGroupElems], int n, const GroupRange& range, const FormatConsts& c,
                              LaneRow& acc) {
  if (c.block == kGroupElems) {  // one block: its scale in registers
    GroupScale sc{1, 0, 1};
    if (n > 0) {
      block_scale_f32(range.amax[0] > range.amax[1] ? range.amax[0] : range.amax[1],
                      range.amin[0] < range.amin[1] ? range.amin[0] : range.amin[1], c, acc, sc.m, sc.dm, sc.dd);
    }
    if (c.format == BlockFormat::kCurrentE4m3 || c.format == BlockFormat::kCurrentE5m2) cast_lanes<2>(a, sc, c, acc);
    else cast_lanes<0>(a, sc, c, acc);
    return;
  }
  float mul[kGroupElems];
  double dq_mul[kGroupElems], dq_div[kGroupElems];
  const int b = c.block;
  for (int start = 0; start < kGroupElems; start += b) {
    float m = 1;  // padding lanes: a = 0 casts to 0 with nothing to divide by zero
    double dm = 0, dd = 1;
    if (start < n) block_scale_f32(range.amax[start / 16], range.amin[start / 16], c, acc, m, dm, dd);
    for (int i = start; i < start + b; ++i) mul[i] = m, dq_mul[i] = dm, dq_div[i] = dd;
  }
  cast_lanes<1>(a, LaneScales{mul, dq_mul, dq_div}, c, acc);
}

// Loads group `group` of `op` as float32 magnitudes, zero-padded to 32; non-finite ones zeroed and counted.
template <typename T>
GAPMON_HD int load_group_f32(const BlockOperand& op, int64_t group, float (&a)[kGroupElems], GroupRange& range,
                             int64_t& nonfinite) {
  const int64_t per_row = groups_per_row(op.cols);
  const int64_t row = group / per_row, first = (group % per_row) * kGroupElems;
  const int n = static_cast<int>(op.cols - first < kGroupElems ? op.cols - first : kGroupElems);
  const T* p = static_cast<const T*>(op.data) + row * op.cols + first;
  float x[kGroupElems];
  if (n == kGroupElems) {
    for (int i = 0; i < kGroupElems; ++i) x[i] = static_cast<float>(widen(p[i]));
  } else {
    for (int i = 0; i < kGroupElems; ++i) x[i] = i < n ? static_cast<float>(widen(p[i])) : 0.0f;
  }
  int bad = 0;
  for (int i = 0; i < kGroupElems; ++i) {
    const float m = fabsf(x[i]);
    const int finite = m <= 3.4028234663852886e38f;
    bad += 1 - finite;
    a[i] = finite ? m : 0.0f;
  }
  nonfinite += bad;
  for (int h = 0; h < 2; ++h) {
    uint32_t top = 0, low = 0x7F800000u;  // +inf: no non-zero element
    for (int i = 16 * h; i < 16 * h + 16; ++i) {
      const uint32_t b = bits_of(a[i]);
      const uint32_t nz = b - 1u < 0x7F800000u ? b : 0x7F800000u;  // zero (b - 1 wraps) counts as +inf
      top = b > top ? b : top;
      low = nz < low ? nz : low;
    }
    range.amax[h] = f32_from_bits(top);
    range.amin[h] = f32_from_bits(low);
  }
  return n;
}

// The rows of formats[0, num_formats) over groups [begin, end) of `op` (tensor amax `amax`), added to rows.
GAPMON_HD void cast_groups(const BlockOperand& op, int64_t begin, int64_t end, const BlockFormat* formats,
                           int num_formats, double amax, BlockRow* rows) {
  double scales[kNumBlockFormats];
  for (int f = 0; f < num_formats; ++f) scales[f] = tensor_scale(formats[f], amax);
  if (op.dtype == DType::kFloat64) {
    double xs[kGroupElems];
    for (int64_t g = begin; g < end; ++g) {
      const int n = load_group_any(op, g, xs);
      for (int f = 0; f < num_formats; ++f) cast_group(xs, n, formats[f], true, scales[f], rows[f]);
    }
    return;
  }
  LaneRow acc[kNumBlockFormats];
  FormatConsts consts[kNumBlockFormats];
  for (int f = 0; f < num_formats; ++f) consts[f] = format_consts(formats[f], scales[f]);
  float a[kGroupElems];
  GroupRange range;
  int64_t nonfinite = 0;
  for (int64_t g = begin; g < end; ++g) {
    int n;
    if (op.dtype == DType::kFloat32) n = load_group_f32<float>(op, g, a, range, nonfinite);
    else if (op.dtype == DType::kBFloat16) n = load_group_f32<BF16>(op, g, a, range, nonfinite);
    else n = load_group_f32<Half>(op, g, a, range, nonfinite);
    for (int f = 0; f < num_formats; ++f) cast_group_f32(a, n, range, consts[f], acc[f]);
  }
  for (int f = 0; f < num_formats; ++f) {
    acc[f].fold_into(rows[f]);
    rows[f].v[bNonfinite] += static_cast<double>(nonfinite);
  }
}

}  // namespace core
}  // namespace gapmon
