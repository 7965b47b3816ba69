"""Slow verifiers for benchmarks: a registered reward that first sleeps a fixed time per
sample, as code execution or a reward model would take.

`reward=experiments.slow_reward:task_after_20ms` is the `task` reward after 20 ms per
sample (any registered reward, any non-negative milliseconds: `math_after_2.5ms`). The
delay is in the name, so a run's config says it, and worker processes (which resolve a
reward's name themselves) build the same verifier. `bench_tlt --slow_reward_ms` uses it.
"""
import functools
import re
import time

from tlt_jax import rewards

_NAME = re.compile(r"(?P<reward>\w+?)_after_(?P<ms>\d+(?:\.\d+)?)ms")


def name(reward: str, ms: float) -> str:
    """The module:function name of `reward` after `ms` milliseconds per sample."""
    if not ms >= 0:
        raise ValueError(f"slow_reward_ms={ms} must be >= 0 (the milliseconds a sample's scoring sleeps).")
    return f"{__name__}:{reward}_after_{f'{ms:f}'.rstrip('0').rstrip('.')}ms"


def _slowed(prompts, completions, *, reward: str, delay_s: float, **fields) -> list[float]:
    time.sleep(delay_s * len(completions))
    return rewards.get_reward(reward)(prompts, completions, **fields)


def __getattr__(attribute: str):
    match = _NAME.fullmatch(attribute)
    if match is None or match["reward"] not in rewards.REWARDS:
        raise AttributeError(f"module {__name__!r} has no attribute {attribute!r} (names are "
                             f"<reward>_after_<ms>ms, reward one of {', '.join(sorted(rewards.REWARDS))})")
    return functools.partial(_slowed, reward=match["reward"], delay_s=float(match["ms"]) / 1e3)
