"""The `code` reward: a completion's program run against its row's tests in a sandbox
(options from config.code; docs/code.md)."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
from typing import Sequence

from tlt_jax import sandbox
from tlt_jax.rewards import code_tests
from tlt_jax.rewards.verifiers import ExplainedScore

logger = logging.getLogger(__name__)
# A program's limits by default (the `sandbox` field below shadows the module in the class).
_LIMITS = sandbox.Limits()


@dataclasses.dataclass(frozen=True)
class CodeReward:
    """The `code` reward: each completion's program (`code_tests.program_of`) run against
    its row's tests (`code_tests.row_tests`) in a fresh sandbox (`sandbox.run`).

    Scores the share of tests passed (partial_credit=False: 1 only if all pass), as
    `ExplainedScore` with passed / total and the first failure's kind. A sample whose sandbox
    failed before its program ran scores NaN: counted as a failed sample, scored 0 and
    shown once per batch by `safe_rewards`, while the rest of the batch scores as usual.

    partial_credit: see above; sandbox: a mode of `sandbox.MODES`; timeout_s (per test),
    memory_mb, output_bytes, file_bytes, processes, disk_mb: each program's `sandbox.Limits`;
    forgeable: what to do with a test the checker cannot decide without the program in its
    own interpreter (`sandbox.Outcome.forgeable`; one warning names the first): "skip" it
    (left out of the share; a sample with no other test scores 0), "run" the row the old,
    forgeable way, or raise an "error";
    max_parallel: sandboxes at once (0: four per CPU: a sandbox spends much of its life
    starting and waiting, and the loops of a batch should time out side by side); python: the interpreter programs
    run with ("": `sandbox.default_python`).
    """

    partial_credit: bool = True
    sandbox: str = "auto"
    timeout_s: float = _LIMITS.timeout_s
    memory_mb: int = _LIMITS.memory_mb
    output_bytes: int = _LIMITS.output_bytes
    file_bytes: int = _LIMITS.file_bytes
    processes: int = _LIMITS.processes
    disk_mb: int = _LIMITS.disk_mb
    forgeable: str = "skip"
    max_parallel: int = 0
    python: str = ""

    def __post_init__(self):
        _ = self.limits  # whose checks name the bad field
        if self.forgeable not in FORGEABLE_POLICIES:
            raise ValueError(f"code.forgeable={self.forgeable!r}; choose from {', '.join(FORGEABLE_POLICIES)}.")
        if self.max_parallel < 0:
            raise ValueError(f"code.max_parallel={self.max_parallel} must be >= 0 (0: four per CPU).")
        if self.sandbox not in sandbox.MODES:
            raise ValueError(f"code.sandbox={self.sandbox!r}; choose from {', '.join(sandbox.MODES)}.")

    @property
    def limits(self) -> sandbox.Limits:
        return sandbox.Limits(self.timeout_s, self.memory_mb, self.output_bytes, self.file_bytes, self.processes,
                              self.disk_mb)

    @property
    def parallel(self) -> int:
        """Sandboxes at once: within a call, and the threads `Scorer` scores samples on."""
        return self.max_parallel or 4 * (os.cpu_count() or 1)

    def check(self) -> str:
        """The sandbox mode this machine runs ours as (ValueError, one line, if it cannot)."""
        return sandbox.resolve_mode(self.sandbox, self.python or sandbox.default_python())

    def _outcome(self, prompt, completion: str, row: dict) -> sandbox.Outcome:
        suite = code_tests.row_tests(prompt, row)
        program = code_tests.program_of(completion, suite)
        outcome = sandbox.run(program, suite, self.limits, self.sandbox, self.python)
        if outcome.forgeable:
            _warn_forgeable(self.forgeable, suite, outcome)
            if self.forgeable == "error":
                raise ValueError(f"code.forgeable='error': a test of the row {suite.tests[0]!r:.80} cannot be decided "
                                 f"outside the program's interpreter ({outcome.detail}); set code.forgeable='skip' "
                                 "to leave such tests out, or 'run' to run them forgeably.")
            if self.forgeable == "run":
                outcome = dataclasses.replace(sandbox.run(program, suite, self.limits, self.sandbox, self.python,
                                                          inline=True), forgeable=outcome.forgeable)
        return outcome

    def _score(self, outcome: sandbox.Outcome) -> ExplainedScore:
        info = {k: v for k, v in dataclasses.asdict(outcome).items() if k != "forgeable" or v}
        if outcome.failure == "sandbox_error":
            return ExplainedScore(float("nan"), info)
        decided = outcome.total - (outcome.forgeable if self.forgeable == "skip" else 0)
        share = outcome.passed / max(decided, 1)
        return ExplainedScore(share if self.partial_credit else float(decided > 0 and outcome.passed == decided), info)

    def __call__(self, prompts: Sequence, completions: Sequence[str], **fields) -> list[ExplainedScore]:
        rows = [{k: v[i] for k, v in fields.items()} for i in range(len(completions))]
        for prompt, row in zip(prompts, rows, strict=True):
            code_tests.row_tests(prompt, row)  # a bad row fails the batch before any sandbox runs
        self.check()
        with concurrent.futures.ThreadPoolExecutor(max(1, min(self.parallel, len(completions)))) as pool:
            return [self._score(o) for o in pool.map(self._outcome, prompts, completions, rows)]


FORGEABLE_POLICIES = ("skip", "run", "error")


_forgeable_warned = threading.Event()


def _warn_forgeable(policy: str, suite: sandbox.Suite, outcome: sandbox.Outcome) -> None:
    """Once per process, for the first row with tests the checker cannot decide."""
    if not _forgeable_warned.is_set():
        _forgeable_warned.set()
        logger.warning("code reward: %d of %d tests of the row %r cannot be decided outside the program's own "
                       "interpreter (%s); code.forgeable=%r (counted in reward_info['forgeable']).",
                       outcome.forgeable, outcome.total, str(suite.tests[0])[:80], outcome.detail, policy)

