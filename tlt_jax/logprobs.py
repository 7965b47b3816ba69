"""Per-token log-probs of a model's own tokens: a forward, then the fused blockwise
log-prob (`losses.linear_logprob`), so no [tokens, vocab] logits exist. What SFT's
cross-entropy and the GRPO learner's ratios both read. And a model's top-k at each
position of its hidden states, projected the same way: the targets a teacher cache and
the offline drafter learn from; or draws from it with counts, a sampled teacher cache's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tlt_jax import losses
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig


def token_logprobs(params, model_config: ModelConfig, tokens_nT, *, temperature=1.0, with_entropy=False,
                   impl="auto", remat=False, positions_nT=None, segment_ids_nT=None, attention_impl="auto"):
    """Log-prob of each next token, [n, T-1] float32 (and the entropy, with_entropy),
    projected blockwise: no [n, T, V] logits exist. Packed rows pass positions and
    segment ids (the last position of a segment then predicts the next one's first
    token: callers mask it)."""
    cut = lambda x: None if x is None else x[:, :-1]
    h = tfm.forward(params, model_config, tokens_nT[:, :-1], positions_BT=cut(positions_nT),
                    segment_ids_BT=cut(segment_ids_nT), remat=remat, attention_impl=attention_impl)
    n, t, d = h.shape
    out = losses.linear_logprob(h.reshape(n * t, d), tfm.lm_head_weight(params, model_config, h.dtype),
                                tokens_nT[:, 1:].reshape(-1), temperature=temperature,
                                with_entropy=with_entropy, impl=impl)
    if with_entropy:
        return out[0].reshape(n, t), out[1].reshape(n, t)
    return out.reshape(n, t)


def topk_of_hidden(params, model_config: ModelConfig, h_BTD, k: int, *, temperature=1.0, block_tokens: int = 0,
                   impl: str = "chunked_xla"):
    """The model's top-k at each position of hidden states h_BTD: (ids_BTK int32, best
    first, ties to the lower id; logp_BTK float32, the full-vocabulary log-probs at
    `temperature` of those ids), as `losses.topk_from_logits` of the logits gives them.
    Projected blockwise (`losses.linear_topk`), `block_tokens` of the B T rows at a time
    (0: the backend's default block), so no [B, T, V] logits exist: beyond h, the
    temporary memory is one block's [block_tokens, V] float32 logits. No gradient.

    impl: `losses.IMPLS`. chunked_xla by default, whose token blocks hold whole rows of
    logits: a top-k of each block is one lax.top_k, where the Pallas running top-k costs k
    rounds per vocabulary tile (a teacher's k = 100: 100 rounds a tile).
    """
    (b, t, d), dtype = h_BTD.shape, model_config.jnp_dtype
    ids_NK, logp_NK = losses.linear_topk(
        h_BTD.reshape(b * t, d).astype(dtype), tfm.lm_head_weight(params, model_config, dtype), k,
        temperature=temperature, impl=impl, block_sizes={"tokens": block_tokens} if block_tokens else None)
    return ids_NK.reshape(b, t, k), logp_NK.reshape(b, t, k)


def samples_of_hidden(params, model_config: ModelConfig, h_BTD, samples: int, keys_B, *, width: int,
                      temperature=1.0, block_tokens: int = 256):
    """`samples` draws with replacement from the model's softmax(logits / temperature) at
    each position of h_BTD, as distinct ids with counts (`linear_samples`): (ids_BTK int32,
    counts_BTK int32), K = width. keys_B: one PRNG key per row; position t of row b draws with
    fold_in(keys_B[b], t), so a row's draws depend on its key alone, not on its batch."""
    (b, t, d), dtype = h_BTD.shape, model_config.jnp_dtype
    if not jnp.issubdtype(keys_B.dtype, jax.dtypes.prng_key):
        keys_B = jax.random.wrap_key_data(keys_B)
    keys_N = jax.vmap(lambda key: jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(t)))(keys_B).reshape(-1)
    ids_NK, counts_NK = linear_samples(h_BTD.reshape(b * t, d).astype(dtype),
                                       tfm.lm_head_weight(params, model_config, dtype), samples, keys_N, width=width,
                                       temperature=temperature, block_tokens=block_tokens)
    return ids_NK.reshape(b, t, width), counts_NK.reshape(b, t, width)


def linear_samples(h_ND, w_DV, samples: int, keys_N, *, width: int, temperature=1.0, block_tokens: int = 256):
    """`samples` draws with replacement from softmax(h w / temperature) per row, row n's with
    the typed PRNG key keys_N[n], as distinct ids with counts: (ids_NK int32, counts_NK int32),
    K = width (1 <= width <= samples), most drawn first, ties to the lower id; empty slots id
    -1, count 0. A row with more than `width` distinct draws keeps its `width` most drawn (the
    rest are lost: width = min(samples, V) keeps every draw).

    Inverse-CDF sampling over one block of `block_tokens` rows' [block, V] float32 logits at
    a time: no [N, V] logits, and no [samples, V] Gumbel noise per row. No gradient.
    """
    (n, d), v = h_ND.shape, w_DV.shape[1]
    if not 1 <= width <= samples:
        raise ValueError(f"width={width} must lie in [1, samples={samples}]")
    h_ND, w_DV = lax.stop_gradient(h_ND), lax.stop_gradient(w_DV)
    bn = min(block_tokens, n)
    pad = -n % bn
    h_ND = jnp.pad(h_ND, ((0, pad), (0, 0)))
    keys_N = jnp.concatenate([keys_N, keys_N[:pad]]) if pad else keys_N

    def block(args):
        h_bD, keys_b = args
        z_bV = jnp.dot(h_bD, w_DV, preferred_element_type=jnp.float32) / temperature
        cdf_bV = jnp.cumsum(jax.nn.softmax(z_bV, axis=-1), axis=-1)
        u_bS = jax.vmap(lambda key: jax.random.uniform(key, (samples,)))(keys_b) * cdf_bV[:, -1:]
        draws_bS = jnp.minimum(jax.vmap(lambda c, u: jnp.searchsorted(c, u, side="right"))(cdf_bV, u_bS), v - 1)
        return _distinct_counts(draws_bS, width, v)

    ids_NK, counts_NK = lax.map(block, (h_ND.reshape(-1, bn, d), keys_N.reshape(-1, bn)))
    return ids_NK.reshape(-1, width)[:n], counts_NK.reshape(-1, width)[:n]


def _distinct_counts(draws_bS, width: int, n_vocab: int):
    """Draws [b, S] -> (ids_bK, counts_bK): each row's distinct ids with their counts, most
    drawn first, ties to the lower id, empty slots (-1, 0); the first `width` kept."""
    same_bSS = draws_bS[:, :, None] == draws_bS[:, None, :]
    counts_bS = jnp.sum(same_bSS, axis=-1, dtype=jnp.int32)
    first_bS = ~jnp.any(jnp.tril(same_bSS, k=-1), axis=-1)  # no earlier draw of the same id
    order_counts, order_ids = jnp.where(first_bS, -counts_bS, 0), jnp.where(first_bS, draws_bS, n_vocab)
    _, ids_bS, counts_bS = lax.sort((order_counts, order_ids, -order_counts), dimension=1, num_keys=2)
    ids_bS = jnp.where(counts_bS > 0, ids_bS, -1)
    return ids_bS[:, :width].astype(jnp.int32), counts_bS[:, :width]
