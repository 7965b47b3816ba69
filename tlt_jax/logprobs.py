"""Per-token log-probs of a model's own tokens: a forward, then the fused blockwise
log-prob (`losses.linear_logprob`), so no [tokens, vocab] logits exist. What SFT's
cross-entropy and the GRPO learner's ratios both read."""
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
