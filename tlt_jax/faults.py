"""Faults: scripted kills that tests place in a run, and the disk-full error writers raise.

Scripted kills. A process whose environment has `TLT_FAULT=<point>[:<n>]` sends itself
SIGKILL when it reaches `maybe_kill(point, n)`: no cleanup, no flush, no finally block
runs, as when a machine dies. Only tests set the variable (tests/test_faults.py kills a
run at each point, then resumes it); unset, `maybe_kill` is a dictionary lookup. The
points, each in the code where the name says:

    rollout          RL step n's rollout, as its first rollout group finishes (the other
                     groups may still decode, the drafter may be training in the gap)
    reward           RL step n's reward scoring
    learner          RL step n's learner phase: the update computed, the rollout engine
                     not yet given the new weights, nothing of the step saved
    drafter_step     drafter optimizer step n (`OnlineDrafter.steps`), dispatched, not finished
    commit/<dir>     checkpoint step n of the Checkpointer whose directory is named <dir>
                     (`checkpoints`, `drafter_checkpoints`), written and committed by orbax
                     but without its integrity manifest yet: a torn checkpoint
    hf_export        a Hugging Face export, its files written but not yet renamed into place

RL steps count from 0 as `RLLoop.step` does (the metrics record of step n is n + 1; a
checkpoint of step n holds the state after n steps). Without `:<n>` any n matches. The
teacher-cache writer is killed from outside instead (tests/distill/test_teacher_cache.py).

Disk full. Writers that can run out of space (checkpoints, the teacher cache) wrap their
writes in `explain_disk_full`, which turns the error the OS, orbax or tensorstore raised
into a `DiskFullError` whose message names the directory and how to go on.
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
from typing import Callable, Iterator

ENV = "TLT_FAULT"

# How the OS error reads inside the messages of tensorstore (a ValueError) and orbax.
_DISK_FULL_TEXT = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def maybe_kill(point: str, n: int | None = None) -> None:
    """SIGKILLs this process if TLT_FAULT names `point` (and `n`, when it gives one)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, _, at = spec.rpartition(":")
    if not at.isdigit():
        name, at = spec, ""
    if name == point and (not at or (n is not None and int(at) == n)):
        os.kill(os.getpid(), signal.SIGKILL)


class DiskFullError(OSError):
    """A write ran out of disk space (or quota); the message says where and what to do."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


def is_disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, is the disk or the quota being full."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
            return True
        if any(text in str(error) for text in _DISK_FULL_TEXT):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def explain_disk_full(message: Callable[[], str]) -> Iterator[None]:
    """Re-raises a disk-full error of the body as DiskFullError(message()); others pass."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        if not is_disk_full(e):
            raise
        raise DiskFullError(f"{message()} ({_first_line(e)})") from e


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
