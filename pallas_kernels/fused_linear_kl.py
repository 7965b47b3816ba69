"""Blockwise LM-head projection fused with a softmax loss: engines for tlt_jax.losses.

Everything here serves one contract. Student logits are z = (h @ w) / T (float32
accumulation), q = softmax(z) over the full vocabulary, and the loss front
(`tlt_jax.losses`) needs only per-row statistics of z,

    lse_n = logsumexp_v z_nv,   zid_nk = z[n, ids_nk],   ez_n = sum_v q_nv z_nv (entropy),

and, for gradients, one cotangent of the form

    dL/dz_nv = q_nv (alpha_n + beta_n z_nv) + sum_k sparse_nk 1[v == ids_nk]      (*)

(top-K KL: alpha = M - r Q, sparse = -p + r q_id, beta = 0; log-prob: alpha = -g,
sparse = g; entropy adds alpha += g_H ez, beta = -g_H). A dense per-row part plus K
sparse terms means no engine ever needs more than a tile of logits and the K ids.

Engines (`impl`), their cost in projections (one projection = one N x D x V matmul),
and transient memory (peak minus inputs and gradient outputs) at D=3072, V=128256,
K=100 with bf16 h and w (a [D, V] f32 array is 1.47 GiB, one bn x V f32 row block
is bn/2 MiB):

chunked_xla  token blocks of `tokens` rows in a lax.scan; each block's logits over
             the whole vocabulary are kept while the block is processed (so lse is
             known before dz, z is formed once per pass, and the teacher logits and
             the sparse gradient terms are a gather / scatter-add on the block, with
             no gathers of W columns).
             - scalar reduction ("sum"/"mean"): gradients in the forward pass,
               3 projections (z, dh, dW).
             - per-token cotangent: forward keeps lse and zid (N (K+1) 4 bytes,
               0.1 GiB at 256k) and the backward recomputes z: 4 projections.
             Within a block, dz, dh and the dW update go `vocab` columns at a
             time (BlockSizes.vocab; the same matmuls split along V, so no extra
             projection): dz is formed per tile from z, and the tile's dW update is
             added into the accumulator in place. With one tile (the GPU default)
             this is the plain block; the H200 run's own XLA temp for it, 1.74 GiB
             at tokens=1024 with bf16, holds a single [D, V] f32 buffer, so XLA:GPU
             forms `acc + h^T dz` without a second one (XLA:CPU does not: 3.2 GiB).
             Transient: the f32 block z, bn V 4 bytes (0.49 GiB at tokens=1024,
             0.12 GiB at 256), a dz tile (bn vocab b bytes) and a [D, vocab] dW
             update, plus the dW accumulator across token blocks:
             dw_accum="float32" (default): D V 4 bytes = 1.47 GiB when w is bf16
               (nothing when w is f32: the accumulator is the output). XLA temp on
               CPU at the CPU defaults (256 tokens x 4096 columns): 1.72 GiB (bf16)
               / 0.18 GiB (f32) at 8k tokens, within the 2.0 / 0.75 GiB bars.
             dw_accum="param": accumulate in w's dtype (the accumulator becomes the
               gradient output), but dW gets one bf16 rounding per token block
               (Liger-kernel style). Measured (experiments/dw_accum_error.py):
               relative dW error 8.2e-3 over 64 blocks and 1.6e-2 over 256, against
               1.8e-3 with float32 (rounding the exact dW to bf16 once: 1.7e-3).
               Hence not the default.
             Every block also reads and writes the dW accumulator (2 D V b bytes),
             about 10% (bf16) / 20% (f32) of the block's dW matmul at tokens=1024,
             so GPU blocks are large; tokens=2048 halves that for twice the block.
             Vocabulary tiles do not change that traffic; each tile adds a
             read-modify-write of the f32 [bn, D] dh sum (12 MB at 1024 x 3072) and
             a scatter of the block's K ids (most dropped), and on the GPU an
             unfused `acc[:, tile] += dW_tile` would add a write and read of the
             tile's update: hence one tile there until a GPU run says otherwise.
             On CPU, XLA computes 16-bit floats in f32 (float normalization), a
             dynamic slice included, so 16-bit h and w are sliced as their bit
             pattern there (`_loop_view`), which costs one 16-bit copy of an array
             that is a parameter of the compiled function: W's (D V 2 bytes; in the
             benchmark it lands in the dW output's buffer) and h's (N D 2 bytes,
             1.5 GiB at 256k: the CPU's only N-dependent term). An h computed inside
             the function is written in that form by its producer: nothing extra.
             With bf16 w, dz is rounded once to bf16 for the matmuls, as dense XLA
             does (the K sparse entries too: they are written as exact f32 values).
pallas       `pl.pallas_call` kernels, one source: interpret mode on CPU, Triton
             lowering on the GPU (compiler_params=pallas.triton.CompilerParams).
             Grid over token blocks (statistics, dh) or vocabulary tiles (dW); z
             tiles are sums over `depth`-row chunks of D, because a [tokens, 3072]
             block does not fit in registers. The kernels handle the dense part of
             (*); the K sparse terms are XLA gathers / scatter-adds of W columns
             (256 rows at a time; column gathers from a row-major [D, V] W are
             uncoalesced, N K D elements: expect them to show on the GPU).
             - statistics: online log-sum-exp over vocab tiles (1 projection) and,
               asked, a running top-k per row merged per tile (k rounds of
               max-and-mask over the P kept and the tile's bv logits, P = k
               rounded up to a power of two: about 4 k (P + bv) vector ops a row
               per tile against the tile's 2 D bv matmul flops, 0.6% at k=8,
               D=3072, bv=128, but on CUDA cores rather than tensor cores: to be
               timed on the GPU; at a teacher's k=100, 100 rounds a tile).
             - dh: per token block, recompute z tiles, accumulate the [tokens, D]
               result in its f32 output block (2 projections).
             - dW: per vocabulary tile, loop over all token blocks, recompute z,
               accumulate the [D, vocab] f32 output tile (2 projections).
             5 projections in both modes (Triton programs run concurrently, so the
             lse of a row is not available to the dW programs without a separate
             pass). Both backward kernels read-modify-write f32 accumulators in HBM
             once per tile (a [tokens, 3072] or [3072, vocab] f32 block cannot live
             in registers), which likely leaves them bandwidth-bound at these tiles.
             Transient: f32 dh (N D 4 bytes, 3 GiB at 256k) and f32 dW (1.47 GiB)
             buffers plus 0.15 GiB of gathered W columns: MISSES the memory bar; it
             exists as the tiled kernel to measure and tune, not as the default.
dense        (in tlt_jax.losses) the reference: materialises [N, V] logits.

A 3-projection pass must sum dW over token blocks (a full [D, V] accumulator, f32 by
default); a vocab-outer order that avoids it needs lse first (a 4th projection) and then
sums dh over vocab (an [N, D] accumulator). The temp bars (DESIGN.md section 5) count
the f32 accumulator in: `python -m experiments.bench_kl --memory_only` checks them.

Padding: N is padded to a multiple of `tokens` (and for pallas D to `depth`, V to
`vocab`) when needed, which copies h (or W); pick block sizes that divide the real
shapes (V=128256 = 501 * 256, D=3072 = 48 * 64) to avoid the copies. Padded vocab
columns get -inf logits and zero gradient; padded rows get zero coefficients.

Engine contract: ids outside [0, V) are absent (gathers clip them, scatters drop
them) and carry zero sparse coefficients; ids are distinct within a row (top-K ids
are); masked or padded rows carry zero coefficients; h is finite in every row (0 * NaN
in a matmul would still reach dW).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Triton lowering parameters; absent in builds without the GPU Pallas backend.
    from jax.experimental.pallas import triton as _pltriton
except ImportError:  # pragma: no cover
    _pltriton = None

ENGINES = ("chunked_xla", "pallas")

# Rows per XLA gather of W columns for the pallas engine's sparse terms:
# 256 rows x K=100 x D=3072 bf16 = 157 MB per step.
_SPARSE_ROWS = 256


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the fused loss; None picks a per-backend default.

    tokens: rows per token block (chunked_xla, pallas).
    vocab: vocabulary tile (pallas); for chunked_xla, the columns of dz per dh / dW
      update within a token block (None on the GPU: the whole vocabulary).
    depth: D chunk summed inside a pallas z tile (pallas).
    dw_accum: "float32" or "param" (chunked_xla): dtype that sums dW over token blocks.
    num_warps, num_stages: Triton compiler parameters (pallas on GPU).
    interpret: run pallas kernels in interpret mode; None: everywhere but on a GPU.
    For pallas on the GPU, tokens / vocab / depth must be powers of two >= 16.
    """

    tokens: int | None = None
    vocab: int | None = None
    depth: int | None = None
    dw_accum: str = "float32"
    num_warps: int | None = None
    num_stages: int | None = None
    interpret: bool | None = None

    def __post_init__(self):
        for name in ("tokens", "vocab", "depth", "num_warps", "num_stages"):
            val = getattr(self, name)
            if val is not None and (not isinstance(val, int) or val <= 0):
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {val!r}")
        if self.dw_accum not in ("float32", "param"):
            raise ValueError(f"BlockSizes.dw_accum must be 'float32' or 'param', got {self.dw_accum!r}")


# Defaults per (engine, backend). GPU chunked_xla blocks are large because each block
# re-reads and re-writes the dW accumulator (see module docstring).
_DEFAULTS = {
    ("chunked_xla", "gpu"): dict(tokens=1024),
    ("chunked_xla", "cpu"): dict(tokens=256, vocab=4096),
    ("pallas", "gpu"): dict(tokens=64, vocab=128, depth=64, num_warps=4, num_stages=2),
    ("pallas", "cpu"): dict(tokens=64, vocab=128, depth=64),
}


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def resolve_block_sizes(
    engine: str, blocks: BlockSizes | None, n: int, d: int, v: int, backend: str | None = None
) -> BlockSizes:
    """Fills None fields with defaults and shrinks tiles to the (power-of-two) problem size."""
    backend = backend or jax.default_backend()
    defaults = _DEFAULTS[(engine, "gpu" if backend == "gpu" else "cpu")]
    blocks = blocks or BlockSizes()
    filled = {f.name: getattr(blocks, f.name) for f in dataclasses.fields(blocks)}
    for key, val in defaults.items():
        if filled[key] is None:
            filled[key] = val
    if engine == "chunked_xla":
        filled["tokens"] = min(filled["tokens"], _round_up(n, 8))
        filled["vocab"] = min(filled["vocab"] or v, v)
    else:  # Triton tiles are powers of two >= 16 (tl.dot's minimum).
        for key, size in (("tokens", n), ("vocab", v), ("depth", d)):
            filled[key] = min(filled[key], max(16, _next_pow2(size)))
    return BlockSizes(**filled)


class RowStats(NamedTuple):
    """Per-row statistics of z = h @ w / T. lse_N, zid_NK, ez_N (None unless asked) float32;
    top_z_NK / top_ids_NK: the row's k largest z and their ids (None unless asked)."""

    lse: jax.Array
    zid: jax.Array
    ez: jax.Array | None
    top_z: jax.Array | None = None
    top_ids: jax.Array | None = None


class Coefs(NamedTuple):
    """Cotangent of z in the form (*): alpha_N, beta_N (or None), sparse_NK, float32."""

    alpha: jax.Array
    beta: jax.Array | None
    sparse: jax.Array


# A scalar-reduction callback: (RowStats of a row block, rows pytree of that block)
# -> (sum of the block's loss, Coefs of the block).
CoefFn = Callable[[RowStats, Any], tuple[jax.Array, Coefs]]


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _to_blocks(x: jax.Array, bn: int) -> jax.Array:
    """[N, ...] -> [ceil(N / bn), bn, ...], zero-padded rows."""
    n_pad = _round_up(x.shape[0], bn)
    return _pad_axis(x, 0, n_pad).reshape(n_pad // bn, bn, *x.shape[1:])


def _from_blocks(x: jax.Array, n: int) -> jax.Array:
    return x.reshape(-1, *x.shape[2:])[:n]


def _gather_ids(ids, n_vocab):
    return jnp.clip(ids, 0, n_vocab - 1)


def _scatter_ids(ids, n_vocab):
    """Out-of-range ids -> n_vocab, dropped by scatters with mode="drop"."""
    return jnp.where((ids >= 0) & (ids < n_vocab), ids, n_vocab)


def _scale_logits(z: jax.Array, temperature: float) -> jax.Array:
    return z if temperature == 1.0 else z * (1.0 / temperature)


# ------------------------------------------------------------------------------------
# chunked_xla: token blocks, each block's full-vocabulary logits kept in HBM.
# ------------------------------------------------------------------------------------


def _xla_logits(h_bD, w_DV, temperature):
    return _scale_logits(jnp.dot(h_bD, w_DV, preferred_element_type=jnp.float32), temperature)


# The CPU backend computes 16-bit float ops in float32 (XLA's float normalization), a
# dynamic slice included, and hoists the widening of a loop-invariant operand out of
# the loop: a float32 copy of the whole array (W's 1.47 GiB at D=3072, V=128256; h's
# N D 4 bytes). On CPU, 16-bit arrays are therefore sliced inside loops as their bit
# pattern; other backends slice them as they are.
def _loop_view(x):
    if x.dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating) and jax.default_backend() == "cpu":
        return lax.bitcast_convert_type(x, jnp.uint16)
    return x


def _from_view(x, dtype):
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def _cols(x_RC, start, size):
    """Columns [start, start + size) of x_RC; start may be traced."""
    if isinstance(start, int):
        return x_RC if (start, size) == (0, x_RC.shape[1]) else x_RC[:, start : start + size]
    return _from_view(lax.dynamic_slice_in_dim(_loop_view(x_RC), start, size, axis=1), x_RC.dtype)


def _set_cols(x_RC, start, cols_RS):
    if isinstance(start, int) and cols_RS.shape == x_RC.shape:
        return cols_RS
    return _from_view(lax.dynamic_update_slice_in_dim(_loop_view(x_RC), _loop_view(cols_RS), start, axis=1), x_RC.dtype)


def _xla_stats(z_bV, ids_bK, with_ez, top_k=0) -> RowStats:
    lse_b = jax.nn.logsumexp(z_bV, axis=1)
    zid_bK = jnp.take_along_axis(z_bV, _gather_ids(ids_bK, z_bV.shape[1]), axis=1)
    ez_b = jnp.sum(jnp.exp(z_bV - lse_b[:, None]) * z_bV, axis=1) if with_ez else None
    top = lax.top_k(z_bV, top_k) if top_k else (None, None)
    return RowStats(lse_b, zid_bK, ez_b, *top)


def _xla_block_grads(z_bV, h_bD, w_DV, ids_bK, lse_b, coefs: Coefs, temperature, dw_acc_DV, vocab):
    """dz for one block from (*), then dh_b [bn, D] and dw_acc_DV += h_b^T dz, both
    `vocab` columns of dz at a time (fewer: one tile).

    dz goes to the parameter dtype (both matmuls run at its rate, as dense XLA does)
    without an f32 cotangent buffer: the dense part is rounded once, and the K entries
    are overwritten by their exact f32 value, rounded once. Vocabulary tiles bound what
    the block needs besides z to a [bn, vocab] dz tile and a [D, vocab] dW update, added
    into the accumulator in place; the matmuls are the same (split along V).
    """

    def dense(z):
        alpha = coefs.alpha[:, None]
        return alpha if coefs.beta is None else alpha + coefs.beta[:, None] * z

    (bn, n_vocab), acc_dtype = z_bV.shape, dw_acc_DV.dtype
    zid_bK = jnp.take_along_axis(z_bV, _gather_ids(ids_bK, n_vocab), axis=1)
    at_ids_bK = _scale_logits(jnp.exp(zid_bK - lse_b[:, None]) * dense(zid_bK) + coefs.sparse, temperature)
    at_ids_bK = at_ids_bK.astype(w_DV.dtype)
    ids_bK = _scatter_ids(ids_bK, n_vocab)
    rows_b1 = jnp.arange(bn)[:, None]

    def tile(start, owned_from, dw_acc_DV):
        """Columns [start, start + vocab) of which those >= owned_from are this tile's (the
        last tile is shifted left to stay in bounds; its overlap gets zero cotangent)."""
        z_bT = _cols(z_bV, start, vocab)
        dz_bT = _scale_logits(jnp.exp(z_bT - lse_b[:, None]) * dense(z_bT), temperature)
        if vocab < n_vocab and n_vocab % vocab:
            dz_bT = jnp.where(start + jnp.arange(vocab) >= owned_from, dz_bT, 0.0)
        local_bK = jnp.where((ids_bK >= owned_from) & (ids_bK < start + vocab), ids_bK - start, vocab)
        dz_bT = dz_bT.astype(w_DV.dtype).at[rows_b1, local_bK].set(at_ids_bK, mode="drop")
        w_DT = _cols(w_DV, start, vocab)
        dh_bD = lax.dot_general(dz_bT, w_DT, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        dw_DT = lax.dot_general(h_bD, dz_bT, (((0,), (0,)), ((), ())), preferred_element_type=acc_dtype)
        return dh_bD, _set_cols(dw_acc_DV, start, _cols(dw_acc_DV, start, vocab) + dw_DT)

    if vocab >= n_vocab:
        vocab = n_vocab
        dh_bD, dw_acc_DV = tile(0, 0, dw_acc_DV)
        return dh_bD.astype(h_bD.dtype), dw_acc_DV

    def body(j, carry):
        dh_bD, dw_acc_DV = carry
        owned_from = j * vocab
        dh_t, dw_acc_DV = tile(jnp.minimum(owned_from, n_vocab - vocab), owned_from, dw_acc_DV)
        return dh_bD + dh_t, dw_acc_DV

    init = (jnp.zeros(h_bD.shape, jnp.float32), dw_acc_DV)
    dh_bD, dw_acc_DV = lax.fori_loop(0, -(-n_vocab // vocab), body, init)
    return dh_bD.astype(h_bD.dtype), dw_acc_DV


def _acc_dtype(w_DV, blocks: BlockSizes):
    return jnp.float32 if blocks.dw_accum == "float32" else w_DV.dtype


def _xla_row_stats(h_ND, w_DV, ids_NK, temperature, with_ez, blocks, top_k=0) -> RowStats:
    n = h_ND.shape[0]

    def one(args):
        h_bD, ids_bK = args
        h_bD = _from_view(h_bD, h_ND.dtype)
        return _xla_stats(_xla_logits(h_bD, w_DV, temperature), ids_bK, with_ez, top_k)

    stats = lax.map(one, (_to_blocks(_loop_view(h_ND), blocks.tokens), _to_blocks(ids_NK, blocks.tokens)))
    return jax.tree.map(lambda x: _from_blocks(x, n), stats)


def _xla_scan(h_ND, w_DV, ids_NK, rows, block_coefs, temperature, blocks):
    """One lax.scan over token blocks: z_b, block_coefs(z_b, ids_b, rows_b) ->
    (value_b, lse_b, Coefs_b), then dh_b and the dW accumulation. -> (value, dh, dW)."""
    n, bn, acc_dtype = h_ND.shape[0], blocks.tokens, _acc_dtype(w_DV, blocks)

    def body(carry, xs):
        dw_acc, value = carry
        h_bD, ids_bK, rows_b = xs
        h_bD = _from_view(h_bD, h_ND.dtype)
        z_bV = _xla_logits(h_bD, w_DV, temperature)
        value_b, lse_b, coefs_b = block_coefs(z_bV, ids_bK, rows_b)
        dh_bD, dw_acc = _xla_block_grads(z_bV, h_bD, w_DV, ids_bK, lse_b, coefs_b, temperature, dw_acc, blocks.vocab)
        return (dw_acc, value + value_b), dh_bD

    xs = (_to_blocks(_loop_view(h_ND), bn), _to_blocks(ids_NK, bn), jax.tree.map(lambda x: _to_blocks(x, bn), rows))
    init = (jnp.zeros(w_DV.shape, acc_dtype), jnp.zeros((), jnp.float32))
    (dw_acc, value), dh_blocks = lax.scan(body, init, xs)
    return value, _from_blocks(dh_blocks, n), dw_acc.astype(w_DV.dtype)


def _xla_grads(h_ND, w_DV, ids_NK, lse_N, coefs: Coefs, temperature, blocks):
    _, dh_ND, dw_DV = _xla_scan(
        h_ND, w_DV, ids_NK, (lse_N, coefs), lambda z, ids, rows: (0.0, *rows), temperature, blocks
    )
    return dh_ND, dw_DV


def _xla_fused(h_ND, w_DV, ids_NK, rows, coef_fn: CoefFn, temperature, with_ez, blocks):
    def block_coefs(z_bV, ids_bK, rows_b):
        stats = _xla_stats(z_bV, ids_bK, with_ez)
        value_b, coefs_b = coef_fn(stats, rows_b)
        return value_b, stats.lse, coefs_b

    return _xla_scan(h_ND, w_DV, ids_NK, rows, block_coefs, temperature, blocks)


# ------------------------------------------------------------------------------------
# pallas: tiled kernels for the dense part of (*); XLA for the K sparse terms.
# ------------------------------------------------------------------------------------


def _interpret(blocks: BlockSizes) -> bool:
    return jax.default_backend() != "gpu" if blocks.interpret is None else blocks.interpret


def _compiler_params(blocks: BlockSizes):
    # Triton parameters select the Triton lowering (jax >= 0.10 defaults to Mosaic GPU).
    if _interpret(blocks):
        return None
    if _pltriton is None:
        raise NotImplementedError("this jax build has no Pallas Triton backend; use interpret=True")
    return _pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def _z_tile(load_h, load_w, n_depth, shape, inv_t, j, n_vocab, padded):
    """Vocabulary tile j of z: sum_c load_h(c) @ load_w(c) over D chunks c, f32
    accumulation, [bn, bv]. Columns past n_vocab (w padded) are -inf. Returns (z, valid),
    valid None when nothing is padded."""

    def body(c, acc):
        return acc + jnp.dot(load_h(c), load_w(c), preferred_element_type=jnp.float32)

    z = lax.fori_loop(0, n_depth, body, jnp.zeros(shape, jnp.float32))
    z = z if inv_t == 1.0 else z * inv_t
    if not padded:
        return z, None
    valid = j * shape[1] + lax.broadcasted_iota(jnp.int32, shape, 1) < n_vocab
    return jnp.where(valid, z, -jnp.inf), valid


def _block_z_tile(h_ref, w_ref, j, bv, bd, inv_t, n_vocab):
    """Vocabulary tile j of z for the whole token block held in h_ref (the kernels
    gridded over token blocks)."""
    v0 = pl.multiple_of(j * bv, bv)
    return _z_tile(
        lambda c: h_ref[:, pl.ds(pl.multiple_of(c * bd, bd), bd)],
        lambda c: w_ref[pl.ds(pl.multiple_of(c * bd, bd), bd), pl.ds(v0, bv)],
        h_ref.shape[1] // bd,
        (h_ref.shape[0], bv),
        inv_t,
        j,
        n_vocab,
        n_vocab != w_ref.shape[1],
    )


def _dense_cotangent(z, lse, alpha, beta, valid, inv_t, dtype):
    """q (alpha + beta z) / T for a z tile; padded columns (z = -inf) give exactly 0."""
    q = jnp.exp(z - lse[:, None])
    dense = alpha[:, None]
    if beta is not None:
        # -inf * 0 at padded columns would be NaN: use 0 there (q is 0 anyway).
        z_finite = z if valid is None else jnp.where(valid, z, 0.0)
        dense = dense + beta[:, None] * z_finite
    e = q * dense
    return (e if inv_t == 1.0 else e * inv_t).astype(dtype)


# Id of an empty slot of a running top-k: above every real id, so it loses every tie.
_NO_ID = jnp.iinfo(jnp.int32).max


def _merge_top_k(top_z_bP, top_ids_bP, z_bT, ids_bT, k):
    """The k largest of a row's running top-k (from earlier vocabulary tiles) and a new
    tile z_bT with its ids: k rounds of max-and-mask, ops the Triton lowering has (no
    sort, concatenate, argmax or dynamic column write). -> (top_z_bP, top_ids_bP), best
    first; the P - k slots past k (P: k rounded up to a power of two) stay empty
    (-inf, _NO_ID). Ties go to the lower id, as in lax.top_k: the running entries come
    from earlier tiles (lower ids) and so win ties against the tile; within either, the
    lowest id at the maximum is taken. A taken entry is masked to -inf, so rows need at
    least k finite logits (k <= V)."""
    slot_bP = lax.broadcasted_iota(jnp.int32, top_z_bP.shape, 1)

    def take_one(r, carry):
        run_z, tile_z, out_z, out_ids = carry
        run_max, tile_max = jnp.max(run_z, axis=1), jnp.max(tile_z, axis=1)
        from_run = run_max >= tile_max
        run_id = jnp.min(jnp.where(run_z == run_max[:, None], top_ids_bP, _NO_ID), axis=1)
        tile_id = jnp.min(jnp.where(tile_z == tile_max[:, None], ids_bT, _NO_ID), axis=1)
        best, pick = jnp.maximum(run_max, tile_max), jnp.where(from_run, run_id, tile_id)
        run_z = jnp.where(from_run[:, None] & (top_ids_bP == pick[:, None]), -jnp.inf, run_z)
        tile_z = jnp.where(jnp.logical_not(from_run)[:, None] & (ids_bT == pick[:, None]), -jnp.inf, tile_z)
        at_r = slot_bP == r
        return run_z, tile_z, jnp.where(at_r, best[:, None], out_z), jnp.where(at_r, pick[:, None], out_ids)

    empty = (jnp.full(top_z_bP.shape, -jnp.inf, jnp.float32), jnp.full(top_ids_bP.shape, _NO_ID, jnp.int32))
    return lax.fori_loop(0, k, take_one, (top_z_bP, z_bT, *empty))[2:]


def _stats_kernel(h_ref, w_ref, *out_refs, n_vocab, bv, bd, inv_t, with_ez, top_k):
    """Per token block: online log-sum-exp (and E_q[z]) over vocabulary tiles, and with
    top_k a running top-k merged per tile (`_merge_top_k`)."""
    bn = h_ref.shape[0]
    n_vt = w_ref.shape[1] // bv
    padded = n_vocab != w_ref.shape[1]

    def vbody(j, carry):
        m, l, s, top = carry
        z, valid = _block_z_tile(h_ref, w_ref, j, bv, bd, inv_t, n_vocab)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        corr = jnp.exp(m - m_new)
        e = jnp.exp(z - m_new[:, None])
        l = l * corr + jnp.sum(e, axis=1)
        if with_ez:
            s = s * corr + jnp.sum(e * (jnp.where(valid, z, 0.0) if padded else z), axis=1)
        if top_k:
            top = _merge_top_k(*top, z, j * bv + lax.broadcasted_iota(jnp.int32, z.shape, 1), top_k)
        return m_new, l, s, top

    rows = lambda val: jnp.full((bn,), val, jnp.float32)
    top = ()
    if top_k:
        top_shape = out_refs[-1].shape
        top = (jnp.full(top_shape, -jnp.inf, jnp.float32), jnp.full(top_shape, _NO_ID, jnp.int32))
    m, l, s, top = lax.fori_loop(0, n_vt, vbody, (rows(-jnp.inf), rows(0.0), rows(0.0), top))
    out_refs[0][...] = m + jnp.log(l)
    if with_ez:
        out_refs[1][...] = s / l
    if top_k:
        out_refs[-2][...], out_refs[-1][...] = top


def _dh_kernel(h_ref, w_ref, lse_ref, alpha_ref, *rest, n_vocab, bv, bd, inv_t, with_beta):
    beta_ref, dh_ref = rest if with_beta else (None, rest[0])
    bn = h_ref.shape[0]
    n_vt, n_depth = w_ref.shape[1] // bv, h_ref.shape[1] // bd
    lse, alpha = lse_ref[...], alpha_ref[...]
    beta = beta_ref[...] if with_beta else None

    def zero(c, _):
        dh_ref[:, pl.ds(pl.multiple_of(c * bd, bd), bd)] = jnp.zeros((bn, bd), jnp.float32)

    lax.fori_loop(0, n_depth, zero, None)

    def vbody(j, _):
        v0 = pl.multiple_of(j * bv, bv)
        z, valid = _block_z_tile(h_ref, w_ref, j, bv, bd, inv_t, n_vocab)
        e = _dense_cotangent(z, lse, alpha, beta, valid, inv_t, w_ref.dtype)

        def dbody(c, _):
            d0 = pl.multiple_of(c * bd, bd)
            w_c = w_ref[pl.ds(d0, bd), pl.ds(v0, bv)]
            dh_ref[:, pl.ds(d0, bd)] += lax.dot_general(
                e, w_c, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )

        lax.fori_loop(0, n_depth, dbody, None)

    lax.fori_loop(0, n_vt, vbody, None)


def _dw_kernel(h_ref, w_ref, lse_ref, alpha_ref, *rest, n_vocab, padded, bn, bd, inv_t, with_beta):
    beta_ref, dw_ref = rest if with_beta else (None, rest[0])
    bv = w_ref.shape[1]
    n_tb, n_depth = h_ref.shape[0] // bn, h_ref.shape[1] // bd
    j = pl.program_id(0)

    def zero(c, _):
        dw_ref[pl.ds(pl.multiple_of(c * bd, bd), bd), :] = jnp.zeros((bd, bv), jnp.float32)

    lax.fori_loop(0, n_depth, zero, None)

    def tbody(b, _):
        r0 = pl.multiple_of(b * bn, bn)
        z, valid = _z_tile(
            lambda c: h_ref[pl.ds(r0, bn), pl.ds(pl.multiple_of(c * bd, bd), bd)],
            lambda c: w_ref[pl.ds(pl.multiple_of(c * bd, bd), bd), :],
            n_depth,
            (bn, bv),
            inv_t,
            j,
            n_vocab,
            padded,
        )
        beta = beta_ref[pl.ds(r0, bn)] if with_beta else None
        e = _dense_cotangent(z, lse_ref[pl.ds(r0, bn)], alpha_ref[pl.ds(r0, bn)], beta, valid, inv_t, h_ref.dtype)

        def dbody(c, _):
            d0 = pl.multiple_of(c * bd, bd)
            h_c = h_ref[pl.ds(r0, bn), pl.ds(d0, bd)]
            dw_ref[pl.ds(d0, bd), :] += lax.dot_general(
                h_c, e, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )

        lax.fori_loop(0, n_depth, dbody, None)

    lax.fori_loop(0, n_tb, tbody, None)


def _pallas_pad(h_ND, w_DV, blocks: BlockSizes):
    n, d = h_ND.shape
    dp, vp = _round_up(d, blocks.depth), _round_up(w_DV.shape[1], blocks.vocab)
    h_p = _pad_axis(_pad_axis(h_ND, 0, _round_up(n, blocks.tokens)), 1, dp)
    return h_p, _pad_axis(_pad_axis(w_DV, 0, dp), 1, vp)


def _pallas_call(kernel, out_shape, grid, in_specs, out_specs, blocks, name):
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=_interpret(blocks),
        compiler_params=_compiler_params(blocks),
        name=name,
    )


def _pallas_stats(h_p, w_p, n_vocab, temperature, with_ez, top_k, blocks):
    """lse (, ez) (, top_z, top_ids) for every padded row: grid over token blocks, online
    lse and running top-k over vocab tiles. The top-k outputs are [rows, P], P = top_k
    rounded up to a power of two (Triton's block shapes), best first."""
    (np_, dp), vp, bn = h_p.shape, w_p.shape[1], blocks.tokens
    kernel = functools.partial(
        _stats_kernel, n_vocab=n_vocab, bv=blocks.vocab, bd=blocks.depth, inv_t=1.0 / temperature, with_ez=with_ez,
        top_k=top_k,
    )
    row = (jax.ShapeDtypeStruct((np_,), jnp.float32), pl.BlockSpec((bn,), lambda i: (i,)))
    outs = [row] * (2 if with_ez else 1)
    if top_k:
        kp = _next_pow2(top_k)
        top_spec = pl.BlockSpec((bn, kp), lambda i: (i, 0))
        outs += [(jax.ShapeDtypeStruct((np_, kp), dtype), top_spec) for dtype in (jnp.float32, jnp.int32)]
    return _pallas_call(
        kernel,
        tuple(shape for shape, _ in outs),
        (np_ // bn,),
        [pl.BlockSpec((bn, dp), lambda i: (i, 0)), pl.BlockSpec((dp, vp), lambda i: (0, 0))],
        tuple(spec for _, spec in outs),
        blocks,
        "fused_linear_stats" if top_k else "fused_linear_lse",
    )(h_p, w_p)


def _gather_teacher_logits(h_ND, w_DV, ids_NK, temperature):
    """zid_NK = h_n . w[:, ids_nk] / T by gathers of W columns, _SPARSE_ROWS rows at a time."""
    n, sb = h_ND.shape[0], min(_SPARSE_ROWS, h_ND.shape[0])

    def one(args):
        h_bD, ids_bK = args
        w_DbK = jnp.take(w_DV, _gather_ids(ids_bK, w_DV.shape[1]), axis=1)
        return _scale_logits(jnp.einsum("nd,dnk->nk", h_bD, w_DbK, preferred_element_type=jnp.float32), temperature)

    return _from_blocks(lax.map(one, (_to_blocks(h_ND, sb), _to_blocks(ids_NK, sb))), n)


def _pallas_row_stats(h_ND, w_DV, ids_NK, temperature, with_ez, blocks, top_k=0) -> RowStats:
    n = h_ND.shape[0]
    h_p, w_p = _pallas_pad(h_ND, w_DV, blocks)
    outs = _pallas_stats(h_p, w_p, w_DV.shape[1], temperature, with_ez, top_k, blocks)
    top = (outs[-2][:n, :top_k], outs[-1][:n, :top_k]) if top_k else (None, None)
    return RowStats(
        outs[0][:n], _gather_teacher_logits(h_ND, w_DV, ids_NK, temperature), outs[1][:n] if with_ez else None, *top
    )


def _pallas_grads(h_ND, w_DV, ids_NK, lse_N, coefs: Coefs, temperature, blocks):
    (n, d), v = h_ND.shape, w_DV.shape[1]
    bn, bv, bd = blocks.tokens, blocks.vocab, blocks.depth
    h_p, w_p = _pallas_pad(h_ND, w_DV, blocks)
    (np_, dp), vp = h_p.shape, w_p.shape[1]
    with_beta, inv_t = coefs.beta is not None, 1.0 / temperature
    rows = [_pad_axis(x, 0, np_) for x in (lse_N, coefs.alpha) + ((coefs.beta,) if with_beta else ())]
    statics = dict(n_vocab=v, bd=bd, inv_t=inv_t, with_beta=with_beta)

    row_block = pl.BlockSpec((bn,), lambda i: (i,))
    dh_p = _pallas_call(
        functools.partial(_dh_kernel, bv=bv, **statics),
        jax.ShapeDtypeStruct((np_, dp), jnp.float32),
        (np_ // bn,),
        [pl.BlockSpec((bn, dp), lambda i: (i, 0)), pl.BlockSpec((dp, vp), lambda i: (0, 0))] + [row_block] * len(rows),
        pl.BlockSpec((bn, dp), lambda i: (i, 0)),
        blocks,
        "fused_linear_dh",
    )(h_p, w_p, *rows)

    row_full = pl.BlockSpec((np_,), lambda j: (0,))
    dw_p = _pallas_call(
        functools.partial(_dw_kernel, bn=bn, padded=vp != v, **statics),
        jax.ShapeDtypeStruct((dp, vp), jnp.float32),
        (vp // bv,),
        [pl.BlockSpec((np_, dp), lambda j: (0, 0)), pl.BlockSpec((dp, bv), lambda j: (0, j))] + [row_full] * len(rows),
        pl.BlockSpec((dp, bv), lambda j: (0, j)),
        blocks,
        "fused_linear_dw",
    )(h_p, w_p, *rows)

    # Sparse terms of (*): sum_k sparse_nk w[:, id_nk] into dh, scatter-add into dW, both f32.
    def body(dw_DV, xs):
        h_bD, ids_bK, sparse_bK, dh_bD = xs
        w_DbK = jnp.take(w_DV, _gather_ids(ids_bK, v), axis=1)
        sparse_bK = sparse_bK * inv_t
        dh_bD = dh_bD + jnp.einsum("nk,dnk->nd", sparse_bK, w_DbK, preferred_element_type=jnp.float32)
        upd_DbK = jnp.einsum("nd,nk->dnk", h_bD.astype(jnp.float32), sparse_bK)
        return dw_DV.at[:, _scatter_ids(ids_bK, v)].add(upd_DbK, mode="drop"), dh_bD.astype(h_ND.dtype)

    sb = min(_SPARSE_ROWS, n)
    xs = tuple(_to_blocks(x, sb) for x in (h_ND, ids_NK, coefs.sparse, dh_p[:n, :d]))
    dw_DV, dh_blocks = lax.scan(body, dw_p[:d, :v], xs)
    return _from_blocks(dh_blocks, n), dw_DV.astype(w_DV.dtype)


# ------------------------------------------------------------------------------------
# Engine entry points.
# ------------------------------------------------------------------------------------


def engines_on(backend: str) -> tuple[str, ...]:
    """The engines that run on `backend`: pallas lowers to Triton on a GPU (where this jax
    build has the Pallas Triton backend) and runs in the Pallas interpreter on the CPU (the
    tests' path); no other backend has a lowering of these kernels."""
    has_pallas = backend == "cpu" or (backend == "gpu" and _pltriton is not None)
    return ENGINES if has_pallas else ("chunked_xla",)


def _check_engine(engine):
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")


def row_stats(
    engine: str, h_ND, w_DV, ids_NK, *, temperature: float, with_ez: bool, blocks: BlockSizes | None, top_k: int = 0
) -> RowStats:
    """Per-row statistics of z = h w / T: one projection (plus W-column gathers for pallas).
    top_k > 0 (<= V) also keeps each row's k largest z and their ids, best first, ties to
    the lower id (as lax.top_k): chunked_xla takes them from each token block's rows,
    pallas merges a running top-k per vocabulary tile."""
    _check_engine(engine)
    if not 0 <= top_k <= w_DV.shape[1]:
        raise ValueError(f"top_k={top_k} must lie in [0, {w_DV.shape[1]}] (the vocabulary size); lower top_k.")
    blocks = resolve_block_sizes(engine, blocks, h_ND.shape[0], *w_DV.shape)
    fn = _xla_row_stats if engine == "chunked_xla" else _pallas_row_stats
    return fn(h_ND, w_DV, ids_NK, temperature, with_ez, blocks, top_k)


def grads(engine: str, h_ND, w_DV, ids_NK, lse_N, coefs: Coefs, *, temperature: float, blocks: BlockSizes | None):
    """(dh_ND, dw_DV) in the input dtypes for the cotangent (*) of z = h w / T, z recomputed."""
    _check_engine(engine)
    blocks = resolve_block_sizes(engine, blocks, h_ND.shape[0], *w_DV.shape)
    fn = _xla_grads if engine == "chunked_xla" else _pallas_grads
    return fn(h_ND, w_DV, ids_NK, lse_N, coefs, temperature, blocks)


def fused_value_and_grads(
    engine: str,
    h_ND,
    w_DV,
    ids_NK,
    rows,
    coef_fn: CoefFn,
    *,
    temperature: float,
    with_ez: bool,
    blocks: BlockSizes | None,
):
    """A scalar loss and its gradients wrt h and w in one pass where the engine allows it.

    rows: pytree of [N, ...] per-row arrays handed to coef_fn block by block (zero-padded
    rows must give zero loss and zero coefficients). Returns (value f32 [], dh_ND, dw_DV).
    chunked_xla: 3 projections; pallas: statistics pass then gradients (5 projections).
    """
    _check_engine(engine)
    blocks = resolve_block_sizes(engine, blocks, h_ND.shape[0], *w_DV.shape)
    if engine == "chunked_xla":
        return _xla_fused(h_ND, w_DV, ids_NK, rows, coef_fn, temperature, with_ez, blocks)
    stats = _pallas_row_stats(h_ND, w_DV, ids_NK, temperature, with_ez, blocks)
    value, coefs = coef_fn(stats, rows)
    dh_ND, dw_DV = _pallas_grads(h_ND, w_DV, ids_NK, stats.lse, coefs, temperature, blocks)
    return value, dh_ND, dw_DV
