"""The rewards by name, `REWARDS` (each scores within `SCORE_RANGE`, [0, 1]):
  task                our synthetic tasks, with partial credit for the format;
  answer_correctness  our synthetic tasks' checkers alone;
  format              our synthetic tasks' format alone;
  gsm8k               the final number against the reference, exactly;
  math                math-verify's equivalence of the final answer and the reference
                      (LaTeX, \\boxed{}, fractions, plain numbers);
  reasoning_gym       a reasoning-gym task's own `score_answer` on the last
                      <answer>...</answer> (the optional extra `envs`);
  code                the completion's program run against its row's tests in a sandbox
                      (`CodeReward`, options from config.code; docs/code.md).
`get_reward` also takes `module.path:function`, any importable reward of the same
convention (`verifiers`), so a verifier of one's own needs no change here.
"""
from __future__ import annotations

import importlib.util

from tlt_jax import by_name
from tlt_jax.data import reasoning_gym_problems
from tlt_jax.rewards.code_reward import CodeReward
from tlt_jax.rewards.verifiers import (
    RewardFn,
    answer_correctness,
    format_reward,
    gsm8k_correctness,
    math_correctness,
    reasoning_gym_score,
    task_reward,
)

REWARDS: dict[str, RewardFn] = {
    "answer_correctness": answer_correctness,
    "format": format_reward,
    "task": task_reward,
    "gsm8k": gsm8k_correctness,
    "math": math_correctness,
    "reasoning_gym": reasoning_gym_score,
    "code": CodeReward(),
}
# Rewards with options, config.<name>: get_reward(name, **options) builds one.
_CONFIGURABLE = {"code": CodeReward}
SCORE_RANGE = (0.0, 1.0)  # every reward of REWARDS scores within it (plots clip reward bands to it)
# Rewards that need a package: reward -> (module, how to install it).
_NEEDS = {"math": ("math_verify", "pip install -e ."),
          "reasoning_gym": ("reasoning_gym", reasoning_gym_problems.INSTALL_HINT)}


def get_reward(name: str, **options) -> RewardFn:
    """The reward `name`: one of `REWARDS`, or `module.path:function` for any importable
    reward of the convention above (a user's own verifier). `options` configure a reward
    that has them (`code`: `CodeReward`'s fields, config.code).

    Raises ValueError for a name that names no reward, ImportError for a module or package
    that cannot be imported; each message is one line naming the config field `reward`.
    """
    if name in _CONFIGURABLE:
        reward = _CONFIGURABLE[name](**options)
        reward.check()
        return reward
    if options:
        raise ValueError(f"reward={name!r} takes no options (given {sorted(options)}).")
    module, install = _NEEDS.get(name, (None, None))
    if module is not None and importlib.util.find_spec(module) is None:
        raise ImportError(f"reward={name!r} needs the package {module}, which is not installed: {install}")
    fn = by_name.resolve(name, REWARDS, "reward", "reward", "function")
    if not callable(fn):
        raise ValueError(f"reward={name!r}: {name.replace(':', '.')} is a {type(fn).__name__}, not a function "
                         "fn(prompts, completions, **fields) -> list[float].")
    return fn


def reward_from_config(config, name: str | None = None) -> RewardFn:
    """The reward `name` (default config.reward) with its options from the config:
    get_reward("code", **config.code), get_reward(name) for a reward without options."""
    name = config.reward if name is None else name
    return get_reward(name, **config[name]) if name in _CONFIGURABLE else get_reward(name)
