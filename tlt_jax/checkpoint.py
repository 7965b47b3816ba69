"""Training-state checkpoints: orbax, asynchronous, verified before they are trusted.

A checkpoint is one step directory written by orbax's CheckpointManager, with two items:
`state`, any pytree of arrays (policy and reference params, optimizer state, PRNG keys;
any sharding, any dtype), and `meta`, a JSON dict (step, data position, config).

Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it to `<step>` once
complete, and never lists tmp directories, so a save cut short by SIGKILL leaves only a
tmp directory behind. Orbax does not notice later damage (a deleted or truncated file, a
flipped bit) nor a step it committed but whose save the caller never saw finish. So once
orbax has committed a step we write a manifest into it, `COMMITTED.json`: the size and
sha256 of every file. A step is trusted only when its manifest is present and every
file still matches; `restore()` tries steps newest first and skips, with a warning, any
that fails the check or that orbax cannot read. Nothing is ever deleted by us: saving a
step at or below steps already on disk (training resumed from an older step) first
renames the newer step directories aside (`<step>.rejected` when a restore found them
bad, `<step>.superseded` otherwise), so orbax's step list and retention only see the
resumed timeline, and the set-aside directories stay for inspection.

A save that runs out of disk space raises `faults.DiskFullError` (from `save`, or from
the next call that waits for a background write), naming the directory and the step a
rerun resumes from; the unfinished step is never listed or trusted, so the steps saved
before it stay intact and restorable.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import pathlib
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from tlt_jax import faults

try:  # orbax's per-process count of saves (see `_align_save_counts`); private, so optional
    from orbax.checkpoint._src.futures.synchronization import OperationIdGenerator as _OrbaxSaveCount
except ImportError:  # pragma: no cover
    _OrbaxSaveCount = None

MANIFEST_NAME = "COMMITTED.json"
_MANIFEST_FORMAT = 1
_ORBAX_TMP_MARKER = ".orbax-checkpoint-tmp"


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint step is incomplete, damaged, or unreadable."""


def _file_digest(path: pathlib.Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _step_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in step_dir.rglob("*")
                  if p.is_file() and not p.name.startswith(MANIFEST_NAME))


def write_manifest(step_dir: pathlib.Path, step: int, checksum: bool = True) -> None:
    """Records size (and sha256 when `checksum`) of every file of a committed step.

    Written to a side file and renamed into place, so the manifest itself is all or
    nothing; its presence is what marks the step committed.
    """
    files = {}
    for path in _step_files(step_dir):
        entry = {"bytes": path.stat().st_size}
        if checksum:
            entry["sha256"] = _file_digest(path)
        files[path.relative_to(step_dir).as_posix()] = entry
    partial = step_dir / (MANIFEST_NAME + ".partial")
    with open(partial, "w") as f:
        json.dump({"format": _MANIFEST_FORMAT, "step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, step_dir / MANIFEST_NAME)


def verify_manifest(step_dir: pathlib.Path, step: int) -> None:
    """Raises CheckpointIntegrityError unless every file listed in the manifest matches."""
    manifest_path = step_dir / MANIFEST_NAME
    if not manifest_path.exists():
        raise CheckpointIntegrityError(
            f"step {step} has no {MANIFEST_NAME}: its save did not finish (or it was not "
            "written by tlt_jax.checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        recorded_step = manifest["step"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointIntegrityError(f"step {step}: unreadable {MANIFEST_NAME}: {e!r}") from e
    if recorded_step != step:
        raise CheckpointIntegrityError(f"step {step}: {MANIFEST_NAME} is for step {recorded_step}")
    for name, entry in files.items():
        path = step_dir / name
        if not path.is_file():
            raise CheckpointIntegrityError(f"step {step}: file {name} is missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointIntegrityError(
                f"step {step}: file {name} has {size} bytes, {entry['bytes']} were written")
        if "sha256" in entry and _file_digest(path) != entry["sha256"]:
            raise CheckpointIntegrityError(f"step {step}: file {name} fails its sha256 check")


def resume_step(directory: str | os.PathLike) -> int:
    """The step `Checkpointer(directory).resume` restores: the newest step whose manifest
    verifies (0 when none does, or there is no directory), read without opening orbax."""
    directory = pathlib.Path(directory)
    steps = sorted((int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()),
                   reverse=True) if directory.is_dir() else []
    for step in steps:
        try:
            verify_manifest(directory / str(step), step)
        except CheckpointIntegrityError:
            continue
        return step
    return 0


def _align_save_counts() -> None:
    """Brings every process's count of orbax saves to the highest (collective).

    orbax numbers each save with a per-process counter and keys the signals a multi-process
    save waits on by that number alone. A `this_process_only` save advances only its own
    process's counter (RL runs: process 0 saves the drafter's checkpoints alone), after which a
    shared save would wait on keys the other processes write under another number: a hang.
    Every shared save calls this first."""
    if _OrbaxSaveCount is None:
        return
    count = int(_OrbaxSaveCount.get_current_operation_id())
    highest = int(np.max(multihost_utils.process_allgather(np.asarray([count], np.int32))))
    if highest > count:
        logging.info("Advancing orbax's save count from %d to %d, with the other processes' saves", count, highest)
    while int(_OrbaxSaveCount.get_current_operation_id()) < highest:
        _OrbaxSaveCount.next_operation_id()


class Checkpointer:
    """Asynchronous, verified checkpoints of a training state in `directory`.

    Usage:
        ckpt = Checkpointer(run_dir / "checkpoints")
        if ckpt.latest_step() is not None:
            state, meta = ckpt.restore(target=abstract_state)  # newest step that verifies
        ...
        ckpt.save(step, state, {"data_position": pos, "config": config.to_dict()})
        ...
        ckpt.close()

    `save` returns once the arrays are copied off the device; the write, orbax's commit
    and the manifest happen on background threads, and the next `save`/`restore`/`wait`
    first waits for them (re-raising any error). With several processes every process
    calls each method (orbax writes each array's shards from the processes that hold
    them); only process 0 writes manifests and renames directories, and every process
    verifies on restore. `this_process_only`: the checkpoints of host data that one
    process alone holds, written and read by it alone (the other processes never open
    the directory).
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 3,
                 async_save: bool = True, checksum: bool = True, this_process_only: bool = False):
        """
        Args:
          directory: checkpoint root (a local or network filesystem: we rely on rename).
          max_to_keep: newest steps orbax keeps (None: all). At least 2, so that a step
            that turns out bad always has an older one to fall back to.
          async_save: write in the background (False: `save` returns when committed).
          checksum: record and check sha256 of every file. False records sizes only,
            which still catches deleted and truncated files but not flipped bits; for
            checkpoints too large to hash on every save.
        """
        if max_to_keep is not None and max_to_keep < 2:
            raise ValueError(f"max_to_keep={max_to_keep}: keep at least 2 checkpoints so a bad "
                             "newest one can fall back to an older one (or None to keep all).")
        self.directory = pathlib.Path(directory).absolute()
        self._checksum = checksum
        alone = this_process_only and jax.process_count() > 1
        self._primary = alone or jax.process_index() == 0
        self._together = jax.process_count() > 1 and not alone  # other processes save and restore with this one
        processes = None
        if alone:  # orbax creates no directory for a subset of processes
            self.directory.mkdir(parents=True, exist_ok=True)
            processes = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                                           active_processes={jax.process_index()})
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=not alone,
                **({"multiprocessing_options": processes} if processes else {})))
        self._committer = (concurrent.futures.ThreadPoolExecutor(1, "checkpoint-commit")
                           if async_save else None)
        self._pending: concurrent.futures.Future | None = None
        self._rejected: dict[int, str] = {}  # step -> why a restore skipped it
        self._write_failed = False  # a save's write raised (orbax raises it again on close)
        for leftover in sorted(self.directory.glob(f"*{_ORBAX_TMP_MARKER}*")):
            logging.warning("Ignoring %s: left by a save that did not finish; orbax never "
                            "lists it as a step.", leftover)

    def _step_dir(self, step: int) -> pathlib.Path:
        return self.directory / str(step)

    def _join_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _commit(self, step: int) -> None:
        with self._writing(step):
            self._manager.wait_until_finished()  # raises if orbax's background write failed
            faults.maybe_kill(f"commit/{self.directory.name}", step)
            if self._primary:
                write_manifest(self._step_dir(step), step, checksum=self._checksum)

    @contextlib.contextmanager
    def _writing(self, step: int):
        """Around the parts of saving `step`: running out of space becomes a DiskFullError
        that says where, which step a rerun resumes from, and what the failed write left
        behind; a failure is remembered, so that `close` does not raise it a second time."""
        def message() -> str:
            complete = [s for s in self._manager.all_steps()
                        if s < step and (self._step_dir(s) / MANIFEST_NAME).exists()]
            left = sorted(str(p) for p in self.directory.glob(f"{step}{_ORBAX_TMP_MARKER}*"))
            if self._step_dir(step).exists() and not (self._step_dir(step) / MANIFEST_NAME).exists():
                left.append(str(self._step_dir(step)))
            resume = (f"it resumes from step {max(complete)}, the newest complete checkpoint, which is intact"
                      if complete else "there is no complete earlier checkpoint to resume from")
            return (f"Out of disk space writing checkpoint step {step} to {self.directory}. Free space on that "
                    f"disk (or move the run to a larger one) and run the same command again: {resume}."
                    + (f" The unfinished write left {', '.join(left)}, which can be deleted." if left else ""))
        try:
            with faults.explain_disk_full(message):
                yield
        except BaseException:
            self._write_failed = True
            raise

    def _set_aside_steps_from(self, step: int) -> None:
        newer = [s for s in self._manager.all_steps() if s >= step]
        if not newer:
            return
        if self._primary:
            for s in newer:
                reason = self._rejected.get(s)
                base = self.directory / f"{s}.{'rejected' if reason else 'superseded'}"
                destination, copy = base, 1
                while destination.exists():  # an earlier resume set this step aside already
                    destination, copy = base.with_name(f"{base.name}~{copy}"), copy + 1
                os.rename(self._step_dir(s), destination)
                logging.warning("Moved checkpoint step %d aside to %s before saving step %d: %s.",
                                s, destination, step,
                                reason or "it is from a timeline abandoned by resuming from an "
                                          "older step")
        if self._together:
            multihost_utils.sync_global_devices(f"tlt_jax_checkpoint_set_aside_{step}")
        self._manager.reload()

    def save(self, step: int, state: Any, meta: Mapping[str, Any] | None = None) -> None:
        """Saves `state` (a pytree of arrays) and `meta` (JSON-able dict) as `step`.

        `meta` is stored with `"step": step` added. Steps >= `step` already on disk are
        renamed aside first (see the module docstring).
        """
        meta = dict(meta or {})
        if meta.setdefault("step", step) != step:
            raise ValueError(f"meta['step']={meta['step']} disagrees with step={step}")
        self._join_pending()
        self._set_aside_steps_from(step)
        if self._together:
            _align_save_counts()
        with self._writing(step):
            saved = self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        if not saved:
            raise RuntimeError(f"orbax declined to save step {step} in {self.directory}")
        if self._committer is None:
            self._commit(step)
        else:
            self._pending = self._committer.submit(self._commit, step)

    def wait(self) -> None:
        """Blocks until the last save is committed and its manifest written."""
        self._join_pending()

    def all_steps(self) -> list[int]:
        """Steps orbax has on disk, ascending, including any that would fail verification."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest step on disk (it may still fail verification; `restore` then falls back)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def verify(self, step: int) -> None:
        """Raises CheckpointIntegrityError unless `step` is committed and intact."""
        self._join_pending()
        if step not in self._manager.all_steps():
            raise FileNotFoundError(f"No checkpoint step {step} in {self.directory}")
        verify_manifest(self._step_dir(step), step)

    def _restore_step(self, step: int, target: Any) -> tuple[Any, dict]:
        self.verify(step)
        abstract = None if target is None else jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax and tensorstore raise many types for unreadable data
            raise CheckpointIntegrityError(f"step {step}: orbax could not restore it: {e!r}") from e
        if restored.meta.get("step") != step:
            raise CheckpointIntegrityError(
                f"step {step}: its meta says step {restored.meta.get('step')}")
        return restored.state, restored.meta

    def read_meta(self, step: int) -> dict:
        """The JSON meta of a verified step alone (e.g. to size the restore target)."""
        self.verify(step)
        return dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

    def restore(self, step: int | None = None, target: Any = None) -> tuple[Any, dict]:
        """Restores (state, meta) of `step`, or of the newest step that verifies.

        Args:
          step: a specific step (no fallback: a bad one raises CheckpointIntegrityError),
            or None for the newest good step; bad newer steps are skipped with a warning.
          target: a pytree like the saved state whose leaves are arrays or
            jax.ShapeDtypeStruct; each leaf is restored with its shape, dtype and
            sharding. None restores with the shardings recorded at save time.

        Raises:
          FileNotFoundError: no step exists, or none of them verifies and restores.
        """
        self._join_pending()
        if step is not None:
            return self._restore_step(step, target)
        steps = self.all_steps()
        for candidate in reversed(steps):
            try:
                return self._restore_step(candidate, target)
            except CheckpointIntegrityError as e:
                self._rejected[candidate] = str(e)
                logging.warning("Skipping checkpoint %s, trying an older one: %s",
                                self._step_dir(candidate), e)
        if not steps:
            raise FileNotFoundError(f"No checkpoint in {self.directory}")
        raise FileNotFoundError(f"No usable checkpoint in {self.directory}; every step failed: "
                                + "; ".join(self._rejected[s] for s in reversed(steps)))

    def resume(self, like: Any) -> tuple[Any, dict | None]:
        """(state, meta) of the newest good step, laid out like `like` (its shapes,
        dtypes and shardings); (like, None) when the directory holds no step yet."""
        if self.latest_step() is None:
            return like, None
        state, meta = self.restore(target=like)
        logging.info("Resuming from %s, step %s", self.directory, meta.get("step"))
        return state, meta

    def close(self) -> None:
        """Waits for the last save to commit, then releases orbax's threads."""
        try:
            self._join_pending()
        finally:
            try:
                self._manager.close()
            except Exception:
                if not self._write_failed:
                    raise
            finally:
                if self._committer is not None:
                    self._committer.shutdown()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
