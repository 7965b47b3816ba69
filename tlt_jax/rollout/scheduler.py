"""A rollout group's host loop: continuous batching over its slots.

    refill free slots with pending requests (prefill, first token sampled)
    run up to `steps_per_sync` decode steps on the device (a while loop that stops early
        when a slot frees up and requests are still pending, so refills are prompt)
    harvest finished slots

Before each chunk the speculation policy (if any) picks a strategy for the number of
active sequences, and hears the chunk's tokens and seconds afterwards; a chunk whose
program runs for the first time (it compiles, or XLA finishes it) is not heard, so the
policy hears steady-state timings only.

Partial rollouts: a request may resume tokens it drew in an earlier call (re-prefilled
after its prompt), and a stop rule may end the loop before every request finished; the
unfinished ones are then recorded with finish reason "" and the tokens drawn so far.
"""
from __future__ import annotations

import collections
import time
from typing import Callable

import jax
import numpy as np

from tlt_jax.rollout import speculative as spec_lib
from tlt_jax.rollout.group import Group
from tlt_jax.rollout.slots import shape_bucket
from tlt_jax.rollout.steps import Resumed
from tlt_jax.rollout.timeline import Chunk, GroupTimeline, SpecChunk
from tlt_jax.rollout.turns import Episodes, Turns


class Scheduler:
    """One `generate` on one group (`run`)."""

    def __init__(self, group: Group, requests, key, sp, timeline: GroupTimeline, results: dict,
                 num_samples: int = 1, speculation=None,
                 on_sample_done: Callable[[int, np.ndarray], None] | None = None, episodes: Episodes | None = None,
                 resumed: dict | None = None, stop: Callable[[set[int]], bool] | None = None):
        """resumed: request id -> (tokens, log-probs) it drew before, which it continues.
        stop(finished request ids): True ends the loop, the rest recorded unfinished."""
        self.group, self.key, self.sp, self.timeline, self.results = group, key, sp, timeline, results
        self.resumed, self.stop, self.finished = resumed or {}, stop, set()
        self.num_samples, self.speculation, self.on_sample_done = num_samples, speculation, on_sample_done
        b = group.engine.rollout_config.num_slots
        self.history = spec_lib.history_store(speculation)
        self.pending = collections.deque(requests)
        self.slot_request = [-1] * b
        self.num_active = 0
        self.active = np.zeros((b,), bool)
        self.lengths = np.zeros((b,), np.int32)  # the cache's, as of the last sync
        self.turns = Turns(group, episodes, b, [rid for rid, _, _ in requests]) if episodes is not None else None
        self.state = group.empty_state(sp, speculation is not None,
                                       self.history.max_tokens if self.history is not None else 0,
                                       turns=episodes is not None)

    def run(self) -> None:
        """Generates every request; fills results[id] and calls on_sample_done(id, tokens)
        for each as it is harvested. With episodes, a sample whose turn ends waits in its
        slot for its environment's step (on a worker thread, while the other slots
        decode), then continues with the observation prefilled."""
        self.timeline.start = time.perf_counter()
        try:
            self._loop()
        finally:
            if self.turns is not None:
                self.turns.close()
        self.timeline.end = time.perf_counter()

    def _loop(self) -> None:
        turns, b = self.turns, len(self.slot_request)
        while True:
            if turns is not None and turns.waiting:
                block = self.num_active == 0 and not (self.pending and -1 in self.slot_request)
                self.state, changed = turns.resume(self.state, self.slot_request, self.results, self.key, self.sp,
                                                   self.on_sample_done, block=block)
                if changed:
                    self._sync()
            free = [s for s in range(b) if self.slot_request[s] < 0]
            if self.pending and free:
                self._refill(free)
            if all(s < 0 for s in self.slot_request):
                break
            if turns is not None and self.num_active == 0 and turns.waiting and \
                    not turns.ended(self.active, self.slot_request):
                continue  # every sample in a slot waits on its environment
            self._chunk()
            done = [s for s in range(b) if self.slot_request[s] >= 0 and not self.active[s]]
            if turns is not None:
                done = [s for s in done if s not in turns.waiting]
            if done:
                t_harvest = time.perf_counter()
                if turns is not None:
                    turns.turn_ended(self.state, done, self.slot_request, self.results, self.on_sample_done)
                else:
                    self.finished.update(self.slot_request[s] for s in done)
                    self.group.harvest(self.state, done, self.slot_request, self.results, self.on_sample_done)
                self.timeline.harvest_s += time.perf_counter() - t_harvest
                if self.stop is not None and self.stop(self.finished):
                    self._record_unfinished()
                    break

    def _record_unfinished(self) -> None:
        """Records every request not finished (in a slot, or never started) with finish
        reason "" and what it drew so far, and frees the slots."""
        live = [s for s, rid in enumerate(self.slot_request) if rid >= 0]
        if live:
            toks, logps, counts = self.group.rows((self.state.out_tokens, self.state.out_logp,
                                                   self.state.num_generated), live)
            for i, s in enumerate(live):
                n = int(counts[i])
                self.results[self.slot_request[s]] = (toks[i, :n].copy(), logps[i, :n].copy(), "", self.group.index,
                                                      None)
                self.slot_request[s] = -1
        empty = (np.zeros((0,), np.int32), np.zeros((0,), np.float32))
        while self.pending:
            rid = self.pending.popleft()[0]
            tokens, logp = self.resumed.get(rid, empty)
            self.results[rid] = (np.asarray(tokens, np.int32), np.asarray(logp, np.float32), "", self.group.index,
                                 None)

    def _sync(self) -> None:
        self.active, self.lengths = jax.device_get((self.state.active, self.state.cache.lengths))
        self.num_active = int(np.sum(self.active))

    def _refill(self, free: list[int]) -> None:
        """Prefills pending requests into the free slots (some finish at their first token)."""
        b, rc = len(self.slot_request), self.group.engine.rollout_config
        take = [self.pending.popleft() for _ in range(min(len(free), len(self.pending)))]
        r = shape_bucket(max(len(take), rc.min_refill_rows), b)
        distinct = {}  # prompt -> its row: the G samples of a prompt share one prefill
        sources = np.zeros((r,), np.int32)
        prompt_lengths = np.ones((r,), np.int32)
        slots = np.full((r,), b, np.int32)
        ids = np.zeros((r,), np.int32)
        # A resumed request's row holds its prompt then the tokens it drew before.
        rows_of = [list(prompt) + [int(t) for t in self.resumed[rid][0]] if rid in self.resumed else prompt
                   for rid, prompt, _ in take]
        for i, ((rid, _, seed_id), row) in enumerate(zip(take, rows_of)):
            sources[i] = distinct.setdefault(tuple(row), len(distinct))
            prompt_lengths[i], slots[i], ids[i] = len(row), free[i], seed_id
            self.slot_request[free[i]] = rid
        # Resumed rows are prefilled at one width, the cache's: one program per row bucket.
        width = rc.max_length if any(rid in self.resumed for rid, _, _ in take) else rc.max_prompt_length
        prompts = np.zeros((shape_bucket(max(len(distinct), rc.min_refill_rows), r), width), np.int32)
        for prompt, row in distinct.items():
            prompts[row, :len(prompt)] = prompt
        rows = None
        if self.history is not None:
            rows = self.history.rows([prompt for _, prompt, _ in take] + [[]] * (r - len(take)))
        resumed = self._resumed_rows(take, r) if any(rid in self.resumed for rid, _, _ in take) else None
        t_insert = time.perf_counter()
        self.state = self.group.insert(self.state, prompts, prompt_lengths, slots, ids, ids // self.num_samples,
                                       self.key, self.sp, rows, sources, resumed)
        self._sync()
        self.timeline.prefill_s += time.perf_counter() - t_insert

    def _resumed_rows(self, take, r: int) -> Resumed:
        """The tokens and log-probs the requests in `take` drew before (none: a fresh one),
        as `steps.Resumed` rows padded to r."""
        m = self.sp.max_tokens
        generated, tokens, logp = np.zeros((r,), np.int32), np.zeros((r, m), np.int32), np.zeros((r, m), np.float32)
        for i, (rid, _, _) in enumerate(take):
            if rid in self.resumed:
                t, lp = self.resumed[rid]
                generated[i], tokens[i, :len(t)], logp[i, :len(lp)] = len(t), t, lp
        return Resumed(generated, tokens, logp)

    def _chunk(self) -> None:
        """One chunk of decode steps (as the policy picks them), timed and recorded; the
        policy hears it unless its program ran for the first time."""
        group, speculation, rc = self.group, self.speculation, self.group.engine.rollout_config
        strategy = speculation.strategy_for(self.num_active) if speculation is not None else None
        attended = group.kv_bucket_for(self.lengths, self.active, strategy, speculation is not None)
        heard = True
        if strategy is not None and rc.background_compiles and not group.warm_in_background(
                self.sp, strategy, attended, self.history.max_tokens if self.history is not None else 0,
                self.turns is not None):
            # Plain decode while the pick compiles; the policy does not hear it as its pick.
            strategy, heard = None, False
            attended = group.kv_bucket_for(self.lengths, self.active, None, True)
        step = group.warm_step(strategy, self.sp, attended, rc.time_spec_phases, self.turns is not None)
        steady = heard and step in group.warm_steps
        group.warm_steps.add(step)
        t0 = time.perf_counter()
        if strategy is not None and rc.time_spec_phases:
            chunk, tokens = self._phased_chunk(strategy, attended, t0)
        else:
            chunk, tokens = self._loop_chunk(strategy, attended, t0)
        self.timeline.chunks.append(chunk)
        if steady and speculation is not None:
            speculation.observe(strategy, self.num_active, tokens, chunk.end - t0)
        self.num_active = int(np.sum(self.active))

    def _phased_chunk(self, strategy, attended, t0):
        """One speculative step as two device calls, draft and verify timed apart."""
        self.state, tree = self.group.spec_draft(self.state, self.key, strategy, self.sp, attended)
        jax.block_until_ready(tree)
        t1 = time.perf_counter()
        self.state, kept = self.group.spec_verify(self.state, tree, self.key, self.sp, attended)
        self.active, self.lengths, kept = jax.device_get((self.state.active, self.state.cache.lengths, kept))
        t2 = time.perf_counter()
        per_sequence = [int(k) for k in kept if k > 0]
        chunk = SpecChunk(t0, t2, [self.num_active], [sum(per_sequence)], strategy=strategy.name,
                          committed_per_sequence=per_sequence, depth=strategy.depth, draft_s=t1 - t0,
                          verify_s=t2 - t1)
        return chunk, sum(per_sequence)

    def _loop_chunk(self, strategy, attended, t0):
        """Up to a chunk's steps in one device loop (`Group.run_chunk`)."""
        floor = self.speculation.chunk_floor(self.num_active) if self.speculation is not None else 0
        # With environments a chunk also stops where a turn ends, so its step starts at once.
        refill_wanted = bool(self.pending) or self.turns is not None
        self.state, n, active_steps, kept = self.group.run_chunk(self.state, self.key, refill_wanted, strategy,
                                                                 self.sp, floor, attended)
        self.active, self.lengths, n, active_steps, kept = jax.device_get(
            (self.state.active, self.state.cache.lengths, n, active_steps, kept))
        t2 = time.perf_counter()
        kept = kept[:n]
        if strategy is None:
            chunk = Chunk(t0, t2, active_steps[:n].tolist(), kept.sum(1).tolist())
        else:
            chunk = SpecChunk(t0, t2, active_steps[:n].tolist(), kept.sum(1).tolist(), strategy=strategy.name,
                              depth=strategy.depth, committed_per_sequence=kept[kept > 0].tolist())
        return chunk, int(kept.sum())
