"""Identity of arrays, files and token datasets: content hashes, "sha256:<hex>".

What a teacher cache was made from, which target a drafter export fits and which policy
an RL run published are all recorded as these fingerprints and checked when read back.
This module imports jax only inside `fingerprint_arrays`, so numpy-only tools stay
jax-free.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np


def _update(h, *parts: bytes | str | int) -> None:
    # Length-prefix every part so that distinct sequences of parts never hash alike.
    for part in parts:
        if isinstance(part, int):
            part = str(part)
        if isinstance(part, str):
            part = part.encode()
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)


def _update_array(h, x: np.ndarray) -> None:
    x = np.asarray(x)
    if x.dtype.byteorder == ">":
        x = x.astype(x.dtype.newbyteorder("<"))
    _update(h, str(x.dtype), repr(x.shape))
    h.update(np.ascontiguousarray(x).reshape(-1).view(np.uint8).data)


def fingerprint_arrays(tree: Any) -> str:
    """Deterministic hash of a pytree of arrays (e.g. a params dict), as "sha256:<hex>".

    Covers each leaf's tree path, dtype, shape and bytes; independent of dict insertion
    order. Leaves must be host-readable (numpy, or fully addressable jax arrays).
    """
    import jax  # here, not at the top: numpy-only writers stay jax-free

    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        _update(h, jax.tree_util.keystr(path))
        _update_array(h, np.asarray(leaf))
    return "sha256:" + h.hexdigest()


def fingerprint_path(path: str | os.PathLike) -> str:
    """Hash of a file, or of every file under a directory (e.g. a tokenizer dir).

    A directory's hash covers the relative paths and contents of its regular files in
    sorted order, so it does not depend on listing order or timestamps.
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        files = [(os.path.basename(path), path)]
    elif os.path.isdir(path):
        files = sorted(
            (os.path.relpath(os.path.join(root, name), path).replace(os.sep, "/"),
             os.path.join(root, name))
            for root, _, names in os.walk(path) for name in names)
    else:
        raise FileNotFoundError(f"cannot fingerprint {path!r}: no such file or directory")
    h = hashlib.sha256()
    for rel, full in files:
        _update(h, rel, os.path.getsize(full))
        with open(full, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    return "sha256:" + h.hexdigest()


def digest_sequences(sequences) -> int:
    """A 52-bit integer digest of token sequences of any lengths (exact in a float64, so a
    numeric metric): runs that sampled the same tokens share it, and almost surely only those."""
    h = hashlib.sha256()
    for tokens in sequences:
        _update_array(h, np.asarray(tokens, dtype="<i4"))
    return int(h.hexdigest()[:13], 16)


def fingerprint_tokens(tokens_NT, rows_per_block: int = 4096) -> str:
    """Hash of a token dataset [N sequences, T positions], as "sha256:<hex>".

    Tokens are hashed as little-endian int32 (what the teacher sees), so int32 and int64
    copies of one dataset agree. Reads `rows_per_block` rows at a time, so a memmap of any
    size is fine.
    """
    if len(tokens_NT.shape) != 2 or not np.issubdtype(tokens_NT.dtype, np.integer):
        raise ValueError(f"tokens_NT must be a 2-D integer array, got {tokens_NT.dtype}{tokens_NT.shape}")
    num_rows, seq_len = (int(n) for n in tokens_NT.shape)
    h = hashlib.sha256()
    _update(h, "tokens_NT", num_rows, seq_len)
    for start in range(0, num_rows, rows_per_block):
        block = np.asarray(tokens_NT[start:start + rows_per_block])
        h.update(np.ascontiguousarray(block, dtype="<i4").data)
    return "sha256:" + h.hexdigest()
