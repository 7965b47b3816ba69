"""Teacher cache: what a teacher predicts at each position, on disk, in one of two kinds.

Offline distillation runs the teacher once over a token dataset and keeps, for every
position, a sparse view of its next-token distribution at the sampling temperature; the
student then trains from the cache with the fused top-K KL (see DESIGN.md, "Fused chunked
KL distillation"). `CacheMeta.cache_kind` says which view:

* "topk" (the paper's): the K most likely next tokens and their full-vocabulary
  log-probabilities (fields `ids`, `logp`). A biased estimate of the teacher: the mass
  outside the K is dropped, so the student is never pushed towards it.
* "sampled" (Random-Sampling KD): `samples` tokens drawn from the teacher with
  replacement, stored as their distinct ids with counts (fields `ids`, `counts`; width
  K = the most distinct ids a position can have). The draws' empirical distribution
  counts / samples is an unbiased estimate of the teacher: the expected gradient of the
  KL against it is the full-vocabulary KL's. A reader hands it out as log-probs
  (`empirical_logp`), so the student's loss is the same for both kinds.

Two layers:

* `ShardedArrayStore` — generic: named arrays sharing a leading row axis, stored as
  zarr v3 arrays through tensorstore, written one shard (a fixed block of rows) at a
  time with a completion marker per shard. A killed writer resumes where it stopped and
  a reader never takes a partly written shard for a complete one. The drafter data
  buffer reuses it with its own fields and metadata.
* The teacher cache on top: `CacheMeta` (what the cache was made from: the teacher, the
  tokenizer, the tokens and the packed layout the teacher attended with),
  `write_teacher_cache` (resumable writer) and `TeacherCacheReader` (checked reader);
  `losses.topk_from_logits` turns teacher logits into cache rows.

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

This module imports jax only inside the functions that need it, so a writer driven by
a numpy teacher (tests, host-side tools) starts without it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import tensorstore as ts
from tqdm import auto as tqdm_auto

from tlt_jax import faults
from tlt_jax.fingerprint import fingerprint_tokens

# Of the teacher cache (its fields and their meaning). 2: the layout of packed rows
# (positions, segment ids) is given to the teacher and recorded (`layout_fingerprint`);
# 1 left it to be recovered from the tokens (<bos>, <pad>), wrong for tokenizers without
# a <bos> or whose <pad> is also an end token.
FORMAT_VERSION = 2
STORE_VERSION = 1  # of the generic store layout
CACHE_KIND = "teacher_topk_cache"  # the store's kind (a teacher cache of either cache_kind)
CACHE_KINDS = ("topk", "sampled")
LOGP_DTYPES = ("bfloat16", "float32")
# A sampled cache's counts take the bytes of the log-probs they replace, so that a top-K and a
# sampled cache of the same width and logp_dtype are the same size.
_COUNTS_DTYPE = {"float32": "int32", "bfloat16": "uint16"}
# Caches written before cache_kind existed are top-K caches: what their metadata lacks.
_TOPK_DEFAULTS = {"cache_kind": "topk", "samples": 0, "sample_seed": 0}

_STORE_FILE = "store.json"
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
        _np_dtype(self.dtype)  # fail early on unknown names

    @property
    def np_dtype(self) -> np.dtype:
        return _np_dtype(self.dtype)

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.np_dtype.itemsize


def _np_dtype(name: str) -> np.dtype:
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


def _json_normal(obj: Any) -> Any:
    # What `obj` reads back as from JSON (tuples become lists), for like-for-like compares.
    return json.loads(json.dumps(obj))


def _differences(found: Any, expected: Any, prefix: str = "") -> list[str]:
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
                out.extend(_differences(found[key], expected[key], f"{name}."))
        return out
    if found != expected:
        return [f"{prefix.rstrip('.')} is {found!r} on disk, {expected!r} expected"]
    return []


class _Pending:
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
        metadata = _json_normal(dict(metadata))
        if rows_per_shard is None:
            if os.path.exists(os.path.join(path, _STORE_FILE)):
                rows_per_shard = _load_store_json(path)["layout"]["rows_per_shard"]
            else:
                row_bytes = sum(f.row_bytes for f in fields.values())
                rows_per_shard = max(1, _TARGET_SHARD_BYTES // max(row_bytes, 1))
        if num_rows < 1 or rows_per_shard < 1:
            raise ValueError(f"need num_rows >= 1 and rows_per_shard >= 1, "
                             f"got {num_rows} and {rows_per_shard}")
        layout = _json_normal({
            "store_version": STORE_VERSION,
            "num_rows": int(num_rows),
            "rows_per_shard": int(rows_per_shard),
            "fields": {name: dataclasses.asdict(f) for name, f in fields.items()},
        })
        store_file = os.path.join(path, _STORE_FILE)
        if os.path.exists(store_file):
            found = _load_store_json(path)
            problems = (_differences(found["metadata"], metadata)
                        + _differences(found["layout"], layout))
            if problems:
                raise MetadataMismatchError(
                    f"cannot resume the store at {path}: it was made differently; "
                    + "; ".join(problems))
        else:
            os.makedirs(path, exist_ok=True)
            # Only a crashed creator's temp files may be here; anything else is not ours.
            strangers = [n for n in os.listdir(path) if not n.startswith(f".{_STORE_FILE}.tmp")]
            if strangers:
                raise NotAStoreError(f"{path} is not empty and holds no {_STORE_FILE}; "
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
        found = _load_store_json(path)
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

    def start_write_shard(self, shard: int, arrays_R: Mapping[str, np.ndarray]) -> _Pending:
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

        return _Pending(futures, mark_complete)

    def write_shard(self, shard: int, arrays_R: Mapping[str, np.ndarray]) -> None:
        """Writes `shard` and marks it complete; see `start_write_shard`."""
        self.start_write_shard(shard, arrays_R).result()

    # -- reading --------------------------------------------------------------------

    def start_read_rows(self, indices_B: Sequence[int] | np.ndarray,
                        fields: Sequence[str] | None = None) -> _Pending:
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
        return _Pending(futures, lambda results: dict(zip(names, results)))

    def read_rows(self, indices_B, fields: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Reads rows of complete shards; see `start_read_rows`."""
        return self.start_read_rows(indices_B, fields).result()


def _load_store_json(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, _STORE_FILE)) as f:
            return json.load(f)
    except FileNotFoundError:
        raise NotAStoreError(f"{path} is not a sharded array store (no {_STORE_FILE}); "
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


# ----------------------------------------------------------------------------------
# Teacher cache
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CacheMeta:
    """What a teacher cache was made from; a reader must expect exactly this.

    Fingerprints are opaque strings, normally from `fingerprint_arrays` (teacher params),
    `fingerprint_path` (tokenizer directory), `fingerprint_tokens` (dataset) and
    `layout_fingerprint` (the rows' positions and segment ids; "" when the teacher sees
    the tokens alone, each row one sequence from position 0).
    `temperature` divides the teacher logits before the log-softmax (and the sampling);
    `logp_dtype` is the on-disk dtype of the log-probs ("bfloat16" or "float32"; a sampled
    cache stores its counts in an integer of the same width).
    `cache_kind`: "topk" or "sampled" (module docstring). `top_k` is the width K of each
    position's row: the K most likely ids, or for a sampled cache the most distinct ids its
    `samples` draws can give (<= samples). `sample_seed`: the draws' seed (row r, position t
    draws with key fold_in(fold_in(key(sample_seed), r), t)). Both 0 for a top-K cache.
    """
    teacher_fingerprint: str
    tokenizer_fingerprint: str
    dataset_fingerprint: str
    top_k: int
    temperature: float = 1.0
    logp_dtype: str = "bfloat16"
    layout_fingerprint: str = ""
    format_version: int = FORMAT_VERSION
    cache_kind: str = "topk"
    samples: int = 0
    sample_seed: int = 0

    def __post_init__(self):
        # Coerce numpy scalars and the like so that the JSON round trip is exact.
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "format_version", int(self.format_version))
        object.__setattr__(self, "samples", int(self.samples))
        object.__setattr__(self, "sample_seed", int(self.sample_seed))
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.cache_kind not in CACHE_KINDS:
            raise ValueError(f"cache_kind={self.cache_kind!r} is not one of {', '.join(CACHE_KINDS)}; set cache_kind "
                             "to 'topk' or 'sampled'")
        if self.cache_kind == "sampled" and not 1 <= self.top_k <= self.samples:
            raise ValueError(f"a sampled cache needs 1 <= top_k <= samples (its rows hold at most `samples` distinct "
                             f"ids), got top_k={self.top_k}, samples={self.samples}; set samples >= 1 and top_k <= it")
        if self.cache_kind == "topk" and (self.samples, self.sample_seed) != (0, 0):
            raise ValueError("samples and sample_seed are a sampled cache's; leave them 0 for cache_kind='topk'")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.logp_dtype not in LOGP_DTYPES:
            raise ValueError(f"logp_dtype must be one of {LOGP_DTYPES}, got {self.logp_dtype!r}")

    def store_metadata(self) -> dict[str, Any]:
        return {"kind": CACHE_KIND, **dataclasses.asdict(self)}

    def fields(self, seq_len: int) -> dict[str, FieldSpec]:
        """ids, then the values: logp (top-K) or counts (sampled), each [seq_len, top_k]."""
        name, dtype = ("logp", self.logp_dtype) if self.cache_kind == "topk" else ("counts",
                                                                                 _COUNTS_DTYPE[self.logp_dtype])
        return {"ids": FieldSpec("int32", (seq_len, self.top_k)), name: FieldSpec(dtype, (seq_len, self.top_k))}


def empirical_logp(counts, samples: int) -> np.ndarray:
    """log(counts / samples) as float32, -inf where a slot holds no id (count 0): a sampled
    cache's teacher side, the log of the draws' empirical distribution."""
    counts = np.asarray(counts, np.float64)
    with np.errstate(divide="ignore"):
        return np.log(counts / samples).astype(np.float32)


def _with_topk_defaults(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Store metadata as this code writes it: a cache from before cache_kind is a top-K one."""
    return {**_TOPK_DEFAULTS, **metadata} if metadata.get("kind") == CACHE_KIND else dict(metadata)


def layout_fingerprint(positions_NT, segment_ids_NT) -> str:
    """Fingerprint of the layout of packed rows: positions and segment ids [N, T] (segment
    0 is padding), as the teacher attends with them."""
    parts = "\n".join(f"{name}={fingerprint_tokens(x_NT)}" for name, x_NT in
                      (("positions", positions_NT), ("segment_ids", segment_ids_NT)))
    return "sha256:" + hashlib.sha256(parts.encode()).hexdigest()


def _check_format(path: str, metadata: Mapping[str, Any], expected: CacheMeta) -> None:
    """A cache of another format version is refused as such, before its other fields are
    compared (their meaning may differ)."""
    found = metadata.get("format_version")
    if found != expected.format_version:
        raise MetadataMismatchError(
            f"teacher cache at {path} has format_version {found!r}, this code reads format_version "
            f"{expected.format_version!r} (format 2 records the packed rows' layout, positions and segment ids, "
            "beside their tokens); it cannot be reused: delete it, or write the new cache elsewhere")


TeacherFn = Callable[..., tuple[Any, Any]]


def write_teacher_cache(path: str | os.PathLike, tokens_NT, teacher_fn: TeacherFn,
                        meta: CacheMeta, *, batch_size: int, layout=None,
                        rows_per_shard: int | None = None,
                        progress: bool = True) -> TeacherCacheReader:
    """Runs `teacher_fn` over `tokens_NT` and stores what it gives at `path`.

    Resumable: if `path` already holds a cache with the same `meta` and shape, complete
    shards are kept and only the missing ones are computed; a different `meta` raises
    MetadataMismatchError naming the field.

    Args:
      path: cache directory (created if absent; must be empty or a cache).
      tokens_NT: [N sequences, T positions] integer tokens (numpy array or memmap).
      teacher_fn: tokens_BT int32 [batch_size, T] -> (ids_BTK, logp_BTK), numpy or jax,
        with K = meta.top_k and log-probs at meta.temperature (see `topk_from_logits`);
        with a `layout`, (tokens_BT, positions_BT, segment_ids_BT) -> the same. A sampled
        cache's teacher also takes the rows' indices int64 [batch_size] last and gives
        (ids_BTK, counts_BTK): distinct ids (-1 in empty slots) and their counts among
        meta.samples draws. Always called with exactly `batch_size` rows (the last batch
        is padded by repeating a row) so a jitted teacher compiles once.
      meta: what the cache is made from; `meta.dataset_fingerprint` must equal
        `fingerprint_tokens(tokens_NT)` and `meta.layout_fingerprint`
        `layout_fingerprint(*layout)` ("" without a layout) (both checked).
      batch_size: sequences per teacher call; free to change between resumes.
      layout: None, or (positions_NT, segment_ids_NT) of packed rows (segment 0 is
        padding): what the teacher attends with, given to it beside the tokens.
      rows_per_shard: sequences per shard (the resume and file granularity), fixed when
        the cache is created; None keeps the existing value or picks ~256 MiB shards.
      progress: show a tqdm progress bar over sequences.
    Returns:
      A reader of the finished cache.
    Raises:
      faults.DiskFullError: the disk filled up; the shards completed so far stay valid
        and a rerun computes only the others.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    dataset_fingerprint = fingerprint_tokens(tokens_NT)  # checks tokens_NT is [N, T] integers
    num_rows, seq_len = (int(n) for n in tokens_NT.shape)
    if meta.dataset_fingerprint != dataset_fingerprint:
        raise MetadataMismatchError(
            f"meta.dataset_fingerprint is {meta.dataset_fingerprint!r} but tokens_NT hashes "
            f"to {dataset_fingerprint!r}")
    if layout is not None:
        layout = tuple(layout)
        if len(layout) != 2 or any(tuple(x.shape) != (num_rows, seq_len) for x in layout):
            raise ValueError(f"layout must be (positions_NT, segment_ids_NT), each of shape {(num_rows, seq_len)}")
    layout_fp = "" if layout is None else layout_fingerprint(*layout)
    if meta.layout_fingerprint != layout_fp:
        raise MetadataMismatchError(
            f"meta.layout_fingerprint is {meta.layout_fingerprint!r} but the layout given hashes to {layout_fp!r}")
    metadata = meta.store_metadata()
    if os.path.isfile(os.path.join(os.fspath(path), _STORE_FILE)):
        found = _load_store_json(os.fspath(path))["metadata"]
        _check_format(os.fspath(path), found, meta)
        if "cache_kind" not in found and _with_topk_defaults(found) == _json_normal(metadata):
            metadata = {k: v for k, v in metadata.items() if k not in _TOPK_DEFAULTS}  # resumed as written
    store = None

    def disk_full() -> str:
        kept = int(store.complete_S.sum()) if store is not None else 0
        return (f"Out of disk space writing the teacher cache at {os.fspath(path)}. Free space on that disk (or give "
                f"the cache a path on a larger one) and run the same command again: its {kept} complete shard(s) "
                "are kept and only the missing ones are computed.")

    with faults.explain_disk_full(disk_full):
        store = ShardedArrayStore.open_or_create(
            path, fields=meta.fields(seq_len), num_rows=num_rows,
            metadata=metadata, rows_per_shard=rows_per_shard)
        field_specs = meta.fields(seq_len)

        rows_M = np.concatenate([np.arange(*store.shard_bounds(s))
                                 for s in store.missing_shards] or [np.zeros((0,), np.int64)])
        shape_TK = (seq_len, meta.top_k)
        buffers: dict[int, dict[str, np.ndarray]] = {}  # shard -> field -> [rows, T, K]
        filled: collections.Counter[int] = collections.Counter()
        pending: collections.deque[_Pending] = collections.deque()
        bar = tqdm_auto.tqdm(total=num_rows, initial=num_rows - len(rows_M), unit="seq",
                             desc="teacher cache", disable=not progress)
        with bar:
            for begin in range(0, len(rows_M), batch_size):
                rows_B = rows_M[begin:begin + batch_size]
                padded_B = np.concatenate([rows_B, np.full(batch_size - len(rows_B), rows_B[-1])])
                inputs = [np.asarray(x_NT[padded_B], dtype=np.int32)
                          for x_NT in (tokens_NT, *(layout or ()))]
                if meta.cache_kind == "sampled":  # each row's draws depend on its index alone
                    inputs.append(padded_B)
                outputs = dict(zip(field_specs, (np.asarray(x) for x in teacher_fn(*inputs))))
                for name, x in outputs.items():
                    if x.shape != (batch_size, *shape_TK):
                        raise ValueError(f"teacher_fn returned {name} of shape {x.shape}, expected "
                                         f"{(batch_size, *shape_TK)} (batch_size, T, top_k)")
                shard_B = rows_B // store.rows_per_shard
                for shard in np.unique(shard_B):
                    start, stop = store.shard_bounds(shard)
                    if shard not in buffers:
                        buffers[shard] = {name: np.empty((stop - start, *shape_TK), spec.np_dtype)
                                          for name, spec in field_specs.items()}
                    in_shard_B = shard_B == shard
                    local = rows_B[in_shard_B] - start
                    for name, x in outputs.items():
                        buffers[shard][name][local] = x[:len(rows_B)][in_shard_B]
                    filled[shard] += len(local)
                    if filled[shard] == stop - start:
                        # Writes run in tensorstore's threads while the teacher computes the next
                        # batches; at most one shard is in flight, to bound host memory.
                        pending.append(store.start_write_shard(shard, buffers.pop(shard)))
                # Mark shards complete as soon as their data is on disk, so a kill loses little.
                while pending and (len(pending) > 1 or pending[0].done()):
                    pending.popleft().result()
                bar.update(len(rows_B))
            while pending:
                pending.popleft().result()
    return TeacherCacheReader(path, meta)


class TeacherBatch(NamedTuple):
    """A batch from `TeacherCacheReader.iter_batches`."""
    indices_B: np.ndarray  # int64 [B], sequence indices into the dataset's tokens_NT
    ids_BTK: np.ndarray  # int32 [B, T, K], most likely (top-K) or most drawn (sampled) first
    logp_BTK: np.ndarray  # [B, T, K] teacher log-probs: top-K: full-vocabulary, logp_dtype; sampled:
    # the draws' empirical distribution, float32 (`empirical_logp`), -inf at empty slots (id -1)


class TeacherCacheReader:
    """Reads a teacher cache after checking it is complete and made as expected.

    Raises NotAStoreError if `path` holds no teacher cache, MetadataMismatchError
    (naming each differing field and both values) if its metadata differs from
    `expected`, and IncompleteStoreError if shards are missing — unless
    `allow_partial=True`, which serves the complete shards only: then `indices_N` lists
    the readable sequences and `len()` counts them.
    """

    def __init__(self, path: str | os.PathLike, expected: CacheMeta, *,
                 allow_partial: bool = False):
        self._store = ShardedArrayStore.open(path)
        self.path = self._store.path
        if self._store.metadata.get("kind") != CACHE_KIND:
            raise NotAStoreError(f"{self.path} is a store of kind "
                                 f"{self._store.metadata.get('kind')!r}, not a teacher cache")
        _check_format(self.path, self._store.metadata, expected)
        problems = _differences(_with_topk_defaults(self._store.metadata), _json_normal(expected.store_metadata()))
        if problems:
            raise MetadataMismatchError(
                f"teacher cache at {self.path} does not match what is expected: "
                + "; ".join(problems))
        missing = self._store.missing_shards
        if missing.size and not allow_partial:
            raise IncompleteStoreError(
                f"teacher cache at {self.path} is incomplete: {missing.size} of "
                f"{self._store.num_shards} shards missing (first {missing[:5].tolist()}); "
                "resume the writer (write_teacher_cache with the same arguments) to finish it")
        self.meta = expected
        self.num_sequences = self._store.num_rows
        self.seq_len = self._store.fields["ids"].row_shape[0]
        self.indices_N = self._store.complete_rows()

    def __len__(self) -> int:
        return len(self.indices_N)

    def read(self, indices_B) -> tuple[np.ndarray, np.ndarray]:
        """(ids_BTK int32, logp_BTK) for sequence indices `indices_B` (any order); see TeacherBatch."""
        return self._teacher_side(self._store.read_rows(indices_B))

    def _teacher_side(self, out: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        if self.meta.cache_kind == "sampled":
            return out["ids"], empirical_logp(out["counts"], self.meta.samples)
        return out["ids"], out["logp"]

    def iter_batches(self, batch_size: int, *, shuffle: bool = False, seed: int = 0,
                     drop_remainder: bool = False) -> Iterator[TeacherBatch]:
        """One pass over the readable sequences in batches, reading the next one ahead."""
        order_N = self.indices_N
        if shuffle:
            order_N = np.random.default_rng(seed).permutation(order_N)
        stop = len(order_N) - len(order_N) % batch_size if drop_remainder else len(order_N)
        batches = [order_N[i:i + batch_size] for i in range(0, stop, batch_size)]
        pending = self._store.start_read_rows(batches[0]) if batches else None
        for i, indices_B in enumerate(batches):
            current = pending
            if i + 1 < len(batches):
                pending = self._store.start_read_rows(batches[i + 1])
            yield TeacherBatch(indices_B, *self._teacher_side(current.result()))


def read_cache_meta(path: str | os.PathLike) -> CacheMeta:
    """The CacheMeta a cache was written with (for inspection; readers should expect)."""
    store = ShardedArrayStore.open(path)
    metadata = _with_topk_defaults(store.metadata)
    if metadata.pop("kind", None) != CACHE_KIND:
        raise NotAStoreError(f"{store.path} is not a teacher cache")
    return CacheMeta(**metadata)
