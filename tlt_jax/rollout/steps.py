"""The device steps of a rollout group, pure: prefill new requests (`insert`), continue
multi-turn samples after their environments answered (`observe`), and run a chunk of plain
or speculative decode steps in one device loop (`chunk`; with the draft and verify phases
apart: `draft_phase`, `verify_phase`).

Each step is a module-level function whose static arguments are a frozen, hashable
`StepSpec` (model, rollout config, drafter, the slot state's layout), the strategy, the kv
bucket and the sampling parameters: a group jits each step once per state layout with its
own shardings (`Group`), and jit's own cache keys the compiled programs by those static
arguments. Nothing here closes over a group or an engine.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from tlt_jax import sampling
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig
from tlt_jax.rollout import speculative as spec_lib
from tlt_jax.rollout.config import RolloutConfig
from tlt_jax.rollout.slots import (
    SlotState,
    SpecSlots,
    TurnSlots,
    attending,
    context_length,
    finish_code,
    first_token_stops,
    model_tokens,
    request_keys,
    request_keys_BJ,
    stop_sequence_hits,
    turn_tail,
)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What a group's device steps are traced for (static, hashable): the model, the
    rollout config, the drafter (None: none) and the slot state's layout, what it carries
    besides the plain slots (speculative slots, their history rows, multi-turn slots)."""

    model: ModelConfig
    rollout: RolloutConfig
    drafter: spec_lib.Drafter | None
    speculative: bool = False
    history: bool = False
    turns: bool = False

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Target layers whose outputs the drafter's features read (speculative states only)."""
        return self.drafter.target_layer_ids if self.drafter is not None and self.speculative else ()


def _sample(key, requests_R, positions_R, logits_RV, sp):
    keys = request_keys(key, requests_R, positions_R)
    return jax.vmap(lambda k, l: sampling.sample(k, l, sp))(keys, logits_RV)


def empty(*, spec: StepSpec, max_tokens: int, history_width: int = 0, live: bool = False) -> SlotState:
    """Slots holding no request (history_width > 0: each with a history row that wide).
    live: every slot decodes, from a cache of one zero entry (what warm-up runs chunks on,
    so that their loop bodies run)."""
    rc, b = spec.rollout, spec.rollout.num_slots
    zeros = jnp.zeros((b,), jnp.int32)
    slots = None
    if spec.speculative:
        drafter = spec.drafter.init_state(b, rc.max_length, rc.max_draft_depth + 1) if spec.drafter else None
        history = jnp.full((b, history_width), -1, jnp.int32) if history_width else None
        slots = SpecSlots(jnp.zeros((b, context_length(rc.max_length)), jnp.int32), zeros - 1, drafter, history)
    cache, length = tfm.init_cache(spec.model, b, rc.max_length), zeros + live
    state = SlotState(cache.with_lengths(length), zeros, zeros - 1, length, zeros, jnp.full((b,), live), zeros,
                      jnp.zeros((b, max_tokens), jnp.int32), jnp.zeros((b, max_tokens), jnp.float32), slots,
                      TurnSlots(zeros, zeros) if spec.turns else None)
    return state


def _prefill_spec(spec, drafter_params, params, slots, prompts_UP, lengths_R, slots_R, groups_R, token_R, h_UPD,
                  layers, sources_R, history_RH):
    """The speculative slots after a prefill: the context (the prompt, then the sampled
    token right after it), the prompt index, the drafter's entries and the history rows."""
    put = lambda a, v: a.at[slots_R].set(v, mode="drop")
    p = prompts_UP.shape[1]
    rows = jnp.arange(lengths_R.shape[0])
    context_RP = jnp.pad(prompts_UP[sources_R], ((0, 0), (0, 1))).at[rows, lengths_R].set(token_R)
    context = slots.context.at[slots_R, :p + 1].set(context_RP, mode="drop")
    drafter_state = slots.drafter
    if drafter_state is not None:
        # Per position: computed once per distinct prompt, then given to its requests.
        features = spec.drafter.features(drafter_params, h_UPD, layers[0] if layers else None)[sources_R]
        drafter_state = spec.drafter.prefill_rows(drafter_params, params, drafter_state, slots_R,
                                                  context_RP[:, 1:], features, lengths_R)
    history = None if slots.history is None else put(slots.history, history_RH)
    return SpecSlots(context, put(slots.group, groups_R), drafter_state, history)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Resumed:
    """What R requests drew before (partial rollouts carry unfinished samples from one
    call to the next): generated_R tokens each (0: a fresh request), right-padded to the
    slots' M = max new tokens, with the log-probs of the policy that drew each."""

    generated_R: jax.Array  # int32 [R]
    tokens_RM: jax.Array  # int32 [R, M]
    logp_RM: jax.Array  # float32 [R, M]


def insert(params, drafter_params, state, prompts_UP, lengths_R, slots_R, requests_R, groups_R, key, history_RH,
           sources_R, resumed: Resumed | None, spec: StepSpec, sp):
    """Prefills R requests into the given slots (slot index B: a padding row, dropped):
    request i samples prompt sources_R[i] of prompts_UP. Each distinct prompt is prefilled
    once, however many of its samples it starts. history_RH: their history rows, exactly
    when the state holds them. resumed: requests that continue what they drew before;
    their rows of prompts_UP hold the prompt then those tokens (lengths_R counts both),
    re-prefilled under the current weights, and their next token draws from key position
    generated_R, the one it has in the request's key stream uninterrupted."""
    cfg, rc = spec.model, spec.rollout
    if rc.decode_mlp_size:
        # Prefill is bound by compute, not by reading weights: it skips the zero units.
        params = tfm.narrow_mlp(params, cfg.intermediate_size)
    u, p = prompts_UP.shape
    small = tfm.init_cache(cfg, u, p, state.cache.k.dtype)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (u, p))
    h_UPD, small, *layers = tfm.decode(params, cfg, small, prompts_UP, positions, layer_ids=spec.layer_ids)
    logits_RV = tfm.logits_from_hidden(params, cfg, h_UPD[sources_R, lengths_R - 1])
    generated_R = jnp.zeros_like(requests_R) if resumed is None else resumed.generated_R
    token_R, logp_R = _sample(key, requests_R, generated_R, logits_RV, sp)
    if resumed is None:
        stop_hit_R = first_token_stops(sp, token_R)
    else:  # a stop sequence may end across the carried tokens and the new one
        stop_hit_R = _resumed_stop_hits(sp, resumed, token_R)
    prompt_lengths_R = lengths_R - generated_R
    code_R = finish_code(token_R, generated_R + 1, prompt_lengths_R, sp, rc.eos_token_id, rc.max_length, stop_hit_R)
    put = lambda a, v: a.at[slots_R].set(v, mode="drop")
    cache = state.cache.with_rows(slots_R, small, lengths_R, sources_R)
    slots = state.spec
    if slots is not None:
        slots = _prefill_spec(spec, drafter_params, params, slots, prompts_UP, lengths_R, slots_R, groups_R,
                              token_R, h_UPD, layers, sources_R, history_RH)
    turns = None if state.turns is None else TurnSlots(put(state.turns.num_observed, 0),
                                                       put(state.turns.turn_start, 0))
    if resumed is None:
        out_tokens = state.out_tokens.at[slots_R, 0].set(token_R, mode="drop")
        out_logp = state.out_logp.at[slots_R, 0].set(logp_R, mode="drop")
    else:
        rows = jnp.arange(token_R.shape[0])
        out_tokens = put(state.out_tokens, resumed.tokens_RM.at[rows, generated_R].set(token_R))
        out_logp = put(state.out_logp, resumed.logp_RM.at[rows, generated_R].set(logp_R))
    return SlotState(
        cache, put(state.last_token, token_R), put(state.request, requests_R),
        put(state.prompt_length, prompt_lengths_R), put(state.num_generated, generated_R + 1),
        put(state.active, code_R == 0), put(state.finish, code_R),
        out_tokens, out_logp, slots, turns)


def _resumed_stop_hits(sp, resumed: Resumed, token_R):
    """Whether each resumed request's new token ends a stop sequence, reading its carried
    tokens before it (None without stop sequences)."""
    if not sp.stop_sequences:
        return None
    w = max(len(s) for s in sp.stop_sequences) - 1
    at = resumed.generated_R[:, None] - w + jnp.arange(w, dtype=jnp.int32)[None]
    earlier = jnp.take_along_axis(resumed.tokens_RM, jnp.maximum(at, 0), 1)
    return stop_sequence_hits(sp, jnp.where(at >= 0, earlier, -1), token_R[:, None])[:, 0]


def observe(params, drafter_params, state, observations_RT, lengths_R, slots_R, key, spec: StepSpec, sp):
    """Continues R waiting samples after their environments answered: each slot's last
    token (the end of its turn) and its observation's lengths_R tokens (observations_RT,
    right-padded) are prefilled into the slot's own cache after what it holds, and the
    next turn's first token is sampled (slot index B: a padding row, dropped). The
    transcript is never prefilled again: the cache, the context and the drafter's
    entries are extended in place. Observation tokens join out_tokens with log-prob 0
    and count in num_observed, not in the model's key stream."""
    cfg, rc = spec.model, spec.rollout
    if rc.decode_mlp_size:
        params = tfm.narrow_mlp(params, cfg.intermediate_size)
    r, t = observations_RT.shape
    rows = jnp.arange(r)
    slots = jnp.minimum(slots_R, rc.num_slots - 1)  # padding rows read a slot, write nothing
    start_R, generated_R = state.cache.lengths[slots], state.num_generated[slots]
    # The turn's last token, then the observation; the new turn's first token comes after.
    fed_RT = jnp.concatenate([state.last_token[slots][:, None], observations_RT], axis=1)
    positions = start_R[:, None] + jnp.arange(t + 1, dtype=jnp.int32)[None]
    h_RTD, cache_R, *layers = tfm.decode(params, cfg, state.cache.rows(slots), fed_RT, positions,
                                         layer_ids=spec.layer_ids)
    logits_RV = tfm.logits_from_hidden(params, cfg, h_RTD[rows, lengths_R])
    observed_R = state.turns.num_observed[slots]
    token_R, logp_R = _sample(key, state.request[slots], generated_R - observed_R, logits_RV, sp)
    num_generated_R = generated_R + lengths_R + 1
    code_R = finish_code(token_R, num_generated_R, state.prompt_length[slots], sp, rc.eos_token_id,
                         rc.max_length, first_token_stops(sp, token_R))
    cache = state.cache.with_rows(slots_R, cache_R, start_R + lengths_R + 1)
    # What joins the outputs: the observation, then the sampled token at its length.
    new_RT = jnp.pad(observations_RT, ((0, 0), (0, 1))).at[rows, lengths_R].set(token_R)
    new_logp_RT = jnp.zeros(new_RT.shape, jnp.float32).at[rows, lengths_R].set(logp_R)
    j = jnp.arange(t + 1, dtype=jnp.int32)[None]
    kept = (j <= lengths_R[:, None]) & (slots_R < rc.num_slots)[:, None]
    at = jnp.where(kept, generated_R[:, None] + j, sp.max_tokens)  # out of range: dropped
    put = lambda a, v: a.at[slots_R].set(v, mode="drop")
    spec_slots = state.spec
    if spec_slots is not None:
        where = jnp.where(kept, state.prompt_length[slots][:, None] + at, spec_slots.context.shape[1])
        drafter_state = spec_slots.drafter
        if drafter_state is not None:
            # Entry t reads (x_{t+1}, f_t): the fed tokens' features predict the observation
            # and then the sampled token.
            features = spec.drafter.features(drafter_params, h_RTD, layers[0] if layers else None)
            drafter_state = spec.drafter.extend_rows(drafter_params, params, drafter_state, slots_R, new_RT,
                                                     features, lengths_R + 1)
        spec_slots = dataclasses.replace(
            spec_slots, context=spec_slots.context.at[slots[:, None], where].set(new_RT, mode="drop"),
            drafter=drafter_state)
    return SlotState(
        cache, put(state.last_token, token_R), state.request, state.prompt_length,
        put(state.num_generated, num_generated_R), put(state.active, code_R == 0), put(state.finish, code_R),
        state.out_tokens.at[slots[:, None], at].set(new_RT, mode="drop"),
        state.out_logp.at[slots[:, None], at].set(new_logp_RT, mode="drop"), spec_slots,
        TurnSlots(put(state.turns.num_observed, observed_R + lengths_R),
                  put(state.turns.turn_start, generated_R + lengths_R)))


def _advance(spec, params, drafter_params, state, tokens_BE, logp_BE, count_B, features_BED, sp):
    """Commits up to E tokens per slot (count_B of them; 0 for inactive slots) to the
    outputs, stopping at the first that finishes its sequence; the context and the
    drafter's pending entries follow. Returns (state, tokens kept per slot); the
    cache is the caller's."""
    rc = spec.rollout
    b, e = tokens_BE.shape
    j = jnp.arange(e, dtype=jnp.int32)[None]
    stop_hits = None
    if sp.stop_sequences:
        stop_hits = stop_sequence_hits(sp, turn_tail(sp, state), tokens_BE)
    codes = finish_code(tokens_BE, state.num_generated[:, None] + j + 1, state.prompt_length[:, None], sp,
                        rc.eos_token_id, rc.max_length, stop_hits)
    stops = (codes != 0) & (j < count_B[:, None])
    first_stop = jnp.argmax(stops, axis=1)
    finished = jnp.any(stops, axis=1)
    kept = jnp.where(finished, first_stop + 1, count_B)
    rows = jnp.arange(b)[:, None]
    keep = j < kept[:, None]
    at = jnp.where(keep, state.num_generated[:, None] + j, sp.max_tokens)  # out of range: dropped
    last = jnp.take_along_axis(tokens_BE, jnp.maximum(kept - 1, 0)[:, None], 1)[:, 0]
    code = jnp.where(finished, jnp.take_along_axis(codes, first_stop[:, None], 1)[:, 0], state.finish)
    slots = state.spec
    if slots is not None:
        where = jnp.where(keep, state.prompt_length[:, None] + state.num_generated[:, None] + j,
                          slots.context.shape[1])
        drafter_state = slots.drafter
        if drafter_state is not None:
            drafter_state = spec.drafter.append(drafter_params, params, drafter_state, tokens_BE, features_BED, kept)
        slots = dataclasses.replace(slots, context=slots.context.at[rows, where].set(tokens_BE, mode="drop"),
                                    drafter=drafter_state)
    new = SlotState(state.cache, jnp.where(kept > 0, last, state.last_token), state.request,
                    state.prompt_length, state.num_generated + kept, state.active & ~finished, code,
                    state.out_tokens.at[rows, at].set(tokens_BE, mode="drop"),
                    state.out_logp.at[rows, at].set(logp_BE, mode="drop"), slots, state.turns)
    return new, kept


def plain_forward(spec, params, state, key, sp):
    """The target's forward over every slot's last token and the next token sampled:
    (token [B], logp [B], h, cache, layers)."""
    logits, h, cache, *layers = tfm.decode(params, spec.model, state.cache, state.last_token[:, None],
                                           state.cache.lengths[:, None], return_logits=True,
                                           layer_ids=spec.layer_ids)
    token, logp = _sample(key, state.request, model_tokens(state), logits[:, 0], sp)
    return token, logp, h, cache, layers


def _decode_step(spec, params, drafter_params, state, key, sp):
    """One plain decode step for every slot: (state, tokens committed per slot)."""
    token, logp, h, cache, layers = plain_forward(spec, params, state, key, sp)
    features = None
    if spec.drafter is not None and state.spec is not None:
        features = spec.drafter.features(drafter_params, h, layers[0] if layers else None)
    was_active = state.active
    new, kept = _advance(spec, params, drafter_params, state, token[:, None], logp[:, None],
                         was_active.astype(jnp.int32), features, sp)
    cache = cache.with_lengths(jnp.where(was_active, cache.lengths, state.cache.lengths))
    return dataclasses.replace(new, cache=cache), kept


def draft(spec, params, drafter_params, state, key, strategy, sp):
    """Drafts a tree for every slot: (state, DraftTree)."""
    if strategy.drafter in ("ngram", "history"):
        slots = state.spec
        length = state.prompt_length + state.num_generated
        # Finished samples lend their text until their slot is refilled; their own drafts go unused.
        tree = spec_lib.ngram_tree(slots.context, length, jnp.where(state.request >= 0, slots.group, -1), strategy,
                                   slots.history if strategy.drafter == "history" else None)
    else:
        position = model_tokens(state)
        if spec.rollout.spec_coupled:  # chain token j proposes model token n + j: its key
            keys = request_keys_BJ(key, state.request, position[:, None] + jnp.arange(strategy.depth))
        else:
            step_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(request_keys(key, state.request, position))
            keys = jax.vmap(lambda k: jax.vmap(functools.partial(jax.random.fold_in, k))(
                jnp.arange(strategy.depth)))(step_keys)
        drafter_state, tree = spec.drafter.draft(drafter_params, params, state.spec.drafter, state.last_token,
                                                 strategy, sp, keys)
        state = dataclasses.replace(state, spec=dataclasses.replace(state.spec, drafter=drafter_state))
    return state, spec_lib.bound_tree(tree, state.cache.lengths, spec.rollout.max_length)


def accepted(spec, state, tree, logits, key, sp):
    """Lossless acceptance over every slot's tree from the target's logits: (path,
    num_accepted, tokens, logp, nodes), the emitted tokens, their log-probs and tree nodes
    cut to at most max_draft_depth + 1 (depth + 1 <= that many are emitted)."""
    target_logp = sampling.processed_logprobs(logits, sp)
    if spec.rollout.spec_coupled:  # the draw after a node at depth j is model token n + j
        depth = spec_lib.depths(spec_lib.ancestors(tree.parents))
        keys = request_keys_BJ(key, state.request, model_tokens(state)[:, None] + depth)
        path, num_accepted, next_token = spec_lib.coupled_verify(tree, target_logp, keys)
    else:
        keys = jax.vmap(lambda k: jax.random.fold_in(k, 2))(request_keys(key, state.request, model_tokens(state)))
        path, num_accepted, next_token = spec_lib.verify_rows(tree, target_logp, keys)
    tokens, logp, nodes = spec_lib.emitted(tree, target_logp, path, num_accepted, next_token)
    e = min(tokens.shape[1], spec.rollout.max_draft_depth + 1)
    return path, num_accepted, tokens[:, :e], logp[:, :e], nodes[:, :e]


def tree_forward(spec, params, state, tree):
    """The target's forward over every slot's draft tree, each node at its depth past the
    cache and seeing only its ancestors: tfm.decode's (logits, h, cache, *layers)."""
    visible = spec_lib.ancestors(tree.parents)
    return tfm.decode(params, spec.model, state.cache, tree.tokens,
                      state.cache.lengths[:, None] + spec_lib.depths(visible), mask_BTW=visible,
                      return_logits=True, layer_ids=spec.layer_ids)


def _verify(spec, params, drafter_params, state, tree, key, sp):
    """One target forward over every tree, lossless acceptance, commit: (state, tokens
    committed per slot)."""
    start = state.cache.lengths
    logits, h, cache, *layers = tree_forward(spec, params, state, tree)
    path, num_accepted, tokens, logp, nodes = accepted(spec, state, tree, logits, key, sp)
    features = None
    if spec.drafter is not None:
        features = spec.drafter.features(drafter_params, h, layers[0] if layers else None)
        features = jnp.take_along_axis(features, nodes[..., None], 1)
    was_active = state.active
    new, kept = _advance(spec, params, drafter_params, state, tokens, logp,
                         jnp.where(was_active, num_accepted + 1, 0), features, sp)
    committed = spec_lib.commit_path(cache, start, path, jnp.maximum(kept - 1, 0))
    cache = committed.with_lengths(jnp.where(was_active, committed.lengths, start))
    return dataclasses.replace(new, cache=cache), kept


def one_step(spec: StepSpec, strategy: spec_lib.Strategy | None, params, drafter_params, state, key, sp):
    """One decode step for every slot, plain (strategy None) or speculative (draft, then
    verify and commit): (state, tokens committed per slot)."""
    if strategy is None:
        return _decode_step(spec, params, drafter_params, state, key, sp)
    state, tree = draft(spec, params, drafter_params, state, key, strategy, sp)
    return _verify(spec, params, drafter_params, state, tree, key, sp)


def chunk(params, drafter_params, state, key, refill_wanted, floor, spec: StepSpec,
          strategy: spec_lib.Strategy | None, attended: int | None, sp):
    """Up to steps_per_sync plain decode steps (strategy None) or spec_steps_per_sync
    speculative ones in one device loop, attention reading the first `attended` cache
    slots (None: all). The loop stops early once a slot frees up while refill_wanted, or
    once fewer than `floor` sequences are active, or where the next step's reads would
    pass the bucket. Returns (state, steps run, active slots per step [n], tokens
    committed per step and slot [n, B])."""
    rc = spec.rollout
    n_steps = rc.steps_per_sync if strategy is None else rc.spec_steps_per_sync
    reach = rc.step_reach(strategy, spec.speculative)
    started_active = state.active
    state = attending(state, attended)

    def cond(carry):
        i, state, _, _ = carry
        freed = jnp.any(started_active & ~state.active)
        # The first step always runs: the floor is at most the active count at the start.
        drained = (i > 0) & (jnp.sum(state.active, dtype=jnp.int32) < floor)
        go = (i < n_steps) & jnp.any(state.active) & ~(refill_wanted & freed) & ~drained
        if attended is not None and attended < rc.max_length:
            longest = jnp.max(jnp.where(state.active, state.cache.lengths, 0))
            go &= longest + reach <= attended  # the next step's reads fit the bucket
        return go

    def body(carry):
        i, state, active, kept = carry
        n = jnp.sum(state.active, dtype=jnp.int32)
        state, kept_B = one_step(spec, strategy, params, drafter_params, state, key, sp)
        return i + 1, state, active.at[i].set(n), kept.at[i].set(kept_B)

    init = (0, state, jnp.zeros((n_steps,), jnp.int32), jnp.zeros((n_steps, rc.num_slots), jnp.int32))
    i, state, active, kept = lax.while_loop(cond, body, init)
    return attending(state, None), i, active, kept


def draft_phase(params, drafter_params, state, key, spec: StepSpec, strategy: spec_lib.Strategy,
                attended: int | None, sp):
    """The draft phase alone (timed apart from verification): (state, DraftTree)."""
    state, tree = draft(spec, params, drafter_params, attending(state, attended), key, strategy, sp)
    return attending(state, None), tree


def verify_phase(params, drafter_params, state, tree, key, spec: StepSpec, attended: int | None, sp):
    """The verify-and-commit phase alone: (state, tokens committed per slot)."""
    state, kept = _verify(spec, params, drafter_params, attending(state, attended), tree, key, sp)
    return attending(state, None), kept
