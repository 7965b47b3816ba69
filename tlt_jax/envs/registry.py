"""The environments by name: the built-ins (`BUILT_IN`), or `module.path:ClassName`."""
from __future__ import annotations

from typing import Any

from tlt_jax import by_name
from tlt_jax.envs.hanoi import TowerOfHanoi
from tlt_jax.envs.python_tool import PythonTool

BUILT_IN: dict[str, Any] = {"python_tool": PythonTool, "tower_of_hanoi": TowerOfHanoi}


def env_class(name: str) -> type:
    """The class config.env.name names: a built-in or `module.path:ClassName` (ValueError
    or ImportError, one line naming the field)."""
    cls = by_name.resolve(name, BUILT_IN, "config.env.name", "environment", "ClassName")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"config.env.name={name!r} has no {' or '.join(missing)} method; an environment needs "
                         "reset() -> first message and step(action) -> envs.StepResult.")
    return cls
