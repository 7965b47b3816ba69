"""The sandbox's modes (`MODES`; docs/code.md says what each protects against):
  bwrap    bubblewrap (Debian package `bubblewrap`): new user, pid, network, ipc and uts
           namespaces, a root filesystem of read-only system directories and, as the one
           writable place, a tmpfs of `disk_mb`; no network at all, every process killed
           with it;
  rlimits  the resource limits alone, for machines where namespaces are blocked (some
           containers' seccomp): no network or filesystem isolation beyond file
           permissions, and no bound on the disk a program fills.
  auto     bwrap where this machine can run it, else rlimits, with one warning saying so.
and the command line that starts a sandboxed interpreter in each.
"""
from __future__ import annotations

import functools
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from tlt_jax.sandbox import uids
from tlt_jax.sandbox.spec import Limits

MODES = ("auto", "bwrap", "rlimits")
INSTALL_HINT = "apt-get install -y bubblewrap"
_HARNESS = pathlib.Path(__file__).with_name("harness.py").read_text()  # run as python -I -c
STARTUP_S = 30.0  # for the sandbox and its interpreter to be up, on a loaded machine
_SYSTEM_PATHS = "/usr/local/bin:/usr/bin:/bin"


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


def clean_env(home: str) -> dict[str, str]:
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
    for name, value in clean_env(_INSIDE).items():
        args += ["--setenv", name, value]
    return args + ["--"]


@functools.cache
def bwrap_problem(python: str) -> str | None:
    """Why bwrap cannot run programs here (None: it can), from one trial run."""
    if shutil.which("bwrap") is None:
        return f"bwrap is not installed ({INSTALL_HINT})"
    with uids.lease() as uid, tempfile.TemporaryDirectory(prefix="tlt_code_") as workdir:
        if uid is not None:
            os.chown(workdir, uid, uid)
        ids = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
        try:
            done = subprocess.run(_bwrap_args(python) + [python, "-I", "-c", "pass"], cwd=workdir,
                                  env=clean_env(workdir), capture_output=True, timeout=STARTUP_S, **ids)
        except subprocess.TimeoutExpired:
            return f"bwrap did not start a program within {STARTUP_S:g} s"
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
    problem = bwrap_problem(python)
    if problem is None:
        return "bwrap"
    if mode == "auto":
        _warn_weak_sandbox(problem)
        return "rlimits"
    raise ValueError(f"code.sandbox='bwrap' is not available on this machine: {problem}; "
                     "it can run code.sandbox='rlimits' (resource limits only).")


def command(mode: str, python: str, limits: Limits) -> list[str]:
    inner = [python, "-I", "-c", _HARNESS]
    return _bwrap_args(python, limits.disk_mb) + inner if mode == "bwrap" else inner

