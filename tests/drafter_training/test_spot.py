"""Spot trainer: steps only inside open gaps, close_gap preempts within one step, budget,
catch-up, overlapping gaps, errors surfacing in the RL thread, and the same under real
threads (with and without JAX work on simulated device groups).

Scripted tests use a fake clock and fake devices whose steps block until the test lets
them finish, so every interleaving of opens, closes and steps is chosen by the test."""
import json
import queue
import threading
import time

import pytest

from tlt_jax.drafter_training.spot import ALL, SpotConfig, SpotStepFailed, SpotTrainer

QUIET = 0.1  # real seconds a test waits to be sure that no further step starts


class FakeClock:
    def __init__(self):
        self.t, self._lock = 0.0, threading.Lock()

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        with self._lock:
            self.t += dt


class FakeDevices:
    """step_fn: records (placement, start, end) on the fake clock. Gated, a step waits for
    `release()`; ungated, it takes `step_time` of fake time and returns."""

    def __init__(self, clock: FakeClock, gated: bool = True, step_time: float = 1.0, metrics=None):
        self.clock, self.gated, self.step_time = clock, gated, step_time
        self.metrics = metrics or (lambda i: {"loss": float(i)})
        self.records, self.started, self.starts = [], queue.Queue(), 0
        self._gate = threading.Semaphore(0)

    def __call__(self, placement):
        i, start = len(self.records), self.clock()
        self.starts += 1
        self.started.put(placement)
        if self.gated:
            if not self._gate.acquire(timeout=10):
                raise TimeoutError("test never released the step")
        else:
            self.clock.advance(self.step_time)
        self.records.append((placement, start, self.clock()))
        return self.metrics(i)

    def release(self):
        self._gate.release()

    def next_start(self, timeout: float = 5.0):
        return self.started.get(timeout=timeout)

    def assert_starts(self, n: int):
        """Exactly n steps have started, and no more start for a while."""
        time.sleep(QUIET)
        assert self.starts == n


def wait_for(pred, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def close_in_thread(trainer, name):
    """close_gap blocks while a step runs in the gap: call it from another thread."""
    out = {}
    t = threading.Thread(target=lambda: out.update(delay=trainer.close_gap(name)))
    t.start()
    return t, out


def test_config_validation():
    for kwargs, field in [(dict(max_steps_per_rl_step=-1), "max_steps_per_rl_step"),
                          (dict(catch_up_steps=1.5), "catch_up_steps"),
                          (dict(max_steps_per_rl_step=2, catch_up_steps=3), "catch_up_steps"),
                          (dict(catch_up_max_share=1.5), "catch_up_max_share"),
                          (dict(catch_up_max_share=-0.1), "catch_up_max_share")]:
        with pytest.raises(ValueError, match=f"tlt.spot.{field}"):
            SpotConfig(**kwargs)
    SpotConfig(max_steps_per_rl_step=0)


def test_no_gap_trains_nothing():
    clock = FakeClock()
    dev = FakeDevices(clock, gated=False)
    with SpotTrainer(dev, SpotConfig(), clock=clock) as spot:
        spot.begin_rl_step(0)
        dev.assert_starts(0)
        assert spot.close_gap("group0") == 0.0  # never opened: nothing to close
        stats = spot.end_rl_step()
    assert dev.records == []
    assert stats["steps"] == stats["gaps"] == 0 and stats["hidden_share"] == 1.0


def test_close_during_step_waits_for_it_and_nothing_starts_after():
    clock = FakeClock()
    dev = FakeDevices(clock)
    with SpotTrainer(dev, SpotConfig(), clock=clock) as spot:
        spot.begin_rl_step(0)
        spot.open_gap("group0", 0)
        assert dev.next_start() == 0
        clock.advance(1.0)
        closer, out = close_in_thread(spot, "group0")
        closer.join(QUIET)
        assert closer.is_alive(), "close_gap returned while a step still ran in its gap"
        clock.advance(2.0)
        dev.release()
        closer.join(5)
        assert out["delay"] == 2.0  # from the close (t=1) to the step's end (t=3)
        dev.assert_starts(1)
        stats = spot.end_rl_step()
    assert dev.records == [(0, 0.0, 3.0)]
    assert stats["steps"] == 1 and stats["hidden_time_s"] == stats["step_time_s"] == 3.0
    assert stats["gap_time_s"] == 3.0 and stats["gaps"] == 1
    assert stats["preemption_delay_max_s"] == stats["preemption_delay_p50_s"] == 2.0
    assert stats["last_loss"] == 0.0


def test_steps_follow_each_other_until_the_gap_closes():
    clock = FakeClock()
    dev = FakeDevices(clock)
    with SpotTrainer(dev, SpotConfig(), clock=clock) as spot:
        spot.begin_rl_step(0)
        spot.open_gap("reward", ALL)
        for _ in range(3):
            assert dev.next_start() == ALL
            clock.advance(1.0)
            dev.release()
        assert dev.next_start() == ALL  # the fourth is in flight
        closer, out = close_in_thread(spot, "reward")
        dev.release()
        closer.join(5)
        dev.assert_starts(4)
        assert spot.end_rl_step()["steps"] == 4


def test_close_wins_against_a_dispatch_in_progress():
    """The dispatcher has decided to train (has_data() returned) when the gap closes."""
    clock = FakeClock()
    dev = FakeDevices(clock)
    asked, answer = threading.Event(), threading.Event()

    def has_data():
        asked.set()
        return answer.wait(5)

    with SpotTrainer(dev, SpotConfig(), has_data=has_data, clock=clock) as spot:
        spot.begin_rl_step(0)
        spot.open_gap("group1", 1)
        assert asked.wait(5)
        assert spot.close_gap("group1") == 0.0
        answer.set()
        dev.assert_starts(0)
        assert spot.end_rl_step()["steps"] == 0


def test_close_wins_against_a_step_handed_to_the_worker():
    """The step slot is taken, but the worker thread has not called step_fn yet."""
    clock = FakeClock()
    dev = FakeDevices(clock)
    handed, go = threading.Event(), threading.Event()
    with SpotTrainer(dev, SpotConfig(), clock=clock) as spot:
        run_claimed = spot._run_claimed

        def slow_worker(step):
            handed.set()
            go.wait(5)
            run_claimed(step)

        spot._run_claimed = slow_worker
        spot.begin_rl_step(0)
        spot.open_gap("group2", 2)
        assert handed.wait(5)
        assert spot.close_gap("group2") == 0.0
        go.set()
        dev.assert_starts(0)
        assert spot.end_rl_step()["steps"] == 0


def test_budget_stops_training_and_end_rl_step_renews_it():
    clock = FakeClock()
    dev = FakeDevices(clock, gated=False)
    with SpotTrainer(dev, SpotConfig(max_steps_per_rl_step=3), clock=clock) as spot:
        spot.begin_rl_step(0)
        spot.open_gap("group0", 0)
        wait_for(lambda: len(dev.records) == 3)
        dev.assert_starts(3)
        spot.close_gap("group0")
        assert spot.end_rl_step()["steps"] == 3
        # A gap between two RL steps (a checkpoint write) trains on the next report's
        # budget, and is counted in it.
        with spot.gap("checkpoint"):
            wait_for(lambda: len(dev.records) == 6)
        spot.begin_rl_step(1)
        spot.open_gap("group0", 0)  # the budget is spent: nothing more this RL step
        spot.close_gap("group0")
        dev.assert_starts(6)
        assert spot.end_rl_step()["steps"] == 3
        spot.begin_rl_step(2)
        spot.open_gap("group0", 0)
        wait_for(lambda: len(dev.records) == 9)
        spot.close_gap("group0")
        dev.assert_starts(9)
        assert spot.end_rl_step()["steps"] == 3


def test_a_budget_of_zero_never_trains_in_gaps_or_catch_up():
    """bench_tlt's frozen mode (max_steps_per_rl_step=0, catch_up_steps=0): RL step after RL
    step, with gaps open and catch-up asked for, no drafter step starts."""
    clock = FakeClock()
    dev = FakeDevices(clock, gated=False)
    with SpotTrainer(dev, SpotConfig(max_steps_per_rl_step=0, catch_up_steps=0), clock=clock) as spot:
        for rl_step in range(3):
            spot.begin_rl_step(rl_step)
            spot.open_gap("group0", 0)
            with spot.gap("reward"):
                dev.assert_starts(0)
            spot.close_gap("group0")
            assert spot.catch_up() == 0
            assert spot.end_rl_step()["steps"] == 0
        dev.assert_starts(0)


def test_without_data_nothing_trains_until_notified():
    clock = FakeClock()
    dev = FakeDevices(clock, gated=False)
    data = threading.Event()
    with SpotTrainer(dev, SpotConfig(max_steps_per_rl_step=2), has_data=data.is_set, clock=clock) as spot:
        spot.begin_rl_step(0)
        spot.open_gap("group0", 0)
        dev.assert_starts(0)
        data.set()
        spot.notify_data()
        wait_for(lambda: len(dev.records) == 2)
        spot.close_gap("group0")
        assert spot.end_rl_step()["steps"] == 2


def test_catch_up_runs_owed_steps_not_hidden():
    clock = FakeClock()
    dev = FakeDevices(clock)
    with SpotTrainer(dev, SpotConfig(max_steps_per_rl_step=5, catch_up_steps=3), clock=clock) as spot:
        spot.begin_rl_step(0)
        spot.open_gap("group0", 0)
        dev.next_start()
        closer, _ = close_in_thread(spot, "group0")
        clock.advance(1.0)
        dev.release()
        closer.join(5)
        dev.gated = False
        assert spot.catch_up() == 2  # 3 owed, 1 hidden in the gap
        assert spot.catch_up() == 0
        stats = spot.end_rl_step()
        assert [p for p, _, _ in dev.records] == [0, ALL, ALL]
        assert stats["steps"] == 1 and stats["catch_up_steps"] == 2
        assert stats["hidden_time_s"] == 1.0 and stats["catch_up_time_s"] == 2.0 and stats["step_time_s"] == 3.0
        assert stats["hidden_share"] == pytest.approx(1 / 3)

        spot.begin_rl_step(1)  # the gap gives all owed steps: no catch-up
        spot.open_gap("group0", 0)
        wait_for(lambda: len(dev.records) == 8)
        spot.close_gap("group0")
        assert spot.catch_up() == 0
        stats = spot.end_rl_step()
        assert stats["steps"] == 5 and stats["hidden_share"] == 1.0


def test_catch_up_stays_within_its_share_of_the_run():
    """No gap ever opens (one rollout group): catch-up runs a 1 s step only while the run's
    catch-up seconds stay within catch_up_max_share of its wall time."""
    clock = FakeClock()
    dev = FakeDevices(clock, gated=False, step_time=1.0)
    config = SpotConfig(max_steps_per_rl_step=4, catch_up_steps=2, catch_up_max_share=0.25)
    ran, capped = [], []
    with SpotTrainer(dev, config, clock=clock) as spot:
        for rl_step in range(6):
            spot.begin_rl_step(rl_step)
            clock.advance(3.0)  # rollout and learner
            ran.append(spot.catch_up())
            capped.append(spot.end_rl_step()["catch_up_capped"])
    # The first step's time is unknown until it runs: step 0 runs one, then refuses a
    # second (2 s > a quarter of 4 s); then one runs whenever 1 s more stays within a
    # quarter of the wall (t = 7: 2 > 1.75, refused; t = 10: 2 <= 2.5; t = 14: 3 <= 3.5; ...).
    assert ran == [1, 0, 1, 1, 1, 1]
    assert capped == [1, 2, 1, 1, 1, 1]
    assert dev.starts == sum(ran)
    assert sum(ran) * 1.0 <= 0.25 * clock()


def test_catch_up_max_share_zero_runs_no_catch_up_and_one_runs_all():
    clock = FakeClock()
    for share, expected in [(0.0, 0), (1.0, 2)]:
        dev = FakeDevices(clock, gated=False)
        with SpotTrainer(dev, SpotConfig(catch_up_steps=2, catch_up_max_share=share), clock=clock) as spot:
            spot.begin_rl_step(0)
            assert spot.catch_up() == expected


def test_overlapping_gaps_train_the_newest_open_one():
    clock = FakeClock()
    dev = FakeDevices(clock)
    with SpotTrainer(dev, SpotConfig(), clock=clock) as spot:
        spot.begin_rl_step(0)
        spot.open_gap("group0", 0)
        assert dev.next_start() == 0
        spot.open_gap("group3", 3)
        dev.release()
        assert dev.next_start() == 3
        closer, out = close_in_thread(spot, "group3")
        clock.advance(0.5)
        dev.release()
        closer.join(5)
        assert out["delay"] == 0.5
        assert dev.next_start() == 0  # training moved back to the gap still open
        assert spot.close_gap("group3") == 0.0  # already closed
        closer, _ = close_in_thread(spot, "group0")
        dev.release()
        closer.join(5)
        dev.assert_starts(3)
        assert spot.end_rl_step()["gaps"] == 2
    assert [p for p, _, _ in dev.records] == [0, 3, 0]


def test_closing_an_older_gap_does_not_preempt_the_newer():
    clock = FakeClock()
    dev = FakeDevices(clock)
    data = threading.Event()
    with SpotTrainer(dev, SpotConfig(), has_data=data.is_set, clock=clock) as spot:
        spot.begin_rl_step(0)
        spot.open_gap("group0", 0)
        spot.open_gap("group1", 1)
        data.set()
        spot.notify_data()
        assert dev.next_start() == 1
        assert spot.close_gap("group0") == 0.0  # returns at once: no step runs in group0
        closer, _ = close_in_thread(spot, "group1")
        dev.release()
        closer.join(5)
        dev.assert_starts(1)


def test_step_error_surfaces_in_the_rl_thread_and_stops_training():
    calls = []

    def step_fn(placement):
        calls.append(placement)
        raise ValueError("boom")

    with SpotTrainer(step_fn, SpotConfig(catch_up_steps=2)) as spot:
        spot.begin_rl_step(7)
        spot.open_gap("group0", 0)
        wait_for(lambda: calls)
        with pytest.raises(SpotStepFailed, match="RL step 7") as info:
            spot.close_gap("group0")
        assert isinstance(info.value.__cause__, ValueError)
        spot.open_gap("group1", 1)
        time.sleep(QUIET)
        with pytest.raises(SpotStepFailed):
            spot.catch_up()
        with pytest.raises(SpotStepFailed):
            spot.end_rl_step()
    assert calls == [0]


def test_gap_context_manager_and_skipped_steps():
    clock = FakeClock()
    dev = FakeDevices(clock, gated=False, metrics=lambda i: {"loss": 1.0, "skipped": int(i % 2 == 1)})
    with SpotTrainer(dev, SpotConfig(max_steps_per_rl_step=4), clock=clock) as spot:
        spot.begin_rl_step(0)
        with spot.gap("checkpoint"):
            wait_for(lambda: len(dev.records) == 4)
        with pytest.raises(KeyError):
            with spot.gap("eval"):
                raise KeyError("the body's error wins")
        stats = spot.end_rl_step()
    assert {p for p, _, _ in dev.records} == {ALL}
    assert stats["steps"] == 4 and stats["skipped"] == 2 and stats["gaps"] == 2


def test_state_dict_round_trip():
    clock = FakeClock()
    dev = FakeDevices(clock, gated=False, metrics=lambda i: {"skipped": int(i == 0)})
    with SpotTrainer(dev, SpotConfig(max_steps_per_rl_step=3, catch_up_steps=3), clock=clock) as spot:
        for rl_step in range(2):
            spot.begin_rl_step(rl_step)
            if rl_step == 0:
                with spot.gap("reward"):
                    wait_for(lambda: len(dev.records) == 3)
            spot.catch_up()
            spot.end_rl_step()
        state = json.loads(json.dumps(spot.state_dict()))
    assert state == dict(steps=6, hidden_steps=3, catch_up_steps=3, skipped=1, rl_steps=2, rl_step=1)
    other = SpotTrainer(dev, SpotConfig())
    other.load_state_dict(state)
    assert other.state_dict() == state
    with pytest.raises(ValueError, match="keys"):
        other.load_state_dict({"steps": 1})


def _run_rollouts(spot, num_groups: int, rl_steps: int, finish_s):
    """Each RL step: num_groups threads play rollout groups that finish at finish_s(g) and
    open their gap (on_group_done); the rollout end closes all of them, then a host phase.
    Returns the stats of each RL step and the gaps as (placement, opened, close called,
    close returned) on time.perf_counter."""
    stats, gaps, lock = [], [], threading.Lock()
    for rl_step in range(rl_steps):
        spot.begin_rl_step(rl_step)
        opened = {}
        t0 = time.perf_counter()

        def group(g, t0=t0, opened=opened):
            time.sleep(max(0.0, t0 + finish_s(g) - time.perf_counter()))
            with lock:
                opened[g] = time.perf_counter()
            spot.open_gap(f"group{g}", g)

        threads = [threading.Thread(target=group, args=(g,)) for g in range(num_groups)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.01)  # the rollout's last step
        for g in range(num_groups):
            called = time.perf_counter()
            spot.close_gap(f"group{g}")
            gaps.append((g, opened[g], called, time.perf_counter()))
        opened_at = time.perf_counter()
        with spot.gap("reward", ALL):
            time.sleep(0.03)
            called = time.perf_counter()
        gaps.append((ALL, opened_at, called, time.perf_counter()))
        stats.append(spot.end_rl_step())
    return stats, gaps


def _check_intervals(records, gaps):
    """Every step ran inside an open gap of its placement, and started before the close."""
    assert records
    for placement, start, end in records:
        assert any(p == placement and opened <= start <= called and end <= returned
                   for p, opened, called, returned in gaps), \
            f"step on {placement} at [{start:.4f}, {end:.4f}] ran outside every gap of its devices"


def test_real_threads_preemption_delay_and_intervals():
    records, lock = [], threading.Lock()

    def step_fn(placement):
        start = time.perf_counter()
        time.sleep(0.005)
        with lock:
            records.append((placement, start, time.perf_counter()))
        return {"loss": 0.0}

    with SpotTrainer(step_fn, SpotConfig(max_steps_per_rl_step=1000)) as spot:
        stats, gaps = _run_rollouts(spot, 4, rl_steps=3, finish_s=lambda g: 0.02 + 0.03 * g)
    assert sum(s["steps"] for s in stats) > 10
    assert all(s["gaps"] == 5 for s in stats)
    assert max(s["preemption_delay_max_s"] for s in stats) <= 0.25
    _check_intervals(records, gaps)


def test_preemption_with_jax_steps_on_device_groups():
    """4 rollout groups of 2 of the 8 simulated CPU devices; a step runs a jitted update on
    its group's devices (group 0's in host phases) and blocks until it is done."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    assert len(devices) == 8, "tests/conftest.py sets 8 simulated CPU devices"

    @jax.jit
    def update(w):
        for _ in range(4):
            w = jnp.tanh(w @ w.T) * 0.5 + w
        return w

    weights = {}
    for g in range(4):
        sharding = NamedSharding(Mesh(devices[2 * g:2 * g + 2], ("d",)), P("d"))
        weights[g] = update(jax.device_put(jnp.eye(128, dtype=jnp.float32), sharding)).block_until_ready()
    records, lock = [], threading.Lock()  # compiled above, outside the timed part

    def step_fn(placement):
        g = 0 if placement == ALL else placement
        start = time.perf_counter()
        weights[g] = update(weights[g]).block_until_ready()
        assert weights[g].devices() == set(devices[2 * g:2 * g + 2])
        with lock:
            records.append((placement, start, time.perf_counter()))
        return {}

    with SpotTrainer(step_fn, SpotConfig(max_steps_per_rl_step=10_000)) as spot:
        stats, gaps = _run_rollouts(spot, 4, rl_steps=2, finish_s=lambda g: 0.03 + 0.05 * g)
    placements = {p for p, _, _ in records}
    assert ALL in placements and len(placements - {ALL}) >= 3  # steps moved from group to group
    assert max(s["preemption_delay_max_s"] for s in stats) <= 0.25
    _check_intervals(records, gaps)


def test_gaps_shorter_than_a_step_are_skipped_once_measured():
    """A gap whose last duration (under its name) leaves less than a step's time gets no
    step, so it is not delayed by one; a longer gap still trains."""
    clock = FakeClock()
    dev = FakeDevices(clock)
    with SpotTrainer(dev, SpotConfig(skip_short_gaps=True), clock=clock) as spot:
        spot.begin_rl_step(0)
        spot.open_gap("reward", ALL)  # never seen: a step starts
        assert dev.next_start() == ALL
        clock.advance(0.5)
        closer, out = close_in_thread(spot, "reward")  # asked at 0.5 s into the gap
        clock.advance(1.5)
        dev.release()
        closer.join(5)
        assert out["delay"] == 1.5
        # Seen: the reward gap lasts 0.5 s, a step 2 s. It is skipped from now on.
        spot.open_gap("reward", ALL)
        dev.assert_starts(1)
        spot.close_gap("reward")
        # A gap long enough for a step: the group gap lasted 5 s last time.
        spot.open_gap("group0", 0)
        assert dev.next_start() == 0
        clock.advance(5.0)
        closer, out = close_in_thread(spot, "group0")
        dev.release()
        closer.join(5)
        spot.open_gap("group0", 0)
        assert dev.next_start() == 0  # 5 s left against a median step of 3.5 s
        closer, out = close_in_thread(spot, "group0")
        dev.release()
        closer.join(5)
        assert spot.end_rl_step()["steps"] == 3
