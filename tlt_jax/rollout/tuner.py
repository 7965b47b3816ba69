"""TLT's bucketed epsilon-greedy multi-armed bandit (BEG-MAB): the adaptive `Speculation`.

Before each rollout chunk the engine asks `strategy_for(num_active)`; the number of
active sequences picks a bucket (buckets are ranges of the active batch size, given by
their lower bounds, TLT: 1, 2, 5, 21), and the bucket's bandit picks one of its arms: a
speculative `Strategy`, or None for plain decode. After the chunk the engine reports
`observe(strategy, num_active, tokens, seconds)`; the pull's reward is tokens committed
(all sequences together) per second of wall time, so it already weighs acceptance
length by batch size, as TLT's accept_len x batch_size / step_time does.

Selection in a bucket: arms never pulled first, in their listed order; then with
probability epsilon an exploring pull; otherwise the arm of best score, the median
reward of its last `window` pulls in that bucket (ties: the first listed).

Kept from the reference (fastrl's BEG-MAB): the buckets, epsilon 0.1, the median over
a 300-pull sliding window (robust to the odd slow chunk), untried arms first. Changed:
  - plain decode is an arm, so speculation has to beat it on measured throughput
    rather than run whenever few sequences are left (`from_config` still adds TLT's
    plain-only bucket above `max_active` active sequences);
  - arms are whole strategies (EAGLE chain or tree, n-gram) and a bucket holds several,
    so the bandit does explore (the reference's defaults put one arm in each bucket);
  - an exploring pull draws arm a with probability median_a / sum of medians
    (`exploration="by_reward"`, the default; "uniform" is the reference's draw). A pull of
    an arm that commits c tokens at rate r_a loses c (1 / r_a - 1 / r_best) seconds against
    the best arm; drawn uniformly, that loss grows without bound as r_a falls (on
    `bench_tlt`'s cpu_wide_pair preset, at batch 1, a 16-token tree's median was 25
    tokens/s beside the 6-deep chain's 172); drawn in proportion to r_a, each arm's
    expected loss is at most c (1 - r_a / r_best) / sum of rates, however slow it is. The
    expected loss of an exploring pull, c (n / R - 1 / r_best) by reward against
    c (H / n - 1 / r_best) uniformly (n arms, R the sum of their rates, H of their
    inverses), is never larger, since n^2 <= R H (the harmonic mean is at most the
    arithmetic one), and equal only when every arm is as fast. No arm is dropped: a slow
    arm is still pulled, less often, so drift in its rate is seen;
  - the state, RNG included, is saved with the run's checkpoint, so a resumed run
    makes the same choices as an uninterrupted one.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import numbers
import os
import re
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from tlt_jax import metrics
from tlt_jax.rollout import history as history_lib
from tlt_jax.rollout.history import HistoryStore
from tlt_jax.rollout.speculative import Strategy

PLAIN = "plain"
EXPLORATIONS = ("by_reward", "uniform")  # how an exploring pull draws its arm


def arm_name(strategy: Strategy | None) -> str:
    """'plain' for plain decode, else the strategy's name ('eagle-d5-k3-t16')."""
    return PLAIN if strategy is None else strategy.name


def parse_arm(name: str) -> Strategy | None:
    """The inverse of `arm_name`."""
    return None if name == PLAIN else Strategy.from_name(name)


def _check_layout(buckets, arms) -> None:
    """Raises ValueError for bad buckets or arms; each message starts with the field."""
    if (not buckets or not all(isinstance(b, numbers.Integral) for b in buckets) or buckets[0] < 1
            or any(a >= b for a, b in zip(buckets, buckets[1:]))):
        raise ValueError(f"buckets must be strictly increasing integers >= 1 (the lower bounds of the "
                         f"active-batch-size buckets, e.g. [1, 2, 5, 21]); got {list(buckets)}.")
    if len(arms) != len(buckets):
        raise ValueError(f"arms needs one arm list per bucket: {len(buckets)} buckets {list(buckets)} but "
                         f"{len(arms)} arm lists.")
    for i, bucket_arms in enumerate(arms):
        if not bucket_arms:
            raise ValueError(f"arms[{i}] (bucket >= {buckets[i]}) is empty; give it at least one arm "
                             f"(e.g. '{PLAIN}' for plain decode).")
        if not all(a is None or isinstance(a, Strategy) for a in bucket_arms):
            raise ValueError(f"arms[{i}] must hold Strategy objects or None (plain decode); got {list(bucket_arms)}.")
        names = [arm_name(a) for a in bucket_arms]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"arms[{i}] (bucket >= {buckets[i]}) lists {repeated} more than once; list each arm "
                             "once.")


@contextlib.contextmanager
def _fields_under(prefix: str):
    """Puts the config path in front of the field a ValueError names ('tlt.tuner.arms[2]')."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{prefix}.{e}") from e


class BucketedEpsilonGreedy:
    """One epsilon-greedy bandit per active-batch-size bucket (a `Speculation`).

    buckets: strictly increasing lower bounds; num_active in [buckets[i], buckets[i+1])
      falls in bucket i, below buckets[0] in bucket 0, from buckets[-1] on in the last.
    arms: arms[i] are bucket i's arms, each a Strategy or None (plain decode).
    epsilon: probability of an exploring pull once every arm was tried.
    exploration: how an exploring pull draws its arm: "by_reward" (in proportion to each
      arm's median reward: a slow arm's pulls are rare, so they cost little time) or
      "uniform" (the reference's BEG-MAB).
    window: pulls per arm (per bucket) the median reward is taken over.
    seed: of the numpy Generator behind exploration.
    history: the store the history arms search (one is made, at its defaults, when an
      arm is a history strategy and none is given); None without history arms. It is
      not part of `state_dict` (a resumed run's history refills as it samples).

    Thread-safe: rollout groups call it from their own threads.
    """

    def __init__(self, buckets: Sequence[int], arms: Sequence[Sequence[Strategy | None]], *,
                 epsilon: float = 0.1, window: int = 300, seed: int = 0, history: HistoryStore | None = None,
                 exploration: str = "by_reward"):
        _check_layout(buckets, arms)
        if not 0 <= epsilon <= 1:
            raise ValueError(f"epsilon is the exploration probability and must be in [0, 1]; got {epsilon}.")
        if exploration not in EXPLORATIONS:
            raise ValueError(f"exploration must be one of {list(EXPLORATIONS)}; got {exploration!r}.")
        if not isinstance(window, numbers.Integral) or window < 1:
            raise ValueError(f"window is the number of recent pulls an arm's median reward is taken over and "
                             f"must be an integer >= 1; got {window}.")
        self.buckets = tuple(int(b) for b in buckets)
        self.arms = tuple(tuple(a) for a in arms)
        self.epsilon = float(epsilon)
        self.exploration = exploration
        self.window = int(window)
        self._lock = threading.Lock()
        self._rng = np.random.default_rng(seed)
        self._rewards = [[collections.deque(maxlen=self.window) for _ in a] for a in self.arms]  # tokens/s
        self._pulls = [[0] * len(a) for a in self.arms]  # all pulls, not only those in the window
        self._ignored = 0
        has_history = any(a.drafter == "history" for a in self.strategies)
        self.history = (history or HistoryStore()) if has_history else None

    @property
    def strategies(self) -> tuple[Strategy, ...]:
        """Every speculative arm once, in bucket then arm order (the engine checks them)."""
        return tuple(dict.fromkeys(a for bucket_arms in self.arms for a in bucket_arms if a is not None))

    def bucket_of(self, num_active: int) -> int:
        """Index of the bucket num_active falls in (below the first bound: bucket 0)."""
        return max(bisect.bisect_right(self.buckets, num_active) - 1, 0)

    def chunk_floor(self, num_active: int) -> int:
        """A chunk chosen at num_active runs while at least this many sequences are active:
        the lower bound of its bucket, so every chunk stays in the bucket it was chosen
        for and the next bucket's choice is made as soon as the batch drains into it."""
        return self.buckets[self.bucket_of(num_active)]

    def _exploit(self, bucket: int) -> int:
        """Index of the first untried arm, else of the best median reward (first on ties)."""
        rewards = self._rewards[bucket]
        for i, r in enumerate(rewards):
            if not r:
                return i
        return int(np.argmax([np.median(r) for r in rewards]))

    def _explore(self, bucket: int) -> int:
        """Index of an exploring pull's arm (every arm tried)."""
        n = len(self.arms[bucket])
        if self.exploration == "by_reward":
            medians = np.asarray([np.median(r) for r in self._rewards[bucket]])
            if medians.sum() > 0:
                return int(self._rng.choice(n, p=medians / medians.sum()))
        return int(self._rng.integers(n))

    def strategy_for(self, num_active: int) -> Strategy | None:
        with self._lock:
            bucket = self.bucket_of(num_active)
            arms = self.arms[bucket]
            # A single arm, or an untried one, is chosen without drawing, so the RNG
            # stream (and with it a resumed run) depends only on the real choices.
            if len(arms) == 1:
                return arms[0]
            if all(self._rewards[bucket]) and self._rng.random() < self.epsilon:
                return arms[self._explore(bucket)]
            return arms[self._exploit(bucket)]

    def observe(self, strategy: Strategy | None, num_active: int, tokens: int, seconds: float) -> None:
        """Records one chunk: `tokens` committed over all sequences in `seconds` of wall
        time, started with num_active sequences. Counted as ignored instead when seconds
        is not positive or the strategy is not an arm of num_active's bucket."""
        with self._lock:
            bucket = self.bucket_of(num_active)
            arms = self.arms[bucket]
            if not seconds > 0 or strategy not in arms:
                self._ignored += 1
                return
            i = arms.index(strategy)
            self._rewards[bucket][i].append(float(tokens) / float(seconds))
            self._pulls[bucket][i] += 1

    def report(self) -> dict:
        """{"buckets": [{"lower", "upper" (exclusive; None for the last), "pulls",
        "arms": {arm name: {"pulls", "median_reward" (tokens/s over the window; None
        if untried)}}, "chosen": the arm exploitation picks now}], "ignored": int}."""
        with self._lock:
            rows = []
            for b, arms in enumerate(self.arms):
                rows.append({
                    "lower": self.buckets[b],
                    "upper": self.buckets[b + 1] if b + 1 < len(self.buckets) else None,
                    "pulls": sum(self._pulls[b]),
                    "arms": {arm_name(a): {"pulls": n, "median_reward": float(np.median(r)) if r else None}
                             for a, n, r in zip(arms, self._pulls[b], self._rewards[b])},
                    "chosen": arm_name(arms[self._exploit(b)]),
                })
            return {"buckets": rows, "ignored": self._ignored}

    def state_dict(self) -> dict:
        """JSON-serialisable state (plain lists, dicts, ints, floats, str)."""
        with self._lock:
            return {"buckets": list(self.buckets),
                    "arms": [[arm_name(a) for a in arms] for arms in self.arms],
                    "rewards": [[list(r) for r in bucket] for bucket in self._rewards],
                    "pulls": [list(p) for p in self._pulls],
                    "ignored": self._ignored,
                    "rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores `state_dict()`'s output; buckets and arms must match this tuner's."""
        arms = [[arm_name(a) for a in bucket_arms] for bucket_arms in self.arms]
        if list(state["buckets"]) != list(self.buckets) or [list(a) for a in state["arms"]] != arms:
            raise ValueError(f"The saved tuner state has buckets {list(state['buckets'])} and arms "
                             f"{list(state['arms'])}, this tuner {list(self.buckets)} and {arms}; resume with the "
                             "tuner config the run was started with.")
        with self._lock:
            # A smaller window than the saved run's keeps each arm's most recent rewards.
            self._rewards = [[collections.deque(r, maxlen=self.window) for r in bucket]
                             for bucket in state["rewards"]]
            self._pulls = [[int(n) for n in p] for p in state["pulls"]]
            self._ignored = int(state["ignored"])
            self._rng.bit_generator.state = state["rng"]


def from_config(cfg: Mapping[str, Any], prefix: str = "tlt.tuner") -> BucketedEpsilonGreedy:
    """Builds the tuner from a ConfigDict or mapping: `buckets` (ints), `arms` (lists of
    arm names, 'plain' for plain decode), optional `epsilon`, `exploration`, `window`, `seed`,
    `max_active` (default 32; None: no threshold) and `history` (the history arms' store:
    `max_tokens` per prompt, `keep_steps`; `history.HistoryStore`'s defaults otherwise).
    With `max_active`, active batches above it decode plain, as in TLT: a last bucket
    from max_active + 1 whose only arm is None is added unless the config already ends
    with exactly that bucket. Errors name the field under `prefix`."""
    fields = dict(cfg)
    known = ("buckets", "arms", "epsilon", "exploration", "window", "seed", "max_active", "history")
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(f"Unknown {prefix} keys {unknown}; known keys: {list(known)}.")
    missing = [k for k in ("buckets", "arms") if k not in fields]
    if missing:
        raise ValueError(f"{prefix}.{missing[0]} is missing; see tuner.default_arms_config() for an example.")
    with _fields_under(prefix):
        buckets = list(fields["buckets"])
        arms = []
        for i, names in enumerate(fields["arms"]):
            try:
                arms.append([parse_arm(n) for n in names])
            except ValueError as e:
                raise ValueError(f"arms[{i}]: {e} ('{PLAIN}' is plain decode.)") from e
        _check_layout(buckets, arms)  # as written, before the plain bucket is added
        max_active = fields.get("max_active", 32)
        if max_active is not None:
            if not isinstance(max_active, numbers.Integral) or max_active < 1:
                raise ValueError(f"max_active must be an integer >= 1 (or None for no threshold); got {max_active}.")
            plain_bucket = buckets[-1] == max_active + 1 and arms[-1] == [None]
            beyond = [b for b in (buckets[:-1] if plain_bucket else buckets) if b > max_active]
            if beyond:
                raise ValueError(f"buckets has lower bounds {beyond} above max_active={max_active}, where only "
                                 "plain decode runs; lower them or raise max_active.")
            if not plain_bucket:
                buckets.append(max_active + 1)
                arms.append([None])
        history = dict(fields.get("history") or {})
        unknown = sorted(set(history) - {"max_tokens", "keep_steps"})
        if unknown:
            raise ValueError(f"history has unknown keys {unknown}; known keys: ['max_tokens', 'keep_steps'].")
        try:
            store = HistoryStore(**history)
        except ValueError as e:
            raise ValueError(f"history.{e}") from e
        options = {k: fields[k] for k in ("epsilon", "exploration", "window", "seed") if k in fields}
        return BucketedEpsilonGreedy(buckets, arms, history=store, **options)


def default_arms_config() -> dict:
    """TLT-like defaults for `from_config`: verify width shrinks as the active batch
    grows (the target forward stops being memory-bound), an n-gram arm while it is
    small, and plain decode everywhere so speculation must earn its place."""
    return {
        "buckets": [1, 2, 5, 21],
        "arms": [["eagle-d8", "eagle-d6", "eagle-d5-k3-t16", "ngram-d4-b2", PLAIN],
                 ["eagle-d8", "eagle-d6", "eagle-d4-k2-t8", "ngram-d4-b2", PLAIN],
                 ["eagle-d4", "ngram-d3-b1", PLAIN],
                 ["eagle-d3", PLAIN]],
        "epsilon": 0.1,
        "exploration": "by_reward",  # "uniform": the reference's
        "window": 300,
        "seed": 0,
        "max_active": 32,
        # The store of history arms (history-d<depth>-b<branches>; none by default).
        "history": {"max_tokens": history_lib.MAX_TOKENS, "keep_steps": history_lib.KEEP_STEPS},
    }


def report_metrics(report: Mapping[str, Any], previous: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Flattens `report()` into scalars for a metrics row: `tuner/b{lower}/pulls`,
    `tuner/b{lower}/chosen_index` (in the bucket's arm list), `tuner/b{lower}/{arm}/pulls`,
    `tuner/b{lower}/{arm}/median_reward` (tokens/s; left out while untried) and
    `tuner/ignored`. With `previous` (an earlier report of the same tuner) pull and
    ignored counts are those since it, e.g. during one RL step."""
    before = {}
    if previous is not None:
        before = {(b["lower"], name): arm["pulls"] for b in previous["buckets"] for name, arm in b["arms"].items()}
        before["ignored"] = previous["ignored"]
    metrics = {}
    for b in report["buckets"]:
        key = f"tuner/b{b['lower']}"
        pulls = {name: arm["pulls"] - before.get((b["lower"], name), 0) for name, arm in b["arms"].items()}
        metrics[f"{key}/pulls"] = sum(pulls.values())
        metrics[f"{key}/chosen_index"] = list(b["arms"]).index(b["chosen"])
        for name, arm in b["arms"].items():
            metrics[f"{key}/{name}/pulls"] = pulls[name]
            if arm["median_reward"] is not None:
                metrics[f"{key}/{name}/median_reward"] = arm["median_reward"]
    metrics["tuner/ignored"] = report["ignored"] - before.get("ignored", 0)
    return metrics


_ARM_PULLS = re.compile(r"tuner/b(\d+)/([^/]+)/pulls")


def plot_arm_choices(records: Sequence[Mapping[str, Any]], path: str | os.PathLike):
    """Per bucket, each arm's share of the bucket's pulls at each RL step, stacked, from
    metrics rows holding `report_metrics` keys (`tuner/b{lower}/{arm}/pulls`, per step).
    Writes a PNG (a step without pulls in a bucket shows as a gap); returns the figure."""
    arms: dict[int, list[str]] = {}  # bucket lower bound -> arm names, first seen first
    for r in records:
        for key in r:
            m = _ARM_PULLS.fullmatch(key)
            if m and m[2] not in arms.setdefault(int(m[1]), []):
                arms[int(m[1])].append(m[2])
    if not arms:
        raise ValueError("No record has tuner/b<lower>/<arm>/pulls keys; write tuner.report_metrics into the rows.")
    figure = metrics.new_figure(figsize=(8, 2.2 * len(arms)), layout="constrained")
    axes = figure.subplots(len(arms), 1, sharex=True, squeeze=False)[:, 0]
    # One colour per arm across buckets (plain grey), so panels read alike.
    names = list(dict.fromkeys(a for lower in sorted(arms) for a in arms[lower] if a != PLAIN))
    colors = {PLAIN: "0.7"} | {a: f"C{i % 10}" for i, a in enumerate(names)}
    lowers = sorted(arms)
    for ax, lower, upper in zip(axes, lowers, lowers[1:] + [None]):
        rows = [r for r in records if any(f"tuner/b{lower}/{a}/pulls" in r for a in arms[lower])]
        steps = np.array([r["step"] for r in rows])
        pulls = np.array([[r.get(f"tuner/b{lower}/{a}/pulls", 0) for r in rows] for a in arms[lower]], np.float64)
        total = pulls.sum(0)
        share = np.divide(pulls, total, out=np.zeros_like(pulls), where=total > 0)
        ax.stackplot(steps, share, labels=arms[lower], colors=[colors[a] for a in arms[lower]])
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of pulls")
        ax.set_title(f"{lower}+ active sequences" if upper is None else f"{lower}-{upper - 1} active sequences",
                     fontsize="medium")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    axes[-1].set_xlabel("step")
    figure.savefig(path, dpi=100)
    return figure
