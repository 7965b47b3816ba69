"""Token sampling: the one place where logits become a sampling distribution.

Every decode path (plain rollout, draft proposals, speculative verification) calls
`processed_logprobs` so that they all sample from exactly the same distribution.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static sampling settings (hashable: a jit static argument).

    temperature 0 means greedy. top_k 0 and top_p 1 and min_p 0 disable those filters.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 256
    stop_tokens: tuple[int, ...] = ()
    # Token sequences that end a turn like a stop token (a multi-turn environment's
    # stop strings, tokenized): matched within the turn's own tokens.
    stop_sequences: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0 or not 0 <= self.min_p < 1:
            raise ValueError(f"top_k must be >= 0 and min_p in [0, 1); got {self.top_k}, {self.min_p}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}.")
        if any(len(s) == 0 for s in self.stop_sequences):
            raise ValueError("stop_sequences must each hold at least one token id (an empty stop string?).")


def processed_logprobs(logits_xV: jax.Array, params: SamplingParams) -> jax.Array:
    """Float32 log-probs of the distribution actually sampled from; -inf where excluded."""
    logits = logits_xV.astype(jnp.float32)
    if params.temperature == 0:
        greedy = jnp.argmax(logits, axis=-1)
        onehot = jax.nn.one_hot(greedy, logits.shape[-1], dtype=bool)
        return jnp.where(onehot, 0.0, -jnp.inf)
    logp = jax.nn.log_softmax(logits / params.temperature, axis=-1)
    if not (params.top_k or params.top_p < 1.0 or params.min_p > 0):
        return jax.nn.log_softmax(logp, axis=-1)  # as the filters' path computes it, bit for bit
    # The filters compare values of one sorted copy of logp, and the mask returns to the
    # vocabulary's order by a second sort: compared with logp itself, a threshold taken from
    # a copy that another fusion recomputed and rounded otherwise can keep no token at all
    # (XLA:CPU's loop emitters do).
    axis = logp.ndim - 1
    neg_sorted, order = jax.lax.sort((-logp, jax.lax.broadcasted_iota(jnp.int32, logp.shape, axis)), dimension=axis,
                                     num_keys=1)
    desc = -neg_sorted
    keep = jnp.ones_like(desc, dtype=bool)
    if params.top_k:
        keep &= desc >= desc[..., params.top_k - 1:params.top_k]
    if params.top_p < 1.0:
        # Keep the smallest prefix (by descending probability) whose mass reaches top_p.
        mass_before = jnp.cumsum(jnp.exp(desc), axis=-1) - jnp.exp(desc)
        keep &= desc >= jnp.min(jnp.where(mass_before < params.top_p, desc, jnp.inf), axis=-1, keepdims=True)
    if params.min_p > 0:
        keep &= desc >= desc[..., :1] + jnp.log(params.min_p)
    keep = jax.lax.sort((order, keep), dimension=axis, num_keys=1)[1]
    return jax.nn.log_softmax(jnp.where(keep, logp, -jnp.inf), axis=-1)


def sample(key: jax.Array, logits_xV: jax.Array, params: SamplingParams):
    """Draws tokens; returns (tokens_x int32, their log-probs under the processed distribution)."""
    logp = processed_logprobs(logits_xV, params)
    tokens = jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
