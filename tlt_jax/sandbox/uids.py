"""Unprivileged uids for sandboxes, leased so that no two sandboxes on this machine share
one, and what a uid leaves behind (processes, files in shared directories) removed.

RLIMIT_NPROC counts per real uid and never binds uid 0, so as root every sandbox runs as
a uid of its own from `SANDBOX_UIDS` (leased through lock files, in any process of this
machine); its processes are found and killed by that uid at the end. Not as root there
is no lease: programs run as this user (`process_limit_binds`).
"""
from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import shutil
import signal
import tempfile
from typing import Iterator

SANDBOX_UIDS = range(200_000, 201_024)  # far above login and system accounts


def processes_by_uid(uids: range) -> dict[int, tuple[list[int], list[int]]]:
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


def kill_uid(uid: int) -> None:
    """Kills every live process of `uid`, in rounds: a fork bomb refills within its limit."""
    for _ in range(10_000):
        live = processes_by_uid(range(uid, uid + 1)).get(uid, ([], []))[0]
        if not live:
            return
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    raise RuntimeError(f"Processes of sandbox uid {uid} survive SIGKILL: {live[:8]}.")


_SHARED_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")  # where an rlimits program may leave files for the next


def remove_files_of(uid: int) -> None:
    """Removes what sandbox uid `uid` left in the world-writable directories (rlimits has
    no tmpfs of its own): no answer a program kept there reaches the program after it."""
    for top in _SHARED_WRITABLE:
        with contextlib.suppress(OSError), os.scandir(top) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid != uid:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)


_next_uid = itertools.count()  # where this process starts looking for a free uid: round robin


@contextlib.contextmanager
def lease() -> Iterator[int | None]:
    """An unprivileged uid no other sandbox on this machine holds (as root; else None),
    with no process of it left. A uid whose killed processes are still zombies (their
    new parent, init, has not reaped them yet) is passed over: they would count against
    the process limit of the next sandbox."""
    if os.geteuid() != 0:
        yield None
        return
    lock_dir = os.path.join(tempfile.gettempdir(), "tlt_jax_sandbox_uids")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    processes = processes_by_uid(SANDBOX_UIDS)
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
                kill_uid(uid)  # left by a process that died holding the lease
            yield uid
        finally:
            os.close(fd)
        return
    raise RuntimeError(f"All {len(SANDBOX_UIDS)} sandbox uids are in use; lower code.max_parallel.")


def process_limit_binds() -> bool:
    """Whether `Limits.processes` bounds a program's processes by themselves: as root each
    sandbox has its own uid; otherwise the program shares this user's count (`tasks_of`)."""
    return os.geteuid() == 0


def tasks_of(uid: int) -> int:
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
