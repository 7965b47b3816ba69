"""One sandboxed interpreter as the host holds it: started in its mode (its own uid as
root, its own directory, its own process group), its pipes, and every process of it
killed on the way out."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import tempfile
from typing import Iterator

from tlt_jax.sandbox import modes, uids
from tlt_jax.sandbox.spec import Limits

_EXIT_GRACE_S = 0.5  # for a sandbox whose tests all ended to exit by itself

# Each role's names for the two pipe ends it holds: (what it says on, what it is told on).
_ROLE_FDS = {"solution": ("reply_fd", "request_fd"), "checker": ("report_fd", "reply_fd"), "stdio": ("report_fd", None),
             "session": ("reply_fd", "request_fd")}


@dataclasses.dataclass(eq=False)
class Interpreter:
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
    ended: set[str] = dataclasses.field(default_factory=set)  # the streams read to their end

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
def start(role: str, job: dict, mode: str, python: str, limits: Limits) -> Iterator[Interpreter]:
    """Starts one sandboxed interpreter for `role` (its own uid as root, its own directory)
    and, on the way out, kills every process of it."""
    job = dict(job, role=role, limits={"timeout_s": limits.timeout_s, "memory_bytes": limits.memory_mb << 20,
                                       "file_bytes": limits.file_bytes, "processes": limits.processes,
                                       "output_bytes": limits.output_bytes})
    with uids.lease() as uid, \
            tempfile.TemporaryDirectory(prefix="tlt_code_", ignore_cleanup_errors=True) as workdir:
        if uid is not None:
            os.chown(workdir, uid, uid)
        else:  # the program counts as this user: room for `processes` beyond what the user runs now
            job["limits"]["processes"] += uids.tasks_of(os.getuid())
        said_name, told_name = _ROLE_FDS[role]
        said_r, said_w = os.pipe()
        told_r, told_w = os.pipe() if told_name else (None, None)
        job[said_name] = said_w
        if told_name:
            job[told_name] = told_r
        ids = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
        theirs = tuple(fd for fd in (said_w, told_r) if fd is not None)  # the pipe ends the interpreter holds
        try:
            process = subprocess.Popen(modes.command(mode, python, limits), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir,
                                       env=modes.clean_env(workdir), pass_fds=theirs, process_group=0, **ids)
        finally:
            for fd in theirs:
                os.close(fd)
        interpreter = Interpreter(role, process, said_r, told_w, memoryview(json.dumps(job).encode()))
        try:
            yield interpreter
        finally:
            interpreter.hang_up()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(_EXIT_GRACE_S)  # one that ended its work exits; under bwrap its parents reap it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            if uid is not None:
                uids.kill_uid(uid)  # also what left the process group (setsid), before the directory goes
                if mode == "rlimits":
                    uids.remove_files_of(uid)
            process.wait()
            for stream in (process.stdin, process.stdout, process.stderr):
                with contextlib.suppress(OSError):
                    stream.close()
            os.close(said_r)

