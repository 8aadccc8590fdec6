// Per-sample squared gradient norms of Linear and Embedding weights without materialising
// per-sample gradients. Composite ops built on ATen batched matmuls (so they run on CPU and
// CUDA alike), summed in float32 or wider whatever the input dtype (16-bit inputs: wide_bmm).
// The ghost forms build the [B, T, T] Grams whole when they are small enough (one batched product
// per layer: O(1) launches), and otherwise tile over the sequence so that only [B, tile, tile]
// blocks exist.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>

namespace gapmon {
namespace {

// A Gram of at most this many elements (64 MiB in float32) is built whole by the default tile.
constexpr int64_t kWholeGramElems = int64_t(1) << 24;
constexpr int64_t kDefaultTile = 256;

// tile == 0 (the default) picks the whole sequence when B * T * T fits kWholeGramElems, else
// kDefaultTile; a positive tile is used as given (tests pass small ones to exercise the tiling).
int64_t pick_tile(int64_t tile, int64_t b, int64_t t, const char* op) {
  TORCH_CHECK_VALUE(tile >= 0, "gapmon.", op, ": tile must be 0 (automatic) or positive, got ", tile);
  if (tile > 0) return tile;
  return b * t * t <= kWholeGramElems ? std::max<int64_t>(t, 1) : kDefaultTile;
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
  TORCH_CHECK_VALUE(a.dim() == 3 && g.dim() == 3 && a.size(0) == g.size(0) && a.size(1) == g.size(1), "gapmon.", op,
                    ": expected [B, T, d] and [B, T, p] tensors, got ", a.sizes(), " and ", g.sizes());
}

// sum_{t,s} (a_t . a_s)(g_t . g_s) per sample: the squared Frobenius norm of g^T a, via Grams.
at::Tensor ghost_norm_sq(const at::Tensor& a, const at::Tensor& g, int64_t tile) {
  check_pair(a, g, "ghost_norm_sq");
  const int64_t t = a.size(1);
  tile = pick_tile(tile, a.size(0), t, "ghost_norm_sq");
  at::Tensor out = at::zeros({a.size(0)}, a.options().dtype(at::promote_types(sum_dtype(a), sum_dtype(g))));
  for (int64_t i = 0; i < t; i += tile) {
    const at::Tensor ai = a.narrow(1, i, std::min(tile, t - i));
    const at::Tensor gi = g.narrow(1, i, std::min(tile, t - i));
    for (int64_t j = i; j < t; j += tile) {  // the Grams are symmetric: off-diagonal tiles count twice
      const at::Tensor aj = a.narrow(1, j, std::min(tile, t - j));
      const at::Tensor gj = g.narrow(1, j, std::min(tile, t - j));
      const at::Tensor block = wide_bmm(ai, aj.transpose(1, 2)).mul_(wide_bmm(gi, gj.transpose(1, 2)));
      out.add_(block.sum({1, 2}), i == j ? 1.0 : 2.0);
    }
  }
  return out;
}

// ||g_b^T a_b||_F^2 per sample, forming the per-sample gradients in batches that stay under
// `max_elements` elements.
at::Tensor direct_norm_sq(const at::Tensor& a, const at::Tensor& g, int64_t max_elements) {
  check_pair(a, g, "direct_norm_sq");
  TORCH_CHECK_VALUE(max_elements > 0, "gapmon.direct_norm_sq: max_elements must be positive, got ", max_elements);
  const int64_t b = a.size(0), per_sample = a.size(2) * g.size(2);
  const int64_t step = std::max<int64_t>(1, max_elements / std::max<int64_t>(1, per_sample));
  at::Tensor out = at::empty({b}, a.options().dtype(at::promote_types(sum_dtype(a), sum_dtype(g))));
  for (int64_t s = 0; s < b; s += step) {
    const int64_t n = std::min(step, b - s);
    const at::Tensor grads = wide_bmm(g.narrow(0, s, n).transpose(1, 2), a.narrow(0, s, n));  // [n, p, d]
    out.narrow(0, s, n).copy_(grads.square().sum({1, 2}));
  }
  return out;
}

// Embedding: per-sample gradient rows are sums of g_t over positions with the same id (rows of
// padding_idx get no gradient), so ||grad||^2 = sum_{t,s: id_t == id_s != pad} g_t . g_s.
at::Tensor embedding_norm_sq(const at::Tensor& ids, const at::Tensor& g, int64_t padding_idx, int64_t tile) {
  TORCH_CHECK_VALUE(ids.dim() == 2 && g.dim() == 3 && ids.size(0) == g.size(0) && ids.size(1) == g.size(1),
                    "gapmon.embedding_norm_sq: expected [B, T] ids and [B, T, d] gradients, got ", ids.sizes(), " and ",
                    g.sizes());
  const int64_t t = ids.size(1);
  tile = pick_tile(tile, ids.size(0), t, "embedding_norm_sq");
  const at::Tensor valid = padding_idx >= 0 ? ids.ne(padding_idx) : at::ones_like(ids, ids.options().dtype(at::kBool));
  at::Tensor out = at::zeros({g.size(0)}, g.options().dtype(sum_dtype(g)));
  for (int64_t i = 0; i < t; i += tile) {
    const int64_t ni = std::min(tile, t - i);
    const at::Tensor idi = ids.narrow(1, i, ni), vi = valid.narrow(1, i, ni), gi = g.narrow(1, i, ni);
    for (int64_t j = i; j < t; j += tile) {
      const int64_t nj = std::min(tile, t - j);
      const at::Tensor same = idi.unsqueeze(2).eq(ids.narrow(1, j, nj).unsqueeze(1))
                                  .logical_and_(vi.unsqueeze(2))
                                  .logical_and_(valid.narrow(1, j, nj).unsqueeze(1));
      const at::Tensor block = wide_bmm(gi, g.narrow(1, j, nj).transpose(1, 2)).mul_(same);
      out.add_(block.sum({1, 2}), i == j ? 1.0 : 2.0);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gapmon, m) {
  m.def("ghost_norm_sq(Tensor a, Tensor g, int tile=0) -> Tensor");
  m.def("direct_norm_sq(Tensor a, Tensor g, int max_elements=67108864) -> Tensor");
  m.def("embedding_norm_sq(Tensor ids, Tensor g, int padding_idx=-1, int tile=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(gapmon, CompositeExplicitAutograd, m) {
  m.impl("ghost_norm_sq", &ghost_norm_sq);
  m.impl("direct_norm_sq", &direct_norm_sq);
  m.impl("embedding_norm_sq", &embedding_norm_sq);
}

}  // namespace gapmon
