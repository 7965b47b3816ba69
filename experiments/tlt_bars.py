"""The adaptive drafter's bars (DESIGN.md section 5) read off one seed of a drift preset.

`bench_tlt --preset=cpu_drift_learn --modes=baseline,tlt,frozen,scratch --repeats=1 ...` ends
with one line per bar from `verdicts`: the policy learns in every mode (eval accuracy, reward,
KL), the frozen drafter goes stale, the drafter trained on the spot keeps up, one from nothing
nearly does, learning is unchanged (every mode drew the same samples), and, only where decode
is padded into the weight-bound regime and its check passed, TLT's rollout against frozen's.
A bar whose modes did not run is reported as not measured, never as passed.
"""
import dataclasses
import json
import statistics

# The bars' thresholds (DESIGN.md section 5, the adaptive drafter's bars).
MIN_EVAL_GAIN = 0.15
MIN_FROZEN_FALL = 0.20
MIN_TLT_OVER_FROZEN = 1.3
MIN_SCRATCH_OVER_TLT = 0.8
MIN_ROLLOUT_OVER_FROZEN = 1.2


@dataclasses.dataclass(frozen=True)
class Verdict:
    bar: str
    passed: bool | None  # None: not measured (a mode missing, or the regime not made)
    detail: str

    def line(self) -> str:
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[self.passed]
        return f"{mark}  {self.bar}: {self.detail}"


def thirds(values: list) -> dict | None:
    """Means of the first and the last third of a per-step list (None entries skipped),
    and the last's over the first; None with fewer than 6 steps."""
    if len(values) < 6:
        return None
    n = len(values) // 3
    mean = lambda xs: statistics.fmean(xs) if xs else None
    first, last = mean([v for v in values[:n] if v is not None]), mean([v for v in values[-n:] if v is not None])
    return dict(first=first, last=last, last_over_first=None if not first or last is None else last / first)


def first_runs(results: list[tuple[str, dict]]) -> dict:
    """{mode: its summary}: each mode's first run among (path, bench_tlt result) pairs, a
    result of --repeats (its `runs`) or of one process (its `modes`) alike."""
    modes = {}
    for _, result in results:
        for run in result.get("runs") or [dict(result=result)]:
            for mode, summary in (run.get("result") or {}).get("modes", {}).items():
                modes.setdefault(mode, summary)
    return modes


def read_results(paths: list[str]) -> list[tuple[str, dict]]:
    """(path, its JSON) for each bench_tlt result in paths."""
    out = []
    for path in paths:
        with open(path) as f:
            out.append((path, json.load(f)))
    return out


def _third(mode: dict, key: str) -> dict:
    return (mode.get("thirds") or {}).get(key) or {}


def _every_mode(modes: dict, bar: str, test, show) -> Verdict:
    """One bar over every mode that ran: passed where `test(mode)` holds in all of them."""
    if not modes:
        return Verdict(bar, None, "no mode ran")
    results = {name: test(m) for name, m in modes.items()}
    return Verdict(bar, all(results.values()), ", ".join(f"{name} {show(m)}" for name, m in modes.items()))


def _learning(modes: dict) -> list[Verdict]:
    def gain(m):
        evals = m.get("eval_accuracy") or []
        return evals[-1] - evals[0] if len(evals) >= 2 else float("-inf")

    def evals(m):
        e = m.get("eval_accuracy") or []
        return f"{e[0]:.3f} -> {e[-1]:.3f}" if len(e) >= 2 else "no eval"

    rewards = lambda m: thirds(m.get("reward_mean") or []) or {}
    kl = lambda m: _third(m, "policy_kl_from_start")
    fmt = lambda t, f: f"{t['first']:{f}} -> {t['last']:{f}}" if t.get("last") is not None else "n/a"
    return [
        _every_mode(modes, f"eval accuracy up by >= {MIN_EVAL_GAIN} from the warm start, every mode",
                    lambda m: gain(m) >= MIN_EVAL_GAIN, evals),
        _every_mode(modes, "reward's last third >= its first (no collapse), every mode",
                    lambda m: rewards(m).get("last") is not None and rewards(m)["last"] >= rewards(m)["first"],
                    lambda m: fmt(rewards(m), ".3f")),
        _every_mode(modes, "policy KL from the start higher over the last third than the first, every mode",
                    lambda m: kl(m).get("last") is not None and kl(m)["last"] > kl(m)["first"],
                    lambda m: fmt(kl(m), ".4f")),
    ]


def _acceptance_last(modes: dict, mode: str) -> float | None:
    return _third(modes[mode], "acceptance_length").get("last") if mode in modes else None


def _ratio_bar(modes: dict, bar: str, num: str, den: str, floor: float) -> Verdict:
    x, y = _acceptance_last(modes, num), _acceptance_last(modes, den)
    if not x or not y:
        return Verdict(bar, None, f"needs modes {num} and {den}")
    return Verdict(bar, x / y >= floor, f"{x / y:.2f}x ({num} {x:.3f}, {den} {y:.3f} over the last third)")


def _frozen_falls(modes: dict) -> Verdict:
    bar = f"frozen drafter's live acceptance falls >= {MIN_FROZEN_FALL:.0%} from the first third to the last"
    t = _third(modes["frozen"], "acceptance_length") if "frozen" in modes else {}
    if not t.get("last_over_first"):
        return Verdict(bar, None, "needs mode frozen")
    fall = 1 - t["last_over_first"]
    return Verdict(bar, fall >= MIN_FROZEN_FALL, f"{t['first']:.3f} -> {t['last']:.3f} ({-fall:+.1%})")


def _learning_unchanged(modes: dict) -> Verdict:
    """Every mode drew the same samples at every step (speculation coupled), so every mode's
    policy, and its eval accuracy, is the baseline's."""
    bar = "learning unchanged: every mode drew the baseline's samples at every step, same final eval accuracy"
    if "baseline" not in modes or len(modes) < 2:
        return Verdict(bar, None, "needs the baseline and another mode")
    base = modes["baseline"]
    digests = base.get("samples_digest") or []
    parts, passed = [], bool(digests) and all(d is not None for d in digests)
    for name, m in modes.items():
        if name == "baseline":
            continue
        same = sum(a is not None and a == b for a, b in zip(digests, m.get("samples_digest") or []))
        evals_equal = (m.get("eval_accuracy") or [None])[-1] == (base.get("eval_accuracy") or [None])[-1]
        passed = passed and same == len(digests) and evals_equal
        parts.append(f"{name} {same}/{len(digests)} steps, final eval "
                     f"{(m.get('eval_accuracy') or [float('nan')])[-1]:.3f}")
    return Verdict(bar, passed, f"baseline final eval {(base.get('eval_accuracy') or [float('nan')])[-1]:.3f}; "
                                + ", ".join(parts))


def _rollout_speed(result: dict) -> Verdict:
    bar = f"TLT's rollout >= {MIN_ROLLOUT_OVER_FROZEN}x frozen's over the last third (weight-bound regime only)"
    regime = result.get("regime")
    if not result.get("decode_mlp_size") or not regime:
        return Verdict(bar, None, "decode not padded or no regime check: this run measures acceptance, not speed")
    if not regime.get("passed"):
        return Verdict(bar, None, f"the regime check failed (spread {regime['spread']:.0%}): no speed verdict here")
    versus = result.get("tlt_versus_frozen") or result.get("tlt_versus_frozen_in_process") or {}
    ratio = versus.get("rollout_tokens_per_s_last_third")
    if ratio is None:
        return Verdict(bar, None, "needs modes tlt and frozen")
    return Verdict(bar, ratio >= MIN_ROLLOUT_OVER_FROZEN, f"{ratio:.2f}x rollout tokens/s")


def verdicts(result: dict) -> list[Verdict]:
    """The bars of one seed, from a bench_tlt result (`modes`: each mode's first run)."""
    modes = result.get("modes") or {}
    return [*_learning(modes), _frozen_falls(modes),
            _ratio_bar(modes, f"TLT's live acceptance >= {MIN_TLT_OVER_FROZEN}x frozen's over the last third",
                       "tlt", "frozen", MIN_TLT_OVER_FROZEN),
            _ratio_bar(modes, f"a drafter from nothing >= {MIN_SCRATCH_OVER_TLT}x TLT's live acceptance over the "
                              "last third", "scratch", "tlt", MIN_SCRATCH_OVER_TLT),
            _learning_unchanged(modes), _rollout_speed(result)]


def print_verdicts(result: dict) -> None:
    lines = verdicts(result)
    print(f"\nthe adaptive drafter's bars, preset {result.get('preset')}, seed {result.get('seed')}:")
    for v in lines:
        print(v.line())
