"""Multi-turn environments: their shape (`base`), the run's environments and their
turns as tokens (`episodes`), the environments by name (`registry`), and the built-ins:
the python tool (`python_tool`) and a planning puzzle (`hanoi`).

The names below are the package's public API; the modules hold the rest.
"""
from tlt_jax.envs.base import Env, StepResult
from tlt_jax.envs.episodes import (
                                   MAX_STOP_TOKENIZATIONS,
                                   EnvConfig,
                                   Episodes,
                                   example_dict,
                                   no_reward,
                                   rollout_sampling_params,
                                   stop_sequences,
)
from tlt_jax.envs.hanoi import MOVE, TowerOfHanoi, hanoi_solution, illegal_move, score_moves, solved
from tlt_jax.envs.python_tool import PythonTool
from tlt_jax.envs.registry import BUILT_IN, env_class

__all__ = ["BUILT_IN", "MAX_STOP_TOKENIZATIONS", "MOVE", "Env", "EnvConfig", "Episodes", "PythonTool", "TowerOfHanoi",
           "env_class", "example_dict", "hanoi_solution", "illegal_move", "no_reward", "rollout_sampling_params",
           "score_moves", "solved", "stop_sequences", "StepResult"]
