"""Running an untrusted Python program against its tests, isolated from the host.

`run(program, suite, limits, mode)` starts the sandboxes of one program, each a fresh
interpreter (`harness.py`, exec'd, never forked from us) in a directory of its
own, with a cleared environment, its own process group and, as root, its own uid. The
harness sets the resource limits (CPU seconds, address space, file size, processes)
before any untrusted code runs. How a suite runs depends on its layout:

  asserts, check  two sandboxes. The checker runs the row's test code (MBPP's asserts and
                  setup, HumanEval's prompt and `check`) and decides each test; every name
                  the tests take from the program is a stub whose calls go, through the
                  host, to the solution sandbox, which holds only the program and answers
                  with the returned value as a builtin value (never pickle). So a program
                  can rig no comparison, call no reporter and read no expected value.
  call            the same two sandboxes: the checker calls fn_name with each test's
                  arguments and compares the value with the expected one, which never
                  reaches the solution. The host relays, and never decodes, what the
                  program returns.
  stdio           one sandbox; each test's stdout comes back and the host compares it.

The host enforces the rest: a wall-clock window of `timeout_s` per test (the first
timeout ends the run: its later tests fail), a cap on the bytes each sandbox writes to
stdout and stderr, and at the end every process of every sandbox is killed.

Each sandbox runs in a mode of `modes.MODES` and, as root, as a uid of its own (`uids`).
"""
from __future__ import annotations

import contextlib
import os
import selectors
import time
from typing import Sequence

from tlt_jax.sandbox import interpreter as interpreter_lib
from tlt_jax.sandbox import modes
from tlt_jax.sandbox.interpreter import Interpreter
from tlt_jax.sandbox.judges import CheckJudge, Judge, StdioJudge
from tlt_jax.sandbox.spec import Limits, Outcome, Suite

_SAID_CAP_FACTOR = 16  # what a sandbox may say (reports, requests, replies), in code.output_bytes


class Relay:
    """The host's loop over one run's interpreters, until every test has ended, a window
    passes, a cap is passed or every interpreter has gone: feeds their jobs, hands the
    lines they say to the judge, writes what the judge tells them, drains and counts
    their output."""

    def __init__(self, interpreters: Sequence[Interpreter], judge: Judge):
        self.interpreters, self.judge = interpreters, judge
        self.selector = selectors.DefaultSelector()
        self.told: set[int] = set()  # the told pipes registered for writing
        self.started = self.last_progress = time.monotonic()
        self.progress = judge.progress
        for interpreter in interpreters:  # an interpreter a session relays again: what is still open
            process = interpreter.process
            streams = [(process.stdin, selectors.EVENT_WRITE, "job")] if interpreter.job else []
            streams += [(process.stdout, selectors.EVENT_READ, "output"),
                        (process.stderr, selectors.EVENT_READ, "stderr")]
            for stream, event, what in streams:
                if what not in interpreter.ended:
                    os.set_blocking(stream.fileno(), False)
                    self.selector.register(stream, event, (interpreter, what))
            if "said" not in interpreter.ended:
                self.selector.register(interpreter.said_fd, selectors.EVENT_READ, (interpreter, "said"))

    def run(self) -> None:
        judge = self.judge
        try:
            while not judge.finished() and self.decider_says():
                if isinstance(judge, CheckJudge):
                    judge.relay(self.interpreters)
                self.register_writes()
                timeout = self.time_left()
                if timeout <= 0:
                    judge.failure = ("timeout" if self.all_ready() else "sandbox_error",
                                     f"no test ended within code.timeout_s={judge.limits.timeout_s:g} s")
                    return
                for key, _ in self.selector.select(timeout):
                    interpreter, what = key.data
                    if what == "job":
                        self.write_job(interpreter, key)
                    elif what == "told":
                        self.write_told(interpreter, key)
                    else:
                        self.read(interpreter, what, key)
                    if judge.failure is not None:
                        return
        finally:
            self.selector.close()

    def decider_says(self) -> bool:
        """Whether the interpreter that reports the tests' ends (checker or stdio harness)
        still has its channel open: once it has gone, no test can end any more."""
        return any(key.data[1] == "said" and key.data[0].role != "solution"
                   for key in self.selector.get_map().values())

    def all_ready(self) -> bool:
        return all(interpreter.ready for interpreter in self.interpreters)

    def time_left(self) -> float:
        """Seconds to the end of this window (a test's, or start-up's), within the run's total."""
        limits, now = self.judge.limits, time.monotonic()
        if self.judge.progress != self.progress:
            self.progress, self.last_progress = self.judge.progress, now
        window = self.last_progress + limits.timeout_s if self.all_ready() else self.started + modes.STARTUP_S
        total = self.started + modes.STARTUP_S + limits.timeout_s * (len(self.judge.suite.tests) + 1)
        return min(window, total) - now

    def register_writes(self) -> None:
        for interpreter in self.interpreters:
            fd = interpreter.told_fd
            if fd is not None and interpreter.outbox and fd not in self.told:
                os.set_blocking(fd, False)
                self.selector.register(fd, selectors.EVENT_WRITE, (interpreter, "told"))
                self.told.add(fd)

    def write_job(self, interpreter: Interpreter, key: selectors.SelectorKey) -> None:
        try:
            interpreter.job = interpreter.job[os.write(key.fd, interpreter.job):]
        except BrokenPipeError:
            interpreter.job = interpreter.job[:0]
        if not interpreter.job:
            self.selector.unregister(key.fileobj)
            interpreter.process.stdin.close()

    def write_told(self, interpreter: Interpreter, key: selectors.SelectorKey) -> None:
        if key.fd not in self.told or interpreter.told_fd != key.fd:  # hung up earlier in this round
            return
        try:
            del interpreter.outbox[:os.write(key.fd, interpreter.outbox)]
        except BrokenPipeError:
            interpreter.outbox.clear()
        if not interpreter.outbox:
            self.unregister_told(key.fd)

    def unregister_told(self, fd: int | None) -> None:
        if fd in self.told:
            self.selector.unregister(fd)
            self.told.discard(fd)

    def read(self, interpreter: Interpreter, what: str, key: selectors.SelectorKey) -> None:
        judge, cap = self.judge, self.judge.limits.output_bytes
        data = os.read(key.fd, 1 << 16)
        if not data:
            self.selector.unregister(key.fileobj)
            interpreter.ended.add(what)
            if what == "said" and interpreter.role == "solution":
                self.solution_gone()
        elif what == "said":
            interpreter.said_bytes += len(data)
            lines = interpreter.lines(data, cap + (1 << 16))
            if interpreter.said_bytes > _SAID_CAP_FACTOR * cap:  # replies flooding the host
                judge.failure = ("output_limit", f"more than {_SAID_CAP_FACTOR} x code.output_bytes of replies")
            elif lines is None:
                judge.failure = ("output_limit", "a line past the output cap")
            else:
                for line in lines:
                    judge.on_line(interpreter, line)
        else:
            if what == "stderr" and len(interpreter.stderr_head) < 4096:
                interpreter.stderr_head += data[:4096]
            interpreter.output_bytes += len(data)
            if interpreter.output_bytes > cap:
                judge.failure = ("output_limit", f"more than code.output_bytes={cap}")

    def solution_gone(self) -> None:
        """The program's interpreter has exited: a load never made is the run's failure,
        and the checker's stubs fail from now on."""
        if not self.judge.loaded and self.judge.failure is None:
            self.judge.failure = ("runtime_error", "the program exited before it loaded")
        for other in self.interpreters:
            if other.role == "checker":
                self.unregister_told(other.told_fd)
                other.hang_up()


def run(program: str, suite: Suite, limits: Limits = Limits(), mode: str = "auto", python: str = "",
        inline: bool = False) -> Outcome:
    """Runs `program` against `suite` (see the module doc); never raises for what the
    program does. inline: asserts and check tests in the program's own interpreter
    (code.forgeable="run": forgeable, for rows the two-process path cannot decide)."""
    return _run(program, suite, limits, mode, python, inline)[0]


def execute(program: str, limits: Limits = Limits(), mode: str = "auto", python: str = "") -> tuple[str, Outcome]:
    """Runs `program` once as __main__ with empty stdin in a new sandbox: (what it printed,
    its Outcome: failure None when it ran to its end). A tool's call, not a test."""
    outcome, stdouts = _run(program, Suite("stdio", [""]), limits, mode, python, False)
    return (stdouts[0] if stdouts else ""), outcome


def _run(program: str, suite: Suite, limits: Limits, mode: str, python: str,
         inline: bool) -> tuple[Outcome, list[str]]:
    python = python or modes.default_python()
    mode = modes.resolve_mode(mode, python)
    windows = len(suite.tests) + 1
    if suite.layout == "stdio":
        judge = StdioJudge(suite, limits)
        jobs = [("stdio", {"program": program, "tests": list(suite.tests), "nonce": judge.nonce})]
    else:
        checker = {"layout": suite.layout, "tests": list(suite.tests), "setup": suite.setup,
                   "preamble": suite.preamble, "entry_point": suite.entry_point, "fn_name": suite.fn_name,
                   "expected": list(suite.expected or [])}
        judge = CheckJudge(suite, limits)
        if inline and suite.layout != "call":
            jobs = [("checker", dict(checker, program=program))]
            judge.loaded = True  # no solution to wait for
        else:
            jobs = [("checker", checker), ("solution", {"program": program, "setup": suite.setup})]
    with contextlib.ExitStack() as stack:
        interpreters = [stack.enter_context(interpreter_lib.start(role, dict(job, windows=windows), mode, python,
                                                                  limits)) for role, job in jobs]
        Relay(interpreters, judge).run()
        return judge.outcome(interpreters), judge.stdouts
