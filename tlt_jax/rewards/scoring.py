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
import multiprocessing.connection
import queue
import signal
import threading
import time
from typing import Sequence

import numpy as np

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


def _worker_main(connection) -> None:
    """A reward worker process: scores the jobs `connection` brings, one at a time, until
    None (or until the training process is gone)."""
    connection.send("ready")
    while True:
        try:
            job = connection.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            reply = (True, _score_job(job))
        except Exception as error:  # noqa: BLE001 - the waiting side raises it
            reply = (False, error)
        try:
            connection.send(reply)
        except Exception as error:  # noqa: BLE001 - a result or exception that does not pickle
            connection.send((False, RuntimeError(f"a reward worker could not send back {reply[1]!r:.200}: {error!r}")))


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


class _Workers:
    """`count` spawned worker processes, each scoring one job at a time, fed in order of
    submission by one thread of this process per worker.

    A multiprocessing.Pool replaces a worker that dies but loses the job it held, which
    then waits out the batch's deadline (or forever, without one). Here the job's future
    gets `_Died` at once, and a fresh process takes the dead one's place. `terminate` kills
    every worker (a deadline passed); `close` lets them finish what they were given."""

    def __init__(self, count: int):
        # Spawned, not forked: forking a process that runs JAX threads can deadlock.
        self._context = multiprocessing.get_context("spawn")
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: set = set()
        self._closing = False
        started = [self._spawn() for _ in range(count)]  # side by side: they start in parallel
        deadline = time.monotonic() + _START_TIMEOUT_S
        workers = [self._await_ready(*w, deadline) for w in started]
        self._threads = [threading.Thread(target=self._serve, args=w, name="reward-worker", daemon=True)
                         for w in workers]
        for thread in self._threads:
            thread.start()

    def submit(self, job) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self._jobs.put((future, job))
        return future

    def _spawn(self):
        parent_end, child_end = self._context.Pipe()
        process = self._context.Process(target=_worker_main, args=(child_end,), name="reward-worker", daemon=True)
        process.start()
        child_end.close()  # so that the worker's death reads as the end of the pipe
        with self._lock:
            self._live.add(process)
            if self._closing:  # terminate ran meanwhile
                process.kill()
        return process, parent_end

    @staticmethod
    def _await_ready(process, connection, deadline: float):
        if connection.poll(max(deadline - time.monotonic(), 0.0)):
            try:
                if connection.recv() == "ready":
                    return process, connection
            except EOFError:  # it died on the way up
                process.join(5.0)
        connection.close()
        if process.exitcode is None:
            process.kill()
            process.join()
            raise RuntimeError(f"A reward worker did not start within {_START_TIMEOUT_S:g} s.")
        raise RuntimeError(f"A reward worker died as it started ({_exit_text(process.exitcode)}).")

    def _start(self):
        return self._await_ready(*self._spawn(), time.monotonic() + _START_TIMEOUT_S)

    @staticmethod
    def _exchange(process, connection, job):
        """The worker's reply to `job`, or None if the worker died first."""
        try:
            connection.send(job)
            # Its sentinel too: a program the reward started may hold the pipe open past its death.
            if connection in multiprocessing.connection.wait([connection, process.sentinel]):
                return connection.recv()
        except (EOFError, OSError):
            pass
        return None

    def _serve(self, process, connection) -> None:
        while (item := self._jobs.get()) is not None and not self._closing:
            future, job = item
            if not future.set_running_or_notify_cancel():
                continue
            if process is None:  # the last replacement failed to start: try again, for this job
                try:
                    process, connection = self._start()
                except RuntimeError as error:
                    future.set_exception(error)
                    continue
            reply = self._exchange(process, connection, job)
            if reply is not None:
                ok, value = reply
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)
                continue
            process.join()
            connection.close()
            with self._lock:
                self._live.discard(process)
            if self._closing:  # terminated: killed, not dead
                return
            future.set_result(_Died.of(job, process.exitcode))
            try:
                process, connection = self._start()
            except RuntimeError as error:
                if self._closing:
                    return
                logger.error("%s The next job tries again.", error)
                process = connection = None
        if process is not None:
            with contextlib.suppress(OSError):
                connection.send(None)
            process.join()
            connection.close()

    def terminate(self) -> None:
        """Kills every worker, and what they hold with them; for a pool no one uses again."""
        with self._lock:
            self._closing = True
            live = list(self._live)
        for process in live:
            process.kill()
        for _ in self._threads:
            self._jobs.put(None)
        for process in live:
            process.join()

    def close(self) -> None:
        """Waits for the jobs given, then for every worker to exit."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()


class _ScoringThread:
    """Daemon threads scoring jobs in this process, in order of submission: submitting
    never blocks the caller (the engine's host loop), and a reward that hangs past a
    deadline is left behind with its thread (a daemon: it keeps no process alive). One
    thread, or a reward's `parallel` (one that waits on subprocesses, as `CodeReward`)."""

    def __init__(self, threads: int = 1):
        self._jobs, self._threads = queue.SimpleQueue(), threads
        for _ in range(threads):
            threading.Thread(target=self._serve, name="reward", daemon=True).start()

    def submit(self, job) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self._jobs.put((future, job))
        return future

    def _serve(self):
        while (item := self._jobs.get()) is not None:
            future, job = item
            if future.set_running_or_notify_cancel():  # cancelled: its batch passed its deadline
                try:
                    future.set_result(_score_job(job))
                except BaseException as error:  # noqa: BLE001 - the waiting side reports it
                    future.set_exception(error)

    def close(self):
        for _ in range(self._threads):
            self._jobs.put(None)


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


class Scorer:
    """Scores batches with one reward: `safe_rewards` in this process (workers=0) or split
    over `workers` spawned processes, within `timeout_s` seconds per batch (0: no deadline).

    What has not finished by the deadline (the batch inline, or a worker's part of it)
    scores 0 and is counted (`BatchScores.timed_out`), and the next batch is scored as usual.
    Worker processes past the deadline are terminated and a fresh pool serves the next
    batch; a pool starts at once and waits for its workers to be up, so the deadline
    counts scoring, not start-up. A worker that dies (killed, or a reward that exits its
    process) is replaced at once: the sample it was scoring scores 0 and is counted
    (`BatchScores.died`, among the failures) and shown in one warning, and the rest of the
    batch does not wait for the deadline. A worker's part of a batch is then scored again
    sample by sample, so that only a sample that kills its worker scores 0. Inline, the
    call is left running on a daemon thread (Python cannot stop a thread), which is enough
    for a reward that waits (on I/O, a lock, a sleep); a reward that can hang while it
    computes, or that can take its process down, belongs in workers.

    `begin` scores a batch sample by sample instead, as its samples come (`PendingBatch`): the
    RL loop hands each sample over as it finishes decoding, so the reward runs while the
    rest decode.

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
        self._pool = _Workers(workers) if workers else None  # replaced after a deadline passes
        self._thread: _ScoringThread | None = None  # PendingBatch's, with workers=0; started at the first

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
        return self._gather([len(job[2]) for job, _ in scored], [result for _, result in scored], len(completions))

    def begin(self) -> PendingBatch:
        """A batch to score sample by sample as its samples come (see `PendingBatch`)."""
        return PendingBatch(self)

    def _gather(self, sizes: list[int], results: list, batch: int) -> BatchScores:
        """The BatchScores of consecutive parts of `sizes` samples each, from their results
        (`_score_job`'s, None for a part not scored by the deadline, or `_Died`)."""
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
                           getattr(self.reward, "__name__", self.reward), timed_out, batch, self.timeout_s)
        died = sum(n for n, _ in deaths)
        if died:
            logger.warning("reward %s: %d worker process(es) died (%s) while scoring %d of %d samples; they score 0, "
                           "and fresh workers took their places. The first: %s",
                           getattr(self.reward, "__name__", self.reward), len(deaths),
                           ", ".join(sorted({_exit_text(d.exitcode) for _, d in deaths})), died, batch,
                           deaths[0][1].sample)
        return BatchScores(np.concatenate(scores), failures, timed_out, failed_sample, seconds, died, forgeable)

    @staticmethod
    def _inline(job, deadline: float | None):
        if deadline is None:
            return _score_job(job)
        out = []
        thread = threading.Thread(target=lambda: out.append(_score_job(job)), name="reward", daemon=True)
        thread.start()
        thread.join(max(deadline - time.monotonic(), 0.0))
        return out[0] if out else None

    def _restart_pool(self) -> None:
        self._pool.terminate()  # the hung workers with it
        self._pool = _Workers(self.workers)

    def _wait(self, jobs, deadline: float | None) -> list:
        """`jobs` scored in workers: each one's result, None for one past the deadline."""
        futures = [self._pool.submit(job) for job in jobs]
        _, pending = concurrent.futures.wait(futures, None if deadline is None else
                                             max(deadline - time.monotonic(), 0.0))
        if pending:
            self._restart_pool()
        return [None if f in pending else f.result() for f in futures]

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

    def _submit(self, job) -> concurrent.futures.Future:
        """Starts scoring `job` in a worker or on the scoring thread; its future result."""
        if not self.workers:
            if self._thread is None:
                fn = get_reward(self.reward) if isinstance(self.reward, str) else self.reward
                self._thread = _ScoringThread(getattr(fn, "parallel", 1))
            return self._thread.submit(job)
        return self._pool.submit(job)

    def _abandon(self, pending: Sequence[concurrent.futures.Future]) -> None:
        """After a deadline passed with `pending` unfinished: the next batch gets fresh
        workers, or a fresh scoring thread (the old one finishes its current sample, if
        ever, and skips the rest)."""
        if self.workers:
            self._restart_pool()
        else:
            for future in pending:
                future.cancel()
            self._thread.close()
            self._thread = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._thread is not None:
            self._thread.close()
            self._thread = None


class PendingBatch:
    """One batch scored sample by sample as its samples come (`Scorer.begin`).

    `submit` hands one sample to a worker process (reward_workers > 0) or to a scoring
    thread of this process and returns at once: the engine calls it between device chunks,
    which a reward run inline there would hold up. `result` waits for every sample and
    gives the batch's `BatchScores`, equal to `Scorer.__call__` on the whole batch, bit for bit,
    for a reward whose score of a sample depends on that sample alone (every reward of
    `REWARDS`): each sample is scored as the batch fallback of `safe_rewards` scores it,
    and failures warn once for the batch. The Scorer's deadline counts from `result`: it
    bounds the wait after the last sample was handed over. Submitting from several
    threads (the engine's rollout groups) is safe.
    """

    def __init__(self, scorer: Scorer):
        self._scorer = scorer
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def __contains__(self, index: int) -> bool:
        return index in self._futures

    def submit(self, index: int, prompt: str, completion: str, fields: dict) -> None:
        """Starts scoring sample `index` of the batch; `fields`: this sample's value of each."""
        with self._lock:
            if index in self._futures:
                raise ValueError(f"Sample {index} was submitted twice; each sample is scored once.")
            job = (self._scorer.reward, [prompt], [completion], {k: [v] for k, v in fields.items()}, False)
            self._futures[index] = self._scorer._submit(job)

    def result(self, batch: int) -> BatchScores:
        """The BatchScores [batch] of samples 0..batch-1, every one of them submitted."""
        missing = sorted(set(range(batch)) - set(self._futures))
        extra = sorted(set(self._futures) - set(range(batch)))
        if missing or extra:
            raise ValueError(f"A batch of {batch} samples, but samples {missing[:8]} were never submitted and "
                             f"{extra[:8]} are not of it.")
        futures = [self._futures[i] for i in range(batch)]
        timeout = self._scorer.timeout_s if self._scorer.timeout_s > 0 else None
        _, pending = concurrent.futures.wait(futures, timeout)
        results = [None if f in pending else f.result() for f in futures]
        if pending:
            self._scorer._abandon(list(pending))
        scores = self._scorer._gather([1] * batch, results, batch)
        failed = [i for i, r in enumerate(results) if isinstance(r, tuple) and r[1]]
        if failed:
            warn_failures(self._scorer.reward, len(failed), batch, scores.failed_sample)
        return scores
