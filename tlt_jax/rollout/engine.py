"""Rollout engine: continuous batching over a fixed set of KV-cache slots.

Each data-parallel group (one slice of the mesh's `data` axis, tensor-parallel inside)
owns `num_slots` slots and runs its own host loop:

    refill free slots with pending requests (prefill, first token sampled)
    run up to `steps_per_sync` decode steps on the device (a while loop that stops early
        when a slot frees up and requests are still pending, so refills are prompt)
    harvest finished slots

Once the pending requests run out the batch drains: that is the long tail, which the
timeline records. Randomness is per request: the key of a request's n-th sampled token
is fold_in(fold_in(key, request), n), so its output does not depend on which slot it
ran in or on its neighbours (callers that name their prompts, `prompt_ids`, get the
same answers for a prompt alone or in any batch). One decode step commits a per-slot number of tokens
(`tokens_per_step`), so speculative steps plug into the same bookkeeping.

Several processes (`jax.distributed`): each rollout group lies on one process's devices
and that process alone drives it; the groups' results, timelines and the chunks the
speculation policy heard are then exchanged between processes as host data, so every
process returns the same `Rollouts` and its policy has heard every group's chunks.

Speculation (`generate(..., speculation=...)`): before each chunk the host asks the
speculation policy for a strategy given the number of active sequences; with one, the
chunk runs speculative steps (draft, then verify and commit) in place of plain decode
steps: up to steps_per_sync of them in the same device loop, or, with `time_spec_phases`,
one step as two device calls timed apart. Every steady-state chunk, plain or
speculative, is reported back to the policy (tokens committed, seconds), so plain
decode competes with the strategies on measured throughput. The slots then also carry their token
context (for the n-gram drafter) and, with an EAGLE drafter, its state. A policy with history
strategies carries a `history.HistoryStore`: each slot then also holds its prompt's row of
earlier completions (one static width, the store's max_tokens), written at refill, and
every finished generate adds its completions to the store.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import threading
import time
from typing import Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tlt_jax import multihost, sampling, sharding
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig, end_token_ids
from tlt_jax.rollout import speculative as spec_lib
from tlt_jax.rollout.history import HistoryStore
from tlt_jax.rollout.timeline import Chunk, GroupTimeline, RolloutTimeline, SpecChunk

# "max_turns" is given on the host, when a multi-turn sample's environment reaches its last turn.
FINISH_REASONS = ("", "eos", "stop", "max_tokens", "cache_full", "max_turns")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """num_slots: concurrent sequences per group. max_prompt_length: prompts are
    right-padded to it (one prefill shape). max_length: KV-cache slots per sequence
    (prompt plus generated tokens). steps_per_sync: decode steps per device loop."""

    num_slots: int = 8
    max_prompt_length: int = 64
    max_length: int = 512
    steps_per_sync: int = 16
    # Speculative steps per device loop: each commits several tokens per sequence, and
    # shorter speculative chunks let the tuner hear (and re-decide) more often in the tail.
    spec_steps_per_sync: int = 4
    # The tokens that end a sequence (finish reason "eos"): an id or several, as
    # ModelConfig.eos_token_id spells them; stored as a tuple (empty: none).
    eos_token_id: int | tuple[int, ...] | None = None
    # Decode's weight layout (see RolloutEngine._engine_layout): per layer, the layer loop
    # unrolled (transformer.unstack_layers: longer compiles, no per-step weight copies on
    # the GPU), and q/k/v and gate/up fused into one matmul each (fuse_projections; not
    # on a tensor axis that does not divide the kv heads). In bfloat16 the unrolled loop
    # lets XLA keep float32 across fused operations, so log-probs differ from a scanned
    # forward's by rounding: at most 0.017 nats (mean 0.004) for an 8-layer model on CPU,
    # where the scanned decode matched it bit for bit; in float32 they agree to 1e-5.
    per_layer_weights: bool = True
    fused_projections: bool = True
    max_draft_depth: int = 8  # deepest speculative strategy this engine runs
    # One speculative step per host sync, its draft and verify phases timed apart;
    # otherwise up to steps_per_sync speculative steps run in one device loop.
    time_spec_phases: bool = False
    # Attention reads the cache in buckets of slots (`kv_buckets`): a chunk reads the
    # smallest of kv_bucket, 2 kv_bucket, 4 kv_bucket, ... and max_length that holds every
    # live sequence and what a step adds to it (`_Group.kv_bucket_for`), since a decode
    # step's cost grows with the slots it reads (at batch 64 on a 16-layer CPU target, 352
    # slots cost 2.4x what 128 do). One compiled chunk per bucket; 0: always max_length.
    kv_bucket: int = 64
    # A stand-in for a bigger target in rollout alone: decode runs every MLP padded to
    # this many units whose weights are zero (transformer.pad_mlp), so the tokens are the
    # model's while each step reads weights several times the CPU's caches, as a GPU's
    # decode is bound by reading its weights. Prefill, bound by compute on both, reads the
    # model's own units; the learner trains the model as it is. 0: the model's own width.
    decode_mlp_size: int = 0
    # Speculative steps emit exactly the tokens plain decode would draw with the same
    # keys (`speculative.coupled_verify`): the samples, and so an RL run, do not depend on
    # whether or with which drafter a chunk speculated, at an acceptance per drafted token
    # at most rejection sampling's (docs/speculative.md: within noise of it with the shipped
    # drafter). For comparing drafters on one trajectory of the policy.
    spec_coupled: bool = False

    def __post_init__(self):
        object.__setattr__(self, "eos_token_id", end_token_ids(self.eos_token_id))
        if self.max_prompt_length >= self.max_length:
            raise ValueError(f"max_prompt_length={self.max_prompt_length} must be below "
                             f"max_length={self.max_length} (the KV cache holds prompt and answer).")
        if min(self.num_slots, self.steps_per_sync, self.spec_steps_per_sync, self.max_prompt_length) < 1:
            raise ValueError("num_slots, steps_per_sync, spec_steps_per_sync and max_prompt_length must be positive.")
        if self.kv_bucket < 0:
            raise ValueError(f"kv_bucket={self.kv_bucket} must be >= 0 (0: attention reads all max_length slots).")
        if self.decode_mlp_size < 0:
            raise ValueError(f"decode_mlp_size={self.decode_mlp_size} must be >= 0 (0: the model's own MLP width).")

    @property
    def kv_buckets(self) -> tuple[int, ...]:
        """The numbers of cache slots a chunk's attention may read, ascending."""
        sizes, n = [], self.kv_bucket
        while 0 < n < self.max_length:
            sizes.append(n)
            n *= 2
        return (*sizes, self.max_length)

    def step_reach(self, strategy, speculative: bool) -> int:
        """The most cache slots past a live sequence's length that one decode step (plain:
        strategy None) writes or reads: the tokens it commits, then the widest forward
        past them (a draft tree's nodes, the drafter's catch-up over its pending entries,
        an EAGLE tree's fed levels). A chunk runs a step only while every active sequence
        has that many attended slots left (`_Group.chunk_step`)."""
        pending = self.max_draft_depth + 1 if speculative else 0
        if strategy is None:
            return 1 + pending
        widest = max(strategy.num_tree_nodes, pending, strategy.topk * strategy.depth)
        return strategy.depth + 1 + widest


@dataclasses.dataclass
class Rollouts:
    """Generated samples in request order (prompt-major, then sample)."""

    prompt_index: np.ndarray  # int32 [n]
    sample_index: np.ndarray  # int32 [n]
    tokens: list[np.ndarray]  # int32 [length_i], the answer only (multi-turn: the whole transcript after the prompt)
    logprobs: list[np.ndarray]  # float32 [length_i], under the processed distribution (0 at observation tokens)
    finish_reason: list[str]
    group: np.ndarray  # int32 [n], the rollout group that produced each sample
    timeline: RolloutTimeline
    # Multi-turn only: bool [length_i], True at the tokens of the environment's observations
    # (context, never actions).
    observation_mask: list[np.ndarray] | None = None

    def __len__(self):
        return len(self.tokens)

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray([len(t) for t in self.tokens], np.int32)

    def padded(self, pad_id: int = 0, length: int | None = None):
        """(tokens [n, L] int32, logprobs [n, L] float32, mask [n, L] bool)."""
        length = length or int(self.lengths.max(initial=0))
        tokens = np.full((len(self), length), pad_id, np.int32)
        logp = np.zeros((len(self), length), np.float32)
        for i, (t, lp) in enumerate(zip(self.tokens, self.logprobs)):
            tokens[i, :len(t)], logp[i, :len(lp)] = t, lp
        return tokens, logp, np.arange(length)[None] < self.lengths[:, None]


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


def _finish_code(token_B, num_generated_B, prompt_length_B, sp, eos_ids, max_length, stop_hit_B=None):
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


def _stop_sequence_hits(sp, earlier_BW, tokens_BE):
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


def _turn_tail(sp, state) -> jax.Array:
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


def _model_tokens(state: SlotState) -> jax.Array:
    """[B] the model's own tokens so far: the position of a request's next sampled token
    in its key stream (observations draw nothing)."""
    return state.num_generated if state.turns is None else state.num_generated - state.turns.num_observed


def _first_token_stops(sp, token_R):
    """Whether a turn's first token ends it as a stop sequence (those of one token)."""
    if not sp.stop_sequences:
        return None
    earlier = jnp.full((token_R.shape[0], max(len(s) for s in sp.stop_sequences) - 1), -1, token_R.dtype)
    return _stop_sequence_hits(sp, earlier, token_R[:, None])[:, 0]


def _request_keys(base_key, request_B, position_B):
    return jax.vmap(lambda r, n: jax.random.fold_in(jax.random.fold_in(base_key, r), n))(request_B, position_B)


def _request_keys_BJ(base_key, request_B, position_BJ):
    """The keys of J positions of each row's request: [B, J]."""
    return jax.vmap(_request_keys, in_axes=(None, None, 1), out_axes=1)(base_key, request_B, position_BJ)


class _Group:
    """One data-parallel group: its sub-mesh, parameter copies and compiled steps."""

    def __init__(self, index: int, mesh: Mesh, engine: "RolloutEngine"):
        self.index, self.mesh, self.engine = index, mesh, engine
        self.processes = sorted({d.process_index for d in mesh.devices.flat})
        self.is_local = self.processes == [jax.process_index()]  # this process drives it
        cfg = engine.model_config
        self.param_shardings = tfm.param_shardings(cfg, engine._param_shapes, mesh)
        b = engine.rollout_config.num_slots
        batch_axis = sharding.logical_to_spec(("batch",), (b,), mesh)[0]
        kv_axis = sharding.logical_to_spec(("kv_heads",), (cfg.num_kv_heads,), mesh)[0]
        row = NamedSharding(mesh, PartitionSpec(batch_axis))
        rows2, rows3 = (NamedSharding(mesh, PartitionSpec(batch_axis, *[None] * n)) for n in (1, 2))
        cache = tfm.KVCache(*[NamedSharding(mesh, PartitionSpec(None, batch_axis, None, kv_axis, None))] * 2, row)
        self.state_shardings = SlotState(
            cache=cache, last_token=row, request=row, prompt_length=row, num_generated=row, active=row, finish=row,
            out_tokens=rows2, out_logp=rows2)
        drafter = None
        if engine.drafter is not None:
            drafter = spec_lib.DrafterState(cache, rows2, rows3, row)
            self.drafter_shardings = sharding.tree_shardings(
                drafter_lib.drafter_logical_axes(cfg, engine.drafter.config), engine._drafter_shapes, mesh)
        else:
            self.drafter_shardings = None
        self.spec_state_shardings = dataclasses.replace(self.state_shardings,
                                                        spec=SpecSlots(rows2, row, drafter))
        self.history_state_shardings = dataclasses.replace(self.state_shardings,
                                                           spec=SpecSlots(rows2, row, drafter, rows2))
        self.turn_shardings = TurnSlots(row, row)
        self.params = self.drafter_params = None
        self._compiled: dict = {}
        self._has_run: set = set()  # (step, strategy, sampling) whose first call, with its compile, is past

    def _jit(self, name, fn, in_shardings, out_shardings, static_argnums=(), donate_argnums=()):
        """The jitted step called `name` (its trace depends on nothing else: a step whose
        body differs with the state's layout carries that layout in its name)."""
        key = (name, static_argnums)
        if key not in self._compiled:
            self._compiled[key] = self._in_turn(sharding.jit_sharded(
                fn, in_shardings=in_shardings, out_shardings=out_shardings, static_argnums=static_argnums,
                donate_argnums=donate_argnums), static_argnums)
        return self._compiled[key]

    def _in_turn(self, jitted, static_argnums=()):
        """`jitted`, compiled in turn with the other groups' (`_CompiledInTurn`) where several
        groups of this process run at once in threads."""
        if len(self.engine.local_groups) > 1:
            return _CompiledInTurn(jitted, static_argnums, self.engine._compiling)
        return jitted

    def _shardings(self, speculative: bool, history: bool = False, turns: bool = False) -> SlotState:
        if history:
            shardings = self.history_state_shardings
        else:
            shardings = self.spec_state_shardings if speculative else self.state_shardings
        return dataclasses.replace(shardings, turns=self.turn_shardings) if turns else shardings

    @staticmethod
    def _layout(state) -> tuple[bool, bool, bool]:
        """(speculative, with history rows, multi-turn): what the state carries besides the plain slots."""
        return state.spec is not None, state.spec is not None and state.spec.history is not None, \
            state.turns is not None

    def empty_state(self, sp: sampling.SamplingParams, speculative: bool = False,
                    history_width: int = 0, live: bool = False, turns: bool = False) -> SlotState:
        """history_width > 0 (speculative only): each slot holds a history row that wide.
        turns: the slots hold multi-turn samples (`TurnSlots`).
        live: every slot decodes, from a cache of one zero entry (no request's: what
        `warm_up` runs chunks on, so that their loop bodies run)."""
        engine = self.engine
        rc, cfg = engine.rollout_config, engine.model_config
        b, m = rc.num_slots, sp.max_tokens

        def make():
            zeros = jnp.zeros((b,), jnp.int32)
            spec = None
            if speculative:
                drafter = None
                if engine.drafter is not None:
                    drafter = engine.drafter.init_state(b, rc.max_length, rc.max_draft_depth + 1)
                history = jnp.full((b, history_width), -1, jnp.int32) if history_width else None
                spec = SpecSlots(jnp.zeros((b, _context_length(rc)), jnp.int32), zeros - 1, drafter, history)
            cache, length = tfm.init_cache(cfg, b, rc.max_length), zeros + live
            return SlotState(cache.with_lengths(length), zeros, zeros - 1, length, zeros,
                             jnp.full((b,), live), zeros, jnp.zeros((b, m), jnp.int32),
                             jnp.zeros((b, m), jnp.float32), spec, TurnSlots(zeros, zeros) if turns else None)

        key = ("empty", m, speculative, history_width, live, turns)
        if key not in self._compiled:
            self._compiled[key] = self._in_turn(jax.jit(make, out_shardings=self._shardings(
                speculative, history_width > 0, turns)))
        return self._compiled[key]()

    def _target_layer_ids(self, state):
        drafter = self.engine.drafter
        return drafter.target_layer_ids if drafter is not None and state.spec is not None else ()

    # -- device steps ----------------------------------------------------------------------

    def insert(self, state, prompts_UP, lengths_R, slots_R, requests_R, groups_R, key, sp, history_RH=None,
               sources_R=None):
        """Prefills R requests into the given slots (slot index B: a padding row, dropped):
        request i samples prompt sources_R[i] of prompts_UP (default i: U = R). Each distinct
        prompt is prefilled once, however many of its samples it starts (G in GRPO).
        history_RH: their history rows, when the state holds them."""
        engine = self.engine
        cfg, rc = engine.model_config, engine.rollout_config
        layer_ids = self._target_layer_ids(state)
        if sources_R is None:
            sources_R = np.arange(len(lengths_R), dtype=np.int32)

        def fn(params, drafter_params, state, prompts_UP, lengths_R, slots_R, requests_R, groups_R, key, history_RH,
               sources_R, sp):
            if rc.decode_mlp_size:
                # Prefill is bound by compute, not by reading weights: it skips the zero units.
                params = tfm.narrow_mlp(params, cfg.intermediate_size)
            u, p = prompts_UP.shape
            small = tfm.init_cache(cfg, u, p, state.cache.k.dtype)
            positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (u, p))
            h_UPD, small, *layers = tfm.decode(params, cfg, small, prompts_UP, positions, layer_ids=layer_ids)
            logits_RV = tfm.logits_from_hidden(params, cfg, h_UPD[sources_R, lengths_R - 1])
            keys = _request_keys(key, requests_R, jnp.zeros_like(requests_R))
            token_R, logp_R = jax.vmap(lambda k, l: sampling.sample(k, l, sp))(keys, logits_RV)
            code_R = _finish_code(token_R, jnp.ones_like(token_R), lengths_R, sp, rc.eos_token_id, rc.max_length,
                                  _first_token_stops(sp, token_R))
            put = lambda a, v: a.at[slots_R].set(v, mode="drop")
            cache = state.cache.with_rows(slots_R, small, lengths_R, sources_R)
            spec = state.spec
            if spec is not None:
                # The context: the prompt, then the sampled token right after it.
                rows = jnp.arange(lengths_R.shape[0])
                context_RP = jnp.pad(prompts_UP[sources_R], ((0, 0), (0, 1))).at[rows, lengths_R].set(token_R)
                context = spec.context.at[slots_R, :p + 1].set(context_RP, mode="drop")
                drafter_state = spec.drafter
                if drafter_state is not None:
                    # Per position: computed once per distinct prompt, then given to its requests.
                    features = engine.drafter.features(drafter_params, h_UPD, layers[0] if layers else None)[sources_R]
                    drafter_state = engine.drafter.prefill_rows(drafter_params, params, drafter_state, slots_R,
                                                                context_RP[:, 1:], features, lengths_R)
                history = None if spec.history is None else put(spec.history, history_RH)
                spec = SpecSlots(context, put(spec.group, groups_R), drafter_state, history)
            return SlotState(cache, put(state.last_token, token_R), put(state.request, requests_R),
                             put(state.prompt_length, lengths_R), put(state.num_generated, jnp.ones_like(token_R)),
                             put(state.active, code_R == 0), put(state.finish, code_R),
                             state.out_tokens.at[slots_R, 0].set(token_R, mode="drop"),
                             state.out_logp.at[slots_R, 0].set(logp_R, mode="drop"), spec,
                             None if state.turns is None else TurnSlots(put(state.turns.num_observed, 0),
                                                                        put(state.turns.turn_start, 0)))

        rep = sharding.replicated(self.mesh)
        layout = self._layout(state)
        if layout[1] != (history_RH is not None):
            raise ValueError("insert takes history rows exactly when the state holds them.")
        shardings = self._shardings(*layout)
        in_shardings = (self.param_shardings, self.drafter_shardings, shardings) + (rep,) * 8
        step = self._jit(("insert", layout), fn, in_shardings, shardings, static_argnums=(11,),
                         donate_argnums=(2,))
        return step(self.params, self.drafter_params, state, prompts_UP, lengths_R, slots_R, requests_R, groups_R,
                    key, history_RH, sources_R, sp)

    def observe(self, state, observations_RT, lengths_R, slots_R, key, sp):
        """Continues R waiting samples after their environments answered: each slot's last
        token (the end of its turn) and its observation's lengths_R tokens (observations_RT,
        right-padded) are prefilled into the slot's own cache after what it holds, and the
        next turn's first token is sampled (slot index B: a padding row, dropped). The
        transcript is never prefilled again: the cache, the context and the drafter's
        entries are extended in place. Observation tokens join out_tokens with log-prob 0
        and count in num_observed, not in the model's key stream."""
        engine = self.engine
        cfg, rc = engine.model_config, engine.rollout_config
        layer_ids = self._target_layer_ids(state)

        def fn(params, drafter_params, state, observations_RT, lengths_R, slots_R, key, sp):
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
                                                 layer_ids=layer_ids)
            logits_RV = tfm.logits_from_hidden(params, cfg, h_RTD[rows, lengths_R])
            observed_R = state.turns.num_observed[slots]
            keys = _request_keys(key, state.request[slots], generated_R - observed_R)
            token_R, logp_R = jax.vmap(lambda k, l: sampling.sample(k, l, sp))(keys, logits_RV)
            num_generated_R = generated_R + lengths_R + 1
            code_R = _finish_code(token_R, num_generated_R, state.prompt_length[slots], sp, rc.eos_token_id,
                                  rc.max_length, _first_token_stops(sp, token_R))
            cache = state.cache.with_rows(slots_R, cache_R, start_R + lengths_R + 1)
            # What joins the outputs: the observation, then the sampled token at its length.
            new_RT = jnp.pad(observations_RT, ((0, 0), (0, 1))).at[rows, lengths_R].set(token_R)
            new_logp_RT = jnp.zeros(new_RT.shape, jnp.float32).at[rows, lengths_R].set(logp_R)
            j = jnp.arange(t + 1, dtype=jnp.int32)[None]
            kept = (j <= lengths_R[:, None]) & (slots_R < rc.num_slots)[:, None]
            at = jnp.where(kept, generated_R[:, None] + j, sp.max_tokens)  # out of range: dropped
            put = lambda a, v: a.at[slots_R].set(v, mode="drop")
            spec = state.spec
            if spec is not None:
                where = jnp.where(kept, state.prompt_length[slots][:, None] + at, spec.context.shape[1])
                drafter_state = spec.drafter
                if drafter_state is not None:
                    # Entry t reads (x_{t+1}, f_t): the fed tokens' features predict the observation
                    # and then the sampled token.
                    features = engine.drafter.features(drafter_params, h_RTD, layers[0] if layers else None)
                    drafter_state = engine.drafter.extend_rows(drafter_params, params, drafter_state, slots_R, new_RT,
                                                               features, lengths_R + 1)
                spec = dataclasses.replace(spec, context=spec.context.at[slots[:, None], where].set(new_RT,
                                                                                                    mode="drop"),
                                           drafter=drafter_state)
            return SlotState(cache, put(state.last_token, token_R), state.request, state.prompt_length,
                             put(state.num_generated, num_generated_R), put(state.active, code_R == 0),
                             put(state.finish, code_R),
                             state.out_tokens.at[slots[:, None], at].set(new_RT, mode="drop"),
                             state.out_logp.at[slots[:, None], at].set(new_logp_RT, mode="drop"), spec,
                             TurnSlots(put(state.turns.num_observed, observed_R + lengths_R),
                                       put(state.turns.turn_start, generated_R + lengths_R)))

        rep = sharding.replicated(self.mesh)
        layout = self._layout(state)
        if not layout[2]:
            raise ValueError("observe takes a multi-turn slot state (empty_state(..., turns=True)).")
        shardings = self._shardings(*layout)
        in_shardings = (self.param_shardings, self.drafter_shardings, shardings) + (rep,) * 4
        step = self._jit(("observe", layout), fn, in_shardings, shardings, static_argnums=(7,), donate_argnums=(2,))
        return step(self.params, self.drafter_params, state, observations_RT, lengths_R, slots_R, key, sp)

    def _advance(self, params, drafter_params, state, tokens_BE, logp_BE, count_B, features_BED, sp):
        """Commits up to E tokens per slot (count_B of them; 0 for inactive slots) to the
        outputs, stopping at the first that finishes its sequence; the context and the
        drafter's pending entries follow. Returns (state, tokens kept per slot); the
        cache is the caller's."""
        rc = self.engine.rollout_config
        b, e = tokens_BE.shape
        j = jnp.arange(e, dtype=jnp.int32)[None]
        stop_hits = None
        if sp.stop_sequences:
            stop_hits = _stop_sequence_hits(sp, _turn_tail(sp, state), tokens_BE)
        codes = _finish_code(tokens_BE, state.num_generated[:, None] + j + 1, state.prompt_length[:, None], sp,
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
        spec = state.spec
        if spec is not None:
            where = jnp.where(keep, state.prompt_length[:, None] + state.num_generated[:, None] + j,
                              spec.context.shape[1])
            drafter_state = spec.drafter
            if drafter_state is not None:
                drafter_state = self.engine.drafter.append(drafter_params, params, drafter_state, tokens_BE,
                                                           features_BED, kept)
            spec = dataclasses.replace(spec, context=spec.context.at[rows, where].set(tokens_BE, mode="drop"),
                                       drafter=drafter_state)
        new = SlotState(state.cache, jnp.where(kept > 0, last, state.last_token), state.request,
                        state.prompt_length, state.num_generated + kept, state.active & ~finished, code,
                        state.out_tokens.at[rows, at].set(tokens_BE, mode="drop"),
                        state.out_logp.at[rows, at].set(logp_BE, mode="drop"), spec, state.turns)
        return new, kept

    def _plain_forward(self, params, state, key, sp):
        """The target's forward over every slot's last token and the next token sampled
        (traced): (token [B], logp [B], h, cache, layers)."""
        logits, h, cache, *layers = tfm.decode(params, self.engine.model_config, state.cache,
                                               state.last_token[:, None], state.cache.lengths[:, None],
                                               return_logits=True, layer_ids=self._target_layer_ids(state))
        keys = _request_keys(key, state.request, _model_tokens(state))
        token, logp = jax.vmap(lambda k, l: sampling.sample(k, l, sp))(keys, logits[:, 0])
        return token, logp, h, cache, layers

    def _decode_step(self, params, drafter_params, state, key, sp):
        """One plain decode step for every slot (traced): (state, tokens committed per slot)."""
        engine = self.engine
        token, logp, h, cache, layers = self._plain_forward(params, state, key, sp)
        features = None
        if engine.drafter is not None and state.spec is not None:
            features = engine.drafter.features(drafter_params, h, layers[0] if layers else None)
        was_active = state.active
        new, kept = self._advance(params, drafter_params, state, token[:, None], logp[:, None],
                                  was_active.astype(jnp.int32), features, sp)
        cache = cache.with_lengths(jnp.where(was_active, cache.lengths, state.cache.lengths))
        return dataclasses.replace(new, cache=cache), kept

    def kv_bucket_for(self, lengths_B: np.ndarray, active_B: np.ndarray, strategy: spec_lib.Strategy | None,
                      speculative: bool) -> int:
        """The smallest of the engine's `kv_buckets` that holds every active sequence's
        cache length (host arrays) plus what a step of `strategy` reaches past it: the
        chunk stops where the bucket is full, and the next one reads the bucket after it,
        so a chunk's length never widens the slots its steps read."""
        rc = self.engine.rollout_config
        need = int(np.max(lengths_B, where=active_B, initial=0)) + rc.step_reach(strategy, speculative)
        return next((n for n in rc.kv_buckets if n >= need), rc.max_length)

    def run_chunk(self, state, key, refill_wanted, strategy: spec_lib.Strategy | None, sp, floor=0,
                  attended: int | None = None):
        """Up to steps_per_sync plain decode steps (strategy None) or spec_steps_per_sync
        speculative ones (draft, then verify and commit) in one device loop, attention
        reading the first `attended` cache slots (None: all; `kv_bucket_for` says how many
        the state's live sequences need). The loop stops
        early once a slot frees up while requests are pending (prompt refills), or once
        fewer than `floor` sequences are active (the speculation policy chooses anew for
        the smaller batch). Returns (state, steps run, active slots per step [n], tokens
        committed per step and slot [n, B])."""
        speculative, history, turns = self._layout(state)
        step = self.chunk_step(strategy, speculative, history, attended=attended, turns=turns)
        return step(self.params, self.drafter_params, state, key, refill_wanted, np.int32(floor), sp)

    def chunk_step(self, strategy: spec_lib.Strategy | None, speculative: bool, history: bool = False,
                   attended: int | None = None, turns: bool = False):
        """The jitted device loop of `run_chunk` for a state of that layout (`_layout`):
        (params, drafter_params, state, key,
        refill_wanted, floor, sp) -> (state, steps, active, kept), the state donated. Its
        arguments may be jax.ShapeDtypeStructs (`.lower` then compiles it abstractly)."""
        rc = self.engine.rollout_config
        n_steps = rc.steps_per_sync if strategy is None else rc.spec_steps_per_sync
        b = rc.num_slots

        def one_step(params, drafter_params, state, key, sp):
            if strategy is None:
                return self._decode_step(params, drafter_params, state, key, sp)
            state, tree = self._draft(params, drafter_params, state, key, strategy, sp)
            return self._verify(params, drafter_params, state, tree, key, sp)

        reach = rc.step_reach(strategy, speculative)

        def fn(params, drafter_params, state, key, refill_wanted, floor, sp):
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
                state, kept_B = one_step(params, drafter_params, state, key, sp)
                return i + 1, state, active.at[i].set(n), kept.at[i].set(kept_B)

            init = (0, state, jnp.zeros((n_steps,), jnp.int32), jnp.zeros((n_steps, b), jnp.int32))
            i, state, active, kept = lax.while_loop(cond, body, init)
            return attending(state, None), i, active, kept

        rep = sharding.replicated(self.mesh)
        shardings = self._shardings(speculative, history, turns)
        name = ("chunk", speculative, history, strategy, attended) + (("turns",) if turns else ())
        return self._jit(name, fn, (self.param_shardings, self.drafter_shardings, shardings, rep, rep, rep),
                         (shardings, rep, rep, rep), static_argnums=(6,), donate_argnums=(2,))

    def _draft(self, params, drafter_params, state, key, strategy, sp):
        """Drafts a tree for every slot (traced): (state, DraftTree)."""
        engine = self.engine
        if strategy.drafter in ("ngram", "history"):
            spec = state.spec
            length = state.prompt_length + state.num_generated
            # Finished samples lend their text until their slot is refilled; their own drafts go unused.
            tree = spec_lib.ngram_tree(spec.context, length, jnp.where(state.request >= 0, spec.group, -1), strategy,
                                       spec.history if strategy.drafter == "history" else None)
        else:
            model_tokens = _model_tokens(state)
            if engine.rollout_config.spec_coupled:  # chain token j proposes model token n + j: its key
                keys = _request_keys_BJ(key, state.request, model_tokens[:, None] + jnp.arange(strategy.depth))
            else:
                step_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(_request_keys(key, state.request,
                                                                                        model_tokens))
                keys = jax.vmap(lambda k: jax.vmap(functools.partial(jax.random.fold_in, k))(
                    jnp.arange(strategy.depth)))(step_keys)
            drafter_state, tree = engine.drafter.draft(drafter_params, params, state.spec.drafter, state.last_token,
                                                       strategy, sp, keys)
            state = dataclasses.replace(state, spec=dataclasses.replace(state.spec, drafter=drafter_state))
        return state, spec_lib.bound_tree(tree, state.cache.lengths, engine.rollout_config.max_length)

    def _tree_forward(self, params, state, tree):
        """The target's forward over every slot's draft tree, each node at its depth past the
        cache and seeing only its ancestors (traced): tfm.decode's (logits, h, cache, *layers)."""
        visible = spec_lib.ancestors(tree.parents)
        return tfm.decode(params, self.engine.model_config, state.cache, tree.tokens,
                          state.cache.lengths[:, None] + spec_lib.depths(visible), mask_BTW=visible,
                          return_logits=True,
                          layer_ids=self._target_layer_ids(state))

    def _accepted(self, state, tree, logits, key, sp):
        """Lossless acceptance over every slot's tree from the target's logits (traced):
        (path, num_accepted, tokens, logp, nodes), the emitted tokens, their log-probs and
        tree nodes cut to at most max_draft_depth + 1 (depth + 1 <= that many are emitted)."""
        target_logp = sampling.processed_logprobs(logits, sp)
        if self.engine.rollout_config.spec_coupled:  # the draw after a node at depth j is model token n + j
            depth = spec_lib.depths(spec_lib.ancestors(tree.parents))
            keys = _request_keys_BJ(key, state.request, _model_tokens(state)[:, None] + depth)
            path, num_accepted, next_token = spec_lib.coupled_verify(tree, target_logp, keys)
        else:
            keys = jax.vmap(lambda k: jax.random.fold_in(k, 2))(_request_keys(key, state.request,
                                                                              _model_tokens(state)))
            path, num_accepted, next_token = spec_lib.verify_rows(tree, target_logp, keys)
        tokens, logp, nodes = spec_lib.emitted(tree, target_logp, path, num_accepted, next_token)
        e = min(tokens.shape[1], self.engine.rollout_config.max_draft_depth + 1)
        return path, num_accepted, tokens[:, :e], logp[:, :e], nodes[:, :e]

    def _verify(self, params, drafter_params, state, tree, key, sp):
        """One target forward over every tree, lossless acceptance, commit (traced):
        (state, tokens committed per slot)."""
        engine = self.engine
        start = state.cache.lengths
        logits, h, cache, *layers = self._tree_forward(params, state, tree)
        path, num_accepted, tokens, logp, nodes = self._accepted(state, tree, logits, key, sp)
        features = None
        if engine.drafter is not None:
            features = engine.drafter.features(drafter_params, h, layers[0] if layers else None)
            features = jnp.take_along_axis(features, nodes[..., None], 1)
        was_active = state.active
        new, kept = self._advance(params, drafter_params, state, tokens, logp,
                                  jnp.where(was_active, num_accepted + 1, 0), features, sp)
        committed = spec_lib.commit_path(cache, start, path, jnp.maximum(kept - 1, 0))
        cache = committed.with_lengths(jnp.where(was_active, committed.lengths, start))
        return dataclasses.replace(new, cache=cache), kept

    def spec_draft(self, state, key, strategy: spec_lib.Strategy, sp, attended: int | None = None):
        """The draft phase alone (timed apart from verification): (state, DraftTree)."""
        rep = sharding.replicated(self.mesh)
        layout = self._layout(state)
        shardings = self._shardings(*layout)

        def fn(params, drafter_params, state, key, strategy, sp):
            state, tree = self._draft(params, drafter_params, attending(state, attended), key, strategy, sp)
            return attending(state, None), tree

        step = self._jit(("draft", layout, attended), fn, (self.param_shardings, self.drafter_shardings, shardings,
                                                           rep), (shardings, rep), static_argnums=(4, 5),
                         donate_argnums=(2,))
        return step(self.params, self.drafter_params, state, key, strategy, sp)

    def spec_verify(self, state, tree, key, sp, attended: int | None = None):
        """The verify-and-commit phase alone: (state, tokens committed per slot)."""
        rep = sharding.replicated(self.mesh)
        layout = self._layout(state)
        shardings = self._shardings(*layout)

        def fn(params, drafter_params, state, tree, key, sp):
            state, kept = self._verify(params, drafter_params, attending(state, attended), tree, key, sp)
            return attending(state, None), kept

        step = self._jit(("verify", layout, attended), fn,
                         (self.param_shardings, self.drafter_shardings, shardings, rep, rep),
                         (shardings, rep), static_argnums=(5,), donate_argnums=(2,))
        return step(self.params, self.drafter_params, state, tree, key, sp)

    # -- host loop ---------------------------------------------------------------------------

    def run(self, requests, key, sp, timeline: GroupTimeline, results: dict, num_samples: int = 1,
            speculation=None, on_sample_done: Callable[[int, np.ndarray], None] | None = None,
            episodes: Episodes | None = None):
        """Generates every (request id, prompt) in `requests`; fills results[id] and calls
        on_sample_done(id, tokens) for each as it is harvested. With `episodes`, a sample
        whose turn ends waits in its slot for its environment's step (on a worker thread,
        while the other slots decode), then continues with the observation prefilled."""
        rc = self.engine.rollout_config
        b, p = rc.num_slots, rc.max_prompt_length
        history = spec_lib.history_store(speculation)
        state = self.empty_state(sp, speculation is not None, history.max_tokens if history is not None else 0,
                                 turns=episodes is not None)
        pending = collections.deque(requests)
        slot_request = [-1] * b
        num_active = 0
        active = np.zeros((b,), bool)
        lengths = np.zeros((b,), np.int32)  # the cache's, as of the last sync
        turns = _Turns(self, episodes, b) if episodes is not None else None
        timeline.start = time.perf_counter()
        while True:
            if turns is not None and turns.waiting:
                state, changed = turns.resume(state, slot_request, results, key, sp, on_sample_done,
                                              block=num_active == 0 and not (pending and -1 in slot_request))
                if changed:
                    active, lengths = jax.device_get((state.active, state.cache.lengths))
                    num_active = int(np.sum(active))
            free = [s for s in range(b) if slot_request[s] < 0]
            if pending and free:
                take = [pending.popleft() for _ in range(min(len(free), len(pending)))]
                r = shape_bucket(len(take), b)
                distinct = {}  # prompt -> its row: the G samples of a prompt share one prefill
                sources = np.zeros((r,), np.int32)
                prompt_lengths = np.ones((r,), np.int32)
                slots = np.full((r,), b, np.int32)
                ids = np.zeros((r,), np.int32)
                for i, (rid, prompt, seed_id) in enumerate(take):
                    sources[i] = distinct.setdefault(tuple(prompt), len(distinct))
                    prompt_lengths[i], slots[i], ids[i] = len(prompt), free[i], seed_id
                    slot_request[free[i]] = rid
                prompts = np.zeros((shape_bucket(len(distinct), r), p), np.int32)
                for prompt, row in distinct.items():
                    prompts[row, :len(prompt)] = prompt
                rows = None
                if history is not None:
                    rows = history.rows([prompt for _, prompt, _ in take] + [[]] * (r - len(take)))
                t_insert = time.perf_counter()
                state = self.insert(state, prompts, prompt_lengths, slots, ids, ids // num_samples, key, sp, rows,
                                    sources)
                active, lengths = jax.device_get((state.active, state.cache.lengths))
                timeline.prefill_s += time.perf_counter() - t_insert
                num_active = int(np.sum(active))  # some finish at their first token
            if all(s < 0 for s in slot_request):
                break
            if turns is not None and num_active == 0 and turns.waiting and not turns.ended(active, slot_request):
                continue  # every sample in a slot waits on its environment
            strategy = speculation.strategy_for(num_active) if speculation is not None else None
            attended = self.kv_bucket_for(lengths, active, strategy, speculation is not None)
            # The policy hears only steady-state timings: a step's first call compiles it.
            step_key = (rc.time_spec_phases and strategy is not None, strategy, sp, attended) + \
                (("turns",) if turns is not None else ())
            steady = step_key in self._has_run
            self._has_run.add(step_key)
            t0 = time.perf_counter()
            if strategy is not None and rc.time_spec_phases:
                state, tree = self.spec_draft(state, key, strategy, sp, attended)
                jax.block_until_ready(tree)
                t1 = time.perf_counter()
                state, kept = self.spec_verify(state, tree, key, sp, attended)
                active, lengths, kept = jax.device_get((state.active, state.cache.lengths, kept))
                t2 = time.perf_counter()
                per_sequence = [int(k) for k in kept if k > 0]
                timeline.chunks.append(SpecChunk(t0, t2, [num_active], [sum(per_sequence)], strategy=strategy.name,
                                                 committed_per_sequence=per_sequence, depth=strategy.depth,
                                                 draft_s=t1 - t0, verify_s=t2 - t1))
                tokens = sum(per_sequence)
            else:
                floor = speculation.chunk_floor(num_active) if speculation is not None else 0
                # With environments a chunk also stops where a turn ends, so its step starts at once.
                refill_wanted = bool(pending) or turns is not None
                state, n, active_steps, kept = self.run_chunk(state, key, refill_wanted, strategy, sp, floor, attended)
                active, lengths, n, active_steps, kept = jax.device_get((state.active, state.cache.lengths, n,
                                                                         active_steps, kept))
                t2 = time.perf_counter()
                kept = kept[:n]
                if strategy is None:
                    timeline.chunks.append(Chunk(t0, t2, active_steps[:n].tolist(), kept.sum(1).tolist()))
                else:
                    timeline.chunks.append(SpecChunk(t0, t2, active_steps[:n].tolist(), kept.sum(1).tolist(),
                                                     strategy=strategy.name, depth=strategy.depth,
                                                     committed_per_sequence=kept[kept > 0].tolist()))
                tokens = int(kept.sum())
            if steady and speculation is not None:
                speculation.observe(strategy, num_active, tokens, t2 - t0)
            num_active = int(np.sum(active))
            done = [s for s in range(b) if slot_request[s] >= 0 and not active[s]]
            if turns is not None:
                done = [s for s in done if s not in turns.waiting]
            if done:
                t_harvest = time.perf_counter()
                if turns is not None:
                    turns.turn_ended(state, done, slot_request, results, on_sample_done)
                else:
                    self._harvest(state, done, slot_request, results, on_sample_done)
                timeline.harvest_s += time.perf_counter() - t_harvest
        if turns is not None:
            turns.close()
        timeline.end = time.perf_counter()

    def _rows(self, arrays, slots):
        """Those slots' rows of each of `arrays` ([B, ...] device arrays), on the host."""
        index = np.asarray(slots + [slots[0]] * (shape_bucket(len(slots), self.engine.rollout_config.num_slots)
                                                 - len(slots)))
        return jax.device_get(_gather_rows(arrays, index))

    def _harvest(self, state, slots, slot_request, results, on_sample_done=None):
        toks, logps, counts, finish = self._rows((state.out_tokens, state.out_logp, state.num_generated,
                                                  state.finish), slots)
        for i, s in enumerate(slots):
            n = int(counts[i])
            self._finish(slot_request, s, results, on_sample_done, toks[i, :n].copy(), logps[i, :n].copy(),
                         FINISH_REASONS[int(finish[i])])

    def _finish(self, slot_request, slot, results, on_sample_done, tokens, logp, reason, observed=None):
        """Records a finished sample (observed: its observation-token mask, multi-turn only)
        and frees its slot."""
        request = slot_request[slot]
        results[request] = (tokens, logp, reason, self.index, observed)
        if on_sample_done is not None:
            on_sample_done(request, tokens)
        slot_request[slot] = -1


class Episodes(Protocol):
    """The environments of a multi-turn `generate`, one episode per request
    (`envs.Episodes` is one; sampling params then carry its stop sequences)."""

    # Whether environments step on worker threads while the other slots decode (True), or
    # on the group's host thread between device chunks, decoding stopped meanwhile (False:
    # the serial schedule, to measure what the overlap hides). Optional; default True.
    overlap: bool

    def step(self, request: int, action: np.ndarray, finish_reason: str) -> Sequence[int] | str:
        """Called once request's turn ended (on an end token: "eos"; a stop token or
        sequence: "stop") with the turn's token ids: the observation's token ids to
        prefill before the next turn, or, when the episode ends, the sample's finish
        reason ("" keeps the turn's). On a worker thread unless `overlap` is False."""
        ...


class _Turns:
    """A group's samples between turns: each waits in its own slot (inactive, so never
    counted as running) while its environment steps on a worker thread (with
    `episodes.overlap` False: at once on this thread, decoding stopped meanwhile)."""

    def __init__(self, group: _Group, episodes: Episodes, num_slots: int):
        self.group, self.episodes = group, episodes
        self.overlap = bool(getattr(episodes, "overlap", True))
        self.pool = concurrent.futures.ThreadPoolExecutor(num_slots, thread_name_prefix="env")
        self.waiting: dict[int, concurrent.futures.Future] = {}  # slot -> its environment's step
        self.observed: dict[int, list[tuple[int, int]]] = {}  # request -> (offset, length) of each observation
        # slot -> (tokens, logp, finish reason, prompt length) as its last turn ended
        self.ended_turn: dict[int, tuple[np.ndarray, np.ndarray, str, int]] = {}

    def close(self):
        self.pool.shutdown(wait=True)

    def ended(self, active, slot_request) -> bool:
        """Whether a slot holds a sample whose turn ended and is not yet with its environment."""
        return any(r >= 0 and not active[s] and s not in self.waiting for s, r in enumerate(slot_request))

    def turn_ended(self, state, slots, slot_request, results, on_sample_done):
        """Hands each slot's finished turn to its environment, or records the sample when
        it ended for good (its token budget or the cache spent)."""
        toks, logps, counts, finish, turn_start, prompt_lengths = self.group._rows(
            (state.out_tokens, state.out_logp, state.num_generated, state.finish, state.turns.turn_start,
             state.prompt_length), slots)
        for i, s in enumerate(slots):
            n, reason = int(counts[i]), FINISH_REASONS[int(finish[i])]
            if reason in ("eos", "stop"):
                self.ended_turn[s] = (toks[i, :n].copy(), logps[i, :n].copy(), reason, int(prompt_lengths[i]))
                args = (slot_request[s], toks[i, int(turn_start[i]):n].copy(), reason)
                self.waiting[s] = self.pool.submit(self.episodes.step, *args) if self.overlap else _done(
                    self.episodes.step, *args)
            else:
                self._record(slot_request, s, results, on_sample_done, toks[i, :n].copy(), logps[i, :n].copy(),
                             reason)

    def _record(self, slot_request, slot, results, on_sample_done, tokens, logp, reason):
        observed = np.zeros(len(tokens), bool)
        for offset, length in self.observed.pop(slot_request[slot], []):
            observed[offset:offset + length] = True
        self.group._finish(slot_request, slot, results, on_sample_done, tokens, logp, reason, observed)

    def resume(self, state, slot_request, results, key, sp, on_sample_done, block: bool):
        """Takes the environments' answers (block: waits for at least one): ended episodes
        are recorded, the others' observations prefilled into their slots. Returns (state,
        whether the device state changed)."""
        if block:
            concurrent.futures.wait(self.waiting.values(), return_when=concurrent.futures.FIRST_COMPLETED)
        rc = self.group.engine.rollout_config
        going = []
        for slot in [s for s, f in self.waiting.items() if f.done()]:
            answer = self.waiting.pop(slot).result()  # Episodes.step catches what an environment raises
            tokens, logp, reason, prompt_length = self.ended_turn.pop(slot)
            generated = len(tokens)
            if isinstance(answer, str):
                self._record(slot_request, slot, results, on_sample_done, tokens, logp, answer or reason)
                continue
            ids = np.asarray(answer, np.int32).reshape(-1)
            # Room for the observation and at least one more model token, in the outputs and the cache.
            if generated + len(ids) + 1 > sp.max_tokens or \
                    prompt_length + generated + len(ids) > rc.max_length:
                self._record(slot_request, slot, results, on_sample_done, tokens, logp, "max_tokens")
                continue
            self.observed.setdefault(slot_request[slot], []).append((generated, len(ids)))
            going.append((slot, ids))
        if not going:
            return state, False
        r = shape_bucket(len(going), rc.num_slots)
        width = shape_bucket(max(len(ids) for _, ids in going), rc.max_length)
        observations = np.zeros((r, width), np.int32)
        lengths = np.zeros((r,), np.int32)
        slots = np.full((r,), rc.num_slots, np.int32)
        for i, (slot, ids) in enumerate(going):
            observations[i, :len(ids)], lengths[i], slots[i] = ids, len(ids), slot
        return self.group.observe(state, observations, lengths, slots, key, sp), True


def _done(fn, *args) -> concurrent.futures.Future:
    """fn(*args) run now, on this thread, as a finished future."""
    future = concurrent.futures.Future()
    try:
        future.set_result(fn(*args))
    except Exception as e:  # noqa: BLE001 - raised where a worker's would be: at .result()
        future.set_exception(e)
    return future


class _CompiledInTurn:
    """A group's jitted step whose first call at each signature waits for `lock`: the
    groups of one process run `generate` in threads at once, and a program compiled by two
    groups at once is compiled twice, while one compiled after the other loads from the
    persistent compilation cache (keyed without its devices:
    `launch.cache_programs_for_any_devices`). Later calls do not wait. The signature: the
    static arguments, each host array's shape (the prompts' buckets) and each other
    argument's pytree structure (the slot state's shapes follow from the step's name and
    the static sampling parameters; a change the signature misses only compiles without
    waiting). `lower` and the rest are the jitted function's own."""

    def __init__(self, jitted, static_argnums, lock: threading.Lock):
        self.jitted, self.static_argnums, self.lock = jitted, static_argnums, lock
        self.seen: set = set()

    def __call__(self, *args):
        signature = tuple(a if i in self.static_argnums else a.shape if isinstance(a, np.ndarray) else
                          jax.tree.structure(a) for i, a in enumerate(args[2:], 2))
        if signature in self.seen:
            return self.jitted(*args)
        with self.lock:
            out = self.jitted(*args)
        self.seen.add(signature)
        return out

    def __getattr__(self, attr):
        return getattr(self.jitted, attr)


def _context_length(rc: RolloutConfig) -> int:
    """Context buffer per slot: everything the cache holds, the pending last token, and
    room for a speculative step's overshoot (dropped writes past it are harmless)."""
    return rc.max_length + 1


@jax.jit
def _gather_rows(arrays, index):
    return jax.tree.map(lambda a: a[index], arrays)


def _part_on(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """The part of `x` on `sharding`'s devices as an array laid out by `sharding`, sharing
    x's buffers: x must already hold, on those devices, the shards `sharding` places there."""
    shards = [s.data for s in x.addressable_shards if s.device in sharding.device_set]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def _abstract(tree) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def shape_bucket(n: int, cap: int, unit: int = 1) -> int:
    """The smallest unit x a power of two that holds n, at most cap: few distinct
    shapes, few compilations (unit: e.g. the fsdp devices a batch is split over)."""
    return min(cap, unit << max(0, -(-n // unit) - 1).bit_length())


class RolloutEngine:
    """Generates G samples per prompt with continuous batching on each rollout group.

    The mesh's `data` axis indexes the groups; each group is a (1, fsdp, tensor) sub-mesh
    holding its own copy of the weights. With a drafter (its config and parameters) the
    engine can decode speculatively with EAGLE strategies; n-gram strategies need none.
    """

    def __init__(self, model_config: ModelConfig, params, mesh: Mesh, rollout_config: RolloutConfig,
                 drafter_config: drafter_lib.DrafterConfig | None = None, drafter_params=None):
        self.model_config, self.rollout_config = model_config, rollout_config
        if 0 < rollout_config.decode_mlp_size < model_config.intermediate_size:
            raise ValueError(f"decode_mlp_size={rollout_config.decode_mlp_size} is below the model's MLP width "
                             f"{model_config.intermediate_size}: it pads, so it can only grow (0: off).")
        # Fused q/k/v are split over the tensor axis by kv head: fuse only when the kv heads
        # split evenly, or the query weights (split by query head unfused) would be copied
        # whole to every device.
        self._fuse = rollout_config.fused_projections and model_config.num_kv_heads % mesh.shape["tensor"] == 0
        self._param_shapes = jax.eval_shape(self._engine_layout, params)
        if (drafter_config is None) != (drafter_params is None):
            raise ValueError("Pass both drafter_config and drafter_params, or neither.")
        self.drafter = None
        if drafter_config is not None:
            drafter_lib.check_drafter_params(drafter_params, model_config, drafter_config)
            self.drafter = spec_lib.Drafter(model_config, drafter_config)
            self._drafter_shapes = jax.eval_shape(lambda p: p, drafter_params)
        self._compiling = threading.Lock()  # a program's first compile, one group at a time (_CompiledInTurn)
        self.groups = [_Group(g, Mesh(mesh.devices[g:g + 1], mesh.axis_names), self)
                       for g in range(mesh.devices.shape[0])]
        spanning = [g for g in self.groups if len(g.processes) > 1]
        if spanning:
            raise ValueError(
                f"Rollout group {spanning[0].index} spans the devices of processes {spanning[0].processes}; each "
                "rollout group (one slice of the mesh's data axis) must lie on one process: make the data axis a "
                f"multiple of the number of processes ({jax.process_count()}).")
        self.local_groups = [g for g in self.groups if g.is_local]
        # The weights in decode's layout on the whole mesh, a copy per data slice: each
        # group's copy is then the part on its devices, taken without a transfer.
        self._layout = jax.jit(self._engine_layout, out_shardings=jax.tree.map(
            lambda s: NamedSharding(mesh, s.spec), self.groups[0].param_shardings))
        # jax.ShapeDtypeStruct weights build an engine that only compiles (memory planning:
        # `_Group.chunk_step(...).lower(...)`); it holds no weights and cannot generate.
        if not _abstract(params):
            self.update_params(params)
            if drafter_params is not None:
                self.update_drafter(drafter_params)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def _engine_layout(self, params):
        """The weights as decode reads them: in the compute dtype (every use casts to it,
        so this changes no result and halves the bytes per step of float32 masters), per
        layer, with fused projections and padded MLPs as the rollout config asks."""
        cfg, rc = self.model_config, self.rollout_config
        params = jax.tree.map(lambda x: x.astype(cfg.jnp_dtype), params)
        if rc.decode_mlp_size:
            params = tfm.pad_mlp(params, cfg, rc.decode_mlp_size)[1]
        if rc.per_layer_weights:
            params = tfm.unstack_layers(params)
        return tfm.fuse_projections(params, cfg) if self._fuse else params

    def update_params(self, params) -> None:
        """Takes new weights (any sharding on the engine's mesh, or host arrays)."""
        params = self._layout(params)
        for group in self.local_groups:
            group.params = jax.tree.map(_part_on, params, group.param_shardings)

    def update_drafter(self, drafter_params) -> None:
        """Takes new drafter weights (between rollouts, as the spot trainer improves them)."""
        if self.drafter is None:
            raise ValueError("This engine was built without a drafter; pass drafter_config and drafter_params.")
        drafter_lib.check_drafter_params(drafter_params, self.model_config, self.drafter.config)
        for group in self.local_groups:
            group.drafter_params = jax.device_put(drafter_params, group.drafter_shardings)

    def warm_up(self, sampling_params: sampling.SamplingParams,
                speculation: spec_lib.Speculation | None = None, turns: bool = False) -> float:
        """Compiles and runs once, on every group and for every kv bucket, the chunk of plain
        decode and of each of the policy's strategies (none without a policy: plain decode
        alone, as `generate` without one runs it) for these sampling parameters, on live
        slots of no request. No rollout then pays a chunk's first compile or first run, and
        the policy hears every chunk from the first. turns: the chunks of multi-turn
        rollouts (`generate(..., episodes=)`, whose slots carry `TurnSlots`; pass the
        sampling parameters those rollouts run, stop sequences and token budget included)
        in place of single-turn ones. Prefills, the first and each continuation's, compile
        at their first shape as before. Returns the seconds spent."""
        if speculation is not None:
            self._check_speculation(speculation)
        t0 = time.perf_counter()
        rc, sp = self.rollout_config, sampling_params
        key = jax.random.PRNGKey(0)
        history = spec_lib.history_store(speculation)
        strategies = () if speculation is None else speculation.strategies
        for group in self.local_groups:
            for strategy in (None, *strategies):
                for attended in rc.kv_buckets:
                    # A chunk's loop body must run, not only compile: XLA:CPU finishes a
                    # program on its first run (at 16 layers on a 2-core EPYC, ~90 ms more
                    # than later runs), which would land in a rollout and the tuner's rewards.
                    state = group.empty_state(sp, speculative=speculation is not None,
                                              history_width=history.max_tokens if history is not None else 0,
                                              live=True, turns=turns)
                    if strategy is not None and rc.time_spec_phases:
                        state, tree = group.spec_draft(state, key, strategy, sp, attended)
                        state, _ = group.spec_verify(state, tree, key, sp, attended)
                    else:
                        state = group.run_chunk(state, key, False, strategy, sp, 0, attended)[0]
                    jax.block_until_ready(state)  # one state at a time in memory
                    group._has_run.add((rc.time_spec_phases and strategy is not None, strategy, sp, attended)
                                       + (("turns",) if turns else ()))
        return time.perf_counter() - t0

    def _check(self, prompts, num_samples):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}.")
        rc = self.rollout_config
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"Prompt {i} is empty; every prompt needs at least one token (e.g. BOS).")
            if len(prompt) > rc.max_prompt_length:
                raise ValueError(
                    f"Prompt {i} has {len(prompt)} tokens but the engine takes at most max_prompt_length="
                    f"{rc.max_prompt_length} (KV cache length {rc.max_length}); raise max_prompt_length "
                    "(and max_length) or shorten the prompt.")
            bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"Prompt {i} has token ids {bad[:5]} outside [0, {self.model_config.vocab_size}).")

    def _check_speculation(self, speculation) -> None:
        for strategy in speculation.strategies:
            if strategy.depth > self.rollout_config.max_draft_depth:
                raise ValueError(f"Strategy {strategy.name} drafts {strategy.depth} deep but the engine was built "
                                 f"with max_draft_depth={self.rollout_config.max_draft_depth}; raise it.")
            if strategy.drafter == "eagle" and self.drafter is None:
                raise ValueError(f"Strategy {strategy.name} needs an EAGLE drafter; build the engine with "
                                 "drafter_config and drafter_params, or use an n-gram strategy.")
            if strategy.drafter == "history" and not isinstance(getattr(speculation, "history", None),
                                                                 HistoryStore):
                raise ValueError(f"Strategy {strategy.name} searches the prompts' earlier rollouts: the speculation "
                                 "policy's `history` must be a history.HistoryStore (tuner.from_config makes one "
                                 "for history arms; FixedSpeculation(..., history=HistoryStore())).")

    def generate(self, prompts: Sequence[Sequence[int]], num_samples: int, sampling_params: sampling.SamplingParams,
                 key: jax.Array, on_group_done: Callable[[int], None] | None = None,
                 speculation: spec_lib.Speculation | None = None,
                 prompt_ids: Sequence[int] | None = None,
                 on_sample_done: Callable[[int, np.ndarray], None] | None = None,
                 episodes: Episodes | None = None) -> Rollouts:
        """Samples `num_samples` answers for every prompt.

        Prompts are split among groups whole (the samples of one prompt stay together);
        `on_group_done(g)` fires as each group finishes, while others may still decode
        (with several processes: each of this process's groups). `speculation` picks a
        strategy (or none) before each chunk from the number of active sequences; the
        samples' distribution is the same either way. With several processes every
        process passes the same arguments (the call is collective) and gets every
        group's samples and timeline; its `speculation` has heard every group's chunks.
        `prompt_ids` name the prompts (default: their positions): sample s of the prompt
        named i draws from the key of request i * num_samples + s, so a prompt gives the
        same answers alone or in any batch, under the same key and name.
        `on_sample_done(i, tokens)` fires as sample i (its index in the returned Rollouts)
        finishes, on its group's host thread between device chunks, so it should only hand
        the sample on (the RL loop submits it for scoring); with several processes, only
        for the samples of this process's groups.
        `episodes` (multi-turn): each sample's turns end at an end token or a stop token or
        sequence of `sampling_params`; its environment (`Episodes.step`) then answers with an
        observation, prefilled into the sample's own slot, until the episode ends.
        `sampling_params.max_tokens` bounds the whole transcript after the prompt; the
        returned Rollouts carry `observation_mask`.
        """
        self._check(prompts, num_samples)
        if speculation is not None:
            self._check_speculation(speculation)
        if prompt_ids is None:
            prompt_ids = range(len(prompts))
        prompt_ids = [int(i) for i in prompt_ids]
        if len(prompt_ids) != len(prompts) or len(set(prompt_ids)) != len(prompt_ids) or \
                not all(0 <= i < (2**31 - 1) // num_samples for i in prompt_ids):
            raise ValueError(f"prompt_ids must name each of the {len(prompts)} prompts once, with non-negative ids "
                             f"below {(2**31 - 1) // num_samples} (int32 request ids); got {prompt_ids[:8]}.")
        timeline = RolloutTimeline([GroupTimeline(g.index, self.rollout_config.num_slots) for g in self.groups])
        requests = [(p * num_samples + s, list(prompt), prompt_ids[p] * num_samples + s)
                    for p, prompt in enumerate(prompts) for s in range(num_samples)]
        shares = np.array_split(np.arange(len(prompts)), self.num_groups)
        results: dict = {}
        policy = _Recorded(speculation) if speculation is not None and multihost.is_multiprocess() else speculation

        def run(group):
            share = set(shares[group.index].tolist())
            mine = [req for req in requests if req[0] // num_samples in share]
            group.run(mine, key, sampling_params, timeline.groups[group.index], results, num_samples, policy,
                      on_sample_done, episodes)
            if on_group_done is not None:
                on_group_done(group.index)

        if prompts:
            if len(self.local_groups) == 1:
                run(self.local_groups[0])
            else:
                with concurrent.futures.ThreadPoolExecutor(len(self.local_groups)) as pool:
                    for f in [pool.submit(run, g) for g in self.local_groups]:
                        f.result()
            if multihost.is_multiprocess():
                self._exchange(results, timeline, policy)
            history = spec_lib.history_store(speculation)
            if history is not None:  # every process holds every result: the stores stay alike
                for p, prompt in enumerate(prompts):
                    history.add(prompt, [results[p * num_samples + s][0] for s in range(num_samples)])
        ids = sorted(results)
        return Rollouts(
            prompt_index=np.asarray([i // num_samples for i in ids], np.int32),
            sample_index=np.asarray([i % num_samples for i in ids], np.int32),
            tokens=[results[i][0] for i in ids], logprobs=[results[i][1] for i in ids],
            finish_reason=[results[i][2] for i in ids], group=np.asarray([results[i][3] for i in ids], np.int32),
            timeline=timeline, observation_mask=[results[i][4] for i in ids] if episodes is not None else None)

    def _exchange(self, results: dict, timeline: RolloutTimeline, policy: _Recorded | None) -> None:
        """Completes `results` and `timeline` with the other processes' groups (their times
        shifted to this process's clock, by each process's start of the call), and tells
        `policy` the chunks they heard."""
        multihost.wait_for_all("rollout")  # on the host: the devices stay free for the drafter meanwhile
        mine = {"results": results, "timelines": [timeline.groups[g.index] for g in self.local_groups],
                "heard": policy.heard if policy is not None else [], "origin": timeline.origin}
        for process, theirs in enumerate(multihost.allgather_objects(mine)):
            if process == jax.process_index():
                continue
            results.update(theirs["results"])
            for group in theirs["timelines"]:
                timeline.groups[group.group] = _shifted(group, timeline.origin - theirs["origin"])
            for chunk in theirs["heard"]:
                policy.inner.observe(*chunk)


class _Recorded:
    """A Speculation that also records what it heard (to tell other processes)."""

    def __init__(self, inner: spec_lib.Speculation):
        self.inner, self.heard = inner, []
        self.strategies = inner.strategies
        self.history = getattr(inner, "history", None)

    def strategy_for(self, num_active):
        return self.inner.strategy_for(num_active)

    def chunk_floor(self, num_active):
        return self.inner.chunk_floor(num_active)

    def observe(self, strategy, num_active, tokens, seconds):
        self.inner.observe(strategy, num_active, tokens, seconds)
        self.heard.append((strategy, num_active, tokens, seconds))


def _shifted(group: GroupTimeline, dt: float) -> GroupTimeline:
    chunks = [dataclasses.replace(c, start=c.start + dt, end=c.end + dt) for c in group.chunks]
    return dataclasses.replace(group, start=group.start + dt, end=group.end + dt, chunks=chunks)
