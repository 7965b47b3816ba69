"""The multi-turn driver: a group's samples between turns. A sample whose turn ended waits
in its own slot (inactive, so never counted as running) while its environment steps on a
worker thread, then continues with the observation prefilled (`Group.observe`).

Deadlines: with `Episodes.step_timeout_s`, a step that has not answered by then ends its
sample with the finish reason "env_timeout", and a step that raises or answers neither
token ids nor a finish reason ends it as "env_error" (the episodes hear of either through
their optional `sample_failed(request, error)`, and the first is warned); the rollout goes on.
A thread cannot be killed: the step's thread is abandoned, and the rollout no longer waits for
it. The episodes' optional `close_episode(request)` is called once each episode ends, whatever
ended it, the rollout's own failure included, so that they free what it holds (an
environment's interpreter); one that raises is warned, and no sample is lost to it.
"""
from __future__ import annotations

import concurrent.futures
import time
import warnings
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from tlt_jax.rollout.slots import FINISH_REASONS, shape_bucket

if TYPE_CHECKING:
    from tlt_jax.rollout.group import Group

# The finish reasons of a sample whose environment missed its step deadline, or failed
# otherwise (raised out of Episodes.step, or answered neither token ids nor a reason).
TIMEOUT, ERROR = "env_timeout", "env_error"


class Episodes(Protocol):
    """The environments of a multi-turn `generate`, one episode per request
    (`envs.Episodes` is one; sampling params then carry its stop sequences).

    Optional attributes: `overlap` (default True): whether environments step on worker
    threads while the other slots decode, or on the group's host thread between device
    chunks, decoding stopped meanwhile (False: the serial schedule, to measure what the
    overlap hides). `step_timeout_s` (default 0: none): the seconds a step may take before
    its sample ends as "env_timeout" (worker threads only). `sample_failed(request, error)`:
    told of such a failure, to count it. `close_episode(request)`: called once request's
    episode has ended (recorded, failed, or the rollout stopped), to free what it holds."""

    overlap: bool

    def step(self, request: int, action: np.ndarray, finish_reason: str) -> Sequence[int] | str:
        """Called once request's turn ended (on an end token: "eos"; a stop token or
        sequence: "stop") with the turn's token ids: the observation's token ids to
        prefill before the next turn, or, when the episode ends, the sample's finish
        reason ("" keeps the turn's). On a worker thread unless `overlap` is False."""
        ...


class StepTimeout(TimeoutError):
    """An environment's step did not answer within `Episodes.step_timeout_s`."""


class Turns:
    """A group's samples between turns (module docstring)."""

    def __init__(self, group: Group, episodes: Episodes, num_slots: int, requests: Sequence[int]):
        self.group, self.episodes = group, episodes
        self.overlap = bool(getattr(episodes, "overlap", True))
        self.timeout_s = float(getattr(episodes, "step_timeout_s", 0) or 0)
        if self.timeout_s < 0:
            raise ValueError(f"step_timeout_s={self.timeout_s} must be >= 0 (0: no deadline).")
        self.pool = concurrent.futures.ThreadPoolExecutor(num_slots, thread_name_prefix="env")
        self.waiting: dict[int, concurrent.futures.Future] = {}  # slot -> its environment's step
        self.deadline: dict[int, float] = {}  # slot -> when its step is given up (with a timeout)
        self.observed: dict[int, list[tuple[int, int]]] = {}  # request -> (offset, length) of each observation
        # slot -> (tokens, logp, finish reason, prompt length) as its last turn ended
        self.ended_turn: dict[int, tuple[np.ndarray, np.ndarray, str, int]] = {}
        self.open: set[int] = set(requests)  # requests whose episode has not ended (started or not)
        self._warned_failure = self._warned_close = False

    def close(self) -> None:
        """Ends the driver: closes every episode still open (the rollout failed, or a step
        missed its deadline) and lets the worker threads go without waiting for any
        abandoned step."""
        for request in sorted(self.open):
            self._close_env(request)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def ended(self, active, slot_request) -> bool:
        """Whether a slot holds a sample whose turn ended and is not yet with its environment."""
        return any(r >= 0 and not active[s] and s not in self.waiting for s, r in enumerate(slot_request))

    def turn_ended(self, state, slots, slot_request, results, on_sample_done):
        """Hands each slot's finished turn to its environment, or records the sample when
        it ended for good (its token budget or the cache spent)."""
        toks, logps, counts, finish, turn_start, prompt_lengths = self.group.rows(
            (state.out_tokens, state.out_logp, state.num_generated, state.finish, state.turns.turn_start,
             state.prompt_length), slots)
        for i, s in enumerate(slots):
            n, reason = int(counts[i]), FINISH_REASONS[int(finish[i])]
            if reason in ("eos", "stop"):
                self.ended_turn[s] = (toks[i, :n].copy(), logps[i, :n].copy(), reason, int(prompt_lengths[i]))
                args = (slot_request[s], toks[i, int(turn_start[i]):n].copy(), reason)
                if self.overlap:
                    self.waiting[s] = self.pool.submit(self.episodes.step, *args)
                    if self.timeout_s:
                        self.deadline[s] = time.monotonic() + self.timeout_s
                else:
                    self.waiting[s] = _done(self.episodes.step, *args)
            else:
                self._record(slot_request, s, results, on_sample_done, toks[i, :n].copy(), logps[i, :n].copy(),
                             reason)

    def _record(self, slot_request, slot, results, on_sample_done, tokens, logp, reason):
        request = slot_request[slot]
        observed = np.zeros(len(tokens), bool)
        for offset, length in self.observed.pop(request, []):
            observed[offset:offset + length] = True
        try:
            self.group.finish(slot_request, slot, results, on_sample_done, tokens, logp, reason, observed)
        finally:
            self._close_env(request)

    def _close_env(self, request: int) -> None:
        """Tells the episodes that request's episode is over (their optional
        close_episode), once; a raise is warned."""
        if request not in self.open:
            return
        self.open.discard(request)
        close = getattr(self.episodes, "close_episode", None)
        if close is None:
            return
        try:
            close(request)
        except Exception as e:  # noqa: BLE001 - a failing close loses no sample; it is shown once
            if not self._warned_close:
                self._warned_close = True
                warnings.warn(f"An environment's close() raised ({type(e).__name__}: {e}); its sample is kept "
                              "(shown once).", stacklevel=2)

    def _wait(self, block: bool) -> list[int]:
        """The slots whose step answered or missed its deadline (block: waits for one)."""
        if block:
            timeout = None
            if self.deadline:
                timeout = max(0.0, min(self.deadline.values()) - time.monotonic())
            concurrent.futures.wait(self.waiting.values(), timeout=timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        now = time.monotonic()
        return [s for s, f in self.waiting.items() if f.done() or self.deadline.get(s, np.inf) <= now]

    def _failure(self, request: int, error: Exception, reason: str) -> str:
        """Ends request's episode for a failure of its environment (its step past the
        deadline, raising, or answering neither token ids nor a finish reason): the episodes
        are told (`sample_failed`), the first such failure is warned, and `reason` returned."""
        sample_failed = getattr(self.episodes, "sample_failed", None)
        if sample_failed is not None:
            sample_failed(request, error)
        if not self._warned_failure:
            self._warned_failure = True
            warnings.warn(f"{type(error).__name__}: {error}; that sample ends as {reason!r} and the rollout goes on "
                          "(shown once).", stacklevel=2)
        return reason

    def _answer(self, future, request: int):
        """The step's answer: token ids (int32 [n]) or a finish reason, a failure's included."""
        if not future.done():  # past its deadline: the thread is abandoned
            return self._failure(request, StepTimeout(
                f"the environment's step for request {request} took over {self.timeout_s:g} s (step_timeout_s)"),
                TIMEOUT)
        try:
            answer = future.result()
            if isinstance(answer, str):
                return answer
            ids = np.asarray(answer).reshape(-1)
            if ids.size and not np.issubdtype(ids.dtype, np.integer):
                raise TypeError(f"Episodes.step returned {answer!r:.80}; return the observation's token ids "
                                "(a sequence of int) or, when the episode ends, a finish reason (str)")
            return ids.astype(np.int32)
        except Exception as e:  # noqa: BLE001 - a failing environment ends its own sample alone
            return self._failure(request, e, ERROR)

    def resume(self, state, slot_request, results, key, sp, on_sample_done, block: bool):
        """Takes the environments' answers (block: waits for at least one, or a deadline):
        ended episodes are recorded, the others' observations prefilled into their slots.
        Returns (state, whether the device state changed)."""
        rc = self.group.engine.rollout_config
        going = []
        for slot in self._wait(block):
            future = self.waiting.pop(slot)
            self.deadline.pop(slot, None)
            answer = self._answer(future, slot_request[slot])
            tokens, logp, reason, prompt_length = self.ended_turn.pop(slot)
            generated = len(tokens)
            if isinstance(answer, str):
                self._record(slot_request, slot, results, on_sample_done, tokens, logp, answer or reason)
                continue
            ids = answer
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
