"""What the code reward's and the sandbox's tests share: the sandbox modes to run (bwrap
skipped where it is not available), scoring through the public code reward, a program that
tries to harm the host, and the processes a sandbox left (the `canary` fixture, in
tests/conftest.py, checks for them after each test that uses it)."""
import dataclasses

import pytest

from tlt_jax import rewards, sandbox
from tlt_jax.sandbox import modes as sandbox_modes
from tlt_jax.sandbox import uids as sandbox_uids

MODES = ["bwrap", "rlimits"]
STRONG = sandbox.resolve_mode("auto", sandbox.default_python())


def require_mode(mode: str) -> str:
    """`mode`, or the test skipped where it is bwrap and bwrap is not available."""
    if mode == "bwrap" and STRONG != "bwrap":
        pytest.skip(f"bwrap is not available here: {sandbox_modes.bwrap_problem(sandbox.default_python())}")
    return mode


def score(completions, *, mode="auto", prompts=None, **options_and_fields):
    """Scores of CodeReward(options) on completions, with per-sample fields."""
    option_names = {f.name for f in dataclasses.fields(rewards.CodeReward)}
    options = {k: v for k, v in options_and_fields.items() if k in option_names}
    fields = {k: v for k, v in options_and_fields.items() if k not in option_names}
    options.setdefault("timeout_s", 3.0)
    reward = rewards.get_reward("code", sandbox=mode, **options)
    return reward(prompts or [""] * len(completions), completions, **fields)


def leftover_processes() -> list[int]:
    return [pid for live, _ in sandbox_uids.processes_by_uid(sandbox_uids.SANDBOX_UIDS).values() for pid in live]


def vandal(canary) -> str:
    """Lines that try to harm the host: write and remove a file outside the sandbox."""
    return (f"import os\ntry:\n    open({str(canary)!r}, 'w').write('harmed')\nexcept OSError:\n    pass\n"
            f"try:\n    os.remove({str(canary)!r})\nexcept OSError:\n    pass\n")


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\nDone."
