"""Lossless parallel verification of draft trees for speculative decoding.

Each of B sequences comes with a draft tree of T nodes. Node 0 is the last committed
token (the root); node i >= 1 hangs under parents[i] < i, or is padding
(parents[i] == -1), so trees of different sizes share one T. The target model has
scored every node at once: target_logp[i] is its next-token distribution r_i after
node i, as it will be sampled (temperature, top-k, top-p applied; -inf = excluded;
rows are normalised log-probs). The walk below picks the tokens to emit.

Walk. Start at the root with r = r_0. Try the children of the current node in
increasing node index; accepting child x (token x) moves the walk to it (r, q reset to
its rows) and its own children are tried next. When no child is accepted, or at a
leaf, one more token is drawn from the current r. Emitted: the accepted tokens, then
that token, at least 1 and at most depth + 1 of them.

Sampled drafts (draft_logp given): the children of node i were drawn one after another
WITHOUT replacement from q_i = exp(draft_logp[i]) (the number of children may depend
on the earlier siblings, never on later draws). Recursive rejection sampling (RRS,
Jeon et al. 2024; the without-replacement form of SpecTr-style multi-draft
verification): child x is accepted with probability min(1, r(x) / q(x)); on rejection

    r <- norm(max(0, r - q)),        q <- q with x removed, renormalised.

Why lossless: given the history, x ~ q (the without-replacement conditional), and
P(x accepted) = min(r, q)(x), P(reject) = sum max(0, r - q) =: Z, so "accept x, or on
rejection draw from max(0, r - q) / Z" outputs exactly r. The rest of the siblings,
then the final draw, is such a draw from the new r with candidates from the new q, so
by induction (on the number of siblings left) the first emitted token is distributed
exactly as r_root, and, by the same argument at the accepted node, every later one as
the target's distribution given the emitted prefix.

Deterministic drafts (draft_logp None: top-k, n-gram, any candidates chosen without
the verifier's randomness, duplicates allowed): child x is accepted with probability
r(x) / sum(r); on rejection r(x) <- 0. The chain rule of r restricted to the
remaining tokens gives the same induction. Rows with temperature 0 (0 at the argmax,
-inf elsewhere) make both walks the exact argmax path.

Since children have larger indices than their parents, one pass over i = 1..T-1 does
the whole walk: node i is tried iff parents[i] is the current node (after the walk
moves to child c, c's later siblings, and the subtrees of rejected siblings, never
match again). Entries with parents[i] >= i or < -1 therefore act as padding too.

Random numbers (both implementations consume exactly these, drawn outside any kernel,
so the same key gives the same outputs):

    k_u, k_g = jax.random.split(key)
    u_BT = jax.random.uniform(k_u, (B, T))   # accept test of node i: u[b, i]
    g_BV = jax.random.gumbel(k_g, (B, V))    # next_token = argmax(log r + g)

The accept test is u * q(x) < r(x) (sampled; q(x) == 0 accepts iff r(x) > 0) or
u * sum(r) < r(x) (deterministic), with r, q float32 probabilities. A node whose token
is outside [0, V) acts as padding (neither it nor its subtree is ever tried). If the
residual max(0, r - q) sums to 0 (r == q up to rounding), r is kept. The argmax takes
the first maximum, so a row of -inf (a target row with no mass, outside the contract)
gives token 0 rather than NaN.

Implementations (`impl`):
reference  plain jnp, vectorised over B, a lax.fori_loop over nodes.
pallas     `pl.pallas_call`, one program per sequence, tiled over V: no [V] row is
           held on chip, only vectors of `block_v` entries (default 2048), so it
           serves V = 128k-152k (Llama 3, Qwen2.5). The walk state (r, q) is rebuilt a
           block at a time from the current node's rows and the rejections recorded
           since (see _tiled_kernel); the masses the walk needs (residual and kept
           draft mass per rejection, sum(r) per deterministic try) and the final
           Gumbel-argmax accumulate over V blocks. Memory traffic: one pass over the
           node's rows per rejection (sampled) or per try (deterministic), plus one for
           the final draw. Interpret mode on CPU, where its outputs equal the
           reference's for the same key (the elementwise values are the reference's
           bit for bit; only the block order of the V-sums differs, which matters
           only where a uniform lies within rounding of an acceptance threshold).
           Triton lowering on the GPU: only the [B, T] node arrays are padded (to a
           power-of-two T), V only when below one block.
auto       the implementation measured fastest on this device for the B x T x V shape
           class (`tlt_jax.impl_table`, written by `experiments/bench_verify.py --table`,
           the verify block of `experiments/device_check.sh`); _AUTO_IMPL's, the
           reference, on a device never measured.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tlt_jax import impl_table

try:  # Triton lowering parameters; absent in builds without the GPU Pallas backend.
    from jax.experimental.pallas import triton as _pltriton
except ImportError:  # pragma: no cover
    _pltriton = None

__all__ = ["IMPLS", "resolve_impl", "verify"]

IMPLS = ("auto", "reference", "pallas")

# impl="auto" on a device the impl table never measured. CPU: the kernel only runs in
# interpret mode there.
_AUTO_IMPL = {"cpu": "reference", "gpu": "reference", "tpu": "reference"}
# The kernel's V block (entries per vector it keeps live).
_BLOCK_V = 2048


def impls_on(backend: str) -> tuple[str, ...]:
    """What runs natively on `backend`: the kernel lowers to Triton on a GPU whose jax has
    the Pallas Triton backend; on a CPU it is an interpreter (tests), not a candidate."""
    return ("reference", "pallas") if backend == "gpu" and _pltriton is not None else ("reference",)


def resolve_impl(impl: str, backend: str | None = None, *, elements: int | None = None) -> str:
    """Maps "auto" to the implementation measured fastest on this device for the shape class
    of B x T x V `elements` (`tlt_jax.impl_table`; None: any), the reference where the device
    was never measured."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    backend = backend or jax.default_backend()
    if impl == "pallas" and backend != "cpu" and "pallas" not in impls_on(backend):  # the CPU: the interpreter
        raise ValueError(f"impl='pallas' has no lowering on the {backend} backend; pass one of auto, "
                         f"{', '.join(impls_on(backend))}.")
    if impl != "auto":
        return impl
    measured = impl_table.lookup("verify", backend, impl_table.device_kind(backend), "float32",
                                 None if elements is None else impl_table.shape_class("verify", elements))
    return measured if measured in impls_on(backend) else _AUTO_IMPL.get(backend, "reference")


# ------------------------------------------------------------------------------------
# The reference walk: b sequences at once, whole [b, V] rows.
# ------------------------------------------------------------------------------------


def _pick(x_bV, onehot_bV):
    """x at the one-hot position, [b, 1] (0 when there is none); exact."""
    return jnp.sum(jnp.where(onehot_bV, x_bV, 0.0), axis=-1, keepdims=True)


def _safe_div(x, z):
    return x / jnp.where(z > 0, z, 1.0)


def _reject_sampled(r_bV, q_bV, onehot_bV):
    """RRS update after the drafted token (onehot) was rejected: (r, q) -> (r', q')."""
    res_bV = jnp.maximum(r_bV - q_bV, 0.0)
    z_b1 = jnp.sum(res_bV, axis=-1, keepdims=True)
    # z == 0 means r == q up to rounding: the residual is undefined, keep r.
    r_bV = jnp.where(z_b1 > 0, _safe_div(res_bV, z_b1), r_bV)
    q_bV = jnp.where(onehot_bV, 0.0, q_bV)
    return r_bV, _safe_div(q_bV, jnp.sum(q_bV, axis=-1, keepdims=True))


def _first_argmax(x_bV, iota_bV):
    """argmax over the last axis, first maximum on ties (an all -inf row gives 0), [b, 1]."""
    m_b1 = jnp.max(x_bV, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x_bV == m_b1, iota_bV, x_bV.shape[-1]), axis=-1, keepdims=True)


def _walk(load, n_nodes, g_bV, sampled):
    """The verification walk over nodes 1..n_nodes-1.

    load(i) -> (token_b1 int32, parent_b1 int32, u_b1 f32, target_logp_bV f32,
    draft_logp_bV f32 or None) of node i (i may be traced). g_bV: Gumbel noise.
    Returns (path_bT [b, n_nodes] int32, -1 padded; num_accepted_b1; next_token_b1).
    """
    _, _, _, t0_bV, d0_bV = load(0)
    b, v = t0_bV.shape
    iota_bV = lax.broadcasted_iota(jnp.int32, (b, v), 1)
    iota_bT = lax.broadcasted_iota(jnp.int32, (b, n_nodes), 1)

    def body(i, carry):
        cur_b1, n_acc_b1, path_bT, r_bV, q_bV = carry
        tok_b1, parent_b1, u_b1, t_bV, d_bV = load(i)
        onehot_bV = iota_bV == tok_b1
        rx_b1 = _pick(r_bV, onehot_bV)
        if sampled:
            accept_b1 = u_b1 * _pick(q_bV, onehot_bV) < rx_b1
            r_rej_bV, q_rej_bV = _reject_sampled(r_bV, q_bV, onehot_bV)
        else:
            accept_b1 = u_b1 * jnp.sum(r_bV, axis=-1, keepdims=True) < rx_b1
            r_rej_bV = jnp.where(onehot_bV, 0.0, r_bV)
        tried_b1 = parent_b1 == cur_b1
        accept_b1 = tried_b1 & accept_b1
        reject_b1 = tried_b1 & ~accept_b1
        # Padding rows may hold anything (NaN): they only ever reach unselected branches.
        r_bV = jnp.where(accept_b1, jnp.exp(t_bV), jnp.where(reject_b1, r_rej_bV, r_bV))
        if sampled:
            q_bV = jnp.where(accept_b1, jnp.exp(d_bV), jnp.where(reject_b1, q_rej_bV, q_bV))
        path_bT = jnp.where(accept_b1 & (iota_bT == n_acc_b1), i, path_bT)
        return jnp.where(accept_b1, i, cur_b1), n_acc_b1 + accept_b1.astype(jnp.int32), path_bT, r_bV, q_bV

    zeros_b1 = jnp.zeros((b, 1), jnp.int32)
    init = (
        zeros_b1,
        zeros_b1,
        jnp.full((b, n_nodes), -1, jnp.int32),
        jnp.exp(t0_bV),
        jnp.exp(d0_bV) if sampled else None,
    )
    _, n_acc_b1, path_bT, r_bV, _ = lax.fori_loop(1, n_nodes, body, init)
    return path_bT, n_acc_b1, _first_argmax(jnp.log(r_bV) + g_bV, iota_bV)


# ------------------------------------------------------------------------------------
# Implementations: (tokens_BT, parents_BT, target_BTV, draft_BTV | None, u_BT, g_BV)
# -> (path_BT, num_accepted_B, next_token_B).
# ------------------------------------------------------------------------------------


def _reference(tokens_BT, parents_BT, target_BTV, draft_BTV, u_BT, g_BV):
    def load(i):
        def col(x_BT):
            return lax.dynamic_slice_in_dim(x_BT, i, 1, axis=1)

        return (
            col(tokens_BT),
            col(parents_BT),
            col(u_BT),
            target_BTV[:, i],
            None if draft_BTV is None else draft_BTV[:, i],
        )

    path_BT, n_acc_B1, next_B1 = _walk(load, tokens_BT.shape[1], g_BV, draft_BTV is not None)
    return path_BT, n_acc_B1[:, 0], next_B1[:, 0]


# The kernel keeps no [V] row on chip. Within one node's children the state (r, q) is a
# function of the current node's rows and of the siblings rejected so far: each
# rejection is recorded as (token, residual mass z, kept draft mass s), and any block
# of r, q is rebuilt from the rows by replaying those updates elementwise, in the
# reference's order and with its operations, so that the values agree bit for bit with
# the reference's given the same z and s. z, s (sampled) or sum(r) (deterministic) and
# the final Gumbel-argmax are accumulated over V blocks. A block past the end of the
# row starts at V - block instead and masks the entries an earlier block counted: no
# padding of the [T, V] inputs (V below one block is padded up to it).


def _tiled_kernel(tok_ref, parent_ref, u_ref, t_ref, *refs, sampled, block_v):
    d_ref, g_ref, path_ref, n_acc_ref, next_ref = refs if sampled else (None, *refs)
    n_nodes, v = t_ref.shape
    n_blocks = pl.cdiv(v, block_v)
    tp = tok_ref.shape[1]
    iota_1T = lax.broadcasted_iota(jnp.int32, (1, tp), 1)
    tokens_1T, parents_1T, u_1T = tok_ref[...], parent_ref[...], u_ref[...]

    def entry(x_1T, j):  # x[j] as a scalar; exact (adds zeros)
        return jnp.sum(jnp.where(iota_1T == j, x_1T, jnp.zeros_like(x_1T)))

    def rows(cur, k, rejected, start, width):
        """r, q [1, width] at columns start.. of the walk's state at node cur after its
        first k rejected siblings (q None for deterministic drafts)."""
        node, cols = pl.ds(cur, 1), pl.ds(start, width)
        ids = start + lax.broadcasted_iota(jnp.int32, (1, width), 1)
        r = jnp.exp(t_ref[node, cols])
        q = jnp.exp(d_ref[node, cols]) if sampled else None
        rej_tok, rej_z, rej_s = rejected

        def replay(j, rq):
            r, q = rq
            hit = ids == entry(rej_tok, j)
            if not sampled:
                return jnp.where(hit, 0.0, r), q
            z, s = entry(rej_z, j), entry(rej_s, j)
            r = jnp.where(z > 0, _safe_div(jnp.maximum(r - q, 0.0), z), r)
            return r, _safe_div(jnp.where(hit, 0.0, q), s)

        return lax.fori_loop(0, k, replay, (r, q))

    def blocks(n, fn, init):
        """Folds fn(valid_1W, ids_1W, start, acc) over the first n V blocks (n = 0: none)."""

        def body(j, acc):
            start = jnp.minimum(j * block_v, v - block_v)
            ids = start + lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
            return fn(ids >= j * block_v, ids, start, acc)

        return lax.fori_loop(0, n, body, init)

    def body(i, carry):
        cur, k, n_acc, path_1T, rejected = carry
        tok = jnp.clip(entry(tokens_1T, i), 0, v - 1)  # out-of-vocab nodes are padding: never tried
        tried = entry(parents_1T, i) == cur
        r_x, q_x = rows(cur, k, rejected, tok, 1)
        r_x = jnp.sum(r_x)
        if sampled:
            accept = tried & (entry(u_1T, i) * jnp.sum(q_x) < r_x)
            reject = tried & ~accept

            def masses(valid, ids, start, acc):
                r, q = rows(cur, k, rejected, start, block_v)
                res = jnp.where(valid, jnp.maximum(r - q, 0.0), 0.0)
                kept = jnp.where(valid & (ids != tok), q, 0.0)
                return acc[0] + jnp.sum(res), acc[1] + jnp.sum(kept)

            z, s = blocks(jnp.where(reject, n_blocks, 0), masses, (jnp.float32(0), jnp.float32(0)))
        else:

            def mass(valid, ids, start, acc):
                return acc + jnp.sum(jnp.where(valid, rows(cur, k, rejected, start, block_v)[0], 0.0))

            total = blocks(jnp.where(tried, n_blocks, 0), mass, jnp.float32(0))
            accept = tried & (entry(u_1T, i) * total < r_x)
            reject = tried & ~accept
            z = s = jnp.float32(0)
        at_k = reject & (iota_1T == k)
        rej_tok, rej_z, rej_s = rejected
        rejected = (jnp.where(at_k, tok, rej_tok), jnp.where(at_k, z, rej_z), jnp.where(at_k, s, rej_s))
        path_1T = jnp.where(accept & (iota_1T == n_acc), i, path_1T)
        k = jnp.where(accept, 0, k + reject.astype(jnp.int32))
        return jnp.where(accept, i, cur), k, n_acc + accept.astype(jnp.int32), path_1T, rejected

    zero = jnp.int32(0)
    no_rejections = (jnp.zeros((1, tp), jnp.int32), jnp.zeros((1, tp), jnp.float32), jnp.ones((1, tp), jnp.float32))
    init = (zero, zero, zero, jnp.full((1, tp), -1, jnp.int32), no_rejections)
    cur, k, n_acc, path_1T, rejected = lax.fori_loop(1, n_nodes, body, init)

    def argmax(valid, ids, start, acc):  # first maximum of log r + g, as _first_argmax
        best, best_id = acc
        x = jnp.where(valid, jnp.log(rows(cur, k, rejected, start, block_v)[0]) + g_ref[:, pl.ds(start, block_v)],
                      -jnp.inf)
        m = jnp.max(x)
        m_id = jnp.min(jnp.where(x == m, ids, v))
        return jnp.where(m > best, m, best), jnp.where(m > best, m_id, best_id)

    _, next_token = blocks(n_blocks, argmax, (jnp.float32(-jnp.inf), zero))
    path_ref[...] = path_1T
    n_acc_ref[...] = jnp.full((1, 1), n_acc, jnp.int32)
    next_ref[...] = jnp.full((1, 1), next_token, jnp.int32)


def _pallas(tokens_BT, parents_BT, target_BTV, draft_BTV, u_BT, g_BV, *, interpret=None, block_v=_BLOCK_V,
            num_warps=4):
    """interpret None: everywhere but on a GPU. block_v: a power of two, the V block.
    The [B, T] node arrays are padded to a power-of-two T (padding nodes) and V is
    padded (-inf log-probs) only when below one block: Triton blocks are powers of two."""
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    b, t, v = target_BTV.shape
    tp = pl.next_power_of_2(t)
    block_v = min(block_v, pl.next_power_of_2(v))
    vp = max(v, block_v)

    def padded(x, sizes, value):
        return jnp.pad(x, [(0, s - n) for n, s in zip(x.shape, sizes)], constant_values=value)

    sampled = draft_BTV is not None
    ins = [
        padded(tokens_BT, (b, tp), 0),
        padded(parents_BT, (b, tp), -1),
        padded(u_BT, (b, tp), 0.0),
        padded(target_BTV, (b, t, vp), -jnp.inf),
    ]
    ins += [padded(draft_BTV, (b, t, vp), -jnp.inf)] if sampled else []
    ins.append(padded(g_BV, (b, vp), 0.0))
    row_T, rows_TV = pl.BlockSpec((1, tp), lambda s: (s, 0)), pl.BlockSpec((pl.Squeezed(), t, vp), lambda s: (s, 0, 0))
    one = pl.BlockSpec((1, 1), lambda s: (s, 0))
    if interpret:
        params = None
    elif _pltriton is None:
        raise NotImplementedError("this jax build has no Pallas Triton backend; use interpret=True")
    else:  # Triton parameters select the Triton lowering (jax >= 0.10 defaults to Mosaic GPU).
        params = _pltriton.CompilerParams(num_warps=num_warps)
    path_BT, n_acc_B1, next_B1 = pl.pallas_call(
        functools.partial(_tiled_kernel, sampled=sampled, block_v=block_v),
        out_shape=(
            jax.ShapeDtypeStruct((b, tp), jnp.int32),
            jax.ShapeDtypeStruct((b, 1), jnp.int32),
            jax.ShapeDtypeStruct((b, 1), jnp.int32),
        ),
        grid=(b,),
        in_specs=[row_T] * 3 + [rows_TV] * (1 + sampled) + [pl.BlockSpec((1, vp), lambda s: (s, 0))],
        out_specs=(row_T, one, one),
        interpret=interpret,
        compiler_params=params,
        name="spec_verify",
    )(*ins)
    return path_BT[:, :t], n_acc_B1[:, 0], next_B1[:, 0]


def _check_shapes(tokens_BT, parents_BT, target_logp_BTV, draft_logp_BTV):
    if tokens_BT.ndim != 2 or parents_BT.shape != tokens_BT.shape:
        raise ValueError(
            f"tokens_BT and parents_BT must share one [B, T] shape, got {tokens_BT.shape}, {parents_BT.shape}"
        )
    if tokens_BT.shape[1] < 1:
        raise ValueError(f"trees need T >= 1 nodes (node 0 is the root), got tokens_BT {tokens_BT.shape}")
    if target_logp_BTV.ndim != 3 or target_logp_BTV.shape[:2] != tokens_BT.shape or target_logp_BTV.shape[2] < 1:
        raise ValueError(
            f"target_logp_BTV must be [B, T, V] = {tokens_BT.shape} + [V >= 1], got {target_logp_BTV.shape}"
        )
    if draft_logp_BTV is not None and draft_logp_BTV.shape != target_logp_BTV.shape:
        raise ValueError(
            f"draft_logp_BTV must match target_logp_BTV {target_logp_BTV.shape}, got {draft_logp_BTV.shape}"
        )
    for name, x in (("tokens_BT", tokens_BT), ("parents_BT", parents_BT)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {x.dtype}")


@functools.partial(jax.jit, static_argnames=("impl",))
def verify(tokens_BT, parents_BT, target_logp_BTV, draft_logp_BTV, key, impl: str = "auto"):
    """Verifies B draft trees against the target; see the module docstring.

    tokens_BT, parents_BT: int [B, T] node tokens (tokens[:, 0] unused) and parents
      (parents[:, 0] == -1; -1 elsewhere = padding node).
    target_logp_BTV: [B, T, V] target next-token log-probs after each node.
    draft_logp_BTV: [B, T, V] log-probs the children of each node were drawn from
      without replacement, or None for deterministic drafts.
    key: PRNG key; the only randomness (split into u_BT and g_BV as documented).
    Returns path_BT int32 (accepted node ids from the root's accepted child down,
    -1 padded), num_accepted_B int32, next_token_B int32 (drawn from the final r).
    Emitted tokens: tokens along the path, then next_token.
    """
    _check_shapes(tokens_BT, parents_BT, target_logp_BTV, draft_logp_BTV)
    b, t, v = target_logp_BTV.shape
    impl = resolve_impl(impl, elements=b * t * v)
    # Out-of-vocabulary drafts become padding here, before V is padded for a kernel.
    parents_BT = jnp.where((tokens_BT >= 0) & (tokens_BT < v), parents_BT, -1)
    k_u, k_g = jax.random.split(key)
    u_BT = jax.random.uniform(k_u, (b, t), jnp.float32)
    g_BV = jax.random.gumbel(k_g, (b, v), jnp.float32)
    draft_BTV = None if draft_logp_BTV is None else draft_logp_BTV.astype(jnp.float32)
    fn = _reference if impl == "reference" else _pallas
    return fn(
        tokens_BT.astype(jnp.int32),
        parents_BT.astype(jnp.int32),
        target_logp_BTV.astype(jnp.float32),
        draft_BTV,
        u_BT,
        g_BV,
    )
