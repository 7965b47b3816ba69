"""The slot state of a rollout group and what reads it, pure: the device arrays each
slot carries (`SlotState`, with `SpecSlots` for speculative steps and `TurnSlots` for
multi-turn samples), why a sequence stops after a token (end tokens, stop tokens and
sequences, its budget, a full cache), and the per-request sampling keys. No jit here:
the device steps (`steps.py`) trace these functions.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tlt_jax.models import transformer as tfm
from tlt_jax.rollout import speculative as spec_lib

# The host gives the last three: "max_turns" when a multi-turn sample's environment reaches its
# last turn, "env_timeout" and "env_error" when it fails (`turns.py`).
FINISH_REASONS = ("", "eos", "stop", "max_tokens", "cache_full", "max_turns", "env_timeout", "env_error")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecSlots:
    """What speculative steps need besides the plain slot state (B slots, C context)."""

    context: jax.Array  # [B, C] the prompt then every generated token, the last sampled included
    group: jax.Array  # [B] prompt index: the samples of one prompt share n-gram matches
    drafter: spec_lib.DrafterState | None
    history: jax.Array | None = None  # [B, H] the prompt's earlier completions, -1 separated (history drafts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TurnSlots:
    """What multi-turn samples need besides the plain slot state (B slots)."""

    # The observation tokens among num_generated: a request's n-th sampled token draws
    # from key n of the model's own tokens, whatever its environments answered.
    num_observed: jax.Array  # [B]
    turn_start: jax.Array  # [B] where the current turn starts in out_tokens (stop sequences match within it)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    """Device state of one group's slots (B slots, M = max new tokens)."""

    cache: tfm.KVCache
    last_token: jax.Array  # [B] sampled, not yet in the cache
    request: jax.Array  # [B] request id, -1 when never filled
    prompt_length: jax.Array  # [B]
    num_generated: jax.Array  # [B] tokens after the prompt: the model's and its environment's
    active: jax.Array  # [B] bool
    finish: jax.Array  # [B] index into FINISH_REASONS
    out_tokens: jax.Array  # [B, M]
    out_logp: jax.Array  # [B, M] 0 at observation tokens
    spec: SpecSlots | None = None
    turns: TurnSlots | None = None  # multi-turn samples (a generate with episodes)


def finish_code(token_B, num_generated_B, prompt_length_B, sp, eos_ids, max_length, stop_hit_B=None):
    """Why a sequence stops after its latest token (0: it goes on): any of `eos_ids` is
    "eos"; a stop token, or the end of a stop sequence (stop_hit_B), "stop". The cache
    holds the prompt and every generated token but the last, hence the `>` for cache_full."""
    code = jnp.zeros_like(token_B)
    code = jnp.where(prompt_length_B + num_generated_B > max_length, 4, code)
    code = jnp.where(num_generated_B >= sp.max_tokens, 3, code)
    if sp.stop_tokens:
        code = jnp.where(jnp.isin(token_B, jnp.asarray(sp.stop_tokens)), 2, code)
    if stop_hit_B is not None:
        code = jnp.where(stop_hit_B, 2, code)
    if eos_ids:
        code = jnp.where(jnp.isin(token_B, jnp.asarray(eos_ids, token_B.dtype)), 1, code)
    return code


def stop_sequence_hits(sp, earlier_BW, tokens_BE):
    """[B, E] bool: whether new token e ends one of sp.stop_sequences, reading the turn's
    earlier tokens earlier_BW (W = the longest sequence's length - 1, the latest last;
    -1 where the turn has none) before tokens_BE. None without stop sequences."""
    if not sp.stop_sequences:
        return None
    w, e = earlier_BW.shape[1], tokens_BE.shape[1]
    window = jnp.concatenate([earlier_BW, tokens_BE], axis=1)  # token e at w + e
    hit = jnp.zeros(tokens_BE.shape, bool)
    for seq in sp.stop_sequences:
        match = jnp.ones(tokens_BE.shape, bool)
        for i, token in enumerate(seq):  # seq[i] sits len(seq) - 1 - i before the last token
            start = w - (len(seq) - 1) + i
            match &= window[:, start:start + e] == token
        hit |= match
    return hit


def turn_tail(sp, state) -> jax.Array:
    """[B, W] the turn's last W tokens before the next one (W: longest stop sequence - 1),
    -1 before the turn's start."""
    w = max(len(s) for s in sp.stop_sequences) - 1
    at = state.num_generated[:, None] - w + jnp.arange(w, dtype=jnp.int32)[None]
    earlier = jnp.take_along_axis(state.out_tokens, jnp.clip(at, 0, state.out_tokens.shape[1] - 1), 1)
    turn_start = 0 if state.turns is None else state.turns.turn_start[:, None]
    return jnp.where(at >= turn_start, earlier, -1)


def attending(state: SlotState, slots: int | None) -> SlotState:
    """The state with its caches (the target's, the drafter's) read up to `slots`
    (None: all): set for a chunk's steps, unset before the state leaves it."""
    state = dataclasses.replace(state, cache=state.cache.attending(slots))
    if state.spec is not None and state.spec.drafter is not None:
        drafter = dataclasses.replace(state.spec.drafter, cache=state.spec.drafter.cache.attending(slots))
        state = dataclasses.replace(state, spec=dataclasses.replace(state.spec, drafter=drafter))
    return state


def model_tokens(state: SlotState) -> jax.Array:
    """[B] the model's own tokens so far: the position of a request's next sampled token
    in its key stream (observations draw nothing)."""
    return state.num_generated if state.turns is None else state.num_generated - state.turns.num_observed


def first_token_stops(sp, token_R):
    """Whether a turn's first token ends it as a stop sequence (those of one token)."""
    if not sp.stop_sequences:
        return None
    earlier = jnp.full((token_R.shape[0], max(len(s) for s in sp.stop_sequences) - 1), -1, token_R.dtype)
    return stop_sequence_hits(sp, earlier, token_R[:, None])[:, 0]


def request_keys(base_key, request_B, position_B):
    return jax.vmap(lambda r, n: jax.random.fold_in(jax.random.fold_in(base_key, r), n))(request_B, position_B)


def request_keys_BJ(base_key, request_B, position_BJ):
    """The keys of J positions of each row's request: [B, J]."""
    return jax.vmap(request_keys, in_axes=(None, None, 1), out_axes=1)(base_key, request_B, position_BJ)


def context_length(max_length: int) -> int:
    """Context buffer per slot: everything the cache holds (max_length), the pending last
    token, and room for a speculative step's overshoot (dropped writes past it are harmless)."""
    return max_length + 1


def shape_bucket(n: int, cap: int, unit: int = 1) -> int:
    """The smallest unit x a power of two that holds n, at most cap: few distinct
    shapes, few compilations (unit: e.g. the fsdp devices a batch is split over)."""
    return min(cap, unit << max(0, -(-n // unit) - 1).bit_length())
