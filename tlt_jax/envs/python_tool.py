"""The python tool: tool-integrated reasoning (ToRL), the model's code run in a sandbox."""
from __future__ import annotations

import re
from typing import Sequence

from tlt_jax import rewards, sandbox

_PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _cell_program(earlier: Sequence[str], cell: str) -> str:
    """A program that replays the earlier cells silently (the interpreter's state, kept
    across a sample's blocks), then runs `cell`, printing its error's last line if it raises."""
    return "\n".join([
        "import contextlib as _c, io as _io, traceback as _tb",
        "_g = {'__name__': '__main__'}",
        f"for _src in {list(earlier)!r}:",
        "    with _c.redirect_stdout(_io.StringIO()), _c.redirect_stderr(_io.StringIO()):",
        "        try:",
        "            exec(compile(_src, '<cell>', 'exec'), _g)",
        "        except BaseException:",
        "            pass",
        "try:",
        f"    exec(compile({cell!r}, '<cell>', 'exec'), _g)",
        "except BaseException as _e:",
        "    print(_tb.format_exception_only(type(_e), _e)[-1].strip())",
    ])


class PythonTool:
    """Tool-integrated reasoning (ToRL): the model writes a ```python block and then
    ```output; the block runs in the `code` reward's sandbox (sandbox.execute), the
    interpreter's state kept across the sample's blocks, and its output comes back,
    closing the ```output block. A turn with no python block is the final answer, scored
    by the math reward against the example's answer (1 or 0); the episode ends there."""

    stop_strings = ("```output",)
    limits = sandbox.Limits(timeout_s=5.0, memory_mb=512, output_bytes=1 << 14)
    mode = "auto"
    max_output_chars = 1000

    def __init__(self, example: dict):
        self.prompt, self.answer = example["prompt"], str(example["answer"])
        self.cells: list[str] = []

    def reset(self):
        return None

    def step(self, action: str):
        blocks = _PYTHON_BLOCK.findall(action)
        if not blocks or not action.rstrip().endswith("```output"):
            score = rewards.math_correctness([self.prompt], [action], answer=[self.answer])[0]
            return None, float(score), True
        stdout, outcome = sandbox.execute(_cell_program(self.cells, blocks[-1]), self.limits, self.mode)
        if outcome.failure is None:
            self.cells.append(blocks[-1])
        else:
            stdout += f"{outcome.failure}: {outcome.detail}\n"
        stdout = stdout[-self.max_output_chars:]
        return "\n" + stdout + ("" if stdout.endswith("\n") else "\n") + "```\n", 0.0, False

