"""Running an untrusted Python program against its tests, isolated from the host.

`run(program, suite, limits, mode)` starts one sandbox for one program: a fresh
temporary directory, a cleared environment, its own process group, and
`sandbox_harness.py` inside, which sets the resource limits (CPU seconds, address space,
file size, processes) before any of the program runs and reports each test's end on a
pipe. The host enforces the rest: a wall-clock window of `timeout_s` per test (the first
timeout ends the run: its later tests fail), a cap on the bytes the sandbox writes, and
at the end every process of the sandbox is killed.

Modes (`MODES`; docs/code.md says what each protects against):
  bwrap    bubblewrap (Debian package `bubblewrap`): new user, pid, network, ipc and uts
           namespaces, a root filesystem of read-only system directories with only the
           run's directory writable, no network at all, every process killed with it;
  rlimits  the resource limits alone, for machines where namespaces are blocked (some
           containers' seccomp): no network or filesystem isolation beyond file
           permissions.
  auto     bwrap where this machine can run it, else rlimits.

Processes: RLIMIT_NPROC counts per real uid and never binds uid 0, so as root every
sandbox runs as its own unprivileged uid (`SANDBOX_UIDS`, leased through lock files,
so concurrent sandboxes, in any process of this machine, never share one); its
processes are found and killed by that uid at the end. Not as root, programs run as
this user, whose own processes count against the limit: it is raised by what the user
runs when the sandbox starts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import itertools
import json
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

MODES = ("auto", "bwrap", "rlimits")
SANDBOX_UIDS = range(200_000, 201_024)  # far above login and system accounts
INSTALL_HINT = "apt-get install -y bubblewrap"
FAILURE_KINDS = ("wrong_answer", "runtime_error", "timeout", "memory", "output_limit", "syntax_error",
                 "sandbox_error")
_HARNESS = pathlib.Path(__file__).with_name("sandbox_harness.py").read_text()  # run as python -I -c
_STARTUP_S = 30.0  # for the sandbox and its interpreter to be up, on a loaded machine
_EXIT_GRACE_S = 0.5  # for a sandbox whose tests all ended to exit by itself
_DETAIL_CHARS = 300
_SYSTEM_PATHS = "/usr/local/bin:/usr/bin:/bin"


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one program may use. timeout_s: wall seconds per test (and for loading the
    program); memory_mb: address space, MiB; output_bytes: what the sandbox may write to
    stdout and stderr, and each stdin/stdout test's output; file_bytes: the largest file it
    may write; processes: tasks of its uid at once (threads count)."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    output_bytes: int = 1 << 20
    file_bytes: int = 16 << 20
    processes: int = 16

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "output_bytes", "file_bytes", "processes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"code.{name}={getattr(self, name)!r} must be > 0.")


@dataclasses.dataclass(frozen=True)
class Suite:
    """The tests of one program, as the harness runs them.

    layout: "asserts" (tests: statements, MBPP's test_list; setup: run once before them),
    "check" (tests: [HumanEval's test code]; entry_point: what check() gets), "call"
    (tests: argument lists for fn_name), or "stdio" (tests: stdin texts).
    expected: per test, the return value ("call") or stdout ("stdio") the host compares;
    it never enters the sandbox.
    """

    layout: str
    tests: Sequence
    setup: str = ""
    entry_point: str = ""
    fn_name: str = ""
    expected: Sequence | None = None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """passed of total tests; failure: the first failed test's kind (FAILURE_KINDS) or None;
    sandbox_error means the sandbox itself failed before the program ran."""

    passed: int
    total: int
    failure: str | None = None
    detail: str = ""


def stdout_matches(actual: str, expected: str) -> bool:
    """Line by line, trailing whitespace and trailing blank lines ignored."""
    lines = lambda text: [line.rstrip() for line in text.rstrip().splitlines()]
    return lines(actual) == lines(expected)


def value_matches(actual, expected) -> bool:
    """A call's return value against the expected one, after a JSON round trip (tuples are
    lists); APPS/TACO often wrap the expected value in a one-element list."""
    actual, expected = (json.loads(json.dumps(v, default=repr)) for v in (actual, expected))
    return actual == expected or (isinstance(expected, list) and len(expected) == 1 and actual == expected[0])


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


def _bwrap_args(workdir: str, python: str) -> list[str]:
    """bubblewrap's command line up to the program: system directories read-only, the run's
    directory the only writable one, /proc and a minimal /dev, every namespace new."""
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
    args += ["--proc", "/proc", "--dev", "/dev", "--bind", workdir, _INSIDE, "--chdir", _INSIDE, "--clearenv"]
    for name, value in _clean_env(_INSIDE).items():
        args += ["--setenv", name, value]
    return args + ["--"]


def _processes_by_uid(uids: range) -> dict[int, tuple[list[int], list[int]]]:
    """The processes whose real uid is in `uids`: uid -> (live, zombies)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if line.startswith(("State:", "Uid:")))
                uid = int(fields["Uid"].split()[0])
            except (OSError, ValueError, KeyError):
                continue
            if uid in uids:
                live, zombies = found.setdefault(uid, ([], []))
                (zombies if fields.get("State", "").strip().startswith("Z") else live).append(int(entry))
    return found


def _kill_uid(uid: int) -> None:
    """Kills every live process of `uid`, in rounds: a fork bomb refills within its limit."""
    for _ in range(10_000):
        live = _processes_by_uid(range(uid, uid + 1)).get(uid, ([], []))[0]
        if not live:
            return
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    raise RuntimeError(f"Processes of sandbox uid {uid} survive SIGKILL: {live[:8]}.")


_next_uid = itertools.count()  # where this process starts looking for a free uid: round robin


@contextlib.contextmanager
def _sandbox_uid() -> Iterator[int | None]:
    """An unprivileged uid no other sandbox on this machine holds (as root; else None),
    with no process of it left. A uid whose killed processes are still zombies (their
    new parent, init, has not reaped them yet) is passed over: they would count against
    the process limit of the next sandbox."""
    if os.geteuid() != 0:
        yield None
        return
    lock_dir = os.path.join(tempfile.gettempdir(), "tlt_jax_sandbox_uids")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    processes = _processes_by_uid(SANDBOX_UIDS)
    start = next(_next_uid)
    for i in range(len(SANDBOX_UIDS)):
        uid = SANDBOX_UIDS[(start + i) % len(SANDBOX_UIDS)]
        if processes.get(uid, ([], []))[1]:
            continue
        fd = os.open(os.path.join(lock_dir, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            if processes.get(uid, ([], []))[0]:
                _kill_uid(uid)  # left by a process that died holding the lease
            yield uid
        finally:
            os.close(fd)
        return
    raise RuntimeError(f"All {len(SANDBOX_UIDS)} sandbox uids are in use; lower code.max_parallel.")


def process_limit_binds() -> bool:
    """Whether `Limits.processes` bounds a program's processes by themselves: as root each
    sandbox has its own uid; otherwise the program shares this user's count (`_tasks_of`)."""
    return os.geteuid() == 0


def _tasks_of(uid: int) -> int:
    """Processes and threads of `uid` now: what RLIMIT_NPROC counts."""
    tasks = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if line.startswith(("Uid:", "Threads:")))
                if int(fields["Uid"].split()[0]) == uid:
                    tasks += int(fields["Threads"])
            except (OSError, ValueError, KeyError):
                continue
    return tasks


def _command(mode: str, workdir: str, python: str) -> list[str]:
    inner = [python, "-I", "-c", _HARNESS]
    return _bwrap_args(workdir, python) + inner if mode == "bwrap" else inner


def _popen(mode: str, workdir: str, python: str, uid: int | None, report_fd: int) -> subprocess.Popen:
    ids = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    return subprocess.Popen(_command(mode, workdir, python), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=workdir, env=_clean_env(workdir), pass_fds=(report_fd,),
                            process_group=0, **ids)


@functools.cache
def _bwrap_problem(python: str) -> str | None:
    """Why bwrap cannot run programs here (None: it can), from one trial run."""
    if shutil.which("bwrap") is None:
        return f"bwrap is not installed ({INSTALL_HINT})"
    with _sandbox_uid() as uid, tempfile.TemporaryDirectory(prefix="tlt_code_") as workdir:
        if uid is not None:
            os.chown(workdir, uid, uid)
        ids = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
        try:
            done = subprocess.run(_bwrap_args(workdir, python) + [python, "-I", "-c", "pass"], cwd=workdir,
                                  env=_clean_env(workdir), capture_output=True, timeout=_STARTUP_S, **ids)
        except subprocess.TimeoutExpired:
            return f"bwrap did not start a program within {_STARTUP_S:g} s"
    if done.returncode:
        message = done.stderr.decode(errors="replace").strip().splitlines()
        return f"bwrap fails here ({message[-1] if message else f'exit status {done.returncode}'})"
    return None


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
        return "rlimits"
    raise ValueError(f"code.sandbox='bwrap' is not available on this machine: {problem}; "
                     "it can run code.sandbox='rlimits' (resource limits only).")


class _Run:
    """The host's side of one sandbox: feeds the job, reads reports and output, enforces
    the wall-clock windows and the output cap."""

    def __init__(self, suite: Suite, limits: Limits):
        self.suite, self.limits = suite, limits
        self.nonce = secrets.token_hex(16)
        self.ready = self.loaded = self.done = False
        self.results: list[tuple[str | None, str]] = []  # per reported test: (failure kind or None, detail)
        self.failure: tuple[str, str] | None = None  # what ended the run early, if anything
        self.output_bytes = 0
        self.stderr_head = b""
        self.stdouts: list[str] = []  # per reported stdin/stdout test that ran to its end

    def on_record(self, record: dict) -> None:
        event, test = record.get("event"), record.get("test")
        if event == "ready":
            self.ready = True
        elif event == "loaded":
            self.loaded = True
        elif event == "done":
            self.done = True
        elif event in ("syntax_error", "load_error"):
            self.failure = (record.get("kind", event), str(record.get("detail", ""))[:_DETAIL_CHARS])
        elif self.loaded and test == len(self.results) < len(self.suite.tests):  # in order, once each
            self.results.append(self._judge(test, record))

    def _judge(self, i: int, record: dict) -> tuple[str | None, str]:
        if record.get("kind"):
            return record["kind"], str(record.get("detail", ""))[:_DETAIL_CHARS]
        layout, expected = self.suite.layout, self.suite.expected
        if layout == "call" and not value_matches(record.get("value"), expected[i]):
            return "wrong_answer", f"returned {record.get('value')!r:.200}"
        if layout == "stdio":
            self.stdouts.append(str(record.get("stdout", "")))
        if layout == "stdio" and expected is not None and not stdout_matches(str(record.get("stdout", "")),
                                                                              expected[i]):
            return "wrong_answer", f"printed {str(record.get('stdout', ''))!r:.200}"
        return None, ""

    def deadline(self, started: float, last_progress: float) -> float:
        return started + _STARTUP_S if not self.ready else last_progress + self.limits.timeout_s

    def outcome(self, exit_status: int | None) -> Outcome:
        total = len(self.suite.tests)
        passed = sum(kind is None for kind, _ in self.results)
        failures = [(kind, detail) for kind, detail in self.results if kind is not None]
        if not self.ready:
            stderr = self.stderr_head.decode(errors="replace").strip().splitlines()
            why = stderr[-1] if stderr else f"exit status {exit_status}"
            return Outcome(0, total, "sandbox_error", f"the sandbox failed before the program ran: {why}"[
                :_DETAIL_CHARS])
        if self.failure is None and not failures and passed < total:
            self.failure = ("runtime_error", f"exited (status {exit_status}) before its tests ended")
        first = failures[0] if failures else self.failure  # a failed test came before what cut the run
        return Outcome(passed, total, *(first or (None, "")))


def run(program: str, suite: Suite, limits: Limits = Limits(), mode: str = "auto", python: str = "") -> Outcome:
    """Runs `program` against `suite` in a new sandbox (see the module doc); never raises
    for what the program does."""
    return _run(program, suite, limits, mode, python).outcome


def execute(program: str, limits: Limits = Limits(), mode: str = "auto", python: str = "") -> tuple[str, Outcome]:
    """Runs `program` once as __main__ with empty stdin in a new sandbox: (what it printed,
    its Outcome: failure None when it ran to its end). A tool's call, not a test."""
    run_ = _run(program, Suite("stdio", [""]), limits, mode, python)
    return (run_.stdouts[0] if run_.stdouts else ""), run_.outcome


@dataclasses.dataclass(frozen=True)
class _Finished:
    outcome: Outcome
    stdouts: list[str]


def _run(program: str, suite: Suite, limits: Limits, mode: str, python: str) -> _Finished:
    python = python or default_python()
    mode = resolve_mode(mode, python)
    state = _Run(suite, limits)
    job = {"program": program, "layout": suite.layout, "tests": list(suite.tests), "setup": suite.setup,
           "entry_point": suite.entry_point, "fn_name": suite.fn_name, "nonce": state.nonce,
           "limits": {"timeout_s": limits.timeout_s, "memory_bytes": limits.memory_mb << 20,
                      "file_bytes": limits.file_bytes, "processes": limits.processes,  # (+ ours, not as root)
                      "output_bytes": limits.output_bytes}}
    with _sandbox_uid() as uid, tempfile.TemporaryDirectory(prefix="tlt_code_", ignore_cleanup_errors=True) as workdir:
        if uid is not None:
            os.chown(workdir, uid, uid)
        else:  # the program counts as this user: room for `processes` beyond what the user runs now
            job["limits"]["processes"] += _tasks_of(os.getuid())
        report_r, report_w = os.pipe()
        try:
            job["report_fd"] = report_w
            process = _popen(mode, workdir, python, uid, report_w)
        finally:
            os.close(report_w)
        try:
            exit_status = _serve(process, report_r, json.dumps(job).encode(), state)
        finally:
            if state.done:  # the harness exits now; under bwrap, its parents reap it and exit
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(_EXIT_GRACE_S)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            if uid is not None:
                _kill_uid(uid)  # also what left the process group (setsid), before the directory goes
            process.wait()
            for stream in (process.stdin, process.stdout, process.stderr):
                with contextlib.suppress(OSError):
                    stream.close()
            os.close(report_r)
    return _Finished(state.outcome(exit_status), state.stdouts)


def _serve(process: subprocess.Popen, report_fd: int, job: bytes, state: _Run) -> int | None:
    """Until the harness reports done, every pipe closes, a window passes or the output cap
    is passed; the harness's exit status (None if it was still running)."""
    started = last_progress = time.monotonic()
    selector = selectors.DefaultSelector()
    for stream in (process.stdin, process.stdout, process.stderr):
        os.set_blocking(stream.fileno(), False)
    selector.register(process.stdin, selectors.EVENT_WRITE, "stdin")
    selector.register(process.stdout, selectors.EVENT_READ, "output")
    selector.register(process.stderr, selectors.EVENT_READ, "stderr")
    selector.register(report_fd, selectors.EVENT_READ, "report")
    pending, buffer = memoryview(job), b""
    try:
        while selector.get_map() and not state.done:
            timeout = state.deadline(started, last_progress) - time.monotonic()
            if timeout <= 0:
                state.failure = ("timeout" if state.ready else "sandbox_error",
                                 f"no test ended within code.timeout_s={state.limits.timeout_s:g} s")
                break
            for key, _ in selector.select(timeout):
                if key.data == "stdin":
                    try:
                        pending = pending[os.write(process.stdin.fileno(), pending):]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(process.stdin)
                        process.stdin.close()
                    continue
                data = os.read(key.fd, 1 << 16)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                if key.data == "report":
                    *lines, buffer = (buffer + data).split(b"\n")
                    before = len(state.results), state.loaded
                    for line in lines:
                        if line.startswith(state.nonce.encode()):
                            with contextlib.suppress(ValueError):
                                state.on_record(json.loads(line[len(state.nonce):]))
                    if (len(state.results), state.loaded) != before:
                        last_progress = time.monotonic()
                    if len(buffer) > state.limits.output_bytes + (1 << 16):
                        state.failure = ("output_limit", "a report past the output cap")
                        break
                    continue
                if key.data == "stderr" and len(state.stderr_head) < 4096:
                    state.stderr_head += data[:4096]
                state.output_bytes += len(data)
                if state.output_bytes > state.limits.output_bytes:
                    state.failure = ("output_limit", f"more than code.output_bytes={state.limits.output_bytes}")
                    break
            else:
                continue
            break
        if not selector.get_map():  # every pipe closed: the harness has exited, or is about to
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(_EXIT_GRACE_S)
    finally:
        selector.close()
    return process.poll()
