"""Running an untrusted Python program against its tests, isolated from the host.

`run(program, suite, limits, mode)` starts the sandboxes of one program, each a fresh
interpreter (`sandbox_harness.py`, exec'd, never forked from us) in a directory of its
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

Modes (`MODES`; docs/code.md says what each protects against):
  bwrap    bubblewrap (Debian package `bubblewrap`): new user, pid, network, ipc and uts
           namespaces, a root filesystem of read-only system directories and, as the one
           writable place, a tmpfs of `disk_mb`; no network at all, every process killed
           with it;
  rlimits  the resource limits alone, for machines where namespaces are blocked (some
           containers' seccomp): no network or filesystem isolation beyond file
           permissions, and no bound on the disk a program fills.
  auto     bwrap where this machine can run it, else rlimits, with one warning saying so.

Each sandbox, as root, runs as a uid of its own (`sandbox_uids`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import pathlib
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator, Sequence

from tlt_jax.data import sandbox_harness, sandbox_uids

MODES = ("auto", "bwrap", "rlimits")
INSTALL_HINT = "apt-get install -y bubblewrap"
FAILURE_KINDS = ("wrong_answer", "runtime_error", "timeout", "memory", "output_limit", "disk_limit",
                 "syntax_error", "sandbox_error", "forgeable")
_HARNESS = pathlib.Path(__file__).with_name("sandbox_harness.py").read_text()  # run as python -I -c
_STARTUP_S = 30.0  # for the sandbox and its interpreter to be up, on a loaded machine
_EXIT_GRACE_S = 0.5  # for a sandbox whose tests all ended to exit by itself
_DETAIL_CHARS = 300
_SAID_CAP_FACTOR = 16  # what a sandbox may say (reports, requests, replies), in code.output_bytes
_SYSTEM_PATHS = "/usr/local/bin:/usr/bin:/bin"


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one program may use. timeout_s: wall seconds per test (and for loading the
    program); memory_mb: address space, MiB; output_bytes: what the sandbox may write to
    stdout and stderr, and each stdin/stdout test's output; file_bytes: the largest file it
    may write; processes: tasks of its uid at once (threads count); disk_mb: all it may
    write, together, under bwrap (a size-capped tmpfs; rlimits cannot bound it)."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    output_bytes: int = 1 << 20
    file_bytes: int = 16 << 20
    processes: int = 16
    disk_mb: int = 64

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "output_bytes", "file_bytes", "processes", "disk_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"code.{name}={getattr(self, name)!r} must be > 0.")


@dataclasses.dataclass(frozen=True)
class Suite:
    """The tests of one program, as the harness runs them.

    layout: "asserts" (tests: statements, MBPP's test_list; setup: run once before them),
    "check" (tests: [HumanEval's test code]; entry_point: what check() gets; preamble:
    the prompt's code, whose helpers the tests may use), "call" (tests: argument lists
    for fn_name), or "stdio" (tests: stdin texts).
    expected: per test, the return value ("call", compared in the checker) or stdout
    ("stdio", compared on the host); it never enters the program's sandbox.
    """

    layout: str
    tests: Sequence
    setup: str = ""
    entry_point: str = ""
    fn_name: str = ""
    expected: Sequence | None = None
    preamble: str = ""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """passed of total tests; failure: the first failed test's kind (FAILURE_KINDS) or None;
    sandbox_error means the sandbox itself failed before the program ran; forgeable: tests
    the checker could not decide without the program in its own interpreter (an argument
    that is no builtin value, a setup that builds the program's objects)."""

    passed: int
    total: int
    failure: str | None = None
    detail: str = ""
    forgeable: int = 0


def stdout_matches(actual: str, expected: str) -> bool:
    """Line by line, trailing whitespace and trailing blank lines ignored."""
    lines = lambda text: [line.rstrip() for line in text.rstrip().splitlines()]
    return lines(actual) == lines(expected)


def _reachable_by_others(path: str) -> bool:
    """Whether an unprivileged uid can execute `path` (every directory on the way searchable)."""
    path = os.path.realpath(path)
    parts = [path] + [os.path.dirname(path)]
    while parts[-1] != "/":
        parts.append(os.path.dirname(parts[-1]))
    try:
        return bool(os.stat(path).st_mode & 0o001) and all(os.stat(p).st_mode & 0o001 for p in parts[1:])
    except OSError:
        return False


@functools.cache
def default_python() -> str:
    """The interpreter programs run with: this one, where the sandbox uid can reach it,
    else the system's python3."""
    if os.geteuid() != 0 or _reachable_by_others(sys.executable):
        return sys.executable
    found = shutil.which("python3", path=_SYSTEM_PATHS)
    if found is None:
        raise FileNotFoundError(f"No python3 the sandbox uid can run: {sys.executable} is under a private "
                                f"directory and {_SYSTEM_PATHS} has none; set code.python.")
    return found


def _clean_env(home: str) -> dict[str, str]:
    return {"PATH": _SYSTEM_PATHS, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}


_INSIDE = "/sandbox"  # the run's directory, as the program sees it under bwrap


def _bwrap_args(python: str, disk_mb: int = Limits.disk_mb) -> list[str]:
    """bubblewrap's command line up to the program: system directories read-only, a tmpfs
    of disk_mb MiB the only writable place (the new root and /dev, /dev/shm included, are
    remounted read-only), /proc and a minimal /dev, every namespace new."""
    args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-all", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    if not prefix.startswith("/usr/"):
        args += ["--ro-bind", prefix, prefix]
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "0777", "--size", str(disk_mb << 20), "--tmpfs",
             _INSIDE, "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", _INSIDE, "--clearenv"]
    for name, value in _clean_env(_INSIDE).items():
        args += ["--setenv", name, value]
    return args + ["--"]


@functools.cache
def _bwrap_problem(python: str) -> str | None:
    """Why bwrap cannot run programs here (None: it can), from one trial run."""
    if shutil.which("bwrap") is None:
        return f"bwrap is not installed ({INSTALL_HINT})"
    with sandbox_uids.lease() as uid, tempfile.TemporaryDirectory(prefix="tlt_code_") as workdir:
        if uid is not None:
            os.chown(workdir, uid, uid)
        ids = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
        try:
            done = subprocess.run(_bwrap_args(python) + [python, "-I", "-c", "pass"], cwd=workdir,
                                  env=_clean_env(workdir), capture_output=True, timeout=_STARTUP_S, **ids)
        except subprocess.TimeoutExpired:
            return f"bwrap did not start a program within {_STARTUP_S:g} s"
    if done.returncode:
        message = done.stderr.decode(errors="replace").strip().splitlines()
        return f"bwrap fails here ({message[-1] if message else f'exit status {done.returncode}'})"
    return None


@functools.cache
def _warn_weak_sandbox(problem: str) -> None:
    """Once per process: what code.sandbox='auto' leaves uncontained without bubblewrap."""
    logging.getLogger(__name__).warning(
        "code.sandbox='auto' runs programs with resource limits alone: %s. Not contained: the network, reads of "
        "the file system, writes wherever the sandbox uid may write (/tmp included) with no bound on the disk, and "
        "(not as root) your own processes. Install bubblewrap (%s) for the full sandbox, or set "
        "code.sandbox='rlimits' to choose this.", problem, INSTALL_HINT)


def resolve_mode(mode: str, python: str) -> str:
    """The mode `mode` runs as here ("auto": bwrap if it works, else rlimits). Raises
    ValueError, one line naming code.sandbox, for a mode this machine cannot provide."""
    if mode not in MODES:
        raise ValueError(f"code.sandbox={mode!r}; choose from {', '.join(MODES)}.")
    if mode == "rlimits":
        return mode
    problem = _bwrap_problem(python)
    if problem is None:
        return "bwrap"
    if mode == "auto":
        _warn_weak_sandbox(problem)
        return "rlimits"
    raise ValueError(f"code.sandbox='bwrap' is not available on this machine: {problem}; "
                     "it can run code.sandbox='rlimits' (resource limits only).")


def _command(mode: str, python: str, limits: Limits) -> list[str]:
    inner = [python, "-I", "-c", _HARNESS]
    return _bwrap_args(python, limits.disk_mb) + inner if mode == "bwrap" else inner


# Each role's names for the two pipe ends it holds: (what it says on, what it is told on).
_ROLE_FDS = {"solution": ("reply_fd", "request_fd"), "checker": ("report_fd", "reply_fd"), "stdio": ("report_fd", None)}


@dataclasses.dataclass(eq=False)
class _Interpreter:
    """One sandboxed interpreter of a run as the host sees it: its job going in, the lines
    it says, what the host tells it, its output drained and counted."""

    role: str
    process: subprocess.Popen
    said_fd: int  # the host's read end of what it says: reports, requests or replies
    told_fd: int | None  # the host's write end of what it is told: requests or replies
    job: memoryview
    outbox: bytearray = dataclasses.field(default_factory=bytearray)
    partial: bytes = b""
    stderr_head: bytes = b""
    output_bytes: int = 0
    said_bytes: int = 0
    ready: bool = False

    def lines(self, data: bytes, cap: int) -> list[bytes] | None:
        """The whole lines `data` completes; None once an unfinished one passes `cap`."""
        *lines, self.partial = (self.partial + data).split(b"\n")
        return None if len(self.partial) > cap else lines

    def tell(self, line: bytes) -> None:
        if self.told_fd is not None:
            self.outbox += line + b"\n"

    def hang_up(self) -> None:
        """Closes what the host tells it: the solution's loop and the checker's stubs end."""
        if self.told_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.told_fd)
            self.told_fd = None


@contextlib.contextmanager
def _interpreter(role: str, job: dict, mode: str, python: str, limits: Limits) -> Iterator[_Interpreter]:
    """Starts one sandboxed interpreter for `role` (its own uid as root, its own directory)
    and, on the way out, kills every process of it."""
    job = dict(job, role=role, limits={"timeout_s": limits.timeout_s, "memory_bytes": limits.memory_mb << 20,
                                       "file_bytes": limits.file_bytes, "processes": limits.processes,
                                       "output_bytes": limits.output_bytes})
    with sandbox_uids.lease() as uid, \
            tempfile.TemporaryDirectory(prefix="tlt_code_", ignore_cleanup_errors=True) as workdir:
        if uid is not None:
            os.chown(workdir, uid, uid)
        else:  # the program counts as this user: room for `processes` beyond what the user runs now
            job["limits"]["processes"] += sandbox_uids.tasks_of(os.getuid())
        said_name, told_name = _ROLE_FDS[role]
        said_r, said_w = os.pipe()
        told_r, told_w = os.pipe() if told_name else (None, None)
        job[said_name] = said_w
        if told_name:
            job[told_name] = told_r
        ids = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
        theirs = tuple(fd for fd in (said_w, told_r) if fd is not None)  # the pipe ends the interpreter holds
        try:
            process = subprocess.Popen(_command(mode, python, limits), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir,
                                       env=_clean_env(workdir), pass_fds=theirs, process_group=0, **ids)
        finally:
            for fd in theirs:
                os.close(fd)
        interpreter = _Interpreter(role, process, said_r, told_w, memoryview(json.dumps(job).encode()))
        try:
            yield interpreter
        finally:
            interpreter.hang_up()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(_EXIT_GRACE_S)  # one that ended its work exits; under bwrap its parents reap it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            if uid is not None:
                sandbox_uids.kill_uid(uid)  # also what left the process group (setsid), before the directory goes
                if mode == "rlimits":
                    sandbox_uids.remove_files_of(uid)
            process.wait()
            for stream in (process.stdin, process.stdout, process.stderr):
                with contextlib.suppress(OSError):
                    stream.close()
            os.close(said_r)


class _Judge:
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
        self.results.append((kind, str(detail)[:_DETAIL_CHARS]))
        self.progress += 1

    def on_event(self, record: dict) -> bool:
        """A load event of the program, taken before it has loaded, once: later ones (a
        program may write them itself) neither restart the window nor ask again. Whether
        `record` was an event."""
        event = record.get("event")
        if self.loaded or event is None:
            return event is not None
        if event in ("syntax_error", "load_error"):
            self.failure = (sandbox_harness.solution_kind(record) if event == "load_error" else "syntax_error",
                            str(record.get("detail", ""))[:_DETAIL_CHARS])
        elif event == "loaded":
            self.loaded = True
            self.progress += 1
        return True

    def outcome(self, interpreters: Sequence[_Interpreter]) -> Outcome:
        total = len(self.suite.tests)
        passed = sum(kind is None for kind, _ in self.results)
        forgeable = sum(kind == "forgeable" for kind, _ in self.results)
        failures = [(kind, detail) for kind, detail in self.results if kind not in (None, "forgeable")]
        unready = [i for i in interpreters if not i.ready]
        if unready and not self.results and (self.failure is None or self.failure[0] == "sandbox_error"):
            stderr = unready[0].stderr_head.decode(errors="replace").strip().splitlines()
            why = stderr[-1] if stderr else f"exit status {unready[0].process.poll()}"
            return Outcome(0, total, "sandbox_error", f"the sandbox failed before the program ran: {why}"[
                :_DETAIL_CHARS])
        if self.failure is None and not failures and passed + forgeable < total:
            status = interpreters[-1].process.poll()
            self.failure = ("runtime_error", f"exited (status {status}) before its tests ended")
        first = failures[0] if failures else self.failure or next(
            ((k, d) for k, d in self.results if k == "forgeable"), None)
        return Outcome(passed, total, *(first or (None, "")), forgeable=forgeable)


class _StdioJudge(_Judge):
    """stdin/stdout tests: the harness reports each test's output (with the job's nonce);
    the host compares it."""

    def __init__(self, suite: Suite, limits: Limits):
        super().__init__(suite, limits)
        self.nonce = secrets.token_hex(16)

    def on_line(self, interpreter: _Interpreter, line: bytes) -> None:
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


class _CheckJudge(_Judge):
    """asserts, check and call tests: the checker runs the row's test code (or the calls
    of fn_name against their expected values) and reports each test's end; its calls into
    the program go to the solution, their replies come back, one per request, through
    here, unread."""

    def __init__(self, suite: Suite, limits: Limits):
        super().__init__(suite, limits)
        self.waiting: list[bytes] = []  # the checker's requests not yet with the solution
        self.asked = False  # a request is with the solution
        self.checker: _Interpreter | None = None

    def on_line(self, interpreter: _Interpreter, line: bytes) -> None:
        if interpreter.role == "checker":
            self.checker = interpreter
            self.from_checker(interpreter, line)
        else:
            self.from_solution(interpreter, line)

    def from_checker(self, checker: _Interpreter, line: bytes) -> None:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            return
        if not isinstance(record, dict):
            return
        event, detail = record.get("event"), str(record.get("detail", ""))[:_DETAIL_CHARS]
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

    def from_solution(self, solution: _Interpreter, line: bytes) -> None:
        record = _event(line)
        if record.get("event") == "ready":
            solution.ready = True
        elif not self.on_event(record) and self.asked and self.checker is not None:
            self.asked = False
            self.checker.tell(line)

    def relay(self, interpreters: Sequence[_Interpreter]) -> None:
        """Hands the solution the checker's next request, once it has loaded and is free."""
        solution = next((i for i in interpreters if i.role == "solution"), None)
        if solution is not None and self.loaded and not self.asked and self.waiting:
            solution.tell(self.waiting.pop(0))
            self.asked = True


class _Relay:
    """The host's loop over one run's interpreters, until every test has ended, a window
    passes, a cap is passed or every interpreter has gone: feeds their jobs, hands the
    lines they say to the judge, writes what the judge tells them, drains and counts
    their output."""

    def __init__(self, interpreters: Sequence[_Interpreter], judge: _Judge):
        self.interpreters, self.judge = interpreters, judge
        self.selector = selectors.DefaultSelector()
        self.told: set[int] = set()  # the told pipes registered for writing
        self.started = self.last_progress = time.monotonic()
        self.progress = judge.progress
        for interpreter in interpreters:
            process = interpreter.process
            for stream in (process.stdin, process.stdout, process.stderr):
                os.set_blocking(stream.fileno(), False)
            self.selector.register(process.stdin, selectors.EVENT_WRITE, (interpreter, "job"))
            self.selector.register(process.stdout, selectors.EVENT_READ, (interpreter, "output"))
            self.selector.register(process.stderr, selectors.EVENT_READ, (interpreter, "stderr"))
            self.selector.register(interpreter.said_fd, selectors.EVENT_READ, (interpreter, "said"))

    def run(self) -> None:
        judge = self.judge
        try:
            while not judge.finished() and self.decider_says():
                if isinstance(judge, _CheckJudge):
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
        window = self.last_progress + limits.timeout_s if self.all_ready() else self.started + _STARTUP_S
        total = self.started + _STARTUP_S + limits.timeout_s * (len(self.judge.suite.tests) + 1)
        return min(window, total) - now

    def register_writes(self) -> None:
        for interpreter in self.interpreters:
            fd = interpreter.told_fd
            if fd is not None and interpreter.outbox and fd not in self.told:
                os.set_blocking(fd, False)
                self.selector.register(fd, selectors.EVENT_WRITE, (interpreter, "told"))
                self.told.add(fd)

    def write_job(self, interpreter: _Interpreter, key: selectors.SelectorKey) -> None:
        try:
            interpreter.job = interpreter.job[os.write(key.fd, interpreter.job):]
        except BrokenPipeError:
            interpreter.job = interpreter.job[:0]
        if not interpreter.job:
            self.selector.unregister(key.fileobj)
            interpreter.process.stdin.close()

    def write_told(self, interpreter: _Interpreter, key: selectors.SelectorKey) -> None:
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

    def read(self, interpreter: _Interpreter, what: str, key: selectors.SelectorKey) -> None:
        judge, cap = self.judge, self.judge.limits.output_bytes
        data = os.read(key.fd, 1 << 16)
        if not data:
            self.selector.unregister(key.fileobj)
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
    python = python or default_python()
    mode = resolve_mode(mode, python)
    windows = len(suite.tests) + 1
    if suite.layout == "stdio":
        judge = _StdioJudge(suite, limits)
        jobs = [("stdio", {"program": program, "tests": list(suite.tests), "nonce": judge.nonce})]
    else:
        checker = {"layout": suite.layout, "tests": list(suite.tests), "setup": suite.setup,
                   "preamble": suite.preamble, "entry_point": suite.entry_point, "fn_name": suite.fn_name,
                   "expected": list(suite.expected or [])}
        judge = _CheckJudge(suite, limits)
        if inline and suite.layout != "call":
            jobs = [("checker", dict(checker, program=program))]
            judge.loaded = True  # no solution to wait for
        else:
            jobs = [("checker", checker), ("solution", {"program": program, "setup": suite.setup})]
    with contextlib.ExitStack() as stack:
        interpreters = [stack.enter_context(_interpreter(role, dict(job, windows=windows), mode, python, limits))
                        for role, job in jobs]
        _Relay(interpreters, judge).run()
        return judge.outcome(interpreters), judge.stdouts
