"""Per-token log-probs of a model's own tokens: a forward, then the fused blockwise
log-prob (`losses.linear_logprob`), so no [tokens, vocab] logits exist. What SFT's
cross-entropy and the GRPO learner's ratios both read. And a model's top-k at each
position of its hidden states, projected the same way: the targets a teacher cache and
the offline drafter learn from."""
from __future__ import annotations

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


def topk_of_hidden(params, model_config: ModelConfig, h_BTD, k: int, *, temperature=1.0, block_tokens: int = 0):
    """The model's top-k at each position of hidden states h_BTD: (ids_BTK int32, best
    first, ties to the lower id; logp_BTK float32, the full-vocabulary log-probs at
    `temperature` of those ids), as `losses.topk_from_logits` of the logits gives them.
    Projected blockwise (`losses.linear_topk`), `block_tokens` of the B T rows at a time
    (0: the backend's default block), so no [B, T, V] logits exist: beyond h, the
    temporary memory is one block's [block_tokens, V] float32 logits. No gradient.

    chunked_xla, whose token blocks hold whole rows of logits: a top-k of each block is
    one lax.top_k; the Pallas running top-k would cost k rounds per vocabulary tile.
    """
    (b, t, d), dtype = h_BTD.shape, model_config.jnp_dtype
    ids_NK, logp_NK = losses.linear_topk(
        h_BTD.reshape(b * t, d).astype(dtype), tfm.lm_head_weight(params, model_config, dtype), k,
        temperature=temperature, impl="chunked_xla", block_sizes={"tokens": block_tokens} if block_tokens else None)
    return ids_NK.reshape(b, t, k), logp_NK.reshape(b, t, k)
