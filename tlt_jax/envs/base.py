"""The shape of a multi-turn environment (`Env`): the model acts, the environment answers
with a `StepResult`."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Protocol


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What `Env.step` returns (SkyRL-gym's BaseTextEnvStepOutput, typed).

    observation: the environment's answer, what the model reads before its next turn;
    None ends the episode. reward: this step's reward (a sample's reward is the sum of
    its steps'). done: the episode ends after this step. info: a small JSON-able dict
    saying why (eval_samples.jsonl shows it with the turn).
    """

    observation: str | None
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not (self.observation is None or isinstance(self.observation, str)):
            raise TypeError(f"StepResult.observation is a {type(self.observation).__name__}; give the text the "
                            "model reads next, or None to end the episode.")
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or \
                not math.isfinite(self.reward):
            raise TypeError(f"StepResult.reward={self.reward!r:.80} is not a finite number.")
        if not isinstance(self.done, bool):
            raise TypeError(f"StepResult.done={self.done!r:.80} is not a bool.")
        if not isinstance(self.info, Mapping):
            raise TypeError(f"StepResult.info is a {type(self.info).__name__}; give a dict (or leave it out).")


class Env(Protocol):
    """One sample's environment. `close` is optional (no-op when absent): it always runs
    once the episode is over, however it ended, to free what the environment holds (the
    python tool's interpreter)."""

    def __init__(self, example: dict): ...

    def reset(self) -> str | list[dict] | None: ...

    def step(self, action: str) -> StepResult: ...

    def close(self) -> None: ...
