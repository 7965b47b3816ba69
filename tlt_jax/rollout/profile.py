"""Where a rollout's seconds go: the parts of a decode chunk, and the ideal speed-up.

A chunk is one jitted device loop (`Group.run_chunk`), so nothing inside it can be timed
from the host. Its parts are measured as marginal costs inside the same kind of loop:
programs that run the chunk's first phases only, for the chunk's number of steps, each one
phase longer than the last, the last being the engine's own chunk. A part is the time its
phase adds to the loop before it, so the parts sum to the chunk's time by construction of
the measurement (telescoping), each measured with everything around it fused as in the
chunk. Speculative steps, in order:

    sync         the call and the host's wait for its results (`device_get`), no step run
    draft        the drafter's forwards: catch-up over the pending entries, then the chain
                 or tree (the n-gram proposer for n-gram strategies)
    verify       the target's forward over the tree (logits and the cache writes)
    accept       lossless acceptance (rejection sampling) and the KV move of the accepted path
    bookkeeping  the rest of the engine's step: outputs and finish codes, the token context,
                 the drafter's features and pending entries (with their overflow catch-up)

and plain steps: sync, forward (the target's forward and sampling), bookkeeping. Between
chunks the host prefills, harvests and asks the policy (`TimedSpeculation` times the last);
`rollout_breakdown` sums a rollout's chunks and gaps from its timeline.

Speculation's ideal speed-up, if nothing but the draft and verify forwards cost anything:
a step commits `acceptance_length` tokens per sequence for draft + verify seconds, where
plain decode commits one per plain forward. Speculation efficiency = measured / ideal.
"""
from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tlt_jax import sampling, sharding
from tlt_jax.rollout import speculative as spec_lib
from tlt_jax.rollout import steps
from tlt_jax.rollout.slots import attending
from tlt_jax.rollout.timeline import GroupTimeline, SpecChunk

SPEC_PARTS = ("sync", "draft", "verify", "accept", "bookkeeping")
PLAIN_PARTS = ("sync", "forward", "bookkeeping")


def ideal_speedup(acceptance_length: float, plain_forward_s: float, draft_s: float, verify_s: float) -> float:
    """Tokens per second of speculative over plain decode if a step cost only its forwards:
    acceptance_length tokens per (draft + verify) seconds against one per plain forward."""
    if min(plain_forward_s, draft_s + verify_s) <= 0:
        raise ValueError(f"Forward costs must be positive: plain {plain_forward_s}, draft {draft_s}, "
                         f"verify {verify_s}.")
    return acceptance_length * plain_forward_s / (draft_s + verify_s)


@dataclasses.dataclass
class ChunkBreakdown:
    """Seconds per chunk of `steps` steps at `batch` slots: `parts` (SPEC_PARTS or
    PLAIN_PARTS, in order) and `wall_s`, the engine's chunk timed alone beside them; the
    fastest of `reps` calls each. `per_step` gives the parts but sync per step."""

    strategy: str  # "" for plain decode
    batch: int
    steps: int
    parts: dict[str, float]
    wall_s: float
    reps: int
    # The chunk when it follows another program (as in a rollout, after a prefill or a
    # harvest) rather than itself: the fastest of such calls.
    after_another_s: float = 0.0
    # The median of the wall calls: a rollout's chunks are single calls, so on a shared
    # machine they are to be set beside the typical call, not the fastest (on a busy machine
    # the two differ by tens of percent).
    wall_median_s: float = 0.0

    @property
    def sum_s(self) -> float:
        return sum(self.parts.values())

    @property
    def per_step(self) -> dict[str, float]:
        return {k: v / max(1, self.steps) for k, v in self.parts.items() if k != "sync"}


def _checksum(*arrays) -> jax.Array:
    """A scalar that depends on every array (so a phase's work is never dropped as dead)."""
    return sum(jnp.sum(a.astype(jnp.float32)) for a in arrays)


def _phases(group, strategy: spec_lib.Strategy | None):
    """One step of each prefix program but the last (the engine's own step):
    [(name, step(params, drafter_params, state, key, sp) -> (state, checksum))]. Each restates
    the start of the engine's step (`steps.one_step`) up to its phase."""

    def forward(params, drafter_params, state, key, sp):
        token, logp, h, cache, layers = steps.plain_forward(group.spec_of(state), params, state, key, sp)
        state = dataclasses.replace(state, cache=cache.with_lengths(state.cache.lengths))
        return state, _checksum(token, logp, h, *layers)

    def draft(params, drafter_params, state, key, sp):
        state, tree = steps.draft(group.spec_of(state), params, drafter_params, state, key, strategy, sp)
        return state, tree

    def verify(params, drafter_params, state, key, sp):
        state, tree = draft(params, drafter_params, state, key, sp)
        logits, h, cache, *layers = steps.tree_forward(group.spec_of(state), params, state, tree)
        return state, tree, logits, h, cache, layers

    def verify_only(params, drafter_params, state, key, sp):
        state, tree, logits, h, cache, layers = verify(params, drafter_params, state, key, sp)
        state = dataclasses.replace(state, cache=cache.with_lengths(state.cache.lengths))
        return state, _checksum(tree.tokens, logits, h, *layers)

    def accept(params, drafter_params, state, key, sp):
        state, tree, logits, h, cache, layers = verify(params, drafter_params, state, key, sp)
        start = state.cache.lengths
        path, num_accepted, tokens, logp, nodes = steps.accepted(group.spec_of(state), state, tree, logits, key, sp)
        keep = jnp.where(state.active, jnp.minimum(num_accepted, tokens.shape[1] - 1), 0)
        committed = spec_lib.commit_path(cache, start, path, keep)
        state = dataclasses.replace(state, cache=committed.with_lengths(start))
        return state, _checksum(tokens, logp, nodes, h, *layers)

    if strategy is None:
        return [("forward", forward)]
    return [("draft", lambda *a: (lambda s, t: (s, _checksum(t.tokens, t.parents)))(*draft(*a))),
            ("verify", verify_only), ("accept", accept)]


def _loop_program(group, step, speculative: bool, attended: int | None):
    """step run `steps` times in one device loop, attention reading `attended` cache slots
    as in the engine's chunk, the state donated: (params, drafter_params, state, key, steps,
    sp) -> (state, checksum)."""
    def fn(params, drafter_params, state, key, steps, sp):
        def body(i, carry):
            state, acc = carry
            state, c = step(params, drafter_params, state, key, sp)
            return state, acc + c

        state, acc = lax.fori_loop(0, steps, body, (attending(state, attended), jnp.float32(0)))
        return attending(state, None), acc

    rep = sharding.replicated(group.mesh)
    shardings = group.shardings(speculative)
    return sharding.jit_sharded(fn, in_shardings=(group.param_shardings, group.drafter_shardings, shardings, rep, rep),
                                out_shardings=(shardings, rep), static_argnums=(5,), donate_argnums=(2,))


def _sync_program(group, speculative: bool):
    """The chunk's call and wait with no step: the state in and out (donated), a scalar back."""
    rep = sharding.replicated(group.mesh)
    shardings = group.shardings(speculative)
    fn = lambda state, key, steps: (state, steps.astype(jnp.float32))
    return sharding.jit_sharded(fn, in_shardings=(shardings, rep, rep), out_shardings=(shardings, rep),
                                donate_argnums=(0,))


def _copy(state):
    out = jax.tree.map(jnp.copy, state)
    jax.block_until_ready(out)
    return out


def filled_state(group, prompts, key, sp: sampling.SamplingParams, speculative: bool = True):
    """`group`'s slots filled with the first num_slots prompts (one sample each, request ids
    from 0) and prefilled: a state to profile chunks from."""
    rc = group.engine.rollout_config
    b, p = rc.num_slots, rc.max_prompt_length
    take = list(prompts[:b])
    if len(take) < b:
        raise ValueError(f"{len(take)} prompts fill fewer than the {b} slots.")
    tokens = np.zeros((b, p), np.int32)
    for i, prompt in enumerate(take):
        tokens[i, :len(prompt)] = prompt
    ids = np.arange(b, dtype=np.int32)
    lengths = np.asarray([len(t) for t in take], np.int32)
    state = group.insert(group.empty_state(sp, speculative), tokens, lengths, ids, ids, ids, key, sp)
    jax.block_until_ready(state)
    return state


def chunk_breakdown(group, state, key, strategy: spec_lib.Strategy | None, sp: sampling.SamplingParams,
                    reps: int = 5, min_seconds: float = 1.0) -> ChunkBreakdown:
    """The parts of the chunk the engine runs from `state` (a slot state of `group`, not
    consumed; speculative for a strategy, plain decode for None), and its wall time as the
    host loop measures it (`run_chunk`, then the `device_get` of its results). The engine's
    chunk is called once first (it compiles; its step count, deterministic for a state and
    key, is the prefixes' step count); then every program compiles by one untimed call, and
    rounds time each program and the host loop's chunk in turn (at least `reps` calls each,
    and `min_seconds` of chunks); each program's time is its fastest call (on a shared
    machine identical calls differ only by what else runs). The last
    part is the engine's chunk less the longest prefix, so the parts sum to the chunk's time
    in those calls; `wall_s` is the same chunk timed in calls of its own, in the same rounds:
    how far the sum is from it is the measurement's noise."""
    speculative = state.spec is not None
    if strategy is not None and not speculative:
        raise ValueError("A speculative chunk needs a speculative slot state (empty_state(..., speculative=True)).")
    lengths, active = jax.device_get((state.cache.lengths, state.active))
    attended = group.kv_bucket_for(lengths, active, strategy, speculative)
    out = group.run_chunk(_copy(state), key, False, strategy, sp, 0, attended)
    steps = int(jax.device_get(out[1]))
    sync = _sync_program(group, speculative)
    loops = [(name, _loop_program(group, step, speculative, attended)) for name, step in _phases(group, strategy)]

    def call(name, program):
        s = _copy(state)
        t0 = time.perf_counter()
        if name == "sync":
            jax.device_get(program(s, key, jnp.int32(steps))[1])
        elif name in ("chunk", "wall"):  # as the host loop calls and waits for it
            new, n, active, kept = group.run_chunk(s, key, False, strategy, sp, 0, attended)
            jax.device_get((new.active, n, active, kept))
        else:
            jax.device_get(program(group.params, group.drafter_params, s, key, jnp.int32(steps), sp)[1])
        return time.perf_counter() - t0

    programs = [("sync", sync), *loops, ("chunk", None), ("wall", None)]
    for name, program in programs:
        call(name, program)  # compiles
    # Each program runs as the host loop runs a chunk, after itself: per round, a call that
    # follows another program (slower: switching programs costs the CPU runtime a little) and
    # then `burst` timed calls; the chunk's calls for the sum and for the wall alternate in
    # one burst, so that both see the same machine. At least min_seconds of the chunk's work
    # per program; rounds in alternate order (ABBA).
    burst = 4
    rounds = max(1, math.ceil(max(reps, min_seconds / max(call("wall", None), 1e-6)) / burst))
    times = {name: [] for name, _ in programs}
    after_another = []  # the chunk's first call of a burst: it follows another program
    bursts = [[p] for p in programs[:-2]] + [programs[-2:]]
    for r in range(rounds):
        for together in (bursts if r % 2 == 0 else bursts[::-1]):
            first = call(*together[0])
            if together[0][0] == "chunk":
                after_another.append(first)
            for _ in range(burst):
                for name, program in together:
                    times[name].append(call(name, program))
    cumulative = [min(times[name]) for name, _ in programs[:-1]]
    names = SPEC_PARTS if strategy is not None else PLAIN_PARTS
    parts = {names[0]: cumulative[0]}
    parts.update({name: cumulative[i] - cumulative[i - 1] for i, name in enumerate(names[1:], 1)})
    return ChunkBreakdown(strategy.name if strategy is not None else "", group.engine.rollout_config.num_slots, steps,
                          parts, min(times["wall"]), len(times["wall"]), min(after_another),
                          float(np.median(times["wall"])))


class TimedSpeculation:
    """A speculation policy that also sums the host seconds spent in its calls (the tuner's
    overhead between chunks)."""

    def __init__(self, inner):
        self.inner, self.seconds, self.calls = inner, 0.0, 0
        self.strategies = inner.strategies

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1

    def strategy_for(self, num_active):
        return self._timed(self.inner.strategy_for, num_active)

    def chunk_floor(self, num_active):
        return self._timed(self.inner.chunk_floor, num_active)

    def observe(self, strategy, num_active, tokens, seconds):
        return self._timed(self.inner.observe, strategy, num_active, tokens, seconds)


def rollout_breakdown(group: GroupTimeline, per_step: dict[str, dict[str, float]], sync_s: dict[str, float],
                      tuner_s: float = 0.0) -> dict:
    """A rollout's seconds by part, from its chunks (their steps, per strategy) and the
    per-step costs measured for each (`per_step[strategy]`, "" plain; `sync_s[strategy]`
    per chunk), beside what its timeline measured: `chunks_s` (the chunks' wall, summed),
    `between_s` (the host between chunks: prefill, harvest, the policy), `wall_s`.
    `parts` are "<plain|spec> <part>" seconds, "tuner", and "between chunks, not the tuner"."""
    parts: dict[str, float] = {}
    for chunk in group.chunks:
        name = chunk.strategy if isinstance(chunk, SpecChunk) else ""
        kind = "spec" if name else "plain"
        steps = len(chunk.active_per_step)
        parts[f"{kind} sync"] = parts.get(f"{kind} sync", 0.0) + sync_s[name]
        for part, seconds in per_step[name].items():
            parts[f"{kind} {part}"] = parts.get(f"{kind} {part}", 0.0) + steps * seconds
    wall = group.end - group.start
    between = sum(group.between_s().values())
    parts["tuner"] = tuner_s
    parts["between chunks, not the tuner"] = between - tuner_s
    return dict(parts=parts, sum_s=sum(parts.values()), chunks_s=group.chunks_s, between_s=between, wall_s=wall,
                chunks=len(group.chunks))
