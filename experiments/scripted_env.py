"""A scripted environment for benchmarks: two turns a sample, one environment step of a fixed latency.

`env.name=experiments.scripted_env:after_20ms`: the model's first turn is its worked answer
up to the stop string "answer:"; the step sleeps 20 ms (a tool call, a simulator, a remote
check) and answers with one space, the token the model writes there anyway; the second
turn is the answer itself, and the step after it scores the whole transcript (1 where the
row's answer is right, by the task's own check) and ends the episode. So every sample
takes the same two turns and one wait, its tokens are those of a single-turn answer, and
the warm start (trained on single-turn answers, which it does not continue after its end
token) stays in its own distribution. A sample that ends its first turn without writing
"answer:" is scored there. The delay is in the name, so a run's config says it.
`bench_tlt --env_latency_ms` uses it.
"""
import functools
import re
import time

from tlt_jax import envs, rewards

_NAME = re.compile(r"after_(?P<ms>\d+(?:\.\d+)?)ms")
STOP = "answer:"
TURNS = 2


def name(ms: float) -> str:
    """The module:Class name of the environment whose step sleeps `ms` milliseconds."""
    if not ms >= 0:
        raise ValueError(f"env_latency_ms={ms} must be >= 0 (the milliseconds each environment step sleeps).")
    return f"{__name__}:after_{f'{ms:f}'.rstrip('0').rstrip('.')}ms"


class Scripted:
    """One sample's episode; `delay_s` (a class attribute) is each step's sleep."""

    delay_s = 0.0
    stop_strings = (STOP,)

    def __init__(self, example: dict):
        self.example, self.actions = example, []

    def reset(self):
        return None

    def step(self, action: str) -> envs.StepResult:
        time.sleep(self.delay_s)
        self.actions.append(action)
        if len(self.actions) == 1 and action.endswith(STOP):
            return envs.StepResult(" ")
        transcript = " ".join(self.actions)
        right = rewards.answer_correctness([self.example["prompt"]], [transcript], answer=[self.example["answer"]],
                                           task=[self.example["task"]])[0]
        return envs.StepResult(None, float(right), True)


@functools.cache
def _scripted(ms: str) -> type:
    return type(f"after_{ms}ms", (Scripted,), dict(delay_s=float(ms) / 1e3))


def __getattr__(attribute: str):
    match = _NAME.fullmatch(attribute)
    if match is None:
        raise AttributeError(f"module {__name__!r} has no attribute {attribute!r} (names are after_<ms>ms)")
    return _scripted(match["ms"])
