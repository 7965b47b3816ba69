"""tlt_jax.models.attention: the blockwise (online-softmax) path against the dense one and
a float64 numpy reference, outputs and gradients, on odd lengths, grouped heads, causal
masks with packed segments and per-row offsets; what `impl="auto"` picks; its memory."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support import tiny
from tlt_jax.models import attention as attn
from tlt_jax.models import transformer as tfm

B, T, H, KV, DH = 2, 37, 6, 2, 8  # odd T, 3 query heads per kv head


def _reference(q, k, v, vis, d_out):
    """float64 numpy: outputs and the gradients of sum(out * d_out) wrt q, k, v."""
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    b, t, h, dh = q.shape
    s, kv = k.shape[1:3]
    g = h // kv
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head i reads kv head i // g
    scale = 1.0 / math.sqrt(dh)
    scores = np.where(vis[:, None], np.einsum("bthd,bshd->bhts", q, kk) * scale, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhts,bshd->bthd", p, vv)
    dp = np.einsum("bthd,bshd->bhts", d_out, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhts,bshd->bthd", ds, kk) * scale
    dk = (np.einsum("bhts,bthd->bshd", ds, q) * scale).reshape(b, s, kv, g, dh).sum(3)
    dv = np.einsum("bhts,bthd->bshd", p, d_out).reshape(b, s, kv, g, dh).sum(3)
    return out, (dq, dk, dv)


def _inputs(t, s, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=shape) for shape in ((B, t, H, DH), (B, s, KV, DH), (B, s, KV, DH)))
    d_out = rng.normal(size=(B, t, H, DH))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, d_out))


def _out_and_grads(impl, q, k, v, mask, d_out, **blocks):
    # Jitted, as the model runs it (op by op, each operation compiles a program of its own).
    @jax.jit
    def run(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: attn.attention(q, k, v, mask, impl=impl, **blocks), q, k, v)
        return out, vjp(d_out)

    return run(q, k, v, d_out)


def _segments(t, seed=0):
    """Packed segments of random lengths (some of length 1), sorted along T."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, 6, (B, t)), axis=1), jnp.int32)


CASES = {
    # name: (T, S, mask builder, (block_q, block_k)): tiles that divide nothing, or
    # square ones; several key blocks past the diagonal.
    "causal": (T, T, lambda: attn.CausalMask(), (8, 8)),
    "causal_segments": (T, T, lambda: attn.CausalMask(segment_ids_BT=_segments(T)), (5, 16)),
    "offsets": (11, 29, lambda: attn.CausalMask(offset_B=jnp.array([0, 18], jnp.int32)), (4, 8)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_blockwise_matches_dense_and_float64(case):
    t, s, make_mask, (block_q, block_k) = CASES[case]
    mask = make_mask()
    q, k, v, d_out = _inputs(t, s)
    vis = np.asarray(mask.visible(B, jnp.arange(t), jnp.arange(s)))
    want_out, want_grads = _reference(q, k, v, vis, d_out)
    dense_out, dense_grads = _out_and_grads("dense", q, k, v, mask, d_out)
    out, grads = _out_and_grads("blockwise", q, k, v, mask, d_out, block_q=block_q, block_k=block_k)
    assert out.shape == (B, t, H, DH) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, want_out, atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(out, dense_out, atol=2e-6, rtol=2e-6)
    for name, got, want, dense in zip("qkv", grads, want_grads, dense_grads):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")
        np.testing.assert_allclose(got, dense, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


def test_blockwise_bfloat16_stays_near_float64():
    """In bfloat16 (probabilities rounded before the value matmuls, as dense does) the
    error against float64 is that of the dense path, to within a factor of 2."""
    mask = attn.CausalMask(segment_ids_BT=_segments(T, seed=1))
    q, k, v, d_out = _inputs(T, T, seed=1, dtype=jnp.bfloat16)
    want_out, want_grads = _reference(q, k, v, np.asarray(mask.visible(B, jnp.arange(T), jnp.arange(T))), d_out)
    err = {}
    for impl, blocks in (("dense", {}), ("blockwise", dict(block_q=8, block_k=16))):
        out, grads = _out_and_grads(impl, q, k, v, mask, d_out, **blocks)
        assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
        err[impl] = [np.linalg.norm(np.asarray(x, np.float64) - w) / np.linalg.norm(w)
                     for x, w in zip((out, *grads), (want_out, *want_grads))]
    assert max(err["dense"]) < 2e-2
    assert all(e_blk < 2 * e_dense + 1e-3 for e_blk, e_dense in zip(err["blockwise"], err["dense"])), err


def test_auto_choice():
    short, long_q, long_kv = (B, 512, H, DH), (B, 4096, H, DH), (B, 4096, KV, DH)
    causal, seg = attn.CausalMask(), attn.CausalMask(segment_ids_BT=jnp.zeros((B, 4096), jnp.int32))
    offsets = attn.CausalMask(offset_B=jnp.zeros((B,), jnp.int32))
    resolve = attn.resolve_impl
    # One block either way (decode steps, short sequences) or a boolean mask: dense.
    assert resolve("auto", short, long_kv, causal, jnp.float32, backend="cpu") == "dense"
    assert resolve("auto", long_q, long_kv, jnp.ones((B, 4096, 4096), bool), jnp.float32, backend="cpu") == "dense"
    assert resolve("auto", long_q, long_kv, causal, jnp.float32, backend="cpu") == "blockwise"
    # GPU: cuDNN where its public API covers the mask and dtype, else blockwise.
    assert resolve("auto", long_q, long_kv, causal, jnp.bfloat16, backend="gpu") == "cudnn"
    for mask, dtype in ((seg, jnp.bfloat16), (offsets, jnp.bfloat16), (causal, jnp.float32)):
        assert resolve("auto", long_q, long_kv, mask, dtype, backend="gpu") == "blockwise"
    assert resolve("dense", long_q, long_kv, causal, jnp.float32, backend="gpu") == "dense"
    with pytest.raises(ValueError, match="impl"):
        resolve("flash", long_q, long_kv, causal, jnp.float32)
    q, k, v, _ = _inputs(4, 4)
    with pytest.raises(ValueError, match="CausalMask"):
        attn.attention(q, k, v, jnp.ones((B, 4, 4), bool), impl="blockwise")
    with pytest.raises(ValueError, match="cudnn"):
        attn.attention(q, k, v, attn.CausalMask(), impl="cudnn")
    with pytest.raises(ValueError, match="H a multiple of K"):
        attn.attention(q[:, :, :5], k, v, attn.CausalMask())


def test_blockwise_keeps_scores_out_of_memory():
    """Compile-time: forward + backward at T = 4096 needs no [H, T, T] buffer (dense:
    scores, probabilities and their cotangents); blockwise holds a few [H, 512, 512]
    tiles."""
    t, h, kv, dh = 4096, 4, 2, 16
    q = jax.ShapeDtypeStruct((1, t, h, dh), jnp.float32)
    k = jax.ShapeDtypeStruct((1, t, kv, dh), jnp.float32)

    def temp_bytes(impl):
        def loss(q, k, v):
            return jnp.sum(attn.attention(q, k, v, attn.CausalMask(), impl=impl) ** 2)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).compile().memory_analysis().temp_size_in_bytes

    scores = h * t * t * 4
    dense, blockwise = temp_bytes("dense"), temp_bytes("blockwise")
    assert dense > scores
    assert blockwise < scores / 8


CFG = tiny.config(vocab_size=61, intermediate_size=48, qkv_bias=True, rope_theta=500.0)


def test_forward_and_prefill_blockwise_equal_dense():
    """The model's paths with impl="blockwise" (one block at these lengths) against
    "dense": packed forward and its parameter gradients, right-padded prefill."""
    params = jax.jit(tfm.init_params, static_argnums=(0, 2))(CFG, jax.random.PRNGKey(0), 0.2)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 13), 0, CFG.vocab_size)
    seg = jnp.array([[0] * 5 + [1] * 8, [0] * 13])
    pos = jnp.where(seg == 1, jnp.arange(13) - 5, jnp.arange(13))

    def loss(p, impl):
        h = tfm.forward(p, CFG, tokens, positions_BT=pos, segment_ids_BT=seg, attention_impl=impl)
        return jnp.sum(h ** 2), h

    # Jitted, as training runs it (op by op, each operation compiles a program of its own).
    value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, h_blk), g_blk = value_and_grad(params, "blockwise")
    (_, h_dense), g_dense = value_and_grad(params, "dense")
    np.testing.assert_allclose(h_blk, h_dense, atol=1e-5, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4), g_blk, g_dense)

    cache = tfm.init_cache(CFG, 2, 20)
    lengths = jnp.array([13, 6])
    prefill = jax.jit(tfm.prefill, static_argnums=1, static_argnames=("return_logits", "attention_impl"))
    outs = [prefill(params, CFG, cache, tokens, lengths, return_logits=True, attention_impl=impl)
            for impl in ("blockwise", "dense")]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), outs[0], outs[1])
