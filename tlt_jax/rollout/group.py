"""One data-parallel rollout group: its sub-mesh, the shardings of its weights and slot
state, its copies of the weights, and the calls of the device steps (`steps.py`) on them.

Each step is jitted once per state layout with the group's shardings (`Programs`), and
jit's own cache keys its programs by the static arguments (`StepSpec`, strategy, kv
bucket, sampling parameters); the group takes no lock on the decode path. Warm-up compiles and
runs what the rollouts will run ahead of them, group after group; a program another group
of this process compiled already loads from the persistent compilation cache, keyed
without its devices (`launch.cache_programs_for_any_devices`). A program first met during
a rollout (a strategy's chunk, a prefill or observation shape) is first called by one group
at a time too (`FirstCalls`).
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import TYPE_CHECKING, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tlt_jax import background, sampling, sharding
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer as tfm
from tlt_jax.rollout import speculative as spec_lib
from tlt_jax.rollout import steps
from tlt_jax.rollout.slots import FINISH_REASONS, SlotState, SpecSlots, TurnSlots, shape_bucket

if TYPE_CHECKING:
    from tlt_jax.rollout.engine import RolloutEngine


class Group:
    """One data-parallel group: its sub-mesh, parameter copies and device steps."""

    def __init__(self, index: int, mesh: Mesh, engine: RolloutEngine):
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
        self._plain_shardings = SlotState(
            cache=cache, last_token=row, request=row, prompt_length=row, num_generated=row, active=row, finish=row,
            out_tokens=rows2, out_logp=rows2)
        drafter = None
        self.drafter_shardings = None
        if engine.drafter is not None:
            drafter = spec_lib.DrafterState(cache, rows2, rows3, row)
            self.drafter_shardings = sharding.tree_shardings(
                drafter_lib.drafter_logical_axes(cfg, engine.drafter.config), engine._drafter_shapes, mesh)
        self._spec_slots = {False: SpecSlots(rows2, row, drafter), True: SpecSlots(rows2, row, drafter, rows2)}
        self._turn_shardings = TurnSlots(row, row)
        self.params = self.drafter_params = None
        self._programs: dict[steps.StepSpec, Programs] = {}
        self._programs_lock = threading.Lock()
        # The steps whose first call, with its compile and XLA's first run, is past (see
        # `warm_step`): the speculation policy hears only the chunks after it.
        self.warm_steps: set = set()
        self._warming: dict = {}  # step -> the future of its warm-up on a thread (`warm_in_background`)

    def shardings(self, speculative: bool, history: bool = False, turns: bool = False) -> SlotState:
        """The slot state's shardings for that layout."""
        shardings = self._plain_shardings
        if speculative:
            shardings = dataclasses.replace(shardings, spec=self._spec_slots[history])
        return dataclasses.replace(shardings, turns=self._turn_shardings) if turns else shardings

    def spec(self, speculative: bool, history: bool = False, turns: bool = False) -> steps.StepSpec:
        """The static spec of this group's steps over a state of that layout."""
        engine = self.engine
        return steps.StepSpec(engine.model_config, engine.rollout_config, engine.drafter, speculative,
                              speculative and history, turns)

    def spec_of(self, state: SlotState) -> steps.StepSpec:
        """The static spec of this group's steps over `state` (its layout read from it)."""
        speculative = state.spec is not None
        return self.spec(speculative, speculative and state.spec.history is not None, state.turns is not None)

    def programs(self, spec: steps.StepSpec) -> Programs:
        """The device steps over states of spec's layout, jitted once with this group's
        shardings; jit's cache then keys their programs by the static arguments. Made under
        a lock (a warm-up on another thread may ask for the same layout), read without."""
        programs = self._programs.get(spec)
        if programs is None:
            with self._programs_lock:
                programs = self._programs.get(spec)
                if programs is None:
                    programs = self._programs[spec] = Programs.jitted(self, spec)
        return programs

    def chunk_programs(self) -> int:
        """How many chunk programs this group has compiled (every layout, strategy, bucket)."""
        return sum(p.chunk._cache_size() for p in self._programs.values())

    def empty_state(self, sp: sampling.SamplingParams, speculative: bool = False,
                    history_width: int = 0, live: bool = False, turns: bool = False) -> SlotState:
        """history_width > 0 (speculative only): each slot holds a history row that wide.
        turns: the slots hold multi-turn samples (`TurnSlots`).
        live: every slot decodes, from a cache of one zero entry (no request's: what
        `warm_up` runs chunks on, so that their loop bodies run)."""
        spec = self.spec(speculative, history_width > 0, turns)
        empty = functools.partial(self.programs(spec).empty, spec=spec, max_tokens=sp.max_tokens,
                                  history_width=history_width, live=live)
        return self.engine.first_calls.call(empty, ("empty", spec, sp.max_tokens, history_width, live))

    def insert(self, state, prompts_UP, lengths_R, slots_R, requests_R, groups_R, key, sp, history_RH=None,
               sources_R=None, resumed: steps.Resumed | None = None):
        """Prefills R requests into the given slots (slot index B: a padding row, dropped):
        request i samples prompt sources_R[i] of prompts_UP (default i: U = R). Each distinct
        prompt is prefilled once, however many of its samples it starts (G in GRPO).
        history_RH: their history rows, when the state holds them. resumed: requests that
        continue tokens drawn before (`steps.insert`)."""
        spec = self.spec_of(state)
        if spec.history != (history_RH is not None):
            raise ValueError("insert takes history rows exactly when the state holds them.")
        if sources_R is None:
            sources_R = np.arange(len(lengths_R), dtype=np.int32)
        return self._call("insert", spec, (sp,), state, prompts_UP, lengths_R, slots_R, requests_R, groups_R, key,
                          history_RH, sources_R, resumed)

    def observe(self, state, observations_RT, lengths_R, slots_R, key, sp):
        """Continues R waiting samples after their environments answered (`steps.observe`)."""
        if state.turns is None:
            raise ValueError("observe takes a multi-turn slot state (empty_state(..., turns=True)).")
        spec = self.spec_of(state)
        return self._call("observe", spec, (sp,), state, observations_RT, lengths_R, slots_R, key)

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
        the state's live sequences need). The loop stops early once a slot frees up while
        requests are pending (prompt refills), or once fewer than `floor` sequences are
        active (the speculation policy chooses anew for the smaller batch). Returns (state,
        steps run, active slots per step [n], tokens committed per step and slot [n, B])."""
        spec = self.spec_of(state)
        return self._call("chunk", spec, (strategy, attended, sp), state, key, refill_wanted, np.int32(floor))

    def chunk_step(self, strategy: spec_lib.Strategy | None, speculative: bool, history: bool = False,
                   attended: int | None = None, turns: bool = False) -> ChunkStep:
        """`run_chunk`'s device loop for a state of that layout, as a callable (params,
        drafter_params, state, key, refill_wanted, floor, sp) -> (state, steps, active,
        kept), the state donated; its `lower` takes jax.ShapeDtypeStructs (memory planning)."""
        return ChunkStep(self, self.spec(speculative, history, turns), strategy, attended)

    def spec_draft(self, state, key, strategy: spec_lib.Strategy, sp, attended: int | None = None):
        """The draft phase alone (timed apart from verification): (state, DraftTree)."""
        spec = self.spec_of(state)
        return self._call("draft", spec, (strategy, attended, sp), state, key)

    def spec_verify(self, state, tree, key, sp, attended: int | None = None):
        """The verify-and-commit phase alone: (state, tokens committed per slot)."""
        spec = self.spec_of(state)
        return self._call("verify", spec, (attended, sp), state, tree, key)

    def _call(self, name: str, spec: steps.StepSpec, static: tuple, state, *host):
        """`Programs`' step `name` on this group's weights, `state` and `host` arguments, then
        the static ones (spec first); its first call at a signature in turn with the other
        groups' (`FirstCalls`)."""
        fn = functools.partial(getattr(self.programs(spec), name), self.params, self.drafter_params, state, *host,
                               spec, *static)
        return self.engine.first_calls.call(fn, (name, spec, static, self.drafter_params is None), (state, host))

    @staticmethod
    def warm_step(strategy, sp, attended: int, time_spec_phases: bool, turns: bool) -> tuple:
        """What names one program a chunk runs, in `warm_steps`."""
        return (time_spec_phases and strategy is not None, strategy, sp, attended) + (("turns",) if turns else ())

    def warm_up(self, sp: sampling.SamplingParams, strategies, speculative: bool, history_width: int,
                turns: bool, buckets: tuple[int, ...] | None = None) -> None:
        """Compiles and runs once, for every kv bucket (or those of `buckets`), the chunk of
        each of `strategies` (None: plain decode) on live slots of no request. A chunk's loop
        body must run, not only compile: XLA:CPU finishes a program on its first run, which
        would otherwise land in a rollout and in the tuner's rewards (docs/benchmarks.md,
        "Rollout engine: figures behind its rules")."""
        rc = self.engine.rollout_config
        key = jax.random.PRNGKey(0)
        for strategy in strategies:
            for attended in buckets or rc.kv_buckets:
                state = self.empty_state(sp, speculative, history_width, live=True, turns=turns)
                if strategy is not None and rc.time_spec_phases:
                    state, tree = self.spec_draft(state, key, strategy, sp, attended)
                    state, _ = self.spec_verify(state, tree, key, sp, attended)
                else:
                    state = self.run_chunk(state, key, False, strategy, sp, 0, attended)[0]
                jax.block_until_ready(state)  # one state at a time in memory
                self.warm_steps.add(self.warm_step(strategy, sp, attended, rc.time_spec_phases, turns))

    def warm_in_background(self, sp: sampling.SamplingParams, strategy: spec_lib.Strategy, attended: int,
                           history_width: int, turns: bool) -> bool:
        """Whether the chunk of `strategy` at kv bucket `attended` is warm. If not, its
        warm-up (`warm_up`, on speculative slots) starts on a thread of its own, once, and
        this says False until it has run; a warm-up that failed raises its error here."""
        step = self.warm_step(strategy, sp, attended, self.engine.rollout_config.time_spec_phases, turns)
        if step in self.warm_steps:
            return True
        with self._programs_lock:
            if step not in self._warming:
                self._warming[step] = background.start(
                    lambda: self.warm_up(sp, [strategy], True, history_width, turns, (attended,)), "strategy_warm_up",
                    one_device=self.mesh.devices.size == 1)
        future = self._warming[step]
        if future.done():
            future.result()
        return step in self.warm_steps

    def rows(self, arrays, slots):
        """Those slots' rows of each of `arrays` ([B, ...] device arrays), on the host."""
        index = np.asarray(slots + [slots[0]] * (shape_bucket(len(slots), self.engine.rollout_config.num_slots)
                                                 - len(slots)))
        return jax.device_get(_gather_rows(arrays, index))

    def harvest(self, state, slots, slot_request, results, on_sample_done=None):
        """Records the finished samples in `slots` and frees them."""
        toks, logps, counts, finish = self.rows((state.out_tokens, state.out_logp, state.num_generated,
                                                 state.finish), slots)
        for i, s in enumerate(slots):
            n = int(counts[i])
            self.finish(slot_request, s, results, on_sample_done, toks[i, :n].copy(), logps[i, :n].copy(),
                        FINISH_REASONS[int(finish[i])])

    def finish(self, slot_request, slot, results, on_sample_done, tokens, logp, reason, observed=None):
        """Records a finished sample (observed: its observation-token mask, multi-turn only)
        and frees its slot."""
        request = slot_request[slot]
        results[request] = (tokens, logp, reason, self.index, observed)
        if on_sample_done is not None:
            on_sample_done(request, tokens)
        slot_request[slot] = -1


@dataclasses.dataclass(frozen=True)
class ChunkStep:
    """A group's chunk program for one layout, strategy and kv bucket (`Group.chunk_step`)."""

    group: Group
    spec: steps.StepSpec
    strategy: spec_lib.Strategy | None
    attended: int | None

    def __call__(self, params, drafter_params, state, key, refill_wanted, floor, sp):
        chunk = functools.partial(self.group.programs(self.spec).chunk, params, drafter_params, state, key,
                                  refill_wanted, floor, self.spec, self.strategy, self.attended, sp)
        return self.group.engine.first_calls.call(
            chunk, ("chunk", self.spec, (self.strategy, self.attended, sp), drafter_params is None),
            (state, (key, refill_wanted, floor)))

    def lower(self, params, drafter_params, state, key, refill_wanted, floor, sp):
        """Lowers the chunk for these arguments (arrays or jax.ShapeDtypeStructs)."""
        return self.group.programs(self.spec).chunk.lower(params, drafter_params, state, key, refill_wanted, floor,
                                                          self.spec, self.strategy, self.attended, sp)


@dataclasses.dataclass(frozen=True)
class Programs:
    """A group's device steps over one state layout (`steps.py`), each jitted with the
    group's shardings in and out and the slot state donated."""

    empty: Callable
    insert: Callable
    observe: Callable
    chunk: Callable
    draft: Callable
    verify: Callable

    @classmethod
    def jitted(cls, group: Group, spec: steps.StepSpec) -> Programs:
        state = group.shardings(spec.speculative, spec.history, spec.turns)
        rep = sharding.replicated(group.mesh)
        weights = (group.param_shardings, group.drafter_shardings, state)

        def jit(fn, n_host, out, n_static=2):  # fn(params, drafter_params, state, *host, *static)
            first = len(weights) + n_host
            return jax.jit(fn, in_shardings=weights + (rep,) * n_host, out_shardings=out,
                           static_argnums=tuple(range(first, first + n_static)), donate_argnums=(2,))

        return cls(
            empty=jax.jit(steps.empty, out_shardings=state,
                          static_argnames=("spec", "max_tokens", "history_width", "live")),
            insert=jit(steps.insert, 9, state), observe=jit(steps.observe, 4, state),
            chunk=jit(steps.chunk, 3, (state, rep, rep, rep), 4), draft=jit(steps.draft_phase, 1, (state, rep), 4),
            verify=jit(steps.verify_phase, 2, (state, rep), 3))


class FirstCalls:
    """The first call of each program, one group of this process at a time. Groups run on
    threads of their own, so two groups that meet a program at once both miss the persistent
    compilation cache and compile it; in turn, the first compiles it (and writes the cache)
    while the others wait, then load it. Keys name a program without its devices (step,
    static arguments, shapes); once a key's first call is past, a call costs a dict lookup.
    `enabled` only with several groups in this process and a persistent cache to load from."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._first: dict = {}  # key -> an event set once its first call is past
        self._lock = threading.Lock()

    def call(self, fn: Callable, program: tuple, args=()):
        """fn(), in turn with the other groups' first calls of the same program: `program`
        names it but for its arguments' shapes, which `args` (no weights) give."""
        if not self.enabled:
            return fn()
        key = (*program, _signature(args))
        passed = self._first.get(key)  # a dict read needs no lock
        if passed is None:
            with self._lock:
                first = key not in self._first
                passed = self._first.setdefault(key, threading.Event())
            if first:
                try:
                    return fn()
                finally:
                    passed.set()
        passed.wait()  # returns at once after the first call
        return fn()


def _signature(args) -> tuple:
    """What a program's arguments (no weights) contribute to its key: tree and leaf shapes."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((getattr(x, "shape", None), getattr(x, "dtype", type(x))) for x in leaves)


@jax.jit
def _gather_rows(arrays, index):
    return jax.tree.map(lambda a: a[index], arrays)
