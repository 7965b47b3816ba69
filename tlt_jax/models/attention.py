"""Grouped-query attention: one function, three implementations chosen by `impl`.

Shapes: q_BTHD [B, T, H, Dh] (H query heads), k_BSKD, v_BSKD [B, S, K, Dh] (K kv heads,
H a multiple of K; query head h reads kv head h // (H / K)). Scores are scaled by
1/sqrt(Dh); the softmax runs in float32; the output has q's dtype.

Masks:
  * a bool array mask_BTS (True where visible): any pattern, e.g. a draft tree. Dense only.
  * `CausalMask`: query t sees key s iff s <= t + offset_B[b] (offset 0 by default) and,
    with segment ids (self-attention, T == S), both belong to the same packed segment.
    What training (`forward`) and prefill need, described without a [B, T, S] array,
    so an implementation can form it a block at a time.

Implementations:
  dense      scores [B, H, T, S] in float32, masked softmax, then the values. Memory
             O(B H T S): 48 GiB of scores per layer at 32k tokens for 12 heads.
  blockwise  online softmax over key blocks (flash-attention style) in plain XLA: for
             each block of queries a loop over the key blocks it can see (blocks past
             the causal diagonal are skipped) carries the running max, the running sum
             and the unnormalised output; only log-sum-exp [B, H, T] is kept for the
             backward, a custom VJP that recomputes each block's probabilities (one pass
             over key blocks, each with an inner pass over the query blocks that see it;
             dQ accumulates in float32). Memory O(B H (T + S) Dh + B H block_q block_k).
             Fully masked query rows give 0 (dense gives NaN).
  cudnn      `jax.nn.dot_product_attention(implementation="cudnn")`: GPU, float16 or
             bfloat16, head_dim a multiple of 8 (<= 128, <= 256 from Hopper on),
             T == S, causal with offset 0 and no segment ids (its public API takes
             neither packed segments nor per-row offsets).
  auto       dense when a side fits in one block (T <= block_q or S <= block_k: decode
             steps, short sequences, every boolean mask); otherwise cudnn on a GPU where
             it applies, else blockwise (_AUTO_IMPL).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["BLOCK_K", "BLOCK_Q", "CausalMask", "IMPLS", "attention", "resolve_impl"]

IMPLS = ("auto", "dense", "blockwise", "cudnn")
# impl="auto" for long sequences, per backend; the GPU entry falls back to blockwise
# wherever cudnn does not apply (packed segments, offsets, float32, head_dim).
_AUTO_IMPL = {"cpu": "blockwise", "gpu": "cudnn", "tpu": "blockwise"}
BLOCK_Q = 512
BLOCK_K = 512


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CausalMask:
    """Query t (0-based among the T queries) sees key s iff s <= t + offset_B[b] and, with
    segment_ids_BT (self-attention only: T == S), segment_ids_BT[b, t] == segment_ids_BT[b, s].

    offset_B: int32 [B], the number of keys before the first query's own (the cache
    length when decoding); None means 0.
    """

    offset_B: jax.Array | None = None
    segment_ids_BT: jax.Array | None = None

    def visible(self, b: int, t_idx: jax.Array, s_idx: jax.Array) -> jax.Array:
        """[B, Tb, Sb] bool for query indices t_idx [Tb] and key indices s_idx [Sb]."""
        offset = jnp.zeros((b,), jnp.int32) if self.offset_B is None else self.offset_B.astype(jnp.int32)
        vis = s_idx[None, None, :] <= t_idx[None, :, None] + offset[:, None, None]
        if self.segment_ids_BT is not None:
            seg = self.segment_ids_BT
            vis = vis & (jnp.take(seg, t_idx, axis=1, mode="clip")[:, :, None]
                         == jnp.take(seg, s_idx, axis=1, mode="clip")[:, None, :])
        return vis


def resolve_impl(impl: str, q_shape, k_shape, mask, dtype, *, backend: str | None = None,
                 block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> str:
    """The implementation `attention` runs for these shapes, mask and dtype."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    t, s = q_shape[1], k_shape[1]
    if not isinstance(mask, CausalMask) or t <= block_q or s <= block_k:
        return "dense"
    backend = backend or jax.default_backend()
    chosen = _AUTO_IMPL.get(backend, "blockwise")
    if chosen == "cudnn" and not _cudnn_applies(q_shape, k_shape, mask, dtype, backend):
        return "blockwise"
    return chosen


def _cudnn_applies(q_shape, k_shape, mask, dtype, backend) -> bool:
    if backend != "gpu" or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    if not isinstance(mask, CausalMask) or mask.offset_B is not None or mask.segment_ids_BT is not None:
        return False
    dh = q_shape[-1]
    capability = getattr(jax.devices()[0], "compute_capability", "0.0")
    max_dh = 256 if float(capability) >= 9.0 else 128
    return q_shape[1] == k_shape[1] and dh % 8 == 0 and dh <= max_dh


def attention(q_BTHD, k_BSKD, v_BSKD, mask, *, impl: str = "auto", block_q: int = BLOCK_Q,
              block_k: int = BLOCK_K):
    """Grouped-query attention (see the module docstring); returns [B, T, H, Dh].

    mask: a [B, T, S] array (True / nonzero where visible) or a `CausalMask`.
    impl: "auto", "dense", "blockwise" or "cudnn". block_q, block_k: the blockwise tiles
    (also what "auto" calls long).
    """
    b, t, h, dh = q_BTHD.shape
    s, kv = k_BSKD.shape[1], k_BSKD.shape[2]
    if k_BSKD.shape != (b, s, kv, dh) or v_BSKD.shape != k_BSKD.shape or h % kv:
        raise ValueError(f"q {q_BTHD.shape}, k {k_BSKD.shape}, v {v_BSKD.shape} must be [B, T, H, Dh] and "
                         "[B, S, K, Dh] with H a multiple of K")
    if isinstance(mask, CausalMask):
        if mask.segment_ids_BT is not None and (t != s or mask.segment_ids_BT.shape != (b, t)):
            raise ValueError(f"segment ids {mask.segment_ids_BT.shape} need self-attention with [B, T] = {(b, t)}")
    elif mask.shape != (b, t, s):
        raise ValueError(f"mask must be a CausalMask or [B, T, S] = {(b, t, s)} (nonzero: visible), got {mask.shape}")
    else:
        mask = mask.astype(jnp.bool_)
    impl = resolve_impl(impl, q_BTHD.shape, k_BSKD.shape, mask, q_BTHD.dtype, block_q=block_q, block_k=block_k)
    if impl != "dense" and not isinstance(mask, CausalMask):
        raise ValueError(f"impl={impl!r} takes a CausalMask; a boolean mask needs impl='dense'")
    with jax.named_scope(f"attention_{impl}"):
        if impl == "dense":
            mask_BTS = mask if not isinstance(mask, CausalMask) else mask.visible(
                b, jnp.arange(t, dtype=jnp.int32), jnp.arange(s, dtype=jnp.int32))
            return _dense(q_BTHD, k_BSKD, v_BSKD, mask_BTS)
        if impl == "cudnn":
            if not _cudnn_applies(q_BTHD.shape, k_BSKD.shape, mask, q_BTHD.dtype, jax.default_backend()):
                raise ValueError("impl='cudnn' needs a GPU, float16/bfloat16, T == S, a CausalMask without offsets "
                                 "or segment ids and head_dim a multiple of 8 within cuDNN's limit")
            return jax.nn.dot_product_attention(q_BTHD, k_BSKD, v_BSKD, is_causal=True, implementation="cudnn")
        offset_B = jnp.zeros((b,), jnp.int32) if mask.offset_B is None else mask.offset_B.astype(jnp.int32)
        seg_BT = mask.segment_ids_BT
        return _blockwise(q_BTHD, k_BSKD, v_BSKD, offset_B, None if seg_BT is None else seg_BT.astype(jnp.int32),
                          min(block_q, t), min(block_k, s))


def _dense(q_BTHD, k_BSKD, v_BSKD, mask_BTS):
    b, t, h, dh = q_BTHD.shape
    kv = k_BSKD.shape[2]
    q = q_BTHD.reshape(b, t, kv, h // kv, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_BSKD, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(dh)
    scores = jnp.where(mask_BTS[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSKD.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BSKD)
    return out.reshape(b, t, h, dh)


# ------------------------------------------------------------------------------------
# Blockwise (online softmax). Internally q is grouped [B, T, K, G, Dh] (G = H / K) and
# T, S are padded to whole blocks; padded keys are invisible, padded queries dropped.
# ------------------------------------------------------------------------------------


def _blockwise(q_BTHD, k_BSKD, v_BSKD, offset_B, seg_BT, block_q, block_k):
    b, t, h, dh = q_BTHD.shape
    kv = k_BSKD.shape[2]
    q = q_BTHD.reshape(b, t, kv, h // kv, dh)
    out = _flash(q, k_BSKD, v_BSKD, offset_B, seg_BT, block_q, block_k)
    return out.reshape(b, t, h, dh)


def _pad_to(x, axis, multiple):
    n = x.shape[axis]
    pad = -n % multiple
    return x if pad == 0 else jnp.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)])


class _Blocks:
    """Block geometry and per-block masks of one blockwise call."""

    def __init__(self, q, k, offset_B, seg_BT, block_q, block_k):
        self.b, self.t = q.shape[:2]
        self.s = k.shape[1]
        self.bq, self.bk = block_q, block_k
        self.nq, self.nk = -(-self.t // block_q), -(-self.s // block_k)
        self.offset_B = offset_B
        self.max_offset = jnp.max(offset_B)
        self.seg_BT = seg_BT
        self.scale = 1.0 / math.sqrt(q.shape[-1])

    def visible(self, i, j):
        """[B, 1, 1, bq, bk] bool of query block i against key block j."""
        t_idx = i * self.bq + jnp.arange(self.bq, dtype=jnp.int32)
        s_idx = j * self.bk + jnp.arange(self.bk, dtype=jnp.int32)
        vis = CausalMask(self.offset_B, self.seg_BT).visible(self.b, t_idx, s_idx) & (s_idx < self.s)[None, None, :]
        return vis[:, None, None]

    def key_blocks_seen(self, i):
        """Key blocks 0 .. n-1 hold every key some query of block i may see."""
        last_key = (i + 1) * self.bq - 1 + self.max_offset
        return jnp.clip(last_key // self.bk + 1, 0, self.nk)

    def first_query_block(self, j):
        """Query blocks before this one see no key of block j."""
        return jnp.clip((j * self.bk - self.max_offset) // self.bq, 0, self.nq)

    def scores(self, q_i, k_j, i, j):
        """Masked float32 scores [B, K, G, bq, bk] and the mask."""
        s = jnp.einsum("btkgd,bskd->bkgts", q_i, k_j, preferred_element_type=jnp.float32) * self.scale
        vis = self.visible(i, j)
        return jnp.where(vis, s, -jnp.inf), vis


def _slice(x, index, size, axis=1):
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q, k, v, offset_B, seg_BT, block_q, block_k):
    return _flash_fwd(q, k, v, offset_B, seg_BT, block_q, block_k)[0]


def _flash_fwd(q, k, v, offset_B, seg_BT, block_q, block_k):
    t = q.shape[1]
    geo = _Blocks(q, k, offset_B, seg_BT, block_q, block_k)
    qp, kp, vp = _pad_to(q, 1, block_q), _pad_to(k, 1, block_k), _pad_to(v, 1, block_k)
    b, _, kv, g, dh = q.shape

    def query_block(i):
        q_i = _slice(qp, i, block_q)

        def key_block(j, carry):
            m, l, acc = carry  # running max, sum [B, K, G, bq]; unnormalised output [B, K, G, bq, Dh]
            s, _ = geo.scores(q_i, _slice(kp, j, block_k), i, j)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing visible yet
            p = jnp.exp(s - m_safe[..., None])
            rescale = jnp.exp(m - m_safe)
            l = l * rescale + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), _slice(vp, j, block_k),
                            preferred_element_type=jnp.float32)
            return m_new, l, acc * rescale[..., None] + pv

        init = (jnp.full((b, kv, g, block_q), -jnp.inf, jnp.float32), jnp.zeros((b, kv, g, block_q), jnp.float32),
                jnp.zeros((b, kv, g, block_q, dh), jnp.float32))
        m, l, acc = lax.fori_loop(0, geo.key_blocks_seen(i), key_block, init)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        # +inf for rows that see nothing: exp(s - lse) = 0 in the backward.
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return jnp.moveaxis(out, 3, 1).astype(q.dtype), lse

    out, lse = lax.map(query_block, jnp.arange(geo.nq))  # [nq, B, bq, K, G, Dh], [nq, B, K, G, bq]
    out = jnp.moveaxis(out, 0, 1).reshape(b, geo.nq * block_q, kv, g, dh)[:, :t]
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, kv, g, geo.nq * block_q)  # [B, K, G, Tp]
    return out, (q, k, v, offset_B, seg_BT, out, lse)


def _flash_bwd(block_q, block_k, residuals, d_out):
    q, k, v, offset_B, seg_BT, out, lse = residuals
    geo = _Blocks(q, k, offset_B, seg_BT, block_q, block_k)
    t, s = q.shape[1], k.shape[1]
    qp, kp, vp = _pad_to(q, 1, block_q), _pad_to(k, 1, block_k), _pad_to(v, 1, block_k)
    dop = _pad_to(d_out.astype(q.dtype), 1, block_q)
    # D_t = sum_d dO * O: the softmax Jacobian's row term. [B, K, G, Tp]
    delta = jnp.einsum("btkgd,btkgd->bkgt", dop.astype(jnp.float32), _pad_to(out, 1, block_q).astype(jnp.float32))

    def key_block(j, carry):
        dq, dk, dv = carry
        k_j, v_j = _slice(kp, j, block_k), _slice(vp, j, block_k)

        def query_block(i, inner):
            dq, dk_j, dv_j = inner
            q_i, do_i = _slice(qp, i, block_q), _slice(dop, i, block_q)
            s_ij, vis = geo.scores(q_i, k_j, i, j)
            p = jnp.where(vis, jnp.exp(s_ij - _slice(lse, i, block_q, axis=3)[..., None]), 0.0)
            dv_j = dv_j + jnp.einsum("bkgts,btkgd->bskd", p.astype(v.dtype), do_i, preferred_element_type=jnp.float32)
            dp = jnp.einsum("btkgd,bskd->bkgts", do_i, v_j, preferred_element_type=jnp.float32)
            ds = (p * (dp - _slice(delta, i, block_q, axis=3)[..., None]) * geo.scale).astype(q.dtype)
            dk_j = dk_j + jnp.einsum("bkgts,btkgd->bskd", ds, q_i, preferred_element_type=jnp.float32)
            dq_i = jnp.einsum("bkgts,bskd->btkgd", ds, k_j, preferred_element_type=jnp.float32)
            dq = lax.dynamic_update_slice_in_dim(dq, _slice(dq, i, block_q) + dq_i, i * block_q, axis=1)
            return dq, dk_j, dv_j

        zeros = jnp.zeros(k_j.shape, jnp.float32)
        dq, dk_j, dv_j = lax.fori_loop(geo.first_query_block(j), geo.nq, query_block, (dq, zeros, zeros))
        dk = lax.dynamic_update_slice_in_dim(dk, dk_j.astype(k.dtype), j * block_k, axis=1)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_j.astype(v.dtype), j * block_k, axis=1)
        return dq, dk, dv

    init = (jnp.zeros(qp.shape, jnp.float32), jnp.zeros(kp.shape, k.dtype), jnp.zeros(vp.shape, v.dtype))
    dq, dk, dv = lax.fori_loop(0, geo.nk, key_block, init)
    return dq[:, :t].astype(q.dtype), dk[:, :s], dv[:, :s], None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
