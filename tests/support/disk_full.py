"""A checkpoint and a teacher cache that run out of disk space, for tests/test_faults.py.

Run as `python -m tests.support.disk_full DIR` from the repository root, DIR being a small
filesystem of its own (the test mounts a tmpfs there in a private mount namespace, which
vanishes with this process); prints one JSON line of what happened.
"""
import glob
import json
import os
import shutil
import sys

import numpy as np

from tests.support import teacher_cache_writer as fake
from tlt_jax import checkpoint, faults
from tlt_jax.distill import teacher_cache as tc


def fill(directory: str, leave_bytes: int) -> str:
    """A file that fills the filesystem of `directory` but for about `leave_bytes`."""
    stat = os.statvfs(directory)
    path = os.path.join(directory, "filler")
    with open(path, "wb") as f:
        f.write(b"\0" * max(stat.f_bavail * stat.f_frsize - leave_bytes, 0))
    return path


def checkpoints(root: str) -> dict:
    """Step 1 saved; step 2 (1 MiB that does not compress) runs out of space; step 1 is
    restored; with space freed and the unfinished write deleted, step 2 saves."""
    directory = os.path.join(root, "checkpoints")
    first = {"w": np.arange(1000, dtype=np.float32)}
    ckpt = checkpoint.Checkpointer(directory)
    ckpt.save(1, first, {"n": 1})
    ckpt.wait()
    filler = fill(root, 64 << 10)
    error = None
    try:
        ckpt.save(2, {"w": np.random.default_rng(0).random(1 << 18, dtype=np.float32)}, {"n": 2})
        ckpt.wait()
    except faults.DiskFullError as e:
        error = str(e)
    ckpt.close()
    with checkpoint.Checkpointer(directory) as again:
        state, meta = again.restore()
    out = {"error": error, "restored_step": meta["step"], "intact": bool(np.array_equal(state["w"], first["w"]))}
    os.remove(filler)
    for leftover in glob.glob(os.path.join(directory, "2.orbax-checkpoint-tmp*")):
        shutil.rmtree(leftover)
    with checkpoint.Checkpointer(directory) as again:
        again.save(2, {"w": first["w"] + 1}, {"n": 2})
    with checkpoint.Checkpointer(directory) as again:
        out["after_freeing_space"] = again.restore()[1]["step"]
    return out


def teacher_cache(root: str) -> dict:
    """A cache larger than the space left: the shards completed before the disk filled
    are kept, and with space freed a rerun computes only the others."""
    rows_per_shard, path = 4, os.path.join(root, "cache")
    tokens = fake.make_tokens(64, 256)
    meta = fake.make_meta(tokens)
    rows = []

    def teacher(tokens_BT):
        rows.append(len(tokens_BT))
        return fake.fake_teacher(tokens_BT)

    filler = fill(root, 48 << 10)
    error = None
    try:
        tc.write_teacher_cache(path, tokens, teacher, meta, batch_size=4, rows_per_shard=rows_per_shard,
                               progress=False)
    except faults.DiskFullError as e:
        error = str(e)
    complete = int(tc.ShardedArrayStore.open(path).complete_S.sum())
    os.remove(filler)
    rows.clear()
    reader = tc.write_teacher_cache(path, tokens, teacher, meta, batch_size=4, rows_per_shard=rows_per_shard,
                                    progress=False)
    ids, logp = reader.read(np.arange(len(tokens)))
    want_ids, want_logp = fake.fake_teacher(tokens)
    equal = bool(np.array_equal(ids, want_ids) and np.allclose(np.asarray(logp, np.float32), want_logp, atol=0.05))
    return {"error": error, "complete_shards": complete, "num_shards": len(tokens) // rows_per_shard,
            "rows_per_shard": rows_per_shard, "recomputed_rows": sum(rows), "equal_to_the_teacher": equal}


if __name__ == "__main__":
    root = sys.argv[1]
    print(json.dumps({"checkpoint": checkpoints(root), "teacher_cache": teacher_cache(root)}))
