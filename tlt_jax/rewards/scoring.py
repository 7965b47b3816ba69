"""Scoring for the RL loop: `Scorer` runs `safe_rewards` in this process or in worker
processes, under a per-batch deadline: a reward that hangs scores 0 and is counted too,
as does a sample whose worker process dies (replaced at once), and the run goes on.
`Scorer.begin` scores a batch sample by sample as each sample finishes decoding
(`PendingBatch`), so a slow verifier runs while the rest decode.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import multiprocessing
import queue
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Protocol, Sequence

import numpy as np
import pebble

from tlt_jax.rewards.registry import get_reward
from tlt_jax.rewards.safe import FailedSample, checked_rewards, warn_failures
from tlt_jax.rewards.verifiers import RewardFn

logger = logging.getLogger(__name__)


_START_TIMEOUT_S = 300.0  # for a new worker process to be up


def _score_job(job) -> tuple[np.ndarray, int, FailedSample | None, float, int]:
    """`safe_rewards` for (reward name or function, prompts, completions, fields, warn),
    with its first failed sample, the seconds the reward took and how many samples had
    tests only the program's own interpreter could decide (the code reward's
    `reward_info['forgeable']`): what a scoring thread or worker process runs (a worker
    imports only this module, no JAX, and resolves a reward's name itself, module:function too)."""
    reward, prompts, completions, fields, warn = job
    fn = get_reward(reward) if isinstance(reward, str) else reward
    t0 = time.perf_counter()
    scores, failures, first, infos = checked_rewards(fn, prompts, completions, fields, warn)
    forgeable = sum(bool(info and info.get("forgeable")) for info in infos)
    return scores, failures, first, time.perf_counter() - t0, forgeable


def _sample_job(job, i: int):
    """Sample `i` of a job, as a job of its own."""
    reward, prompts, completions, fields, warn = job
    return reward, [prompts[i]], [completions[i]], {k: v[i:i + 1] for k, v in fields.items()}, warn


def _exit_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit status {exitcode}"


@dataclasses.dataclass(frozen=True)
class _Died:
    """A job's result when its worker process died while scoring it."""

    sample: FailedSample  # the job's first sample
    exitcode: int | None

    @classmethod
    def of(cls, job, exitcode: int | None) -> _Died:
        _, prompts, completions, _, _ = job
        return cls(FailedSample(str(prompts[0]), str(completions[0]),
                                f"its reward worker died ({_exit_text(exitcode)})"), exitcode)


def _outcome(job, future: concurrent.futures.Future):
    """What a job came to: `_score_job`'s result, `_Died` where its worker died, None where
    it did not finish in time (still running, cancelled, or past its task timeout)."""
    if not future.done() or future.cancelled():
        return None
    error = future.exception()
    if error is None:
        return future.result()
    if isinstance(error, pebble.ProcessExpired):
        return _Died.of(job, error.exitcode)
    if isinstance(error, BrokenProcessPool):  # the pool lost every worker
        return _Died.of(job, None)
    if isinstance(error, concurrent.futures.TimeoutError):
        return None
    raise error


class _Backend(Protocol):
    """Where jobs are scored: worker processes (`_Workers`) or threads of this process (`_Threads`)."""

    def submit(self, job, timeout: float | None = None) -> concurrent.futures.Future: ...

    def abandon(self, pending: Sequence[concurrent.futures.Future]) -> None: ...

    def close(self) -> None: ...


def _count_start(started) -> None:
    """Each worker's initializer, once this module is imported there: counts it as up."""
    with started.get_lock():
        started.value += 1


class _Workers:
    """`count` spawned worker processes of a pebble ProcessPool, each scoring one job at a
    time. A job whose worker dies gets `_Died` at once (pebble's ProcessExpired) and pebble
    starts a fresh worker in its place; a job past its task timeout has its worker killed
    and replaced. A pool starts at once and waits for its workers to be up, so a deadline
    counts scoring, not start-up; after a deadline passed (`abandon`) a fresh pool, up
    before the next batch, takes the next jobs."""

    def __init__(self, count: int):
        self._count = count
        self._pool = self._start()

    def _start(self) -> pebble.ProcessPool:
        # Spawned, not forked: forking a process that runs JAX threads can deadlock.
        context = multiprocessing.get_context("spawn")
        started = context.Value("i", 0)
        pool = pebble.ProcessPool(self._count, initializer=_count_start, initargs=(started,), context=context)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while started.value < self._count:
            if not pool.active:  # asking starts the pool; a worker that dies on the way up breaks it
                pool.stop()
                raise RuntimeError("A reward worker died as it started; see its error above.")
            if time.monotonic() > deadline:
                pool.stop()
                raise RuntimeError(f"A reward worker did not start within {_START_TIMEOUT_S:g} s.")
            time.sleep(0.01)
        return pool

    @property
    def broken(self) -> bool:
        """Whether the pool takes no more jobs (it lost every worker at once)."""
        return not self._pool.active

    def submit(self, job, timeout: float | None = None) -> concurrent.futures.Future:
        return self._pool.schedule(_score_job, (job,), timeout=timeout)

    def abandon(self, pending: Sequence[concurrent.futures.Future]) -> None:
        """Jobs past their batch's deadline: every worker is killed, the hung ones with
        them, and a fresh pool takes the next jobs."""
        self._pool.stop()
        self._pool.join()
        self._pool = self._start()

    def close(self) -> None:
        """Waits for the jobs given, then for every worker to exit (a broken pool: at once)."""
        if self.broken:
            self._pool.stop()
        else:
            self._pool.close()
        self._pool.join()


class _Threads:
    """Daemon threads scoring jobs in this process, in order of submission: submitting
    never blocks the caller (the engine's host loop), and a reward that hangs past a
    deadline is left behind with its thread (a daemon: it keeps no process alive). One
    thread, or a reward's `parallel` (one that waits on subprocesses, as `CodeReward`)."""

    def __init__(self, threads: int = 1):
        self._threads = threads
        self._jobs: queue.SimpleQueue | None = None  # started at the first job, again after `abandon`

    def submit(self, job, timeout: float | None = None) -> concurrent.futures.Future:
        """timeout: unused (a thread cannot be stopped); the waiting side keeps the deadline."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            for _ in range(self._threads):
                threading.Thread(target=self._serve, args=(self._jobs,), name="reward", daemon=True).start()
        future = concurrent.futures.Future()
        self._jobs.put((future, job))
        return future

    @staticmethod
    def _serve(jobs: queue.SimpleQueue):
        while (item := jobs.get()) is not None:
            future, job = item
            if future.set_running_or_notify_cancel():  # cancelled: its batch passed its deadline
                try:
                    future.set_result(_score_job(job))
                except BaseException as error:  # noqa: BLE001 - the waiting side reports it
                    future.set_exception(error)

    def abandon(self, pending: Sequence[concurrent.futures.Future]) -> None:
        """Jobs past their batch's deadline: fresh threads take the next ones; the old ones
        finish their current job, if ever, and skip the rest."""
        for future in pending:
            future.cancel()
        self.close()

    def close(self) -> None:
        if self._jobs is not None:
            for _ in range(self._threads):
                self._jobs.put(None)
            self._jobs = None


@dataclasses.dataclass(frozen=True)
class BatchScores:
    """A batch's rewards as the RL loop gets them from `Scorer`."""

    scores: np.ndarray  # [B] float32; 0 where a sample failed
    failures: int  # samples scored 0: their reward raised, was not finite, not in time, or its worker died
    timed_out: int  # of those, the samples whose scoring passed the batch's deadline
    failed_sample: FailedSample | None = None  # the first whose reward raised or was not finite, to show
    scoring_s: float = 0.0  # seconds the reward ran, summed over its calls (workers run them side by side)
    died: int = 0  # of the failures, the samples whose worker process died while scoring them
    forgeable: int = 0  # samples with tests only the program's own interpreter could decide (code reward)


def _reward_name(reward) -> str:
    return getattr(reward, "__name__", reward)


def _batch_scores(reward, timeout_s: float, sizes: list[int], results: list, batch: int) -> BatchScores:
    """The BatchScores of consecutive parts of `sizes` samples each, from their results
    (`_score_job`'s, None for a part not scored by the deadline, or `_Died`), with one
    warning for the parts past the deadline and one for the dead workers."""
    scores, failed_sample = [np.zeros((0,), np.float32)], None
    failures = timed_out = forgeable = 0
    seconds = 0.0
    deaths: list[tuple[int, _Died]] = []
    for n, result in zip(sizes, results, strict=True):
        if result is None or isinstance(result, _Died):
            scores.append(np.zeros((n,), np.float32))
            failures += n
            if result is None:
                timed_out += n
            else:
                deaths.append((n, result))
        else:
            scores.append(result[0])
            failures += result[1]
            failed_sample = failed_sample or result[2]
            seconds += result[3]
            forgeable += result[4]
    if timed_out:
        logger.warning("reward %s did not score %d of %d samples within reward_timeout_s=%g s; they score 0.",
                       _reward_name(reward), timed_out, batch, timeout_s)
    died = sum(n for n, _ in deaths)
    if died:
        logger.warning("reward %s: %d worker process(es) died (%s) while scoring %d of %d samples; they score 0, "
                       "and fresh workers took their places. The first: %s", _reward_name(reward), len(deaths),
                       ", ".join(sorted({_exit_text(d.exitcode) for _, d in deaths})), died, batch,
                       deaths[0][1].sample)
    return BatchScores(np.concatenate(scores), failures, timed_out, failed_sample, seconds, died, forgeable)


class Scorer:
    """Scores batches with one reward: `safe_rewards` in this process (workers=0) or split
    over `workers` spawned processes, within `timeout_s` seconds per batch (0: no deadline).

    What has not finished by the deadline (the batch inline, or a worker's part of it)
    scores 0 and is counted (`BatchScores.timed_out`), and the next batch is scored as usual.
    A worker past the deadline is killed and a fresh one takes its place; the pool starts
    at once and waits for its workers to be up, so the deadline counts scoring, not
    start-up. A worker that dies (killed, or a reward that exits its process) is replaced
    at once: the sample it was scoring scores 0 and is counted (`BatchScores.died`, among
    the failures) and shown in one warning, and the rest of the batch does not wait for
    the deadline. A worker's part of a batch is then scored again sample by sample, so
    that only a sample that kills its worker scores 0. Inline, the call is left running on
    a daemon thread (Python cannot stop a thread), which is enough for a reward that waits
    (on I/O, a lock, a sleep); a reward that can hang while it computes, or that can take
    its process down, belongs in workers.

    `begin` scores a batch sample by sample instead, as its samples come (`PendingBatch`):
    the RL loop hands each sample over as it finishes decoding, so the reward runs while
    the rest decode.

    reward: a name `get_reward` resolves (of `REWARDS`, or module.path:function), or a
    reward function (with workers: a module-level one, as it is pickled by reference).
    """

    def __init__(self, reward: str | RewardFn, workers: int = 0, timeout_s: float = 0.0):
        if isinstance(reward, str):
            get_reward(reward)  # a bad name fails here, not in a worker at the first batch
        if workers < 0:
            raise ValueError(f"reward_workers={workers} must be >= 0 (0: score in the training process).")
        if not timeout_s >= 0:
            raise ValueError(f"reward_timeout_s={timeout_s} must be >= 0 (0: no deadline).")
        self.reward, self.workers, self.timeout_s = reward, workers, timeout_s
        self._pool = _Workers(workers) if workers else None
        self._threads: _Threads | None = None  # PendingBatch's, with workers=0; started at the first

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], fields: dict) -> BatchScores:
        """Scores [B] for B samples; `fields` are per-sample sequences of length B."""
        deadline = time.monotonic() + self.timeout_s if self.timeout_s > 0 else None
        parts = np.array_split(np.arange(len(completions)), max(self.workers, 1))
        jobs = [(self.reward, [prompts[i] for i in part], [completions[i] for i in part],
                 {k: [v[i] for i in part] for k, v in fields.items()}, True) for part in parts if len(part)]
        if self.workers:
            scored = self._in_workers(jobs, deadline)
        else:
            scored = [(job, self._inline(job, deadline)) for job in jobs]
        return _batch_scores(self.reward, self.timeout_s, [len(job[2]) for job, _ in scored],
                             [result for _, result in scored], len(completions))

    def begin(self) -> PendingBatch:
        """A batch to score sample by sample as its samples come (see `PendingBatch`)."""
        return PendingBatch(self.reward, self.timeout_s, self._backend())

    def _backend(self) -> _Backend:
        """The workers (a fresh pool where the last one broke), or this process's threads."""
        if self.workers:
            if self._pool.broken:
                self._pool.close()
                self._pool = _Workers(self.workers)
            return self._pool
        if self._threads is None:
            fn = get_reward(self.reward) if isinstance(self.reward, str) else self.reward
            self._threads = _Threads(getattr(fn, "parallel", 1))
        return self._threads

    @staticmethod
    def _inline(job, deadline: float | None):
        if deadline is None:
            return _score_job(job)
        out = []
        thread = threading.Thread(target=lambda: out.append(_score_job(job)), name="reward", daemon=True)
        thread.start()
        thread.join(max(deadline - time.monotonic(), 0.0))
        return out[0] if out else None

    def _wait(self, jobs, deadline: float | None) -> list:
        """`jobs` scored in workers, each with the time left as its task timeout: each
        one's result, None for one past the deadline (the pool then replaced)."""
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        pool = self._backend()
        futures = [pool.submit(job, timeout) for job in jobs]
        # A job queued behind others starts late, and its task timeout with it: the batch's deadline still holds.
        _, pending = concurrent.futures.wait(futures, None if deadline is None else
                                             max(deadline - time.monotonic(), 0.0))
        results = [None if f in pending else _outcome(job, f) for job, f in zip(jobs, futures)]
        if any(result is None for result in results):  # past the deadline, whether pebble or the wait saw it first
            pool.abandon([f for f, result in zip(futures, results) if result is None])
        return results

    def _in_workers(self, jobs, deadline: float | None) -> list[tuple]:
        """(job, result) for jobs that together hold `jobs`' samples in order: a job whose
        worker died is scored again sample by sample, as jobs of one sample each, unless the
        deadline passed."""
        results = self._wait(jobs, deadline)
        again = {} if any(r is None for r in results) else {
            i: [_sample_job(job, k) for k in range(len(job[2]))] for i, (job, result) in enumerate(zip(jobs, results))
            if isinstance(result, _Died) and len(job[2]) > 1}
        retried = iter(self._wait([single for singles in again.values() for single in singles], deadline))
        scored = []
        for i, (job, result) in enumerate(zip(jobs, results)):
            scored += [(single, next(retried)) for single in again[i]] if i in again else [(job, result)]
        return scored

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._threads is not None:
            self._threads.close()
            self._threads = None


class PendingBatch:
    """One batch scored sample by sample as its samples come (`Scorer.begin`).

    `submit` hands one sample to a worker process (reward_workers > 0) or to a scoring
    thread of this process and returns at once: the engine calls it between device chunks,
    which a reward run inline there would hold up. `result` waits for every sample and
    gives the batch's `BatchScores`, equal to `Scorer.__call__` on the whole batch, bit for
    bit, for a reward whose score of a sample depends on that sample alone (every reward of
    `REWARDS`): each sample is scored as the batch fallback of `safe_rewards` scores it,
    and failures warn once for the batch. The deadline, timeout_s, counts from `result`:
    it bounds the wait after the last sample was handed over. Submitting from several
    threads (the engine's rollout groups) is safe.
    """

    def __init__(self, reward: str | RewardFn, timeout_s: float, backend: _Backend):
        self._reward, self._timeout_s, self._backend = reward, timeout_s, backend
        self._jobs: dict[int, tuple] = {}
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def __contains__(self, index: int) -> bool:
        return index in self._futures

    def submit(self, index: int, prompt: str, completion: str, fields: dict) -> None:
        """Starts scoring sample `index` of the batch; `fields`: this sample's value of each."""
        with self._lock:
            if index in self._futures:
                raise ValueError(f"Sample {index} was submitted twice; each sample is scored once.")
            job = (self._reward, [prompt], [completion], {k: [v] for k, v in fields.items()}, False)
            self._jobs[index], self._futures[index] = job, self._backend.submit(job)

    def result(self, batch: int) -> BatchScores:
        """The BatchScores [batch] of samples 0..batch-1, every one of them submitted."""
        missing = sorted(set(range(batch)) - set(self._futures))
        extra = sorted(set(self._futures) - set(range(batch)))
        if missing or extra:
            raise ValueError(f"A batch of {batch} samples, but samples {missing[:8]} were never submitted and "
                             f"{extra[:8]} are not of it.")
        futures = [self._futures[i] for i in range(batch)]
        _, pending = concurrent.futures.wait(futures, self._timeout_s if self._timeout_s > 0 else None)
        results = [None if f in pending else _outcome(self._jobs[i], f) for i, f in enumerate(futures)]
        if pending:
            self._backend.abandon(list(pending))
        scores = _batch_scores(self._reward, self._timeout_s, [1] * batch, results, batch)
        failed = [i for i, r in enumerate(results) if isinstance(r, tuple) and r[1]]
        if failed:
            warn_failures(self._reward, len(failed), batch, scores.failed_sample)
        return scores
