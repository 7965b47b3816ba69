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

The cache is a `ShardedArrayStore` (`array_store`: named arrays on disk, written a shard at a
time with completion markers, so a killed writer resumes and a reader never takes a partial
shard) with the teacher cache on top: `CacheMeta` (what the cache was made from: the teacher,
the tokenizer, the tokens and the packed layout the teacher attended with),
`write_teacher_cache` (resumable writer) and `TeacherCacheReader` (checked reader);
`losses.topk_from_logits` turns teacher logits into cache rows.

This module imports jax only inside the functions that need it, so a writer driven by
a numpy teacher (tests, host-side tools) starts without it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
from tqdm import auto as tqdm_auto

from tlt_jax import faults
from tlt_jax.distill.array_store import (  # noqa: F401  (the store's names, as a cache's user meets them)
    STORE_FILE,
    FieldSpec,
    IncompleteStoreError,
    MetadataMismatchError,
    NotAStoreError,
    Pending,
    ShardedArrayStore,
    differences,
    json_normal,
    load_store_json,
)
from tlt_jax.fingerprint import fingerprint_tokens

# Of the teacher cache (its fields and their meaning). 2: the layout of packed rows
# (positions, segment ids) is given to the teacher and recorded (`layout_fingerprint`);
# 1 left it to be recovered from the tokens (<bos>, <pad>), wrong for tokenizers without
# a <bos> or whose <pad> is also an end token.
FORMAT_VERSION = 2
CACHE_KIND = "teacher_topk_cache"  # the store's kind (a teacher cache of either cache_kind)
CACHE_KINDS = ("topk", "sampled")
LOGP_DTYPES = ("bfloat16", "float32")
# A sampled cache's counts take the bytes of the log-probs they replace, so that a top-K and a
# sampled cache of the same width and logp_dtype are the same size.
_COUNTS_DTYPE = {"float32": "int32", "bfloat16": "uint16"}
# Caches written before cache_kind existed are top-K caches: what their metadata lacks.
_TOPK_DEFAULTS = {"cache_kind": "topk", "samples": 0, "sample_seed": 0}



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
    layout = _checked_layout(tokens_NT, meta, layout)
    seq_len = int(tokens_NT.shape[1])
    store = None

    def disk_full() -> str:
        kept = int(store.complete_S.sum()) if store is not None else 0
        return (f"Out of disk space writing the teacher cache at {os.fspath(path)}. Free space on that disk (or give "
                f"the cache a path on a larger one) and run the same command again: its {kept} complete shard(s) "
                "are kept and only the missing ones are computed.")

    with faults.explain_disk_full(disk_full):
        store = ShardedArrayStore.open_or_create(
            path, fields=meta.fields(seq_len), num_rows=int(tokens_NT.shape[0]),
            metadata=_metadata_to_write(path, meta), rows_per_shard=rows_per_shard)
        _fill_missing_shards(store, (tokens_NT, *(layout or ())), teacher_fn, meta, batch_size, progress)
    return TeacherCacheReader(path, meta)


def _checked_layout(tokens_NT, meta: CacheMeta, layout):
    """`layout` as a tuple (or None) after checking the tokens and the layout hash to what
    `meta` says they are."""
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
    return layout


def _metadata_to_write(path, meta: CacheMeta) -> dict:
    """The store metadata of `meta`; a cache from before cache_kind is resumed as it was written."""
    metadata = meta.store_metadata()
    if os.path.isfile(os.path.join(os.fspath(path), STORE_FILE)):
        found = load_store_json(os.fspath(path))["metadata"]
        _check_format(os.fspath(path), found, meta)
        if "cache_kind" not in found and _with_topk_defaults(found) == json_normal(metadata):
            metadata = {k: v for k, v in metadata.items() if k not in _TOPK_DEFAULTS}
    return metadata


def _fill_missing_shards(store: ShardedArrayStore, inputs_NT: tuple, teacher_fn: TeacherFn, meta: CacheMeta,
                         batch_size: int, progress: bool) -> None:
    """Runs the teacher over the rows of the store's missing shards (inputs_NT: the tokens and
    the layout, if any) and writes each shard as soon as it is full."""
    num_rows, seq_len = (int(n) for n in inputs_NT[0].shape)
    field_specs = meta.fields(seq_len)
    rows_M = np.concatenate([np.arange(*store.shard_bounds(s))
                             for s in store.missing_shards] or [np.zeros((0,), np.int64)])
    shape_TK = (seq_len, meta.top_k)
    buffers: dict[int, dict[str, np.ndarray]] = {}  # shard -> field -> [rows, T, K]
    filled: collections.Counter[int] = collections.Counter()
    pending: collections.deque[Pending] = collections.deque()
    bar = tqdm_auto.tqdm(total=num_rows, initial=num_rows - len(rows_M), unit="seq",
                         desc="teacher cache", disable=not progress)
    with bar:
        for begin in range(0, len(rows_M), batch_size):
            rows_B = rows_M[begin:begin + batch_size]
            padded_B = np.concatenate([rows_B, np.full(batch_size - len(rows_B), rows_B[-1])])
            inputs = [np.asarray(x_NT[padded_B], dtype=np.int32) for x_NT in inputs_NT]
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
        problems = differences(_with_topk_defaults(self._store.metadata), json_normal(expected.store_metadata()))
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
