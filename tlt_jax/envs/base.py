"""The shape of a multi-turn environment (`Env`): the model acts, the environment answers."""
from __future__ import annotations

from typing import Protocol


class Env(Protocol):
    def __init__(self, example: dict): ...

    def reset(self) -> str | list[dict] | None: ...

    def step(self, action: str) -> tuple: ...
