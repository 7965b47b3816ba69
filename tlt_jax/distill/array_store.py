"""A generic sharded array store on disk: named arrays sharing a leading row axis, stored as
zarr v3 arrays through tensorstore, written one shard (a fixed block of rows) at a time with a
completion marker per shard. A killed writer resumes where it stopped and a reader never takes
a partly written shard for a complete one. The teacher cache (`teacher_cache`) and the drafter
data buffer are stores with their own fields and metadata.

On-disk layout of a store at `path`::

    store.json          layout (rows, rows per shard, fields) and caller metadata;
                        written first, atomically, and never changed afterwards
    <field>/            one zarr v3 array per field, shape [num_rows, *row_shape]; one
                        zarr shard file per store shard ([rows_per_shard, *row_shape]),
                        inner chunks of one row so a single row reads on its own
    done/<shard>.json   completion marker of one shard, written atomically (tmp file,
                        fsync, os.replace) only after all of the shard's data is durable

Because a store shard is exactly one zarr shard file, writing one shard never touches
another shard's file, and complete shards are never rewritten.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts

STORE_VERSION = 1  # of the generic store layout
STORE_FILE = "store.json"
_DONE_DIR = "done"
_MARKER_RE = re.compile(r"^(\d{8})\.json$")
# Default shard size: large enough that per-file overheads vanish, small enough that a
# killed writer loses little work and the writer's buffers stay modest.
_TARGET_SHARD_BYTES = 256 << 20


class NotAStoreError(FileNotFoundError):
    """The path holds no store (or no teacher cache)."""


class MetadataMismatchError(ValueError):
    """The store on disk was made with different metadata or layout than expected."""


class IncompleteStoreError(RuntimeError):
    """Some shards are not complete (the writer was interrupted or is still running)."""


# ----------------------------------------------------------------------------------
# Generic sharded array store
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One array of a store: every row has shape `row_shape` and dtype `dtype`.

    `dtype` is a numpy dtype name; "bfloat16" means ml_dtypes.bfloat16.
    """
    dtype: str
    row_shape: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "row_shape", tuple(int(d) for d in self.row_shape))
        np_dtype_of(self.dtype)  # fail early on unknown names

    @property
    def np_dtype(self) -> np.dtype:
        return np_dtype_of(self.dtype)

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.np_dtype.itemsize


def np_dtype_of(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _atomic_write_json(path: str, obj: Any) -> None:
    """Writes JSON so that readers see either nothing or the whole file, even on a crash."""
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # The rename itself is durable only once the directory entry is synced.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def json_normal(obj: Any) -> Any:
    # What `obj` reads back as from JSON (tuples become lists), for like-for-like compares.
    return json.loads(json.dumps(obj))


def differences(found: Any, expected: Any, prefix: str = "") -> list[str]:
    """Human-readable differences between two JSON values, naming each differing key."""
    if isinstance(found, dict) and isinstance(expected, dict):
        out = []
        for key in sorted(set(found) | set(expected), key=str):
            name = f"{prefix}{key}"
            if key not in found:
                out.append(f"{name} is absent on disk, {expected[key]!r} expected")
            elif key not in expected:
                out.append(f"{name} is {found[key]!r} on disk, absent from what is expected")
            else:
                out.extend(differences(found[key], expected[key], f"{name}."))
        return out
    if found != expected:
        return [f"{prefix.rstrip('.')} is {found!r} on disk, {expected!r} expected"]
    return []


class Pending:
    """Tensorstore futures plus a step to run once they are all done."""

    def __init__(self, futures: Sequence[Any], finish: Callable[[list[Any]], Any]):
        self._futures = futures
        self._finish = finish

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self) -> Any:
        return self._finish([f.result() for f in self._futures])


class ShardedArrayStore:
    """Named arrays with a shared row axis, written shard by shard with completion markers.

    Shard s holds rows [s * rows_per_shard, min((s + 1) * rows_per_shard, num_rows)).
    A shard counts as complete only once its marker exists; the marker is written after
    every field's data for the shard is committed (tensorstore syncs files by default),
    so a writer killed at any point leaves at worst an unmarked shard, which the next
    writer recomputes and readers refuse. Complete shards are immutable. One writer at a
    time; any number of readers.

    Make one with `open_or_create` (writers) or `open` (readers).
    """

    def __init__(self, path: str, layout: dict[str, Any], metadata: dict[str, Any],
                 arrays: dict[str, ts.TensorStore]):
        self.path = path
        self.num_rows: int = layout["num_rows"]
        self.rows_per_shard: int = layout["rows_per_shard"]
        self.fields = {name: FieldSpec(f["dtype"], f["row_shape"])
                       for name, f in layout["fields"].items()}
        self.metadata = metadata
        self._layout = layout
        self._arrays = arrays
        self.complete_S = self._read_markers()

    def _array(self, name: str) -> ts.TensorStore:
        if name not in self._arrays:
            spec = _zarr_spec(self.path, name, self.fields[name], self._layout)
            self._arrays[name] = ts.open(spec, open=True).result()
        return self._arrays[name]

    # -- opening --------------------------------------------------------------------

    @classmethod
    def open_or_create(cls, path: str | os.PathLike, *, fields: Mapping[str, FieldSpec],
                       num_rows: int, metadata: Mapping[str, Any],
                       rows_per_shard: int | None = None) -> ShardedArrayStore:
        """Opens the store at `path` for writing, creating it if absent.

        An existing store must have the same fields, `num_rows` and `metadata` (and
        `rows_per_shard`, if given), else MetadataMismatchError names every differing key.
        `rows_per_shard=None` keeps an existing store's value, or for a new store picks
        about 256 MiB of data per shard.
        """
        path = os.fspath(path)
        fields = dict(fields)
        metadata = json_normal(dict(metadata))
        if rows_per_shard is None:
            if os.path.exists(os.path.join(path, STORE_FILE)):
                rows_per_shard = load_store_json(path)["layout"]["rows_per_shard"]
            else:
                row_bytes = sum(f.row_bytes for f in fields.values())
                rows_per_shard = max(1, _TARGET_SHARD_BYTES // max(row_bytes, 1))
        if num_rows < 1 or rows_per_shard < 1:
            raise ValueError(f"need num_rows >= 1 and rows_per_shard >= 1, "
                             f"got {num_rows} and {rows_per_shard}")
        layout = json_normal({
            "store_version": STORE_VERSION,
            "num_rows": int(num_rows),
            "rows_per_shard": int(rows_per_shard),
            "fields": {name: dataclasses.asdict(f) for name, f in fields.items()},
        })
        store_file = os.path.join(path, STORE_FILE)
        if os.path.exists(store_file):
            found = load_store_json(path)
            problems = (differences(found["metadata"], metadata)
                        + differences(found["layout"], layout))
            if problems:
                raise MetadataMismatchError(
                    f"cannot resume the store at {path}: it was made differently; "
                    + "; ".join(problems))
        else:
            os.makedirs(path, exist_ok=True)
            # Only a crashed creator's temp files may be here; anything else is not ours.
            strangers = [n for n in os.listdir(path) if not n.startswith(f".{STORE_FILE}.tmp")]
            if strangers:
                raise NotAStoreError(f"{path} is not empty and holds no {STORE_FILE}; "
                                     f"refusing to create a store there (found {strangers[:5]})")
            _atomic_write_json(store_file, {"layout": layout, "metadata": metadata})
        os.makedirs(os.path.join(path, _DONE_DIR), exist_ok=True)
        arrays = {name: ts.open(_zarr_spec(path, name, f, layout), create=True,
                                open=True).result()
                  for name, f in fields.items()}
        return cls(path, layout, metadata, arrays)

    @classmethod
    def open(cls, path: str | os.PathLike) -> ShardedArrayStore:
        """Opens an existing store for reading; NotAStoreError if `path` holds none."""
        path = os.fspath(path)
        found = load_store_json(path)
        layout = found["layout"]
        if layout.get("store_version") != STORE_VERSION:
            raise MetadataMismatchError(
                f"store at {path} has store_version {layout.get('store_version')!r}, "
                f"this code reads {STORE_VERSION}")
        # Arrays open on first read: a creator killed before making them leaves a store
        # with no complete shard, which must still open (and report itself incomplete).
        return cls(path, layout, found["metadata"], arrays={})

    # -- shards ---------------------------------------------------------------------

    @property
    def num_shards(self) -> int:
        return -(-self.num_rows // self.rows_per_shard)

    def shard_bounds(self, shard: int) -> tuple[int, int]:
        """Rows [start, stop) of `shard`."""
        start = int(shard) * self.rows_per_shard
        return start, min(start + self.rows_per_shard, self.num_rows)

    @property
    def missing_shards(self) -> np.ndarray:
        """Indices of shards without a completion marker (as of open or last write)."""
        return np.flatnonzero(~self.complete_S)

    def complete_rows(self) -> np.ndarray:
        """Indices [M] of the rows that lie in complete shards, ascending."""
        rows = [np.arange(*self.shard_bounds(s)) for s in np.flatnonzero(self.complete_S)]
        return np.concatenate(rows) if rows else np.zeros((0,), np.int64)

    def _read_markers(self) -> np.ndarray:
        complete_S = np.zeros((self.num_shards,), bool)
        done_dir = os.path.join(self.path, _DONE_DIR)
        for name in os.listdir(done_dir) if os.path.isdir(done_dir) else ():
            if (m := _MARKER_RE.match(name)) and int(m.group(1)) < self.num_shards:
                complete_S[int(m.group(1))] = True
        return complete_S

    def start_write_shard(self, shard: int, arrays_R: Mapping[str, np.ndarray]) -> Pending:
        """Starts writing every field of `shard`; `.result()` waits, then marks it complete.

        `arrays_R[name]` has shape [rows of the shard, *row_shape] and is cast to the
        field's dtype. The shard is complete (for this and later readers) only after
        `.result()` returns.
        """
        shard = int(shard)
        if self.complete_S[shard]:
            raise ValueError(f"shard {shard} of {self.path} is complete; complete shards "
                             "are never rewritten")
        if set(arrays_R) != set(self.fields):
            raise ValueError(f"shard data has fields {sorted(arrays_R)}, the store has "
                             f"{sorted(self.fields)}")
        start, stop = self.shard_bounds(shard)
        futures = []
        for name, spec in self.fields.items():
            x = np.asarray(arrays_R[name]).astype(spec.np_dtype, copy=False)
            if x.shape != (stop - start, *spec.row_shape):
                raise ValueError(f"field {name!r} of shard {shard}: shape {x.shape}, "
                                 f"expected {(stop - start, *spec.row_shape)}")
            # Waiting on `commit` (not just the copy out of `x`) means the data is on disk.
            futures.append(self._array(name)[start:stop].write(x).commit)

        def mark_complete(_):
            _write_marker(self.path, shard, start, stop)
            self.complete_S[shard] = True

        return Pending(futures, mark_complete)

    def write_shard(self, shard: int, arrays_R: Mapping[str, np.ndarray]) -> None:
        """Writes `shard` and marks it complete; see `start_write_shard`."""
        self.start_write_shard(shard, arrays_R).result()

    # -- reading --------------------------------------------------------------------

    def start_read_rows(self, indices_B: Sequence[int] | np.ndarray,
                        fields: Sequence[str] | None = None) -> Pending:
        """Starts reading rows `indices_B` (any order, repeats allowed) of complete shards.

        `.result()` gives {field: array [B, *row_shape]}. Raises IncompleteStoreError at
        once if a row lies in a shard that is not complete.
        """
        indices_B = np.asarray(indices_B, np.int64).reshape(-1)
        if indices_B.size and (indices_B.min() < 0 or indices_B.max() >= self.num_rows):
            raise IndexError(f"row indices must lie in [0, {self.num_rows})")
        bad_shards = np.unique(indices_B // self.rows_per_shard)
        bad_shards = bad_shards[~self.complete_S[bad_shards]]
        if bad_shards.size:
            raise IncompleteStoreError(
                f"rows requested from incomplete shards {bad_shards[:10].tolist()} of "
                f"{self.path}")
        names = list(self.fields if fields is None else fields)
        futures = [self._array(name)[indices_B].read() for name in names]
        return Pending(futures, lambda results: dict(zip(names, results)))

    def read_rows(self, indices_B, fields: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Reads rows of complete shards; see `start_read_rows`."""
        return self.start_read_rows(indices_B, fields).result()


def load_store_json(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, STORE_FILE)) as f:
            return json.load(f)
    except FileNotFoundError:
        raise NotAStoreError(f"{path} is not a sharded array store (no {STORE_FILE}); "
                             "was it written by write_teacher_cache?") from None


def _write_marker(path: str, shard: int, start: int, stop: int) -> None:
    _atomic_write_json(os.path.join(path, _DONE_DIR, f"{shard:08d}.json"),
                       {"shard": shard, "rows": [start, stop]})


def _zarr_spec(path: str, name: str, field: FieldSpec, layout: dict[str, Any]) -> dict:
    """zarr v3 spec: one shard file per store shard, one inner chunk per row."""
    row_shape = list(field.row_shape)
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": os.path.join(path, name)},
        "metadata": {
            "shape": [layout["num_rows"], *row_shape],
            "data_type": field.dtype,
            "chunk_grid": {"name": "regular", "configuration": {
                "chunk_shape": [layout["rows_per_shard"], *row_shape]}},
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": [1, *row_shape],
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                           {"name": "zstd", "configuration": {"level": 1}}],
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                 {"name": "crc32c"}],
            }}],
            "fill_value": 0,
        },
    }
