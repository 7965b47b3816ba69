"""Losses on an LM head without materialising [tokens, vocab] logits.

Public API:
  linear_topk_kl(h_ND, w_DV, teacher_ids_NK, teacher_logp_NK, ...) -> loss_N or scalar
      KL from a cached teacher top-K to the student softmax of z = h w / T.
  linear_logprob(h_ND, w_DV, targets_N, ...) -> logp_N (, entropy_N)
      per-token log-probs (the K=1 case, teacher probability 1 on the target) for GRPO.
  linear_logprob_topk(h_ND, w_DV, targets_N, k, ...) -> (logp_N, entropy_N, ids_NK, logp_NK)
      the same log-probs from the same projection pass, plus each row's top-k ids and
      log-probs: what the online drafter learns from (no gradient).
  linear_topk(h_ND, w_DV, k, ...) -> (ids_NK, logp_NK)
      a teacher's top-k ids and log-probs alone (the teacher cache, the offline drafter's
      targets), from the same blockwise pass.
  BlockSizes: tiling knobs (pallas_kernels.fused_linear_kl).

Math (z = (h @ w) / T in float32, q = softmax(z) over the full vocabulary, S the row's
valid teacher ids, p_k = exp(teacher_logp_k) NOT renormalised, M = sum_S p, Q = sum_S q):
  tail=False: loss = sum_k p_k (log p_k - log q_{id_k})     (can be negative: M <= 1)
              dL/dz_v = M q_v - p_v 1[v in S]
  tail=True:  adds (1 - M) log((1 - M) / (1 - Q)), the mass outside S as one bucket;
              dL/dz_v += r (q_v 1[v in S] - Q q_v),  r = (1 - M) / (1 - Q).
  Every gradient is (per-row scalar) * q + K sparse terms; the engines in
  pallas_kernels/fused_linear_kl.py only ever see that form (see its docstring for the
  memory / matmul-count analysis of each implementation and which bar each meets).

Stability of the tail: 1 - M = -expm1(logsumexp(teacher_logp)) and
1 - Q = -expm1(logsumexp(log q_S)) avoid cancelling 1 - sum; (1 - M) log(1 - M) is 0
at M = 1. log q_S = z_S - lse still carries f32 error ~1e-7 max|z| (2e-6 at logits of
20), which 1 - Q -> 0 cannot beat, so 1 - Q is floored at 2^-17 (7.6e-6): below it
the tail saturates at (1 - M) log((1 - M) 2^17) with zero gradient through Q (the
gradient of the floored value, in every implementation), instead of reporting f32
noise that differs between implementations.

Conventions:
  - Masked rows (mask_N False) give loss 0 and no gradient; their teacher entries may
    be anything (NaN included). Their h must be finite (0 * NaN in a matmul reaches dW).
  - Teacher ids outside [0, V) are absent: they add nothing to the loss, M, Q or the
    gradient (use e.g. -1 to pad a short top-K). Valid ids must be distinct within a
    row, as top-K ids are (a duplicate is counted twice in the loss, but its gradient
    is undefined).
  - teacher_logp gets no gradient (a cached teacher is a constant).
  - Outputs are float32; gradients come back in the dtypes of h and w.
  - reduction "mean" divides by the number of unmasked rows (at least 1).
  - impl: "dense" (reference; materialises [N, V] f32 logits), "chunked_xla",
    "pallas", or "auto": the fastest implementation measured on this device for the
    dtype and the N x V shape class (`tlt_jax.impl_table`, package data written by
    experiments/bench_kl.py), _AUTO_IMPL's where the device was never measured.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.scipy.special import xlogy

from pallas_kernels import fused_linear_kl as fk
from pallas_kernels.fused_linear_kl import BlockSizes
from tlt_jax import impl_table

__all__ = ["BlockSizes", "IMPLS", "linear_logprob", "linear_logprob_topk", "linear_topk", "linear_topk_kl",
           "resolve_impl", "topk_from_logits"]

IMPLS = ("auto", "dense", "chunked_xla", "pallas")
REDUCTIONS = ("none", "sum", "mean")

# impl="auto" on a device the impl table (tlt_jax/impl_table.json) never measured.
_AUTO_IMPL = {"cpu": "chunked_xla", "gpu": "chunked_xla", "tpu": "chunked_xla"}

# Floor of 1 - Q in the tail term (see module docstring).
_ONE_MINUS_Q_FLOOR = 2.0**-17
# Finite stand-in for log(0) inside logsumexp: keeps gradients NaN-free.
_LOG_ZERO = -1e30


@dataclasses.dataclass(frozen=True)
class _Config:
    impl: str
    temperature: float
    blocks: BlockSizes | None
    tail: bool = False
    with_entropy: bool = False
    top_k: int = 0  # the per-token log-prob pass also keeps each row's top-k


def resolve_impl(impl: str, backend: str | None = None, *, dtype=None, elements: int | None = None) -> str:
    """Maps "auto" to the implementation measured fastest on this device (`impl_table`: for
    the dtype of h and w and the shape class of N x V `elements`, each None for any), or to
    _AUTO_IMPL's where the device was never measured; an impl with no lowering on the backend
    (pallas on a TPU, or on a GPU without the Triton backend) is refused, naming those it
    has."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    backend = backend or jax.default_backend()
    if impl == "auto":
        measured = impl_table.lookup(
            "losses", backend, impl_table.device_kind(backend), None if dtype is None else jnp.dtype(dtype).name,
            None if elements is None else impl_table.shape_class("losses", elements))
        return measured if measured in fk.engines_on(backend) else _AUTO_IMPL.get(backend, "chunked_xla")
    if impl in fk.ENGINES and impl not in fk.engines_on(backend):
        have = ", ".join(("auto", "dense") + fk.engines_on(backend))
        raise ValueError(f"impl={impl!r} has no lowering on the {backend} backend; pass one of {have}.")
    return impl


def _resolve(impl, h_ND, w_DV):
    return resolve_impl(impl, dtype=h_ND.dtype, elements=h_ND.shape[0] * w_DV.shape[1])


def _as_blocks(block_sizes) -> BlockSizes | None:
    if block_sizes is None or isinstance(block_sizes, BlockSizes):
        return block_sizes
    if isinstance(block_sizes, dict):
        return BlockSizes(**block_sizes)
    raise ValueError(f"block_sizes must be a BlockSizes, a dict or None, got {type(block_sizes)}")


def _check_projection(h_ND, w_DV, temperature):
    if h_ND.ndim != 2 or w_DV.ndim != 2 or h_ND.shape[1] != w_DV.shape[0]:
        raise ValueError(f"h_ND {h_ND.shape} and w_DV {w_DV.shape} must be [N, D] and [D, V]")
    if h_ND.dtype != w_DV.dtype or not jnp.issubdtype(h_ND.dtype, jnp.floating):
        raise ValueError(
            f"h_ND {h_ND.shape} {h_ND.dtype} and w_DV {w_DV.shape} {w_DV.dtype} must " "share one floating dtype"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _check_ids(name, ids, h_ND, trailing):
    if ids.shape[:1] != h_ND.shape[:1] or ids.ndim != 1 + len(trailing):
        want = "[N, K]" if trailing else "[N]"
        raise ValueError(f"{name} {ids.shape} must be {want} for h_ND {h_ND.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} {ids.shape} must be integer, got {ids.dtype}")


def _in_vocab(ids, n_vocab):
    """(ids as int32, mask of ids in [0, V)); the engines skip the others."""
    return ids.astype(jnp.int32), (ids >= 0) & (ids < n_vocab)


# ------------------------------------------------------------------------------------
# Row math shared by every implementation.
# ------------------------------------------------------------------------------------


def _kl_rows(zid_NK, lse_N, logp_NK, valid_NK, tail):
    """Per-row loss and unit-cotangent coefficients (alpha_N, sparse_NK) of the form (*)."""
    logq_NK = zid_NK - lse_N[:, None]
    p_NK = jnp.where(valid_NK, jnp.exp(logp_NK), 0.0)
    support = p_NK > 0
    logp_safe = jnp.where(support, logp_NK, 0.0)
    loss_N = jnp.sum(jnp.where(support, p_NK * (logp_safe - logq_NK), 0.0), axis=1)
    mass_N = jnp.sum(p_NK, axis=1)
    if not tail:
        return loss_N, mass_N, -p_NK
    one_m_mass = jnp.clip(-jnp.expm1(jax.nn.logsumexp(jnp.where(valid_NK, logp_NK, _LOG_ZERO), axis=1)), 0.0, 1.0)
    q_NK = jnp.where(valid_NK, jnp.exp(logq_NK), 0.0)
    one_m_q_raw = -jnp.expm1(jax.nn.logsumexp(jnp.where(valid_NK, logq_NK, _LOG_ZERO), axis=1))
    one_m_q = jnp.maximum(one_m_q_raw, _ONE_MINUS_Q_FLOOR)
    loss_N = loss_N + xlogy(one_m_mass, one_m_mass) - one_m_mass * jnp.log(one_m_q)
    r_N = jnp.where(one_m_q_raw > _ONE_MINUS_Q_FLOOR, one_m_mass / one_m_q, 0.0)
    return loss_N, mass_N - r_N * jnp.sum(q_NK, axis=1), r_N[:, None] * q_NK - p_NK


# ------------------------------------------------------------------------------------
# Top-K KL.
# ------------------------------------------------------------------------------------


def _dense_kl_rows(h_ND, w_DV, ids_NK, logp_NK, valid_NK, cfg: _Config):
    z_NV = jnp.dot(h_ND, w_DV, preferred_element_type=jnp.float32) / cfg.temperature
    lse_N = jax.nn.logsumexp(z_NV, axis=1)
    zid_NK = jnp.take_along_axis(z_NV, jnp.clip(ids_NK, 0, w_DV.shape[1] - 1), axis=1)
    return _kl_rows(zid_NK, lse_N, jax.lax.stop_gradient(logp_NK), valid_NK, cfg.tail)[0]


def _engine_kl_rows(h_ND, w_DV, ids_NK, logp_NK, valid_NK, cfg: _Config):
    stats = fk.row_stats(cfg.impl, h_ND, w_DV, ids_NK, temperature=cfg.temperature, with_ez=False, blocks=cfg.blocks)
    return stats, _kl_rows(stats.zid, stats.lse, logp_NK, valid_NK, cfg.tail)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _kl_tokens(h_ND, w_DV, ids_NK, logp_NK, valid_NK, cfg: _Config):
    return _engine_kl_rows(h_ND, w_DV, ids_NK, logp_NK, valid_NK, cfg)[1]


def _kl_tokens_fwd(h_ND, w_DV, ids_NK, logp_NK, valid_NK, cfg):
    stats, loss_N = _engine_kl_rows(h_ND, w_DV, ids_NK, logp_NK, valid_NK, cfg)
    return loss_N, (h_ND, w_DV, ids_NK, logp_NK, valid_NK, stats.lse, stats.zid)


def _kl_tokens_bwd(cfg, res, g_N):
    h_ND, w_DV, ids_NK, logp_NK, valid_NK, lse_N, zid_NK = res
    _, alpha_N, sparse_NK = _kl_rows(zid_NK, lse_N, logp_NK, valid_NK, cfg.tail)
    coefs = fk.Coefs(g_N * alpha_N, None, g_N[:, None] * sparse_NK)
    dh_ND, dw_DV = fk.grads(cfg.impl, h_ND, w_DV, ids_NK, lse_N, coefs, temperature=cfg.temperature, blocks=cfg.blocks)
    return dh_ND, dw_DV, None, None, None


_kl_tokens.defvjp(_kl_tokens_fwd, _kl_tokens_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _kl_scalar(h_ND, w_DV, ids_NK, logp_NK, valid_NK, weight_N, cfg: _Config):
    return jnp.sum(weight_N * _engine_kl_rows(h_ND, w_DV, ids_NK, logp_NK, valid_NK, cfg)[1])


def _kl_scalar_fwd(h_ND, w_DV, ids_NK, logp_NK, valid_NK, weight_N, cfg):
    # Gradients for a unit cotangent are formed in the same pass as the value.
    def coef_fn(stats, rows):
        logp_bK, valid_bK, weight_b = rows
        loss_b, alpha_b, sparse_bK = _kl_rows(stats.zid, stats.lse, logp_bK, valid_bK, cfg.tail)
        return (jnp.sum(weight_b * loss_b), fk.Coefs(weight_b * alpha_b, None, weight_b[:, None] * sparse_bK))

    value, dh_ND, dw_DV = fk.fused_value_and_grads(
        cfg.impl,
        h_ND,
        w_DV,
        ids_NK,
        (logp_NK, valid_NK, weight_N),
        coef_fn,
        temperature=cfg.temperature,
        with_ez=False,
        blocks=cfg.blocks,
    )
    return value, (dh_ND, dw_DV)


def _scale(x, g):
    return (x.astype(jnp.float32) * g).astype(x.dtype)


def _kl_scalar_bwd(cfg, res, g):
    dh_ND, dw_DV = res
    return _scale(dh_ND, g), _scale(dw_DV, g), None, None, None, None


_kl_scalar.defvjp(_kl_scalar_fwd, _kl_scalar_bwd)


def linear_topk_kl(
    h_ND: jax.Array,
    w_DV: jax.Array,
    teacher_ids_NK: jax.Array,
    teacher_logp_NK: jax.Array,
    *,
    mask_N: jax.Array | None = None,
    temperature: float = 1.0,
    tail: bool = False,
    reduction: str = "none",
    impl: str = "auto",
    block_sizes: BlockSizes | dict | None = None,
) -> jax.Array:
    """KL(teacher top-K || softmax(h w / T)) per token, without [N, V] logits.

    Args:
      h_ND: student hidden states [N, D], bf16 or f32.
      w_DV: LM head [D, V], same dtype as h_ND.
      teacher_ids_NK: int [N, K] teacher top-K ids (K <= V), distinct within a row; ids
        outside [0, V) are absent.
      teacher_logp_NK: float [N, K] teacher full-vocabulary log-probs at those ids (not
        renormalised over the K).
      mask_N: bool [N]; False rows give 0 and no gradient. None: all rows.
      temperature: divides the student logits.
      tail: add the (1 - M) log((1 - M) / (1 - Q)) bucket for the mass outside the top-K.
      reduction: "none" -> loss_N float32 [N]; "sum" / "mean" (over unmasked rows) ->
        float32 scalar, whose gradients are formed in the same pass as the value.
      impl: "auto", "dense", "chunked_xla" or "pallas".
      block_sizes: BlockSizes or dict of its fields; None for defaults.
    Returns:
      float32 loss_N [N] (masked rows 0), or a scalar with "sum" / "mean". Differentiable
      wrt h_ND and w_DV (nats).
    """
    _check_projection(h_ND, w_DV, temperature)
    _check_ids("teacher_ids_NK", teacher_ids_NK, h_ND, trailing=(None,))
    if teacher_logp_NK.shape != teacher_ids_NK.shape or not jnp.issubdtype(teacher_logp_NK.dtype, jnp.floating):
        raise ValueError(
            f"teacher_logp_NK {teacher_logp_NK.shape} {teacher_logp_NK.dtype} must be "
            f"floating with the shape of teacher_ids_NK {teacher_ids_NK.shape}"
        )
    n, (k, v) = h_ND.shape[0], (teacher_ids_NK.shape[1], w_DV.shape[1])
    if not 1 <= k <= v:
        raise ValueError(f"need 1 <= K <= V: teacher_ids_NK {teacher_ids_NK.shape}, w_DV {w_DV.shape}")
    if mask_N is None:
        mask_N = jnp.ones((n,), bool)
    elif mask_N.shape != (n,) or mask_N.dtype != jnp.bool_:
        raise ValueError(f"mask_N {mask_N.shape} {mask_N.dtype} must be bool [N] for h_ND {h_ND.shape}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    cfg = _Config(_resolve(impl, h_ND, w_DV), float(temperature), _as_blocks(block_sizes), tail=bool(tail))

    ids_NK, valid_NK = _in_vocab(teacher_ids_NK, v)
    valid_NK = valid_NK & mask_N[:, None]
    logp_NK = teacher_logp_NK.astype(jnp.float32)
    if reduction == "none" or cfg.impl == "dense":
        if cfg.impl == "dense":
            loss_N = _dense_kl_rows(h_ND, w_DV, ids_NK, logp_NK, valid_NK, cfg)
        else:
            loss_N = _kl_tokens(h_ND, w_DV, ids_NK, logp_NK, valid_NK, cfg)
        loss_N = jnp.where(mask_N, loss_N, 0.0)
        if reduction == "none":
            return loss_N
        total = jnp.sum(loss_N)
        return total if reduction == "sum" else total / jnp.maximum(jnp.sum(mask_N), 1)
    weight_N = mask_N.astype(jnp.float32)
    if reduction == "mean":
        weight_N = weight_N / jnp.maximum(jnp.sum(weight_N), 1.0)
    return _kl_scalar(h_ND, w_DV, ids_NK, logp_NK, valid_NK, weight_N, cfg)


# ------------------------------------------------------------------------------------
# Per-token log-probs (and entropy).
# ------------------------------------------------------------------------------------


def _logprob_outputs(stats: fk.RowStats, valid_N, cfg: _Config):
    logp_N = jnp.where(valid_N, stats.zid[:, 0] - stats.lse, 0.0)
    if cfg.top_k:
        return logp_N, stats.lse - stats.ez, stats.top_ids.astype(jnp.int32), stats.top_z - stats.lse[:, None]
    return (logp_N, stats.lse - stats.ez) if cfg.with_entropy else logp_N


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _logprob(h_ND, w_DV, ids_N1, valid_N, cfg: _Config):
    return _logprob_fwd(h_ND, w_DV, ids_N1, valid_N, cfg)[0]


def _logprob_fwd(h_ND, w_DV, ids_N1, valid_N, cfg):
    stats = fk.row_stats(
        cfg.impl, h_ND, w_DV, ids_N1, temperature=cfg.temperature, with_ez=cfg.with_entropy, blocks=cfg.blocks,
        top_k=cfg.top_k,
    )
    residuals = (h_ND, w_DV, ids_N1, valid_N, stats._replace(top_z=None, top_ids=None))
    return _logprob_outputs(stats, valid_N, cfg), residuals


def _logprob_bwd(cfg, res, g):
    h_ND, w_DV, ids_N1, valid_N, stats = res
    # The top-k outputs' cotangents (g[2:]) are dropped: linear_logprob_topk stops their gradient.
    g_lp = jnp.where(valid_N, g[0] if cfg.with_entropy else g, 0.0)
    # d logp / dz = 1[target] - q;  d H / dz = q (E_q[z] - z).
    if cfg.with_entropy:
        coefs = fk.Coefs(g[1] * stats.ez - g_lp, -g[1], g_lp[:, None])
    else:
        coefs = fk.Coefs(-g_lp, None, g_lp[:, None])
    dh_ND, dw_DV = fk.grads(
        cfg.impl, h_ND, w_DV, ids_N1, stats.lse, coefs, temperature=cfg.temperature, blocks=cfg.blocks
    )
    return dh_ND, dw_DV, None, None


_logprob.defvjp(_logprob_fwd, _logprob_bwd)


def _dense_logprob(h_ND, w_DV, ids_N1, valid_N, cfg: _Config):
    logq_NV = jax.nn.log_softmax(jnp.dot(h_ND, w_DV, preferred_element_type=jnp.float32) / cfg.temperature, axis=1)
    ids_N1 = jnp.clip(ids_N1, 0, w_DV.shape[1] - 1)
    logp_N = jnp.where(valid_N, jnp.take_along_axis(logq_NV, ids_N1, axis=1)[:, 0], 0.0)
    if not cfg.with_entropy:
        return logp_N
    entropy_N = -jnp.sum(jnp.exp(logq_NV) * logq_NV, axis=1)
    if not cfg.top_k:
        return logp_N, entropy_N
    top_logp_NK, ids_NK = jax.lax.top_k(jax.lax.stop_gradient(logq_NV), cfg.top_k)
    return logp_N, entropy_N, ids_NK.astype(jnp.int32), top_logp_NK


def linear_logprob(
    h_ND: jax.Array,
    w_DV: jax.Array,
    targets_N: jax.Array,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    impl: str = "auto",
    block_sizes: BlockSizes | dict | None = None,
) -> Any:
    """log softmax(h w / T)[target] per token, without [N, V] logits.

    Args:
      h_ND, w_DV: as in linear_topk_kl.
      targets_N: int [N]; targets outside [0, V) give logp 0 and no gradient (padding).
      with_entropy: also return the entropy of softmax(h w / T) per token.
    Returns:
      float32 logp_N [N], or (logp_N, entropy_N) (nats); differentiable wrt h and w.
    """
    _check_projection(h_ND, w_DV, temperature)
    _check_ids("targets_N", targets_N, h_ND, trailing=())
    cfg = _Config(_resolve(impl, h_ND, w_DV), float(temperature), _as_blocks(block_sizes),
                  with_entropy=bool(with_entropy))
    ids_N, valid_N = _in_vocab(targets_N, w_DV.shape[1])
    if cfg.impl == "dense":
        return _dense_logprob(h_ND, w_DV, ids_N[:, None], valid_N, cfg)
    return _logprob(h_ND, w_DV, ids_N[:, None], valid_N, cfg)


def linear_logprob_topk(
    h_ND: jax.Array,
    w_DV: jax.Array,
    targets_N: jax.Array,
    k: int,
    *,
    temperature: float = 1.0,
    impl: str = "auto",
    block_sizes: BlockSizes | dict | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`linear_logprob(..., with_entropy=True)` plus the top-k of softmax(h w / T) per row,
    from one blockwise projection: (logp_N, entropy_N, ids_NK int32, logp_NK float32).

    The projection pass that gives the target's log-prob and the entropy keeps each row's
    k best logits too (chunked_xla: a top-k of each token block's rows; pallas: a running
    top-k merged per vocabulary tile), so the extra outputs cost no second projection.
    logp_N and entropy_N are those of linear_logprob, differentiable wrt h and w the same
    way (the on-policy GRPO update takes its loss and the drafter's data from one forward);
    the top-k carry no gradient. ids_NK are best first, ties to the lower id (as
    lax.top_k). k: 1 <= k <= V. impl, block_sizes: as in linear_topk_kl.
    """
    _check_projection(h_ND, w_DV, temperature)
    _check_ids("targets_N", targets_N, h_ND, trailing=())
    _check_top_k("k", k, w_DV)
    cfg = _Config(_resolve(impl, h_ND, w_DV), float(temperature), _as_blocks(block_sizes), with_entropy=True,
                  top_k=int(k))
    ids_N, valid_N = _in_vocab(targets_N, w_DV.shape[1])
    forward = _dense_logprob if cfg.impl == "dense" else _logprob
    logp_N, entropy_N, ids_NK, logp_NK = forward(h_ND, w_DV, ids_N[:, None], valid_N, cfg)
    return logp_N, entropy_N, ids_NK, jax.lax.stop_gradient(logp_NK)


def linear_topk(
    h_ND: jax.Array,
    w_DV: jax.Array,
    k: int,
    *,
    temperature: float = 1.0,
    impl: str = "auto",
    block_sizes: BlockSizes | dict | None = None,
) -> tuple[jax.Array, jax.Array]:
    """A teacher's top-k per row from the blockwise projection, never [N, V] logits:
    (ids_NK int32, best first, ties to the lower id; logp_NK float32, the full-vocabulary
    log-probs of softmax(h w / T) at those ids, not renormalised over the k). The same
    values as `topk_from_logits` of the rows' logits (to f32 rounding). No gradient. Temporary memory is
    one token block's logits (chunked_xla) or tile (pallas), not N x V.

    h_ND, w_DV, impl, block_sizes: as in linear_topk_kl; k: 1 <= k <= V.
    """
    _check_projection(h_ND, w_DV, temperature)
    _check_top_k("k", k, w_DV)
    impl = _resolve(impl, h_ND, w_DV)
    h_ND, w_DV = jax.lax.stop_gradient(h_ND), jax.lax.stop_gradient(w_DV)
    if impl == "dense":
        return topk_from_logits(jnp.dot(h_ND, w_DV, preferred_element_type=jnp.float32), k, temperature)
    no_ids_N1 = jnp.zeros((h_ND.shape[0], 1), jnp.int32)
    stats = fk.row_stats(impl, h_ND, w_DV, no_ids_N1, temperature=float(temperature), with_ez=False,
                         blocks=_as_blocks(block_sizes), top_k=int(k))
    return stats.top_ids.astype(jnp.int32), stats.top_z - stats.lse[:, None]


def _check_top_k(name, k, w_DV):
    if not 1 <= k <= w_DV.shape[1]:
        raise ValueError(f"{name}={k} must lie in [1, {w_DV.shape[1]}] (the vocabulary size); set {name} <= "
                         f"{w_DV.shape[1]}.")


def topk_from_logits(logits_BTV, k: int, temperature: float = 1.0):
    """Top-k ids and full-vocabulary log-probs at them, from teacher logits.

    Args:
      logits_BTV: teacher logits [B, T, V], any float dtype (computed in f32).
      k: number of ids kept per position (static under jit).
      temperature: > 0; log-probs are log_softmax(logits / temperature).
    Returns:
      ids_BTK int32, most likely first; logp_BTK f32, the log-probs of those ids under the
      full-vocabulary distribution (not renormalised over the top k).
    """
    scaled_BTV = logits_BTV.astype(jnp.float32) / temperature
    # top_k of the logits equals top_k of the log-probs; subtracting the normaliser after
    # the top_k avoids a second [B, T, V] array.
    top_BTK, ids_BTK = jax.lax.top_k(scaled_BTV, k)
    logp_BTK = top_BTK - jax.nn.logsumexp(scaled_BTV, axis=-1, keepdims=True)
    return ids_BTK.astype(jnp.int32), logp_BTK
