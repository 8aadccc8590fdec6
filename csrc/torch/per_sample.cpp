// Per-sample squared gradient norms of Linear and Embedding weights without materialising
// per-sample gradients. Composite ops built on ATen batched matmuls (so they run on CPU and
// CUDA alike), summed in float32 or wider whatever the input dtype (16-bit inputs: wide_bmm).
// The ghost forms build the [T, T] Grams whole (their upper triangle, in bands of rows, when the products are
// large), for chunks of samples whose Grams fit 64 MiB, and tile over the sequence only when one sample's Gram is
// larger, so that only [B, tile, tile] blocks exist.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <tuple>
#include <vector>

#include "../core/stats_state.h"
#include "../cpu/per_sample_kernels.h"
#include "message.h"

namespace gapmon {
namespace {

// Grams are built whole, for as many samples at a time as keep a chunk's Grams within this many
// elements (64 MiB in float32): one batched product pair per chunk (per band, below), O(B * T^2 / 2^24)
// launches per layer. Only a sequence whose one Gram is larger is tiled, into kDefaultTile x kDefaultTile blocks.
constexpr int64_t kWholeGramElems = int64_t(1) << 24;
constexpr int64_t kDefaultTile = 256;

// The Grams are symmetric, so a whole Gram is built as kBands bands of rows, each from its diagonal on: the
// band's square on the diagonal counted once, the rest of it twice, (kBands + 1) / (2 kBands) of the products
// (5/8), for kBands times the launches. Worth it once the products outweigh the launches: from kBandMacsCpu
// multiply-adds of a chunk's Grams on the CPU (an op costs ~10 us there; the LM head of a d=128 model at
// T=128, 8 x 128^2 x 4224 = 2^29: 5.9 -> 4.3 ms), from kBandMacsCuda on a GPU, where an op costs a launch
// (~5 us) that tensor cores spend on ~10^9 multiply-adds.
constexpr int64_t kBands = 4;
constexpr int64_t kBandMacsCpu = int64_t(1) << 25;
constexpr int64_t kBandMacsCuda = int64_t(1) << 33;

// Samples per chunk of whole Grams, or 0 when the sequence must be tiled: no tile (the default)
// picks whole Grams when one sample's fits kWholeGramElems; a given tile, which must be positive,
// always tiles (tests pass small ones to exercise the tiling).
int64_t samples_per_chunk(std::optional<int64_t> tile, int64_t t, const char* op) {
  TORCH_CHECK_VALUE(!tile || *tile > 0, message("gapmon.", op,
                                                ": tile must be a positive number of positions (or None: "
                                                "automatic), got ",
                                                tile.value_or(0)));
  if (tile || t * t > kWholeGramElems) return 0;
  return std::max<int64_t>(1, kWholeGramElems / std::max<int64_t>(1, t * t));
}

bool is_16bit(const at::Tensor& x) { return x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16; }

// The dtype the products are summed in: float32 for 16-bit inputs, else the inputs' own.
at::ScalarType sum_dtype(const at::Tensor& x) { return is_16bit(x) ? at::kFloat : x.scalar_type(); }

// x @ y per batch, in float32 or wider. 16-bit CUDA inputs of one dtype run on tensor cores with
// float32 accumulation and a float32 result (bmm's out_dtype): no float32 copy of the activations
// or gradients. Elsewhere (CPU, or mixed dtypes) 16-bit operands are widened here, one tile at a
// time, rather than whole by the caller.
at::Tensor wide_bmm(const at::Tensor& x, const at::Tensor& y) {
  if (is_16bit(x) && x.scalar_type() == y.scalar_type() && x.is_cuda()) return at::bmm(x, y, at::kFloat);
  const at::ScalarType want = at::promote_types(sum_dtype(x), sum_dtype(y));
  return at::bmm(x.to(want), y.to(want));
}

void check_pair(const at::Tensor& a, const at::Tensor& g, const char* op) {
  TORCH_CHECK_VALUE(
      a.dim() == 3 && g.dim() == 3 && a.size(0) == g.size(0) && a.size(1) == g.size(1),
      message("gapmon.", op, ": expected [B, T, d] and [B, T, p] tensors, got ", a.sizes(), " and ", g.sizes()));
}

// The sums over the [T, T] Gram products of each of b samples ([b], `options`), from products(s, n, i, ni, j, nj) ->
// [n, ni, nj], the products at rows [i, i + ni) and columns [j, j + nj) of samples [s, s + n), over the upper
// triangle (the Grams are symmetric): chunks of samples whose Grams are built whole, in bands of rows when a chunk's
// Grams cost more than the band threshold (`width` multiply-adds per Gram entry), or (a positive tile, or a sequence
// too long) tile pairs, off-diagonal entries counted twice. Whole Grams start from the first band's sums, not from
// zeros, and one chunk's sums are the result: on a GPU each op is a launch.
template <typename Products>
at::Tensor sum_gram_blocks(int64_t b, const at::TensorOptions& options, int64_t t, int64_t width,
                           std::optional<int64_t> given_tile, const char* op, const Products& products) {
  const int64_t step = samples_per_chunk(given_tile, t, op);
  if (b == 0 || t == 0) return at::zeros({b}, options);
  if (step > 0) {
    const int64_t threshold = options.device().is_cuda() ? kBandMacsCuda : kBandMacsCpu;
    std::vector<at::Tensor> chunks;
    for (int64_t s = 0; s < b; s += step) {
      const int64_t n = std::min(step, b - s);
      const bool banded = t >= kBands && n * t * t * width >= threshold;
      const int64_t height = banded ? (t + kBands - 1) / kBands : t;
      at::Tensor sum;
      for (int64_t i = 0; i < t; i += height) {
        const int64_t rows = std::min(height, t - i);
        at::Tensor p = products(s, n, i, rows, i, t - i);
        if (rows < t - i) p.narrow(2, rows, t - i - rows).mul_(2.0);  // right of the band's square: the mirror's share
        at::Tensor part = p.sum({1, 2});
        sum = sum.defined() ? sum.add_(part) : part;
      }
      chunks.push_back(sum);
    }
    return chunks.size() == 1 ? chunks[0] : at::cat(chunks);
  }
  at::Tensor out = at::zeros({b}, options);
  const int64_t tile = given_tile.value_or(kDefaultTile);
  for (int64_t i = 0; i < t; i += tile) {
    for (int64_t j = i; j < t; j += tile) {
      out.add_(products(0, b, i, std::min(tile, t - i), j, std::min(tile, t - j)).sum({1, 2}), i == j ? 1.0 : 2.0);
    }
  }
  return out;
}

// sum_{t,s} (a_t . a_s)(g_t . g_s) per sample: the squared Frobenius norm of g^T a, via Grams. With `bias`,
// sum_{t,s} (a_t . a_s + 1)(g_t . g_s): the weight's and the bias's together (the bias is the weight of an input
// that is 1 at every position, and ||sum_t g_t||^2 is the sum of g's Gram), one op added to the Grams instead of a
// reduction of g of its own.
at::Tensor ghost_norm_sq(const at::Tensor& a, const at::Tensor& g, std::optional<int64_t> tile, bool bias) {
  check_pair(a, g, "ghost_norm_sq");
  return sum_gram_blocks(a.size(0), a.options().dtype(at::promote_types(sum_dtype(a), sum_dtype(g))), a.size(1),
                         a.size(2) + g.size(2), tile, "ghost_norm_sq",
                         [&](int64_t s, int64_t n, int64_t i, int64_t ni, int64_t j, int64_t nj) {
    const at::Tensor as = a.narrow(0, s, n), gs = g.narrow(0, s, n);
    at::Tensor a_gram = wide_bmm(as.narrow(1, i, ni), as.narrow(1, j, nj).transpose(1, 2));
    if (bias) a_gram.add_(1.0);
    return a_gram.mul_(wide_bmm(gs.narrow(1, i, ni), gs.narrow(1, j, nj).transpose(1, 2)));
  });
}

// Sum of the squares of each x[b], by gapmon's own statistics kernel: one read of x, float64 sums
// (x.square().sum() writes and reads x once more; ATen's float32 vector_norm is off by ~1e-4 at 10^6
// elements on the CPU).
at::Tensor sum_of_squares(const at::Tensor& x) {
  static const auto instance_stats = c10::Dispatcher::singleton()
                                         .findSchemaOrThrow("gapmon::instance_stats", "")
                                         .typed<at::Tensor(const at::Tensor&, int64_t)>();
  return instance_stats.call(x, 1).select(1, core::kNorm).square();
}

// Over the x[b] ([n, ...], a CPU float32/float64 tensor): writes their sum over b into *sum (x[0]'s shape and
// dtype, contiguous; null: no sum) and adds the squared norm of each to sq[b] (float64), in one read of x by
// cpu::sum_rows_and_squares, in chunks of kSumChunk elements whose squared sums are added in chunk order (the
// same bits whatever the threads).
constexpr int64_t kSumChunk = 4096;
void sum_and_squares_into(const at::Tensor& x, at::Tensor* sum, double* sq) {
  const at::Tensor xc = x.contiguous();
  const int64_t n = xc.size(0), per = xc.numel() / std::max<int64_t>(1, n);
  const int64_t chunks = (per + kSumChunk - 1) / kSumChunk;
  if (n == 0 && sum != nullptr) sum->zero_();
  std::vector<double> partial(chunks * n);
  double* part = partial.data();
  AT_DISPATCH_FLOATING_TYPES(xc.scalar_type(), "sum_and_squares", [&] {
    const scalar_t* in = xc.const_data_ptr<scalar_t>();
    scalar_t* out = sum != nullptr ? sum->data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        cpu::sum_rows_and_squares(in, n, per, c * kSumChunk, std::min(per, (c + 1) * kSumChunk), out, part + c * n);
      }
    });
  });
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t b = 0; b < n; ++b) sq[b] += part[c * n + b];
  }
}

// The per-sample gradients g_b^T a_b of samples [0, n) of a [n, T, d] and g [n, T, p] on the CPU, formed a tile of
// rows of p at a time, each tile read back while it is in cache (kTileElems elements, 1 MiB in float32): their
// squared norms added to sq (float64 [n]) and, when `sum` is given ([p, d], contiguous), their sum over the
// samples written into it. Forming all [n, p, d] first and reading them back cost a write and a read of memory as
// large as the products (the LM head's [8, 4096, 128]: 16 MB; measured 0.35 ms past the products, ~0 in tiles).
constexpr int64_t kTileElems = int64_t(1) << 18;
void products_in_tiles(const at::Tensor& a, const at::Tensor& g, at::Tensor* sum, double* sq) {
  const int64_t n = a.size(0), p = g.size(2), d = a.size(2);
  const int64_t tile = std::max<int64_t>(1, kTileElems / std::max<int64_t>(1, n * d));
  const at::Tensor aw = a.to(at::promote_types(sum_dtype(a), sum_dtype(g)));  // widened once, not per tile
  for (int64_t r = 0; r < p; r += tile) {
    const int64_t rows = std::min(tile, p - r);
    at::Tensor part = sum != nullptr ? sum->narrow(0, r, rows) : at::Tensor();
    sum_and_squares_into(wide_bmm(g.narrow(2, r, rows).transpose(1, 2), aw), sum != nullptr ? &part : nullptr, sq);
  }
  if (p == 0 && sum != nullptr) sum->zero_();
}

// Whether products_in_tiles serves these operands: CPU tensors whose products are float32 or float64.
bool in_tiles(const at::Tensor& a, const at::Tensor& g) {
  const at::ScalarType t = at::promote_types(sum_dtype(a), sum_dtype(g));
  return a.is_cpu() && g.is_cpu() && (t == at::kFloat || t == at::kDouble);
}

// The per-sample gradients g_b^T a_b, formed in batches of samples under `max_elements` elements: their squared
// norms [B] and, `with_sum`, their sum over the batch [p, d] (else an undefined tensor). On the CPU in cache-sized
// tiles (products_in_tiles); elsewhere each batch whole, read by the statistics kernel and ATen's sum. Sums in
// float32 or wider (16-bit inputs: wide_bmm).
std::tuple<at::Tensor, at::Tensor> direct_products(const at::Tensor& a, const at::Tensor& g, int64_t max_elements,
                                                   bool with_sum, const char* op) {
  check_pair(a, g, op);
  TORCH_CHECK_VALUE(max_elements > 0, message("gapmon.", op, ": max_elements must be positive, got ", max_elements));
  const int64_t b = a.size(0), p = g.size(2), d = a.size(2);
  const int64_t step = std::max<int64_t>(1, max_elements / std::max<int64_t>(1, p * d));
  const auto wide = a.options().dtype(at::promote_types(sum_dtype(a), sum_dtype(g)));
  at::Tensor sq = at::empty({b}, wide);
  at::Tensor grad;  // the first batch's sum, then accumulated
  for (int64_t s = 0; s < b; s += step) {
    const int64_t n = std::min(step, b - s);
    const at::Tensor as = a.narrow(0, s, n), gs = g.narrow(0, s, n);
    at::Tensor batch_sum;
    if (in_tiles(a, g)) {
      at::Tensor batch_sq = at::zeros({n}, a.options().dtype(at::kDouble));
      if (with_sum) batch_sum = at::empty({p, d}, wide);
      products_in_tiles(as, gs, with_sum ? &batch_sum : nullptr, batch_sq.data_ptr<double>());
      sq.narrow(0, s, n).copy_(batch_sq);
    } else {
      const at::Tensor grads = wide_bmm(gs.transpose(1, 2), as);  // [n, p, d]
      sq.narrow(0, s, n).copy_(sum_of_squares(grads));
      if (with_sum) batch_sum = grads.sum(0);
    }
    if (with_sum) grad = grad.defined() ? grad.add_(batch_sum) : batch_sum;
  }
  if (with_sum && !grad.defined()) grad = at::zeros({p, d}, wide);
  return {sq, grad};
}

// ||g_b^T a_b||_F^2 per sample.
at::Tensor direct_norm_sq(const at::Tensor& a, const at::Tensor& g, int64_t max_elements) {
  return std::get<0>(direct_products(a, g, max_elements, false, "direct_norm_sq"));
}

// Book-keeping: the squared norms of the per-sample gradients g_b^T a_b ([B]) and their sum over the
// batch ([p, d], the layer's weight gradient), from one formation of the per-sample gradients.
std::tuple<at::Tensor, at::Tensor> direct_norm_sq_and_grad(const at::Tensor& a, const at::Tensor& g,
                                                           int64_t max_elements) {
  return direct_products(a, g, max_elements, true, "direct_norm_sq_and_grad");
}

// Book-keeping of a Linear whose weight and bias both train: direct_norm_sq_and_grad's squared norms plus each
// sample's bias part ||sum_t g_bt||^2 ([B]), the weight gradient ([p, d]) and the bias gradient sum_b sum_t g_bt ([p],
// summed in float32 or wider): the layer's backward work in one op (on a GPU its launches queued from C++).
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_norm_sq_and_grads(const at::Tensor& a, const at::Tensor& g,
                                                                        int64_t max_elements) {
  auto [sq, grad] = direct_products(a, g, max_elements, true, "linear_norm_sq_and_grads");
  const at::Tensor per_sample = g.sum({1}, false, sum_dtype(g));  // [B, p]: each sample's bias gradient
  sq.add_(per_sample.square().sum(1));
  return {sq, grad, per_sample.sum(0)};
}

// The use check's sketch of a Linear's gradients from its positions a [..., d], g [..., p]: the weight gradient
// sum_{b,t} g_bt a_btᵀ times the probe r [d] (or [d, k]), as Gᵀ(A r) (no [p, d] product formed), and, given r_bias
// ([1] or [1, k]), the bias gradient sum_{b,t} g_bt times it; both [p] (or [p, k]) in r's dtype (an empty tensor for no
// bias). Two matrix-vector products
// and a sum queued from C++ instead of ~10 calls from Python.
std::tuple<at::Tensor, at::Tensor> linear_grad_sketch(const at::Tensor& a, const at::Tensor& g, const at::Tensor& r,
                                                      const std::optional<at::Tensor>& r_bias) {
  TORCH_CHECK_VALUE(
      a.dim() >= 1 && g.dim() == a.dim() && a.sizes().slice(0, a.dim() - 1) == g.sizes().slice(0, g.dim() - 1),
      message("gapmon.linear_grad_sketch: expected [..., d] and [..., p] tensors of the same leading dims, got ",
              a.sizes(), " and ", g.sizes()));
  const int64_t d = a.size(-1), p = g.size(-1);
  TORCH_CHECK_VALUE(
      (r.dim() == 1 || r.dim() == 2) && r.size(0) == d,
      message("gapmon.linear_grad_sketch: expected a probe of ", d, " rows ([d] or [d, k]), got ", r.sizes()));
  const at::Tensor gr = g.reshape({-1, p}).to(r.scalar_type());
  const at::Tensor weight = gr.t().matmul(a.reshape({-1, d}).to(r.scalar_type()).matmul(r));
  if (!r_bias) return {weight, at::empty({0}, r.options())};
  TORCH_CHECK_VALUE(r_bias->size(0) == 1 && r_bias->dim() == r.dim(),
                    message("gapmon.linear_grad_sketch: a bias probe has one ",
                            "row, as the weight's probe has its dims, got ", r_bias->sizes()));
  return {weight, gr.sum(0).reshape({p, 1}).matmul(r_bias->to(r.scalar_type()))};
}

// The squared norms of the per-sample table gradients formed row by row on the CPU (cpu::embedding_row_norms): each
// sample's positions sorted by id and each run of one id summed into its row, in float64, padding rows left out.
// B·T·d additions and B sorts of T, where the Gram pairs cost B·T²·d multiply-adds and B·T² masks; one pass over g,
// no temporaries of its size (a composite of ~25 ATen ops before: 0.2-0.3 ms for [8, 128, 128] on the 2-core VM).
at::Tensor embedding_norm_sq_by_rows(const at::Tensor& ids, const at::Tensor& g, int64_t padding_idx) {
  const int64_t b = g.size(0), t = g.size(1), d = g.size(2);
  const auto wide = g.options().dtype(sum_dtype(g));
  if (b * t == 0) return at::zeros({b}, wide);
  TORCH_CHECK_VALUE(t < (int64_t(1) << 31),
                    message("gapmon.embedding_norm_sq: at most 2^31 - 1 positions per sample, got ", t));
  const at::Tensor id = ids.to(at::kLong).contiguous();
  const at::Tensor rows = g.to(sum_dtype(g)).contiguous();
  at::Tensor out = at::empty({b}, g.options().dtype(at::kDouble));
  std::atomic<bool> ok{true};
  at::parallel_for(0, b, 1, [&](int64_t b0, int64_t b1) {
    const bool fine = rows.scalar_type() == at::kDouble
        ? cpu::embedding_row_norms(id.data_ptr<int64_t>(), rows.data_ptr<double>(), t, d, padding_idx, b0, b1,
                                   out.data_ptr<double>())
        : cpu::embedding_row_norms(id.data_ptr<int64_t>(), rows.data_ptr<float>(), t, d, padding_idx, b0, b1,
                                   out.data_ptr<double>());
    if (!fine) ok = false;
  });
  if (!ok) {
    const auto [lowest, highest] = at::aminmax(id);
    TORCH_CHECK_VALUE(false, message("gapmon.embedding_norm_sq: ids must lie in [0, 2^32), got ",
                                     lowest.item<int64_t>(), " .. ", highest.item<int64_t>()));
  }
  return out.to(wide);
}

// Embedding: per-sample gradient rows are sums of g_t over positions with the same id (rows of
// padding_idx get no gradient), so ||grad||^2 = sum_{t,s: id_t == id_s != pad} g_t . g_s: on the CPU by rows
// (embedding_norm_sq_by_rows), on CUDA (where the pairs' products run on tensor cores, without a sort) or with
// a tile given by the Gram pairs, in whole Grams or tiles.
at::Tensor embedding_norm_sq(const at::Tensor& ids, const at::Tensor& g, int64_t padding_idx, std::optional<int64_t> tile) {
  TORCH_CHECK_VALUE(ids.dim() == 2 && g.dim() == 3 && ids.size(0) == g.size(0) && ids.size(1) == g.size(1),
                    message("gapmon.embedding_norm_sq: expected [B, T] ids and [B, T, d] gradients, got ", ids.sizes(),
                            " and ", g.sizes()));
  if (g.is_cpu() && ids.is_cpu() && !tile) return embedding_norm_sq_by_rows(ids, g, padding_idx);
  const bool padded = padding_idx >= 0;
  const at::Tensor valid = padded ? ids.ne(padding_idx) : at::Tensor();
  return sum_gram_blocks(g.size(0), g.options().dtype(sum_dtype(g)), ids.size(1), g.size(2), tile, "embedding_norm_sq",
                         [&](int64_t s, int64_t n, int64_t i, int64_t ni, int64_t j, int64_t nj) {
    const at::Tensor id = ids.narrow(0, s, n), gs = g.narrow(0, s, n);
    at::Tensor same = id.narrow(1, i, ni).unsqueeze(2).eq(id.narrow(1, j, nj).unsqueeze(1));
    if (padded) {  // pairs of positions with the padding id have no gradient
      const at::Tensor ok = valid.narrow(0, s, n);
      same.logical_and_(ok.narrow(1, i, ni).unsqueeze(2)).logical_and_(ok.narrow(1, j, nj).unsqueeze(1));
    }
    return wide_bmm(gs.narrow(1, i, ni), gs.narrow(1, j, nj).transpose(1, 2)).mul_(same);
  });
}

// An affine normalisation's per-sample gradients over the last dim of x, g [B, T, n] (LayerNorm, or RMSNorm with
// `rms`): (sum_t g_t ⊙ x̂_t, sum_t g_t) [B, n] each, in float32 or wider. On the CPU one read of x and g in float64
// (cpu::affine_norm_sums; x̂, its product and the sums are ~7 ATen ops apart, each a pass over [B, T, n]); elsewhere
// (CUDA, meta) from ATen's own normalisation.
std::tuple<at::Tensor, at::Tensor> affine_norm_sums(const at::Tensor& x, const at::Tensor& g, double eps, bool rms) {
  TORCH_CHECK_VALUE(x.dim() == 3 && g.sizes() == x.sizes(),
                    message("gapmon.affine_norm_sums: expected x and g of one shape "
                            "[B, T, n], got ",
                            x.sizes(), " and ", g.sizes()));
  const at::ScalarType wide = at::promote_types(sum_dtype(x), sum_dtype(g));
  const int64_t b = x.size(0), t = x.size(1), n = x.size(2);
  if (!(x.is_cpu() && g.is_cpu())) {
    const at::Tensor xw = x.to(wide), gw = g.to(wide);
    const at::Tensor xhat = rms ? at::rms_norm(xw, {n}, std::nullopt, eps) : at::layer_norm(xw, {n}, {}, {}, eps);
    return {gw.mul(xhat).sum(1), gw.sum(1)};
  }
  const at::Tensor xw = x.to(wide).contiguous(), gw = g.to(wide).contiguous();
  at::Tensor weight = at::empty({b, n}, x.options().dtype(at::kDouble)), bias = at::empty_like(weight);
  at::parallel_for(0, b, 1, [&](int64_t b0, int64_t b1) {
    if (wide == at::kDouble) {
      cpu::affine_norm_sums(xw.data_ptr<double>(), gw.data_ptr<double>(), t, n, eps, rms, b0, b1,
                            weight.data_ptr<double>(), bias.data_ptr<double>());
    } else {
      cpu::affine_norm_sums(xw.data_ptr<float>(), gw.data_ptr<float>(), t, n, eps, rms, b0, b1,
                            weight.data_ptr<double>(), bias.data_ptr<double>());
    }
  });
  return {weight.to(wide), bias.to(wide)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gapmon, m) {
  m.def("ghost_norm_sq(Tensor a, Tensor g, int? tile=None, bool bias=False) -> Tensor");
  m.def("direct_norm_sq(Tensor a, Tensor g, int max_elements=67108864) -> Tensor");
  m.def("direct_norm_sq_and_grad(Tensor a, Tensor g, int max_elements=67108864) -> (Tensor, Tensor)");
  m.def("linear_norm_sq_and_grads(Tensor a, Tensor g, int max_elements=67108864) -> (Tensor, Tensor, Tensor)");
  m.def("embedding_norm_sq(Tensor ids, Tensor g, int padding_idx=-1, int? tile=None) -> Tensor");
  m.def("affine_norm_sums(Tensor x, Tensor g, float eps, bool rms) -> (Tensor, Tensor)");
  m.def("linear_grad_sketch(Tensor a, Tensor g, Tensor r, Tensor? r_bias=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(gapmon, CompositeExplicitAutograd, m) {
  m.impl("ghost_norm_sq", &ghost_norm_sq);
  m.impl("direct_norm_sq", &direct_norm_sq);
  m.impl("direct_norm_sq_and_grad", &direct_norm_sq_and_grad);
  m.impl("linear_norm_sq_and_grads", &linear_norm_sq_and_grads);
  m.impl("embedding_norm_sq", &embedding_norm_sq);
  m.impl("affine_norm_sums", &affine_norm_sums);
  m.impl("linear_grad_sketch", &linear_grad_sketch);
}

}  // namespace gapmon
