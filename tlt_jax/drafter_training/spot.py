"""Spot training: drafter optimizer steps spliced into the idle gaps of an RL step.

A host-side scheduler that knows nothing about models. It calls a user-supplied
`step_fn(placement)` that runs ONE drafter optimizer step on the devices named by
`placement` (a rollout group index, or `ALL` when every device waits on the host) and
blocks until the step is done on the device.

Event protocol. A gap is a stretch of time in which some devices would otherwise idle;
whoever knows it starts and ends raises the events, nothing polls:

- the rollout engine's `on_group_done(g)` opens gap `group{g}` with placement `g` (that
  group finished its share while others still decode); the RL loop closes every group's
  gap when the rollout ends (closing a gap that never opened is a no-op);
- the RL loop wraps reward scoring, batch building, checkpoint writes and evaluation in
  `with spot.gap(name, ALL):` (all devices wait on the host);
- after the learner, `catch_up()` runs the steps still owed by `catch_up_steps` (not
  hidden: they lengthen the RL step) while their seconds stay within `catch_up_max_share`
  of the run's, and `end_rl_step()` reports the split.

Only one drafter step runs at a time: there is one drafter, and its state is shared. With
several gaps open, steps go to the most recently opened one still open. A step starts
only while its gap is open, the RL step's budget is not spent and `has_data()` holds;
after every step the gap is checked again, so `close_gap` waits for at most one step (the
preemption delay, reported). The decision to start a step is taken under a lock that
`close_gap` also takes, so a close always wins against a step about to start.

Why asyncio on the host: the dispatcher only waits (for events, or for the step it
started, which runs in a one-thread executor so the loop stays responsive). An event loop
on one background thread does that with no polling and no thread per gap, and callbacks
from the rollout engine's group threads reach it through `call_soon_threadsafe`.

Unlike the reference (DESIGN.md section 7), whose coordinator ends the window early and
never advances its RL-step counter so online training barely runs, every step here is
counted per RL step (hidden in gaps vs. catch-up), together with the preemption delays,
and a failing step is raised in the RL thread instead of stopping training silently.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import statistics
import threading
import time
from typing import Callable, Hashable

ALL = "all"  # placement of a gap in which every device waits (host phases) and of catch-up steps


class SpotStepFailed(RuntimeError):
    """A drafter step raised; the original exception is the cause. Spot training has stopped."""


@dataclasses.dataclass(frozen=True)
class SpotConfig:
    max_steps_per_rl_step: int = 50  # budget of drafter steps per RL step (gaps + catch-up)
    catch_up_steps: int = 0  # run after the learner when the gaps gave fewer than this many
    # The most of the run's wall time (since this process's first RL step) that catch-up
    # steps may take: one runs only if the catch-up seconds so far plus a step's (the median
    # of recent ones) stay within this share. Where no device is ever idle (one rollout
    # group) catch-up is all the drafter gets, and this caps what it adds to every step.
    catch_up_max_share: float = 1.0
    # Start no step in a gap that, by its last duration under the same name, has less time
    # left than a drafter step takes: such a step would delay the phase after the gap.
    skip_short_gaps: bool = False

    def __post_init__(self):
        for name in ("max_steps_per_rl_step", "catch_up_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"tlt.spot.{name} must be a non-negative integer, got {value!r}.")
        if self.catch_up_steps > self.max_steps_per_rl_step:
            raise ValueError(
                f"tlt.spot.catch_up_steps={self.catch_up_steps} exceeds tlt.spot.max_steps_per_rl_step="
                f"{self.max_steps_per_rl_step} (the budget covers catch-up steps too); lower catch_up_steps or "
                "raise max_steps_per_rl_step.")
        share = self.catch_up_max_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ValueError(f"tlt.spot.catch_up_max_share must be a number in [0, 1] (a share of the run's "
                             f"wall time), got {share!r}.")


@dataclasses.dataclass
class _Gap:
    placement: Hashable
    opened_at: float


@dataclasses.dataclass
class _Step:
    gap: str | None  # None: a catch-up step
    placement: Hashable
    started: bool = False  # set under the lock right before step_fn is called
    cancelled: bool = False  # its gap closed before it started: it never will


@dataclasses.dataclass
class _RLStepStats:
    steps: int = 0
    catch_up_steps: int = 0
    catch_up_capped: int = 0  # owed steps that catch_up_max_share did not allow
    skipped: int = 0
    hidden_time_s: float = 0.0
    catch_up_time_s: float = 0.0
    gap_time_s: float = 0.0
    delays: list = dataclasses.field(default_factory=list)
    last_metrics: dict = dataclasses.field(default_factory=dict)


class SpotTrainer:
    """Dispatches `step_fn` into open gaps from an asyncio loop on a background thread.

    `open_gap`, `close_gap` and `notify_data` may be called from any thread; `catch_up`,
    `begin_rl_step` and `end_rl_step` from the RL loop's thread. Use as a context manager
    or call `start()` / `close()`.
    """

    def __init__(self, step_fn: Callable[[Hashable], dict], config: SpotConfig, *,
                 has_data: Callable[[], bool] = lambda: True, clock: Callable[[], float] = time.perf_counter):
        self.step_fn, self.config, self.has_data, self.clock = step_fn, config, has_data, clock
        self._cond = threading.Condition()  # guards everything below; notified when a step leaves the slot
        self._gaps: dict[str, _Gap] = {}  # open gaps, in the order they opened
        self._running: _Step | None = None  # the one step slot
        self._catching_up = False
        self._error: BaseException | None = None
        self._stats = _RLStepStats()
        self._gap_seconds: dict[str, float] = {}  # the last duration of each gap name
        self._step_seconds: collections.deque = collections.deque(maxlen=20)  # recent drafter steps
        self._rl_step = -1
        self._run_started_at: float | None = None  # this process's first begin_rl_step
        self._catch_up_seconds = 0.0  # since then
        self._totals = dict(steps=0, hidden_steps=0, catch_up_steps=0, skipped=0, rl_steps=0)
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    # Lifecycle.

    def start(self) -> "SpotTrainer":
        if self._thread is not None:
            raise RuntimeError("SpotTrainer already started.")
        self._stopping = False
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spot-step")
        ready = threading.Event()
        # Daemon: a run that forgets close() must still be able to exit.
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="spot-loop", daemon=True)
        self._thread.start()
        ready.wait()
        self._notify()  # gaps opened before start
        return self

    def close(self) -> None:
        """Stops dispatching and waits for the step in flight, if any."""
        if self._thread is None:
            return
        with self._cond:
            self._stopping = True
        self._notify()
        self._thread.join()
        self._executor.shutdown(wait=True)
        self._thread = self._executor = self._loop = self._wake = None

    def __enter__(self) -> "SpotTrainer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # Events.

    def begin_rl_step(self, rl_step: int) -> None:
        """Names the RL step that failures are reported against. The budget and stats run
        from one `end_rl_step` to the next, so steps in gaps between two RL steps (e.g.
        checkpoint writes) count towards the next report."""
        with self._cond:
            self._rl_step = rl_step
            if self._run_started_at is None:
                self._run_started_at = self.clock()

    def open_gap(self, name: str, placement: Hashable) -> None:
        """Devices `placement` are idle from now until `close_gap(name)`; returns at once."""
        with self._cond:
            if name in self._gaps:
                raise ValueError(f"Spot gap {name!r} is already open; close it before opening it again.")
            self._gaps[name] = _Gap(placement, self.clock())
        self._notify()

    def close_gap(self, name: str) -> float:
        """Returns once no drafter step runs in gap `name` any more: the seconds waited for
        the step in flight (the preemption delay), 0.0 if none was running. Closing a gap
        that is not open does nothing. Raises SpotStepFailed if a step has failed."""
        t0 = self.clock()
        delay = 0.0
        with self._cond:
            gap = self._gaps.pop(name, None)
            if gap is not None:
                step = self._running
                if step is not None and step.gap == name:
                    if step.started:
                        while self._running is step:
                            self._cond.wait()
                        delay = self.clock() - t0
                    else:  # claimed but not yet in step_fn: it must not start now
                        step.cancelled = True
                closed_at = self.clock()
                self._stats.gap_time_s += closed_at - gap.opened_at
                self._gap_seconds[name] = t0 - gap.opened_at  # until the close was asked: no wait in it
                self._stats.delays.append(delay)
        # No wake-up needed: the dispatcher re-claims (for another open gap) as the slot frees.
        self._raise_if_failed()
        return delay

    @contextlib.contextmanager
    def gap(self, name: str, placement: Hashable = ALL):
        """Open on enter, closed on exit (the delay is recorded in the RL step's stats)."""
        self.open_gap(name, placement)
        try:
            yield
        except BaseException:
            with contextlib.suppress(SpotStepFailed):  # the body's own error comes first
                self.close_gap(name)
            raise
        self.close_gap(name)

    def notify_data(self) -> None:
        """Tells the scheduler `has_data()` may have turned true (e.g. the buffer was filled
        while a gap was already open); nothing polls it."""
        self._notify()

    # Synchronous parts of the RL step.

    def catch_up(self) -> int:
        """Runs, on ALL devices in this thread, the steps still owed by `catch_up_steps` for
        this RL step, within its budget; returns how many ran. Their time is not hidden."""
        self._raise_if_failed()
        with self._cond:
            self._catching_up = True  # no gap step may start while catch-up runs
            while self._running is not None:
                self._cond.wait()
        ran = 0
        try:
            while True:
                with self._cond:
                    # Within the budget too: SpotConfig checks catch_up_steps <= max_steps_per_rl_step.
                    owed = self.config.catch_up_steps - self._stats.steps - self._stats.catch_up_steps
                    if owed <= 0 or self._error is not None:
                        break
                    if not self._catch_up_within_share():
                        self._stats.catch_up_capped += owed
                        break
                    step = self._running = _Step(None, ALL, started=True)
                if not self.has_data():
                    with self._cond:
                        self._running = None
                    break
                self._run(step)
                ran += 1
        finally:
            with self._cond:
                self._catching_up = False
            self._notify()
        self._raise_if_failed()
        return ran

    def end_rl_step(self) -> dict:
        """Stats since the previous report (times in seconds of `clock`): gaps, gap_time_s
        and the preemption delays cover the gaps closed since; `last_*` are the metrics of
        the latest step. Then a fresh budget. Raises SpotStepFailed if a step has failed."""
        self._raise_if_failed()
        with self._cond:
            s = self._stats
            self._totals["rl_steps"] += 1
            out = {
                "steps": s.steps, "catch_up_steps": s.catch_up_steps, "catch_up_capped": s.catch_up_capped,
                "skipped": s.skipped,
                "step_time_s": s.hidden_time_s + s.catch_up_time_s, "hidden_time_s": s.hidden_time_s,
                "catch_up_time_s": s.catch_up_time_s, "gap_time_s": s.gap_time_s,
                "hidden_share": (s.hidden_time_s / (s.hidden_time_s + s.catch_up_time_s)
                                 if s.hidden_time_s + s.catch_up_time_s > 0 else 1.0),
                "preemption_delay_p50_s": statistics.median(s.delays) if s.delays else 0.0,
                "preemption_delay_max_s": max(s.delays, default=0.0),
                "gaps": len(s.delays),
            }
            out.update({f"last_{k}": v for k, v in s.last_metrics.items()})
            self._stats = _RLStepStats()
        self._notify()  # a spent budget is available again
        return out

    def state_dict(self) -> dict:
        with self._cond:
            return dict(self._totals, rl_step=self._rl_step)

    def load_state_dict(self, d: dict) -> None:
        expected = set(self._totals) | {"rl_step"}
        if set(d) != expected:
            raise ValueError(f"Spot trainer state has keys {sorted(d)}, expected {sorted(expected)}.")
        with self._cond:
            self._totals = {k: int(d[k]) for k in self._totals}
            self._rl_step = int(d["rl_step"])

    # Internals.

    def _notify(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has just closed
                loop.call_soon_threadsafe(wake.set)

    def _serve(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()

        async def main():
            self._wake = asyncio.Event()
            self._loop = loop
            ready.set()
            await self._dispatch()

        try:
            loop.run_until_complete(main())
        finally:
            loop.close()

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()  # before claiming, so an event raised meanwhile is not lost
            if self._stopping:
                return
            while (step := self._claim()) is not None:
                await loop.run_in_executor(self._executor, self._run_claimed, step)

    def _may_dispatch(self) -> bool:
        s = self._stats
        return (not self._stopping and self._error is None and not self._catching_up and self._running is None
                and bool(self._gaps) and s.steps + s.catch_up_steps < self.config.max_steps_per_rl_step
                and self._long_enough(next(reversed(self._gaps))))

    def _long_enough(self, name: str) -> bool:
        """Whether gap `name` is expected to outlast one more drafter step (always, until
        both its duration and a step's have been seen)."""
        if not self.config.skip_short_gaps or name not in self._gap_seconds or not self._step_seconds:
            return True
        left = self._gap_seconds[name] - (self.clock() - self._gaps[name].opened_at)
        return left >= statistics.median(self._step_seconds)

    def _catch_up_within_share(self) -> bool:
        """Whether one more catch-up step keeps the run's catch-up seconds within
        `catch_up_max_share` of its wall time (with a share above 0: always, until both a
        step's time and the run's start have been seen)."""
        share = self.config.catch_up_max_share
        if share >= 1.0:
            return True
        if share <= 0.0:
            return False
        if not self._step_seconds or self._run_started_at is None:
            return True
        wall = self.clock() - self._run_started_at
        return self._catch_up_seconds + statistics.median(self._step_seconds) <= share * wall

    def _claim(self) -> _Step | None:
        """Takes the step slot for the newest open gap, or returns None."""
        with self._cond:
            if not self._may_dispatch():
                return None
        # User code, outside the lock; a gap that closes meanwhile is caught by the re-check.
        if not self.has_data():
            return None
        with self._cond:
            if not self._may_dispatch():
                return None
            name = next(reversed(self._gaps))
            self._running = _Step(name, self._gaps[name].placement)
            return self._running

    def _run_claimed(self, step: _Step) -> None:
        with self._cond:
            if step.cancelled:
                self._running = None
                self._cond.notify_all()
                return
            step.started = True
        self._run(step)

    def _run(self, step: _Step) -> None:
        """Runs a started step, records it and frees the slot (whatever happens)."""
        t0 = self.clock()
        try:
            metrics = dict(self.step_fn(step.placement) or {})
            skipped = bool(metrics.get("skipped", 0))
        except BaseException as e:  # noqa: BLE001 -- re-raised in the RL thread
            with self._cond:
                self._error = e
                self._running = None
                self._cond.notify_all()
            return
        dt = self.clock() - t0
        with self._cond:
            self._step_seconds.append(dt)
            s = self._stats
            if step.gap is None:
                s.catch_up_steps += 1
                s.catch_up_time_s += dt
                self._catch_up_seconds += dt
                self._totals["catch_up_steps"] += 1
            else:
                s.steps += 1
                s.hidden_time_s += dt
                self._totals["hidden_steps"] += 1
            s.skipped += skipped
            s.last_metrics = metrics
            self._totals["steps"] += 1
            self._totals["skipped"] += skipped
            self._running = None
            self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        with self._cond:
            error = self._error
        if error is not None:
            raise SpotStepFailed(f"A drafter step failed at RL step {self._rl_step}: {error!r}; "
                                 "spot training has stopped.") from error
