"""The BEG-MAB tuner driven by synthetic rewards: selection frequencies, bucket routing,
the sliding-window median, determinism and resumption, threads, errors, metrics."""
import json
import sys
import threading

import numpy as np
import pytest

from tlt_jax.rollout import tuner as tuner_lib
from tlt_jax.rollout.speculative import Strategy
from tlt_jax.rollout.tuner import BucketedEpsilonGreedy

A = Strategy.from_name("eagle-d4")
B = Strategy.from_name("eagle-d5-k3-t12")
N = Strategy.from_name("ngram-d4-b2")
RATES = {A: 100.0, B: 200.0, None: 150.0}  # tokens/s: B is best, then plain, then A


def _pull(tuner, num_active, rates, noise_rng=None, seconds=0.01):
    """One chunk: ask, then report rates[strategy] tokens/s (times 1 + 10% noise)."""
    strategy = tuner.strategy_for(num_active)
    rate = rates[strategy] * (1 + 0.1 * noise_rng.standard_normal() if noise_rng is not None else 1)
    tuner.observe(strategy, num_active, rate * seconds, seconds)
    return strategy


def _run(tuner, pulls, num_active=1, rates=RATES, seed=0):
    noise = np.random.default_rng(seed)
    return [_pull(tuner, num_active, rates, noise) for _ in range(pulls)]


def test_untried_arms_first_in_listed_order():
    tuner = BucketedEpsilonGreedy([1], [[A, B, None]], epsilon=1.0)
    # Not observed yet (e.g. the engine's compiling first chunk): still untried.
    assert [tuner.strategy_for(3) for _ in range(3)] == [A, A, A]
    assert _run(tuner, 3) == [A, B, None]
    assert tuner.report()["buckets"][0]["chosen"] == "eagle-d5-k3-t12"


@pytest.mark.parametrize("epsilon", [0.1, 0.3])
def test_best_arm_frequency_is_one_minus_epsilon_times_share_of_others(epsilon):
    tuner = BucketedEpsilonGreedy([1], [[A, B, None]], epsilon=epsilon, exploration="uniform", seed=1)
    _run(tuner, 100)
    choices = _run(tuner, 3000, seed=2)
    freq = {s: choices.count(s) / len(choices) for s in (A, B, None)}
    # Exploration draws among all 3 arms, the best included.
    np.testing.assert_allclose(freq[B], 1 - epsilon * 2 / 3, atol=0.025)
    np.testing.assert_allclose(freq[A], epsilon / 3, atol=0.02)
    np.testing.assert_allclose(freq[None], epsilon / 3, atol=0.02)


def test_exploration_by_reward_draws_arms_in_proportion_to_their_median_reward():
    rates = {A: 20.0, B: 800.0, None: 180.0}  # tokens/s: a slow tree, a fast chain, plain decode
    tuner = BucketedEpsilonGreedy([1], [[A, B, None]], epsilon=1.0, seed=1)  # every pull explores
    assert tuner.exploration == "by_reward"
    _run(tuner, 100, rates=rates)
    choices = _run(tuner, 4000, rates=rates, seed=2)
    total = sum(rates.values())
    for s, rate in rates.items():
        np.testing.assert_allclose(choices.count(s) / len(choices), rate / total, atol=0.015)

    # What it is for: exploration's lost seconds per token, against always pulling the best arm.
    def lost_seconds_per_token(exploration):
        t = BucketedEpsilonGreedy([1], [[A, B, None]], epsilon=0.1, exploration=exploration, seed=3)
        pulls = _run(t, 10000, rates=rates)[3:]
        return sum(1 / rates[s] - 1 / rates[B] for s in pulls) / len(pulls)

    # Expected: 0.1 x 0.00175 s against 0.1 x 0.0177 s, a tenth.
    assert lost_seconds_per_token("by_reward") < lost_seconds_per_token("uniform") / 5


def test_epsilon_zero_never_explores_and_one_is_uniform():
    greedy = BucketedEpsilonGreedy([1], [[A, B, None]], epsilon=0.0)
    _run(greedy, 3)
    assert set(_run(greedy, 500)) == {B}

    uniform = BucketedEpsilonGreedy([1], [[A, B, None]], epsilon=1.0, exploration="uniform", seed=3)
    _run(uniform, 3)
    choices = _run(uniform, 3000)
    for s in (A, B, None):
        np.testing.assert_allclose(choices.count(s) / len(choices), 1 / 3, atol=0.03)


def test_buckets_route_num_active():
    tuner = BucketedEpsilonGreedy([2, 5, 21], [[A], [B], [N]])
    expected = {0: A, 1: A, 2: A, 4: A, 5: B, 20: B, 21: N, 1000: N}
    assert {n: tuner.strategy_for(n) for n in expected} == expected
    for n, s in expected.items():
        tuner.observe(s, n, 10, 0.1)
    report = tuner.report()
    assert [b["pulls"] for b in report["buckets"]] == [4, 2, 2]
    assert [(b["lower"], b["upper"]) for b in report["buckets"]] == [(2, 5), (5, 21), (21, None)]
    assert report["ignored"] == 0


def test_from_config_adds_a_plain_only_bucket_above_max_active():
    cfg = {"buckets": [1, 4], "arms": [["eagle-d4", "plain"], ["ngram-d4-b2"]], "max_active": 8, "epsilon": 0.0}
    tuner = tuner_lib.from_config(cfg)
    assert tuner.buckets == (1, 4, 9)
    assert [tuner.strategy_for(n) for n in (1, 8, 9, 500)] == [A, N, None, None]
    assert tuner.report()["buckets"][-1]["arms"] == {"plain": {"pulls": 0, "median_reward": None}}
    assert tuner.strategies == (A, N)
    # A config that already ends with that bucket (e.g. written from a report) is kept.
    explicit = tuner_lib.from_config({**cfg, "buckets": [1, 4, 9], "arms": cfg["arms"] + [["plain"]]})
    assert explicit.buckets == (1, 4, 9)
    assert tuner_lib.from_config({**cfg, "max_active": None}).buckets == (1, 4)


def test_threshold_edges_and_chunk_floors():
    """max_active 1 (every bucket above plain only), a bucket starting at max_active, a config
    without max_active (the default, 32), the seed and window keys, and each bucket's floor."""
    plain_only = {"arms": [["plain"]]}
    assert tuner_lib.from_config({"buckets": [1], **plain_only, "max_active": 1}).buckets == (1, 2)
    assert tuner_lib.from_config({"buckets": [1, 32], "arms": [["eagle-d4"], ["plain"]]}).buckets == (1, 32, 33)
    assert tuner_lib.from_config({"buckets": [1, 5], "arms": [["eagle-d4"], ["plain"]]}).buckets == (1, 5, 33)
    cfg = {"buckets": [1], "arms": [["eagle-d4", "eagle-d5-k3-t12", "plain"]], "epsilon": 0.5}
    def choices(tuner):  # every arm tried once (untried arms go first, without a draw), then 40 draws
        for arm in tuner.arms[0]:
            tuner.observe(arm, 1, 10, 0.1)
        return [tuner_lib.arm_name(tuner.strategy_for(1)) for _ in range(40)]

    assert choices(tuner_lib.from_config({**cfg, "seed": 5})) == choices(
        BucketedEpsilonGreedy([1, 33], [[A, B, None], [None]], epsilon=0.5, seed=5))
    assert choices(tuner_lib.from_config({**cfg, "seed": 5})) != choices(tuner_lib.from_config(cfg))
    assert tuner_lib.from_config({**cfg, "window": 1}).window == 1
    default = BucketedEpsilonGreedy([1], [[A]])
    assert default.window == 300 and default.epsilon == 0.1
    assert choices(BucketedEpsilonGreedy([1], [[A, B, None]], epsilon=0.5)) == choices(
        BucketedEpsilonGreedy([1], [[A, B, None]], epsilon=0.5, seed=0))
    tuner = BucketedEpsilonGreedy([1, 2, 5], [[A], [B], [None]])
    assert [tuner.chunk_floor(n) for n in (0, 1, 2, 4, 5, 64)] == [1, 1, 2, 2, 5, 5]


def test_default_config_builds_tlt_buckets_with_plain_everywhere():
    cfg = tuner_lib.default_arms_config()
    tuner = tuner_lib.from_config(cfg)
    assert tuner.buckets == (1, 2, 5, 21, 33)
    assert tuner.arms[-1] == (None,)
    assert all(None in arms for arms in tuner.arms)
    for names, arms in zip(cfg["arms"], tuner.arms):
        assert [tuner_lib.arm_name(a) for a in arms] == names
        assert [tuner_lib.parse_arm(n) for n in names] == list(arms)
    # eagle-d8, eagle-d6 and ngram-d4-b2 are shared by two buckets
    assert len(tuner.strategies) == len(set(tuner.strategies)) == 8
    assert tuner.strategies[:3] == (Strategy("eagle", 8), Strategy("eagle", 6), Strategy("eagle", 5, 3, 16))


def test_window_median_follows_a_change_of_rewards():
    """B's rewards drop from 200 to 50 tok/s after 40 pulls: with a 20-pull window the
    median falls below A's 100 on the 11th low pull (a mean would need 14, a median
    over all pulls 41)."""
    tuner = BucketedEpsilonGreedy([1], [[A, B]], epsilon=0.0, window=20)
    rates = {A: 100.0, B: 200.0}
    _run(tuner, 41, rates=rates)
    assert tuner.report()["buckets"][0]["arms"]["eagle-d5-k3-t12"]["pulls"] == 40
    rates[B] = 50.0
    choices = [_pull(tuner, 1, rates) for _ in range(12)]
    assert choices == [B] * 11 + [A]


def test_same_seed_same_choices_and_seed_matters():
    def choices(seed):
        tuner = BucketedEpsilonGreedy([1, 3], [[A, B, None], [N, None]], epsilon=0.3, seed=seed)
        noise = np.random.default_rng(0)
        return [_pull(tuner, 1 + i % 5, RATES | {N: 120.0}, noise) for i in range(400)]

    assert choices(7) == choices(7)
    assert choices(7) != choices(8)


def test_state_dict_round_trip_resumes_the_same_choices():
    rates = RATES | {N: 120.0}

    def build():
        return BucketedEpsilonGreedy([1, 3], [[A, B, None], [N, None]], epsilon=0.3, window=50, seed=5)

    def drive(tuner, start, stop):
        return [_pull(tuner, 1 + i % 5, rates, np.random.default_rng(i)) for i in range(start, stop)]

    uninterrupted = build()
    first = drive(uninterrupted, 0, 300)
    rest = drive(uninterrupted, 300, 600)

    interrupted = build()
    assert drive(interrupted, 0, 300) == first
    resumed = build()
    resumed.load_state_dict(json.loads(json.dumps(interrupted.state_dict())))
    assert drive(resumed, 300, 600) == rest
    assert resumed.report() == uninterrupted.report()

    other = BucketedEpsilonGreedy([1, 3], [[A, B], [N, None]])
    with pytest.raises(ValueError, match="tuner config the run was started with"):
        other.load_state_dict(resumed.state_dict())


def test_single_arm_bucket_and_untried_arms_draw_no_random_numbers():
    tuner = BucketedEpsilonGreedy([1, 5], [[A, B], [None]], epsilon=0.5)
    rng_state = tuner.state_dict()["rng"]
    for _ in range(20):
        assert tuner.strategy_for(9) is None
        tuner.observe(None, 9, 100, 1.0)
    _run(tuner, 2)  # A then B, both untried
    assert tuner.state_dict()["rng"] == rng_state


def test_concurrent_threads_lose_no_pulls_and_snapshots_are_consistent():
    """Rollout groups pull from their threads while the trainer snapshots the state."""
    tuner = BucketedEpsilonGreedy([1, 3], [[A, B, None], [N, None]], epsilon=0.2, window=10_000)
    threads, per_thread = 6, 400
    torn = []

    def worker(k):
        noise = np.random.default_rng(k)
        for i in range(per_thread):
            _pull(tuner, 1 + (i + k) % 5, RATES | {N: 120.0}, noise)

    def snapshots(stop):
        while not stop.is_set():
            state = tuner.state_dict()
            rewards = [len(r) for bucket in state["rewards"] for r in bucket]
            if rewards != [n for bucket in state["pulls"] for n in bucket]:
                torn.append(state)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible to expose races
    stop = threading.Event()
    reader = threading.Thread(target=snapshots, args=(stop,))
    try:
        pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for t in [reader] + pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert sum(b["pulls"] for b in tuner.report()["buckets"]) == threads * per_thread
    assert not torn, f"{len(torn)} state_dict snapshots caught an observe half done"


def test_ties_go_to_the_first_listed_arm():
    tuner = BucketedEpsilonGreedy([1], [[A, B, None]], epsilon=0.0)
    for _ in range(30):
        _pull(tuner, 1, {A: 100.0, B: 300.0, None: 300.0})  # no noise: B and plain tie
    assert tuner.report()["buckets"][0]["chosen"] == "eagle-d5-k3-t12"
    assert tuner.strategy_for(1) == B


@pytest.mark.parametrize("kwargs, match", [
    (dict(buckets=[2, 2], arms=[[A], [B]]), r"^buckets must be strictly increasing"),
    (dict(buckets=[5, 2], arms=[[A], [B]]), r"^buckets must be strictly increasing"),
    (dict(buckets=[0, 2], arms=[[A], [B]]), r"^buckets .* >= 1"),
    (dict(buckets=[], arms=[]), r"^buckets"),
    (dict(buckets=[1, 2], arms=[[A]]), r"^arms needs one arm list per bucket"),
    (dict(buckets=[1, 2], arms=[[A], []]), r"^arms\[1\] .* is empty"),
    (dict(buckets=[1], arms=[[A, None, A]]), r"^arms\[0\] .* more than once"),
    (dict(buckets=[1], arms=[[A, None, None]]), r"^arms\[0\] .*'plain'.* more than once"),
    (dict(buckets=[1], arms=[["eagle-d4"]]), r"^arms\[0\] must hold Strategy objects"),
    (dict(buckets=[1], arms=[[A]], epsilon=1.5), r"^epsilon .* \[0, 1\]"),
    (dict(buckets=[1], arms=[[A]], epsilon=-0.1), r"^epsilon .* \[0, 1\]"),
    (dict(buckets=[1], arms=[[A]], window=0), r"^window .* >= 1"),
    (dict(buckets=[1], arms=[[A]], exploration="softmax"), r"^exploration must be one of \['by_reward', 'uniform'\]"),
])
def test_bad_construction_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BucketedEpsilonGreedy(kwargs.pop("buckets"), kwargs.pop("arms"), **kwargs)


@pytest.mark.parametrize("changes, match", [
    (dict(buckets=[1, 40], arms=[["plain"], ["eagle-d4"]]), r"^tlt\.tuner\.buckets .*\[40\].*max_active=32"),
    (dict(arms=[["eagle-d4"], ["eagle-x"]]), r"^tlt\.tuner\.arms\[1\]: Cannot read strategy 'eagle-x'"),
    (dict(arms=[["eagle-d4"], ["eagle-d2-k2-t20"]]), r"^tlt\.tuner\.arms\[1\]: .*num_nodes"),
    (dict(arms=[["eagle-d4"], ["plain", "plain"]]), r"^tlt\.tuner\.arms\[1\] .* more than once"),
    (dict(arms=[["eagle-d4"]]), r"^tlt\.tuner\.arms needs one arm list per bucket: 2 buckets \[1, 4\]"),
    (dict(buckets=[4, 1]), r"^tlt\.tuner\.buckets must be strictly increasing"),
    (dict(epsilon=2.0), r"^tlt\.tuner\.epsilon"),
    (dict(window=0), r"^tlt\.tuner\.window"),
    (dict(exploration="greedy"), r"^tlt\.tuner\.exploration must be one of"),
    (dict(max_active=0), r"^tlt\.tuner\.max_active"),
    (dict(buckets=[1, 40], arms=[["plain"], ["eagle-d4"]]), r"lower them or raise max_active\.$"),
    (dict(epsilon_decay=0.5), r"Unknown tlt\.tuner keys \['epsilon_decay'\]"),
])
def test_bad_config_names_the_config_field(changes, match):
    cfg = {"buckets": [1, 4], "arms": [["eagle-d4", "plain"], ["ngram-d4-b2", "plain"]]} | changes
    with pytest.raises(ValueError, match=match):
        tuner_lib.from_config(cfg)
    with pytest.raises(ValueError, match=r"^tlt\.tuner\.arms is missing"):
        tuner_lib.from_config({"buckets": [1]})


def test_observations_outside_the_bucket_or_without_time_are_ignored():
    tuner = BucketedEpsilonGreedy([1, 3], [[A, B], [N, None]])
    tuner.observe(N, 1, 10, 0.1)  # N is an arm of the other bucket only
    tuner.observe(None, 2, 10, 0.1)
    tuner.observe(A, 1, 10, 0.0)
    tuner.observe(A, 1, 10, -1.0)
    tuner.observe(A, 1, 10, float("nan"))
    report = tuner.report()
    assert report["ignored"] == 5
    assert [b["pulls"] for b in report["buckets"]] == [0, 0]
    assert tuner.strategy_for(1) == A  # still untried
    tuner.observe(N, 3, 10, 0.1)
    assert tuner.report()["buckets"][1]["arms"]["ngram-d4-b2"] == {"pulls": 1, "median_reward": 100.0}


def test_report_metrics_counts_pulls_since_the_previous_report():
    tuner = BucketedEpsilonGreedy([1, 3], [[A, B, None], [N, None]], epsilon=0.0)
    tuner.observe(A, 1, 10, 0.1)
    tuner.observe(N, 4, 30, 0.1)
    tuner.observe(A, 9, 30, 0.1)  # ignored
    first = tuner.report()
    for rate in (200, 400, 600):
        tuner.observe(B, 2, rate, 1.0)
    tuner.observe(A, 1, 20, 0.1)
    tuner.observe(N, 1, 20, 0.1)  # ignored
    second = tuner.report()

    metrics = tuner_lib.report_metrics(second, previous=first)
    assert metrics["tuner/b1/pulls"] == 4
    assert metrics["tuner/b1/eagle-d4/pulls"] == 1
    assert metrics["tuner/b1/eagle-d5-k3-t12/pulls"] == 3
    assert metrics["tuner/b1/plain/pulls"] == 0
    assert metrics["tuner/b3/pulls"] == 0
    assert metrics["tuner/ignored"] == 1
    assert metrics["tuner/b1/eagle-d5-k3-t12/median_reward"] == 400.0
    assert metrics["tuner/b1/eagle-d4/median_reward"] == 150.0
    assert "tuner/b1/plain/median_reward" not in metrics  # untried
    assert metrics["tuner/b1/chosen_index"] == 2  # plain: the first untried
    assert metrics["tuner/b3/chosen_index"] == 1

    totals = tuner_lib.report_metrics(second)
    assert totals["tuner/b1/pulls"] == 5
    assert totals["tuner/b3/ngram-d4-b2/pulls"] == 1
    assert totals["tuner/ignored"] == 2
    assert json.loads(json.dumps(metrics)) == metrics


def test_plot_arm_choices_writes_a_png(tmp_path):
    tuner = tuner_lib.from_config({"buckets": [1, 3], "arms": [["eagle-d4", "eagle-d5-k3-t12", "plain"],
                                                               ["ngram-d4-b2", "plain"]], "max_active": 4})
    records, previous = [], None
    for step in range(4):
        for i in range(60):
            _pull(tuner, 1 + (i + step) % 6, RATES | {N: 120.0}, np.random.default_rng(i))
        report = tuner.report()
        records.append({"step": step, **tuner_lib.report_metrics(report, previous)})
        previous = report
    path = tmp_path / "arms.png"
    figure = tuner_lib.plot_arm_choices(records, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 1000
    # A panel per bucket, each arm's share of its pulls stacked to 1 (docs/tlt.md).
    assert [ax.get_title() for ax in figure.axes] == ["1-2 active sequences", "3-4 active sequences",
                                                      "5+ active sequences"]
    assert [[t.get_text() for t in ax.get_legend().get_texts()] for ax in figure.axes] == [
        ["eagle-d4", "eagle-d5-k3-t12", "plain"], ["ngram-d4-b2", "plain"], ["plain"]]
    for ax in figure.axes:
        top = ax.collections[-1].get_paths()[0].vertices[:, 1]
        np.testing.assert_allclose(top.max(), 1.0)
    with pytest.raises(ValueError, match="No record has tuner"):
        tuner_lib.plot_arm_choices([{"step": 0, "loss": 1.0}], tmp_path / "none.png")
