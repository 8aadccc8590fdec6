"""The one door to the compiled ops (torch.ops.gapmon): extension loading, fake kernels for
tracing, and every op on local (non-distributed) tensors, with the pure-PyTorch reference as the
fallback where the extension or its kernels for a device are missing.

No other module calls torch.ops.gapmon. The public, DTensor-aware front is gapmon.ops.
"""
from __future__ import annotations

import os
import warnings
from typing import Sequence

import torch
import torch.nn.functional as F

from .. import _torch_compat
from . import reference
from .layout import (
    ACC_NAMES,
    BLOCK_COLUMNS,
    FLOAT_DTYPES,
    NUMERICS_COLUMNS,
    STAT_NAMES,
    STATE_NAMES,
    UPDATE_COLUMNS,
    check_states,
    check_tensor,
    check_tensor_list,
)

_LIB = "gapmon"


def _load_extension() -> bool:
    if os.environ.get("GAPMON_BACKEND", "").lower() == "torch":
        return False
    try:
        from .. import _C  # noqa: F401  (registers torch.ops.gapmon.*)
    except ImportError as e:
        warnings.warn(
            f"gapmon: compiled extension not available ({e}); using the slow pure-PyTorch reference. "
            "Build it with `pip install --no-build-isolation -e .`",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


COMPILED = _load_extension()
CUDA_KERNELS = COMPILED and _torch_compat.has_kernel_for(f"{_LIB}::tensor_stats", "CUDA")


def _check_layout() -> None:
    """The column layouts are defined once, in csrc/core; stats.py and numerics.py name them. A build
    whose layout differs (a stale gapmon._C) is refused rather than misread."""
    built = [names.split(",") for names in torch.ops.gapmon._layout()]
    named = [list(STAT_NAMES), list(STATE_NAMES), list(ACC_NAMES), list(NUMERICS_COLUMNS)]
    if built != named:
        raise ImportError(f"gapmon._C reports column layouts {built}, the Python package expects {named}: "
                          "rebuild the extension (pip install --no-build-isolation -e .)")


if COMPILED:
    _check_layout()


def backend() -> str:
    """The active backend: "cuda" (compiled, GPU present), "cpu" (compiled) or "torch" (fallback)."""
    if not COMPILED:
        return "torch"
    return "cuda" if CUDA_KERNELS and torch.cuda.is_available() else "cpu"


def cuda_kernels_compiled() -> bool:
    """Whether this build of gapmon._C has the CUDA kernels."""
    return CUDA_KERNELS


def _compiled_for(device: torch.device) -> bool:
    return COMPILED and (device.type == "cpu" or (device.type == "cuda" and CUDA_KERNELS))


def cpu_isa(request: str = "") -> str:
    """The CPU instruction set of the kernels ("avx512", "avx2", "generic"); selects one if given."""
    if not COMPILED:
        return "torch"
    return torch.ops.gapmon._cpu_isa(request)


if COMPILED:
    # Shapes of the outputs, for tracing (torch.compile, FakeTensor, meta).
    _ROW = len(STAT_NAMES)

    @torch.library.register_fake(f"{_LIB}::tensor_stats")
    def _(x, correction=1):
        return x.new_empty((_ROW,), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::instance_stats")
    def _(x, correction=1):
        _torch_compat.check(x.dim() >= 1, lambda: "instance_stats expects a batch dimension")
        return x.new_empty((x.shape[0], _ROW), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::multi_tensor_stats")
    def _(xs, correction=1):
        return xs[0].new_empty((len(xs), _ROW), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::multi_tensor_states")
    def _(xs):
        return xs[0].new_empty((len(xs), len(STATE_NAMES)), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::merge_states")
    def _(states):
        return states.new_empty((states.shape[1], len(STATE_NAMES)), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::finalize_states")
    def _(states, correction=1):
        return states.new_empty((states.shape[0], _ROW), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::accumulate_instance_stats")
    def _(x, acc, row, correction=1):
        return None

    @torch.library.register_fake(f"{_LIB}::accumulate_instance_stats_and_numerics")
    def _(x, acc, row, correction, numerics, numerics_row):
        return None

    @torch.library.register_fake(f"{_LIB}::accumulate_instance_stats_numerics_blocks")
    def _(x, acc, row, correction, numerics_on, numerics, numerics_row, formats, amax, blocks, blocks_row):
        return None

    @torch.library.register_fake(f"{_LIB}::numerics_states")
    def _(xs):
            return xs[0].new_empty((len(xs), len(NUMERICS_COLUMNS)), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::merge_numerics_states")
    def _(states):
        return states.new_empty((states.shape[1], states.shape[2]), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::block_numerics")
    def _(xs, formats, amaxes):
        return xs[0].new_empty((len(xs), len(formats), len(BLOCK_COLUMNS)), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::states_numerics_blocks")
    def _(xs, numerics, formats, amaxes):
        return (xs[0].new_empty((len(xs), len(STATE_NAMES)), dtype=torch.float64),
                xs[0].new_empty((len(xs), len(NUMERICS_COLUMNS) if numerics else 0), dtype=torch.float64),
                xs[0].new_empty((len(xs), len(formats), len(BLOCK_COLUMNS)), dtype=torch.float64))

    @torch.library.register_fake(f"{_LIB}::update_sums")
    def _(before, after, grads):
        return before[0].new_empty((len(before), len(UPDATE_COLUMNS)), dtype=torch.float64)

    @torch.library.register_fake(f"{_LIB}::multi_tensor_states_and_numerics")
    def _(xs):
        return (xs[0].new_empty((len(xs), len(STATE_NAMES)), dtype=torch.float64),
                xs[0].new_empty((len(xs), len(NUMERICS_COLUMNS)), dtype=torch.float64))


# ------------------------------------------------------------------ statistics of local tensors
# The host cost of a small call counts (SPEC: at most 1.5x that of x.sum()): a plain tensor on a
# dense float tensor on a device the build has kernels for goes straight to the op; anything else
# takes the checks that name what is wrong.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain_and_compiled(x) -> bool:
    return (type(x) in _PLAIN_TYPES and COMPILED and x.dtype in FLOAT_DTYPES and x.layout is torch.strided
            and (x.is_cpu or (x.is_cuda and CUDA_KERNELS)))


def tensor_rows(x: torch.Tensor, correction: int = 1) -> torch.Tensor:
    """The [7] float64 statistics row of a local tensor."""
    if _plain_and_compiled(x):
        return torch.ops.gapmon.tensor_stats.default(x, correction)
    check_tensor(x, "tensor_stats")
    if not _compiled_for(x.device):
        return reference.tensor_stats(x, correction).rows()
    return torch.ops.gapmon.tensor_stats(x, correction)  # not differentiable: no detach needed (csrc/torch/ops.cpp)


def instance_rows(x: torch.Tensor, correction: int = 1) -> torch.Tensor:
    """[x.shape[0], 7] float64 statistics rows of each x[b] of a local tensor."""
    if _plain_and_compiled(x):
        return torch.ops.gapmon.instance_stats.default(x, correction)
    check_tensor(x, "instance_stats")
    if not _compiled_for(x.device):
        return reference.instance_stats(x, correction).rows()
    return torch.ops.gapmon.instance_stats(x, correction)


def multi_rows(xs: Sequence[torch.Tensor], correction: int = 1) -> torch.Tensor:
    """[N, 7] float64 statistics rows of N local tensors on one device, in one launch."""
    if not xs:
        return torch.empty(0, len(STAT_NAMES), dtype=torch.float64)
    if not _compiled_for(xs[0].device):
        return reference.multi_tensor_stats(xs, correction).rows()
    return torch.ops.gapmon.multi_tensor_stats(xs, correction)


def block_numerics_rows(xs: Sequence[torch.Tensor], codes: Sequence[int], amaxes: torch.Tensor) -> torch.Tensor:
    """[N, F, 12] float64 block-format rows of N local tensors on one device (gapmon.stats.block_formats), in
    one read of each element; amaxes: float64 [N], each tensor's largest finite |x|."""
    xs = list(xs)
    check_tensor_list(xs, "block_numerics")
    if not xs:
        return torch.empty(0, len(codes), len(BLOCK_COLUMNS), dtype=torch.float64)
    if not _compiled_for(xs[0].device):
        return reference.block_numerics(xs, codes, amaxes.tolist()).to(xs[0].device)
    return torch.ops.gapmon.block_numerics(xs, list(codes), amaxes.to(xs[0].device, torch.float64).contiguous())


def states_numerics_blocks_rows(xs: Sequence[torch.Tensor], numerics: bool, codes: Sequence[int],
                                amaxes: torch.Tensor) -> torch.Tensor:
    """[N, 7 + C + F * 12] float64: the mergeable states, the numerics rows (C columns, none without `numerics`)
    and the block-format rows of N local tensors on one device, side by side: the compiled op reads each tensor
    once (CPU: each chunk while in cache; CUDA: one launch, each chunk re-read from L2 by the block that has
    just read it); without the extension, the references one after the other."""
    xs = list(xs)
    check_tensor_list(xs, "states_numerics_blocks")
    n = len(xs)
    if xs and _compiled_for(xs[0].device):
        states, rows, blocks = torch.ops.gapmon.states_numerics_blocks(xs, numerics, list(codes),
                                                                       amaxes.to(torch.float64).contiguous())
        return torch.cat((states, rows, blocks.reshape(n, -1)), dim=1)
    first = states_and_numerics_rows(xs) if numerics else multi_states(xs)
    blocks = block_numerics_rows(xs, codes, amaxes)
    return torch.cat((first, blocks.to(first.device).reshape(n, -1)), dim=1)


def update_sums(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor],
                grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """[N, 5] float64 update rows (UPDATE_COLUMNS) of N local parameters on one device, in one read of
    each tensor."""
    before, after, grads = list(before), list(after), list(grads)
    for name, xs in (("before", before), ("after", after), ("grads", grads)):
        check_tensor_list(xs, f"update_sums ({name})")
    if not len(before) == len(after) == len(grads):
        raise ValueError(f"gapmon.update_sums: expected as many weights after the step and gradients as weights "
                         f"before it, got {len(before)}, {len(after)} and {len(grads)}")
    for i, (b, a, g) in enumerate(zip(before, after, grads)):
        if not b.shape == a.shape == g.shape:
            raise ValueError(f"gapmon.update_sums: parameter {i}: shapes differ (before {tuple(b.shape)}, after "
                             f"{tuple(a.shape)}, gradient {tuple(g.shape)})")
    if not before:
        return torch.zeros(0, len(UPDATE_COLUMNS), dtype=torch.float64)
    if not _compiled_for(before[0].device):
        return reference.update_sums(before, after, grads)
    return torch.ops.gapmon.update_sums(before, after, grads)


def multi_states(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """[N, 7] float64 mergeable partial states of N local tensors on one device."""
    xs = list(xs)
    check_tensor_list(xs, "multi_tensor_states")
    if not xs:
        return torch.empty(0, len(STATE_NAMES), dtype=torch.float64)
    if not _compiled_for(xs[0].device):
        return reference.multi_tensor_states([x.detach() for x in xs])
    return torch.ops.gapmon.multi_tensor_states(xs)


def merge_states(states: torch.Tensor) -> torch.Tensor:
    """Merges [R, N, 7] partial states over R (in order) into [N, 7]."""
    check_states(states, 3, "merge_states")
    if not _compiled_for(states.device):
        return reference.merge_states(states)
    return torch.ops.gapmon.merge_states(states)


def finalize_rows(states: torch.Tensor, correction: int = 1) -> torch.Tensor:
    """[N, 7] partial states -> [N, 7] float64 statistics rows."""
    check_states(states, 2, "finalize_states")
    if not _compiled_for(states.device):
        return reference.finalize_states(states, correction)
    return torch.ops.gapmon.finalize_states(states, correction)


def numerics_rows(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """[N, C] float64 numerics rows (gapmon.numerics) of N local tensors on one device: the compiled
    kernels where they are built for that device, else the pure-PyTorch reference."""
    xs = list(xs)
    check_tensor_list(xs, "numerics_states")
    if not xs or not _compiled_for(xs[0].device):
        return reference.numerics_states(xs)
    return torch.ops.gapmon.numerics_states(xs)


def states_and_numerics_rows(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """[N, 7 + C] float64: the mergeable states and the numerics rows of N local tensors on one
    device, side by side. The compiled kernels read each tensor once for both, with the bits the two
    separate ops give; the pure-PyTorch fallback runs its two references one after the other."""
    xs = list(xs)
    check_tensor_list(xs, "multi_tensor_states_and_numerics")
    if xs and _compiled_for(xs[0].device):
        states, numerics = torch.ops.gapmon.multi_tensor_states_and_numerics(xs)
    else:
        states, numerics = multi_states(xs), numerics_rows(xs)
    return torch.cat((states, numerics.to(states.device)), dim=1)


def merge_states_and_numerics_rows(rows: torch.Tensor) -> torch.Tensor:
    """Merges [R, N, 7 + C] rows of states_and_numerics_rows over R (in order) into [N, 7 + C]."""
    k = len(STATE_NAMES)
    return torch.cat((merge_states(rows[..., :k].contiguous()), merge_numerics_rows(rows[..., k:].contiguous())), dim=-1)


def merge_numerics_rows(states: torch.Tensor) -> torch.Tensor:
    """Merges [R, N, C] numerics rows over R (in order) into [N, C]."""
    if not _compiled_for(states.device):
        return reference.merge_numerics_states(states)
    return torch.ops.gapmon.merge_numerics_states(states)


def accumulate_instance_stats(x: torch.Tensor, acc: torch.Tensor, row: int, correction: int = 1) -> None:
    """Folds the per-instance statistics of x (dim 0 = instances) into row `row` of a float64
    [rows, len(ACC_NAMES)] accumulator: one fused op, what GAPMonitor runs in its activation hooks."""
    if not _compiled_for(x.device):
        reference.accumulate_instance_stats(x.detach(), acc, row, correction)
        return
    torch.ops.gapmon.accumulate_instance_stats(x, acc, row, correction)


def accumulate_instance_stats_and_numerics(x: torch.Tensor, acc: torch.Tensor, row: int, correction: int,
                                           numerics: torch.Tensor, numerics_row: int) -> None:
    """accumulate_instance_stats, and x's numerics row (gapmon.numerics) merged into row
    `numerics_row` of a float64 [rows, C] table in place: what GAPMonitor's activation hooks run with
    numerics on, one op and one pass over x (on CUDA, many short instances take two launches)."""
    if not _compiled_for(x.device):
        reference.accumulate_instance_stats_and_numerics(x.detach(), acc, row, correction, numerics, numerics_row)
        return
    torch.ops.gapmon.accumulate_instance_stats_and_numerics(x, acc, row, correction, numerics, numerics_row)


def accumulate_instance_stats_numerics_blocks(x: torch.Tensor, acc: torch.Tensor, row: int, correction: int,
                                              numerics: torch.Tensor | None, numerics_row: int, codes: Sequence[int],
                                              amax: torch.Tensor | None, blocks: torch.Tensor, blocks_row: int) -> None:
    """accumulate_instance_stats (with a `numerics` table, accumulate_instance_stats_and_numerics), and x's per-block
    format rows (block_numerics; `amax`: float64 [1], x's largest finite |x|, read by the formats scaled per tensor;
    None: the op measures it) merged into row `blocks_row` of a float64 [rows, F, 12] table in place: GAPMonitor's
    activation hooks with block formats on, one pass over x (CPU: each chunk's block groups while it is in cache;
    CUDA: one launch, each chunk re-read from L2, except many short instances; a format scaled per tensor needs a
    read of x for its amax first)."""
    numerics_on = numerics is not None
    table = numerics if numerics_on else acc.new_empty(0, len(NUMERICS_COLUMNS))
    if not _compiled_for(x.device):
        reference.accumulate_instance_stats_numerics_blocks(x.detach(), acc, row, correction, numerics_on, table,
                                                            numerics_row, list(codes), amax, blocks, blocks_row)
        return
    torch.ops.gapmon.accumulate_instance_stats_numerics_blocks(x, acc, row, correction, numerics_on, table, numerics_row,
                                                               list(codes), amax, blocks, blocks_row)


# ------------------------------------------------------------------ per-sample norm products
def product_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the norm products of `x` are summed in: float32 for 16-bit tensors (the compiled
    ops use tensor cores with float32 results on CUDA and widen tile by tile elsewhere; sums never
    run in 16 bits), else x's own."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(product_dtype(x))


def ghost_norm_sq(a: torch.Tensor, g: torch.Tensor, bias: bool = False) -> torch.Tensor:
    """Σ_{t,s} (a_t·a_s)(g_t·g_s) per sample of a [B, T, d], g [B, T, p]: ||gᵀa||²_F via Grams. `bias`:
    Σ_{t,s} (a_t·a_s + 1)(g_t·g_s), the squared norm of a Linear's weight and bias gradients together."""
    if COMPILED:
        return torch.ops.gapmon.ghost_norm_sq(a, g, None, bias)
    a, g = _wide(a), _wide(g)
    a_gram = torch.bmm(a, a.transpose(1, 2))
    return ((a_gram + 1 if bias else a_gram) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))


def direct_norm_sq(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """||g_bᵀ a_b||²_F per sample, forming the [p, d] per-sample products in bounded batches."""
    if COMPILED:
        return torch.ops.gapmon.direct_norm_sq(a, g)
    a, g = _wide(a), _wide(g)
    dtype = torch.promote_types(a.dtype, g.dtype)
    return torch.bmm(g.transpose(1, 2).to(dtype), a.to(dtype)).square().sum((1, 2))


def direct_norm_sq_and_grad(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(||g_bᵀ a_b||²_F per sample [B], Σ_b g_bᵀ a_b [p, d]): book-keeping's norms and weight
    gradient from one formation of the per-sample products, in bounded batches."""
    if COMPILED:
        return torch.ops.gapmon.direct_norm_sq_and_grad(a, g)
    a, g = _wide(a), _wide(g)
    dtype = torch.promote_types(a.dtype, g.dtype)
    grads = torch.bmm(g.transpose(1, 2).to(dtype), a.to(dtype))
    return grads.square().sum((1, 2)), grads.sum(0)


def linear_norm_sq_and_grads(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(||g_bᵀ a_b||²_F + ||Σ_t g_bt||² per sample [B], Σ_b g_bᵀ a_b [p, d], Σ_b Σ_t g_bt [p]): book-keeping of a Linear
    whose weight and bias both train, in one op."""
    if COMPILED:
        return torch.ops.gapmon.linear_norm_sq_and_grads(a, g)
    sq, grad = direct_norm_sq_and_grad(a, g)
    per_sample = g.sum(1, dtype=product_dtype(g))
    return sq + per_sample.square().sum(1), grad, per_sample.sum(0)


def linear_grad_sketch(a: torch.Tensor, g: torch.Tensor, r: torch.Tensor,
                       r_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The use check's sketches of a Linear's gradients from positions a [..., d], g [..., p]: (Σ g aᵀ) r = Gᵀ(A r) [p]
    and, given the bias probe r_bias [1], (Σ g) r_bias [p] (else an empty tensor), in r's dtype; a probe of k columns
    ([d, k], [1, k]) gives [p, k] each."""
    if COMPILED:
        return torch.ops.gapmon.linear_grad_sketch(a, g, r, r_bias)
    gr = g.reshape(-1, g.shape[-1]).to(r.dtype)
    weight = gr.T @ (a.reshape(-1, a.shape[-1]).to(r.dtype) @ r)
    return weight, (gr.sum(0).reshape(-1, 1) @ r_bias.to(r.dtype) if r_bias is not None else r.new_empty(0))


def embedding_norm_sq(ids: torch.Tensor, g: torch.Tensor, padding_idx: int = -1) -> torch.Tensor:
    """Σ over positions t, s with equal ids (not padding_idx) of g_t·g_s, per sample."""
    if COMPILED:
        return torch.ops.gapmon.embedding_norm_sq(ids, g, padding_idx)
    g = _wide(g)
    same = ids.unsqueeze(2) == ids.unsqueeze(1)
    if padding_idx >= 0:
        valid = ids != padding_idx
        same &= valid.unsqueeze(2) & valid.unsqueeze(1)
    return (torch.bmm(g, g.transpose(1, 2)) * same).sum((1, 2))


def affine_norm_sums(x: torch.Tensor, g: torch.Tensor, eps: float, rms: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_t g_t ⊙ x̂_t, Σ_t g_t) [B, n] per sample of x, g [B, T, n]: an affine LayerNorm's (RMSNorm's with `rms`) per-sample
    weight and bias gradients over the last dim, x̂ normalised with `eps`, in float32 or wider."""
    if COMPILED:
        return torch.ops.gapmon.affine_norm_sums(x, g, eps, rms)
    dtype = torch.promote_types(product_dtype(x), product_dtype(g))
    x, g = x.to(dtype), g.to(dtype)
    n = x.shape[-1]
    xhat = F.rms_norm(x, (n,), eps=eps) if rms else F.layer_norm(x, (n,), eps=eps)
    return (g * xhat).sum(1), g.sum(1)
