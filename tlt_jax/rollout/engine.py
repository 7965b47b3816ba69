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

import concurrent.futures
import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from tlt_jax import multihost, sampling
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig
from tlt_jax.rollout import speculative as spec_lib
from tlt_jax.rollout.config import RolloutConfig
from tlt_jax.rollout.group import FirstCalls, Group
from tlt_jax.rollout.history import HistoryStore
from tlt_jax.rollout.scheduler import Scheduler
from tlt_jax.rollout.slots import FINISH_REASONS, SlotState, attending, shape_bucket
from tlt_jax.rollout.timeline import GroupTimeline, RolloutTimeline
from tlt_jax.rollout.turns import Episodes

# The engine's public names, wherever they live.
__all__ = ["FINISH_REASONS", "Episodes", "PartialRequests", "RolloutConfig", "RolloutEngine", "Rollouts", "SlotState",
           "attending", "shape_bucket"]


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


@dataclasses.dataclass(frozen=True)
class PartialRequests:
    """A generate that runs some samples, resumes what they drew before and may stop early.

    samples: the request indices to run (prompt p's sample s is p * num_samples + s).
    resumed: request index -> (tokens int32 [k], log-probs float32 [k]) it drew in an
    earlier call, with the log-probs of the policy that drew each; it continues from there
    (its prompt and those tokens re-prefilled) with the key of its next position.
    stop(finished, requests): called on each rollout group as its samples finish, with the
    request indices finished so far there and all that group runs; True ends that group's
    rollout, its unfinished samples returned with finish reason "" and their tokens so far
    (those never started: what they were resumed with)."""

    samples: Sequence[int]
    resumed: dict = dataclasses.field(default_factory=dict)
    stop: Callable[[set, list], bool] | None = None

    def checked(self, num_requests: int) -> list[int]:
        samples = sorted(int(i) for i in self.samples)
        if len(set(samples)) != len(samples) or (samples and not 0 <= samples[0] <= samples[-1] < num_requests):
            raise ValueError(f"partial.samples must name distinct requests in [0, {num_requests}); got {samples[:8]}.")
        unknown = set(self.resumed) - set(samples)
        if unknown:
            raise ValueError(f"partial.resumed names requests that do not run: {sorted(unknown)[:8]}.")
        return samples

    def of_group(self, requests: list[int]) -> tuple[dict, Callable[[set], bool] | None]:
        """What one rollout group's scheduler takes for its `requests`: those that resume
        tokens (request -> (tokens, log-probs)), and the stop rule on its finished ones."""
        resumed = {r: self.resumed[r] for r in requests if r in self.resumed and len(self.resumed[r][0])}
        return resumed, (lambda finished: self.stop(finished, requests)) if self.stop is not None else None


def _add_finished(history: HistoryStore, prompts, num_samples: int, results: dict) -> None:
    """Each prompt's finished samples (not those a partial rollout stopped) to the history."""
    for p, prompt in enumerate(prompts):
        done = [results[i][0] for i in range(p * num_samples, (p + 1) * num_samples) if i in results and results[i][2]]
        if done:
            history.add(prompt, done)


def _part_on(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """The part of `x` on `sharding`'s devices as an array laid out by `sharding`, sharing
    x's buffers: x must already hold, on those devices, the shards `sharding` places there."""
    shards = [s.data for s in x.addressable_shards if s.device in sharding.device_set]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def _abstract(tree) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


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
        self.groups = [Group(g, Mesh(mesh.devices[g:g + 1], mesh.axis_names), self)
                       for g in range(mesh.devices.shape[0])]
        spanning = [g for g in self.groups if len(g.processes) > 1]
        if spanning:
            raise ValueError(
                f"Rollout group {spanning[0].index} spans the devices of processes {spanning[0].processes}; each "
                "rollout group (one slice of the mesh's data axis) must lie on one process: make the data axis a "
                f"multiple of the number of processes ({jax.process_count()}).")
        self.local_groups = [g for g in self.groups if g.is_local]
        self.first_calls = FirstCalls(len(self.local_groups) > 1 and jax.config.jax_compilation_cache_dir is not None)
        # The weights in decode's layout on the whole mesh, a copy per data slice: each
        # group's copy is then the part on its devices, taken without a transfer.
        self._layout = jax.jit(self._engine_layout, out_shardings=jax.tree.map(
            lambda s: NamedSharding(mesh, s.spec), self.groups[0].param_shardings))
        # jax.ShapeDtypeStruct weights build an engine that only compiles (memory planning:
        # `Group.chunk_step(...).lower(...)`); it holds no weights and cannot generate.
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
                speculation: spec_lib.Speculation | None = None, turns: bool = False,
                strategies: bool = False) -> float:
        """Compiles and runs once, on every group (one after the other) and for every kv
        bucket, the chunk of plain decode for these sampling parameters, on live slots of no
        request, in the slot layout the rollouts run (speculative with a policy, with history
        rows for history arms). No rollout then pays a plain chunk's first compile or first
        run. A drafting strategy compiles when the policy first picks it (its first chunk,
        unheard by the policy), so a run pays only for the strategies it drafts with;
        strategies=True compiles each of the policy's strategies here too, and the policy
        then hears every chunk from the first. turns: the chunks of multi-turn rollouts
        (`generate(..., episodes=)`, whose slots carry `TurnSlots`; pass the sampling
        parameters those rollouts run, stop sequences and token budget included) in place
        of single-turn ones. Prefills, the first and each continuation's, compile at their
        first shape as before. Returns the seconds spent."""
        if speculation is not None:
            self._check_speculation(speculation)
        t0 = time.perf_counter()
        history = spec_lib.history_store(speculation)
        chunks = (None, *(speculation.strategies if speculation is not None and strategies else ()))
        for group in self.local_groups:
            group.warm_up(sampling_params, chunks, speculation is not None,
                          history.max_tokens if history is not None else 0, turns)
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
                 episodes: Episodes | None = None, partial: PartialRequests | None = None) -> Rollouts:
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
        `partial` (partial rollouts, single-turn): which samples run, what each drew
        before, and the rule that stops a group early (`PartialRequests`); the returned
        Rollouts then hold only the samples run, the unfinished ones with finish reason "".
        """
        self._check(prompts, num_samples)
        if partial is not None and episodes is not None:
            raise ValueError("Partial rollouts take single-turn requests; pass partial or episodes, not both.")
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
        if partial is not None:
            requests = [requests[i] for i in partial.checked(len(requests))]
        shares = np.array_split(np.arange(len(prompts)), self.num_groups)
        results: dict = {}
        policy = _Recorded(speculation) if speculation is not None and multihost.is_multiprocess() else speculation

        def run(group):
            share = set(shares[group.index].tolist())
            mine = [req for req in requests if req[0] // num_samples in share]
            resumed, stop = partial.of_group([rid for rid, _, _ in mine]) if partial is not None else (None, None)
            Scheduler(group, mine, key, sampling_params, timeline.groups[group.index], results, num_samples, policy,
                      on_sample_done, episodes, resumed, stop).run()
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
                _add_finished(history, prompts, num_samples, results)
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
