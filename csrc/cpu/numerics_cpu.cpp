// CPU implementation of the numerics ops (csrc/core/numerics.h): the exponent histogram and
// central moments of many tensors in one at::parallel_for region over fixed-size chunks, each
// chunk's partial merged in chunk order, so the result is the same bits whatever the threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <array>
#include <cstring>
#include <vector>

#include "../core/numerics.h"
#include "../tensor_views.h"

namespace gapmon {
namespace {

using core::Moments;

// Elements per block of power sums: each block is shifted by the running mean of the chunk, so
// that the sums of third and fourth powers do not cancel.
constexpr int64_t kBlock = 256;

struct ChunkNumerics {
  std::array<int64_t, core::kNumBins> bins{};
  Moments moments;
};

// Element i of a run as (value, bin).
template <typename T>
inline void load(const T* p, double& value, int& bin);

template <>
inline void load<float>(const float* p, double& value, int& bin) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  bin = core::exponent_bin_f32(bits);
  value = *p;
}

template <>
inline void load<double>(const double* p, double& value, int& bin) {
  uint64_t bits;
  std::memcpy(&bits, p, sizeof bits);
  bin = core::exponent_bin_f64(bits);
  value = *p;
}

template <>
inline void load<at::BFloat16>(const at::BFloat16* p, double& value, int& bin) {
  const uint32_t bits = static_cast<uint32_t>(p->x) << 16;  // bfloat16 is float32's top half
  float f;
  std::memcpy(&f, &bits, sizeof f);
  bin = core::exponent_bin_f32(bits);
  value = f;
}

template <>
inline void load<at::Half>(const at::Half* p, double& value, int& bin) {
  const float f = static_cast<float>(*p);  // exact
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bin = core::exponent_bin_f32(bits);
  value = f;
}

template <typename T>
ChunkNumerics chunk_numerics(const core::StridedView& v, int64_t lo, int64_t hi) {
  ChunkNumerics out;
  const T* base = static_cast<const T*>(v.data);
  double n = 0, shift = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0;
  auto flush = [&]() {
    out.moments = core::merge(out.moments, core::from_power_sums(n, shift, s1, s2, s3, s4));
    n = s1 = s2 = s3 = s4 = 0;
  };
  core::RowCursor cursor(v, 0, lo, hi);
  int64_t offset, len, stride;
  while (cursor.next(offset, len, stride)) {
    const T* p = base + offset;
    for (int64_t i = 0; i < len; ++i, p += stride) {
      double x;
      int bin;
      load<T>(p, x, bin);
      ++out.bins[bin];
      if (n == 0) {  // a new block: shift by the running mean (or its first element)
        const double running = out.moments.count > 0 ? out.moments.mean : x;
        shift = core::is_finite(running) ? running : 0.0;
      }
      const double d = x - shift, d2 = d * d;
      n += 1;
      s1 += d;
      s2 += d2;
      s3 += d2 * d;
      s4 += d2 * d2;
      if (n == kBlock) flush();
    }
  }
  if (n > 0) flush();
  return out;
}

ChunkNumerics chunk_numerics_of(const core::StridedView& v, int64_t lo, int64_t hi) {
  switch (v.dtype) {
    case core::DType::kFloat32: return chunk_numerics<float>(v, lo, hi);
    case core::DType::kFloat64: return chunk_numerics<double>(v, lo, hi);
    case core::DType::kBFloat16: return chunk_numerics<at::BFloat16>(v, lo, hi);
    case core::DType::kFloat16: return chunk_numerics<at::Half>(v, lo, hi);
  }
  return {};
}

// [N, kNumNumericsColumns] float64 rows: bins (exact integers below 2^53), then the moments.
at::Tensor numerics_states_cpu(at::TensorList xs) {
  std::vector<at::Tensor> keep_alive;
  auto views = views_of(xs, "numerics_states", keep_alive);
  const int64_t num_views = static_cast<int64_t>(views.size());
  at::Tensor out = at::zeros({num_views, core::kNumNumericsColumns}, at::kDouble);
  if (num_views == 0) return out;
  const int64_t total_chunks = core::plan_chunks(views.data(), num_views);
  std::vector<ChunkNumerics> chunks(total_chunks);
  at::parallel_for(0, total_chunks, 1, [&](int64_t begin, int64_t end) {
    int64_t vi = core::find_view(views.data(), num_views, begin);
    for (int64_t c = begin; c < end; ++c) {
      while (c >= views[vi].first_chunk + views[vi].chunks_per_item) ++vi;
      const core::StridedView& v = views[vi];
      const int64_t lo = (c - v.first_chunk) * core::kChunkElems;
      const int64_t hi = std::min(lo + core::kChunkElems, v.item_numel);
      if (lo < hi) chunks[c] = chunk_numerics_of(v, lo, hi);
    }
  });
  double* rows = out.data_ptr<double>();
  for (int64_t i = 0; i < num_views; ++i) {
    const core::StridedView& v = views[i];
    double* row = rows + v.out_row * core::kNumNumericsColumns;
    std::array<int64_t, core::kNumBins> bins{};
    Moments m;
    for (int64_t k = 0; k < v.chunks_per_item; ++k) {  // chunk order: deterministic moments
      const ChunkNumerics& c = chunks[v.first_chunk + k];
      for (int b = 0; b < core::kNumBins; ++b) bins[b] += c.bins[b];
      m = core::merge(m, c.moments);
    }
    for (int b = 0; b < core::kNumBins; ++b) row[b] = static_cast<double>(bins[b] * v.repeat);
    core::store_moments(core::repeat(m, static_cast<double>(v.repeat)), row);
  }
  return out;
}

// [R, N, kNumNumericsColumns] rows (R partial results of N tensors) -> [N, ...], merged in order.
at::Tensor merge_numerics_states_cpu(const at::Tensor& states) {
  TORCH_CHECK_VALUE(states.scalar_type() == at::kDouble && states.dim() == 3 &&
                        states.size(2) == core::kNumNumericsColumns,
                    "gapmon.merge_numerics_states: expected float64 [parts, tensors, ", core::kNumNumericsColumns,
                    "] rows (from numerics_states), got ", states.scalar_type(), " ", states.sizes());
  const at::Tensor s = states.contiguous();
  const int64_t parts = s.size(0), n = s.size(1);
  at::Tensor out = at::zeros({n, core::kNumNumericsColumns}, at::kDouble);
  double* o = out.data_ptr<double>();
  const double* p = s.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    Moments m;
    double* row = o + i * core::kNumNumericsColumns;
    for (int64_t r = 0; r < parts; ++r) {
      const double* part = p + (r * n + i) * core::kNumNumericsColumns;
      for (int b = 0; b < core::kNumBins; ++b) row[b] += part[b];
      m = core::merge(m, core::load_moments(part));
    }
    core::store_moments(m, row);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gapmon, CPU, m) {
  m.impl("numerics_states", &numerics_states_cpu);
  m.impl("merge_numerics_states", &merge_numerics_states_cpu);
}

}  // namespace gapmon
