"""The python tool: tool-integrated reasoning (ToRL), the model's code run in a sandbox."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from tlt_jax import rewards, sandbox
from tlt_jax.envs.base import StepResult

if TYPE_CHECKING:
    from tlt_jax.envs.episodes import EnvConfig

_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


class PythonTool:
    """Tool-integrated reasoning (ToRL): the model writes a ```python block and then
    ```output; the block runs as the next cell of the episode's own sandboxed interpreter
    (`sandbox.Session`: one per episode, its state kept across the sample's blocks, no
    block ever run twice), and its output comes back, closing the ```output block. A turn
    with no python block is the final answer, scored by the math reward against the
    example's answer (1 or 0); the episode ends there.

    code: the sandbox's mode, interpreter and limits (`rewards.CodeReward`, config.code;
    timeout_s is each cell's); cells: the most cells the episode runs (env.max_turns).
    """

    stop_strings = ("```output",)
    max_output_chars = 1000

    def __init__(self, example: dict, code: rewards.CodeReward | None = None, cells: int = 16):
        self.prompt, self.answer = example["prompt"], str(example["answer"])
        code = code or rewards.CodeReward()
        self.session = sandbox.Session(code.limits, code.sandbox, code.python, cells=cells)
        self.cells = 0  # cells run

    @classmethod
    def from_env_config(cls, example: dict, config: EnvConfig) -> PythonTool:
        return cls(example, config.code, config.max_turns)

    def reset(self):
        return None

    def step(self, action: str) -> StepResult:
        blocks = _PYTHON_BLOCK.findall(action)
        if not blocks or not action.rstrip().endswith("```output"):
            score = rewards.math_correctness([self.prompt], [action], answer=[self.answer])[0]
            return StepResult(None, float(score), True)
        stdout, outcome = self.session.run_cell(blocks[-1])
        self.cells += 1
        if outcome.failure is not None:
            stdout += f"{outcome.failure}: {outcome.detail}\n"
        stdout = stdout[-self.max_output_chars:]
        return StepResult("\n" + stdout + ("" if stdout.endswith("\n") else "\n") + "```\n")

    def close(self) -> None:
        self.session.close()
