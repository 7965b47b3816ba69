"""The host's judges of one run: each test's end, in order and once, read from what the
interpreters say, and what cut the run short."""
from __future__ import annotations

import contextlib
import json
import secrets
from typing import Sequence

from tlt_jax.sandbox import harness
from tlt_jax.sandbox.interpreter import Interpreter
from tlt_jax.sandbox.spec import DETAIL_CHARS, Limits, Outcome, Suite, stdout_matches


def json_object(line: bytes) -> dict | None:
    """The JSON object a line holds (None for anything else)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


class Judge:
    """The host's side of one run's tests: each test's end, in order and once, and what
    cut the run short. Subclasses read what the interpreters say (`on_line`)."""

    def __init__(self, suite: Suite, limits: Limits):
        self.suite, self.limits = suite, limits
        self.loaded = False
        self.results: list[tuple[str | None, str]] = []  # per test that ended: (failure kind or None, detail)
        self.failure: tuple[str, str] | None = None  # what ended the run early, if anything
        self.stdouts: list[str] = []  # per stdin/stdout test that ran to its end
        self.progress = 0  # events that restart the window: loads and tests

    def finished(self) -> bool:
        return self.failure is not None or len(self.results) == len(self.suite.tests)

    def end_test(self, kind: str | None, detail: str = "") -> None:
        self.results.append((kind, str(detail)[:DETAIL_CHARS]))
        self.progress += 1

    def on_event(self, record: dict) -> bool:
        """A load event of the program, taken before it has loaded, once: later ones (a
        program may write them itself) neither restart the window nor ask again. Whether
        `record` was an event."""
        event = record.get("event")
        if self.loaded or event is None:
            return event is not None
        if event in ("syntax_error", "load_error"):
            self.failure = (harness.solution_kind(record) if event == "load_error" else "syntax_error",
                            str(record.get("detail", ""))[:DETAIL_CHARS])
        elif event == "loaded":
            self.loaded = True
            self.progress += 1
        return True

    def outcome(self, interpreters: Sequence[Interpreter]) -> Outcome:
        total = len(self.suite.tests)
        passed = sum(kind is None for kind, _ in self.results)
        forgeable = sum(kind == "forgeable" for kind, _ in self.results)
        failures = [(kind, detail) for kind, detail in self.results if kind not in (None, "forgeable")]
        unready = [i for i in interpreters if not i.ready]
        if unready and not self.results and (self.failure is None or self.failure[0] == "sandbox_error"):
            stderr = unready[0].stderr_head.decode(errors="replace").strip().splitlines()
            why = stderr[-1] if stderr else f"exit status {unready[0].process.poll()}"
            return Outcome(0, total, "sandbox_error", f"the sandbox failed before the program ran: {why}"[
                :DETAIL_CHARS])
        if self.failure is None and not failures and passed + forgeable < total:
            status = interpreters[-1].process.poll()
            self.failure = ("runtime_error", f"exited (status {status}) before its tests ended")
        first = failures[0] if failures else self.failure or next(
            ((k, d) for k, d in self.results if k == "forgeable"), None)
        return Outcome(passed, total, *(first or (None, "")), forgeable=forgeable)


class StdioJudge(Judge):
    """stdin/stdout tests: the harness reports each test's output (with the job's nonce);
    the host compares it."""

    def __init__(self, suite: Suite, limits: Limits):
        super().__init__(suite, limits)
        self.nonce = secrets.token_hex(16)

    def on_line(self, interpreter: Interpreter, line: bytes) -> None:
        if not line.startswith(self.nonce.encode()):
            return
        with contextlib.suppress(ValueError, RecursionError, AttributeError):
            record = json.loads(line[len(self.nonce):])
            if record.get("event") == "ready":
                interpreter.ready = True
            elif not self.on_event(record) and record.get("test") == len(self.results) < len(self.suite.tests):
                self.judge(record)

    def judge(self, record: dict) -> None:
        if record.get("kind"):
            kind = record["kind"]
            return self.end_test(kind if kind in _STDIO_KINDS else "runtime_error", record.get("detail", ""))
        stdout = str(record.get("stdout", ""))
        self.stdouts.append(stdout)
        expected = self.suite.expected
        if expected is not None and not stdout_matches(stdout, expected[len(self.results)]):
            return self.end_test("wrong_answer", f"printed {stdout!r:.200}")
        self.end_test(None)


def _event(line: bytes) -> dict:
    """A solution's load event ({} for anything else: its replies pass through unread, so
    the host never decodes what a program returns)."""
    if not line.startswith(b'{"event": '):
        return {}
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


_CHECKER_KINDS = (None, "wrong_answer", "runtime_error", "memory", "disk_limit", "forgeable")
_STDIO_KINDS = ("runtime_error", "memory", "output_limit")  # what a stdin/stdout test's report may say failed


class CheckJudge(Judge):
    """asserts, check and call tests: the checker runs the row's test code (or the calls
    of fn_name against their expected values) and reports each test's end; its calls into
    the program go to the solution, their replies come back, one per request, through
    here, unread."""

    def __init__(self, suite: Suite, limits: Limits):
        super().__init__(suite, limits)
        self.waiting: list[bytes] = []  # the checker's requests not yet with the solution
        self.asked = False  # a request is with the solution
        self.checker: Interpreter | None = None

    def on_line(self, interpreter: Interpreter, line: bytes) -> None:
        if interpreter.role == "checker":
            self.checker = interpreter
            self.from_checker(interpreter, line)
        else:
            self.from_solution(interpreter, line)

    def from_checker(self, checker: Interpreter, line: bytes) -> None:
        record = json_object(line)
        if record is None:
            return
        event, detail = record.get("event"), str(record.get("detail", ""))[:DETAIL_CHARS]
        if event == "ready":
            checker.ready = True
        elif record.get("op"):
            self.waiting.append(line)
        elif event == "loaded":
            self.progress += 1
        elif event in ("syntax_error", "load_error"):
            self.failure = (str(record.get("kind") or event), detail)
        elif record.get("test") == len(self.results) < len(self.suite.tests):
            kind = record.get("kind")
            self.end_test(kind if kind in _CHECKER_KINDS else "runtime_error", detail)

    def from_solution(self, solution: Interpreter, line: bytes) -> None:
        record = _event(line)
        if record.get("event") == "ready":
            solution.ready = True
        elif not self.on_event(record) and self.asked and self.checker is not None:
            self.asked = False
            self.checker.tell(line)

    def relay(self, interpreters: Sequence[Interpreter]) -> None:
        """Hands the solution the checker's next request, once it has loaded and is free."""
        solution = next((i for i in interpreters if i.role == "solution"), None)
        if solution is not None and self.loaded and not self.asked and self.waiting:
            solution.tell(self.waiting.pop(0))
            self.asked = True

