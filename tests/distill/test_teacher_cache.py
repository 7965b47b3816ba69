"""Tests of tlt_jax/distill/teacher_cache.py: round trip, metadata checks, resume."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import jax
import ml_dtypes
import numpy as np
import pytest

from tests.support import REPO
from tests.support import teacher_cache_writer as fake
from tlt_jax import fingerprint, losses
from tlt_jax.distill import array_store
from tlt_jax.distill import teacher_cache as tc


def _expected(tokens_NT, logp_dtype):
    ids_NTK, logp_NTK = fake.fake_teacher(tokens_NT)
    return ids_NTK, logp_NTK.astype(tc.FieldSpec(logp_dtype, ()).np_dtype)


def _read_all(reader):
    return reader.read(np.arange(reader.num_sequences))


def _write(path, tokens_NT, meta, teacher_fn=fake.fake_teacher, **kw):
    kw = {"batch_size": 3, "rows_per_shard": fake.ROWS_PER_SHARD, "progress": False, **kw}
    return tc.write_teacher_cache(path, tokens_NT, teacher_fn, meta, **kw)


class CountingTeacher:
    """The fake teacher, counting the sequences it is asked for."""

    def __init__(self):
        self.rows_seen = []

    def __call__(self, tokens_BT):
        self.rows_seen.extend(map(bytes, tokens_BT))
        return fake.fake_teacher(tokens_BT)


@pytest.mark.parametrize("logp_dtype", ["bfloat16", "float32"])
def test_round_trip(tmp_path, logp_dtype):
    tokens_NT = fake.make_tokens(num_seq=11)  # 6 shards of 2, the last one short
    meta = fake.make_meta(tokens_NT, logp_dtype)
    # batch_size 3 straddles shard boundaries and pads the last batch.
    reader = _write(tmp_path / "cache", tokens_NT, meta, progress=True)
    ids_NTK, logp_NTK = _expected(tokens_NT, logp_dtype)

    assert len(reader) == reader.num_sequences == 11 and reader.seq_len == fake.SEQ_LEN
    ids, logp = _read_all(reader)
    assert ids.dtype == np.int32 and logp.dtype == tc.FieldSpec(logp_dtype, ()).np_dtype
    np.testing.assert_array_equal(ids, ids_NTK)
    np.testing.assert_array_equal(logp, logp_NTK)  # exact: cast once, stored losslessly

    ids, logp = reader.read([7, 2, 2])  # any order, repeats
    np.testing.assert_array_equal(ids, ids_NTK[[7, 2, 2]])
    np.testing.assert_array_equal(logp, logp_NTK[[7, 2, 2]])

    batches = list(reader.iter_batches(4, shuffle=True, seed=1))
    assert [len(b.indices_B) for b in batches] == [4, 4, 3]
    seen = np.concatenate([b.indices_B for b in batches])
    assert sorted(seen) == list(range(11)) and list(seen) != list(range(11))
    for b in batches:
        np.testing.assert_array_equal(b.ids_BTK, ids_NTK[b.indices_B])
        np.testing.assert_array_equal(b.logp_BTK, logp_NTK[b.indices_B])
    assert len(list(reader.iter_batches(4, drop_remainder=True))) == 2

    assert tc.read_cache_meta(tmp_path / "cache") == meta
    # A fresh reader (another process's view) agrees.
    np.testing.assert_array_equal(_read_all(tc.TeacherCacheReader(tmp_path / "cache", meta))[1],
                                  logp_NTK)


def test_teacher_always_gets_full_batches(tmp_path):
    tokens_NT = fake.make_tokens(num_seq=5)
    shapes = []

    def teacher(tokens_BT):
        shapes.append(tokens_BT.shape)
        assert tokens_BT.dtype == np.int32
        return fake.fake_teacher(tokens_BT)

    _write(tmp_path / "c", tokens_NT.astype(np.int64), fake.make_meta(tokens_NT), teacher,
           batch_size=4)
    assert shapes == [(4, fake.SEQ_LEN)] * 2


@pytest.mark.parametrize("field,value", [
    ("teacher_fingerprint", "sha256:other-teacher"),
    ("tokenizer_fingerprint", "sha256:other-tokenizer"),
    ("top_k", 3),
    ("temperature", 0.7),
    ("logp_dtype", "float32"),
    ("format_version", tc.FORMAT_VERSION + 1),
])
def test_metadata_mismatch_names_field(tmp_path, field, value):
    tokens_NT = fake.make_tokens(num_seq=4)
    meta = fake.make_meta(tokens_NT)
    _write(tmp_path / "c", tokens_NT, meta)
    other = dataclasses.replace(meta, **{field: value})

    with pytest.raises(tc.MetadataMismatchError) as err:
        tc.TeacherCacheReader(tmp_path / "c", other)
    for text in (field, repr(getattr(meta, field)), repr(getattr(other, field))):
        assert text in str(err.value)

    # Resuming with a different teacher/meta is refused the same way, before any work.
    def teacher(tokens_BT):
        raise AssertionError("must not run")

    with pytest.raises(tc.MetadataMismatchError, match=field):
        _write(tmp_path / "c", tokens_NT, other, teacher)


def test_dataset_and_layout_mismatch(tmp_path):
    tokens_NT = fake.make_tokens(num_seq=4)
    meta = fake.make_meta(tokens_NT)
    with pytest.raises(tc.MetadataMismatchError, match="dataset_fingerprint"):
        _write(tmp_path / "c", tokens_NT[:3], meta)  # tokens differ from what meta says
    _write(tmp_path / "c", tokens_NT, meta)
    with pytest.raises(tc.MetadataMismatchError, match="rows_per_shard is 2 on disk, 1"):
        _write(tmp_path / "c", tokens_NT, meta, rows_per_shard=1)

    def teacher(tokens_BT):
        raise AssertionError("a complete cache needs no teacher")

    # rows_per_shard=None keeps the stored value; nothing is left to compute.
    reader = _write(tmp_path / "c", tokens_NT, meta, teacher, rows_per_shard=None)
    assert len(reader) == 4


def test_sharded_array_store(tmp_path):
    """The generic layer the drafter buffer reuses: any fields, shards in any order."""
    fields = {"h": tc.FieldSpec("bfloat16", (3,)), "tok": tc.FieldSpec("int32", ())}
    store = tc.ShardedArrayStore.open_or_create(
        tmp_path / "s", fields=fields, num_rows=5, rows_per_shard=2, metadata={"kind": "x"})
    assert store.num_shards == 3 and store.shard_bounds(2) == (4, 5)
    h = np.arange(15, dtype=np.float32).reshape(5, 3)
    store.write_shard(2, {"h": h[4:], "tok": np.array([4])})
    store.write_shard(0, {"h": h[:2], "tok": np.array([0, 1])})
    with pytest.raises(ValueError, match="never rewritten"):
        store.write_shard(0, {"h": h[:2], "tok": np.array([0, 1])})
    with pytest.raises(ValueError, match="shape"):
        store.write_shard(1, {"h": h[:1], "tok": np.array([2])})

    reopened = tc.ShardedArrayStore.open(tmp_path / "s")
    assert reopened.missing_shards.tolist() == [1]
    assert reopened.complete_rows().tolist() == [0, 1, 4]
    out = reopened.read_rows([4, 0], fields=["h"])
    assert list(out) == ["h"] and out["h"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out["h"], h[[4, 0]].astype(ml_dtypes.bfloat16))
    with pytest.raises(tc.IncompleteStoreError):
        reopened.read_rows([2])
    with pytest.raises(IndexError):
        reopened.read_rows([5])
    with pytest.raises(tc.MetadataMismatchError, match="fields.tok.dtype is 'int32' on disk"):
        tc.ShardedArrayStore.open_or_create(
            tmp_path / "s", fields={**fields, "tok": tc.FieldSpec("int64", ())}, num_rows=5,
            metadata={"kind": "x"})


def test_not_a_cache(tmp_path):
    meta = fake.make_meta(fake.make_tokens())
    with pytest.raises(tc.NotAStoreError, match="not a sharded array store"):
        tc.TeacherCacheReader(tmp_path / "absent", meta)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.bin").write_bytes(b"x")
    with pytest.raises(tc.NotAStoreError, match="not a sharded array store"):
        tc.TeacherCacheReader(tmp_path / "other", meta)
    # The writer will not scribble into a directory that is not a cache.
    with pytest.raises(tc.NotAStoreError, match="not empty"):
        _write(tmp_path / "other", fake.make_tokens(), meta)
    # A store of another kind (e.g. a drafter buffer) is not a teacher cache.
    tc.ShardedArrayStore.open_or_create(
        tmp_path / "buffer", fields={"h": tc.FieldSpec("float32", (3,))}, num_rows=2,
        metadata={"kind": "drafter_buffer"})
    with pytest.raises(tc.NotAStoreError, match="not a teacher cache"):
        tc.TeacherCacheReader(tmp_path / "buffer", meta)


def test_unmarked_shard_is_recomputed(tmp_path, monkeypatch):
    """Data written but the writer died before the marker: never read, recomputed."""
    tokens_NT = fake.make_tokens()
    meta = fake.make_meta(tokens_NT, "float32")
    path = tmp_path / "c"
    real_write_marker = array_store._write_marker

    def crash_at_shard_3(path_, shard, start, stop):
        if shard == 3:
            raise KeyboardInterrupt("simulated crash between data and marker")
        real_write_marker(path_, shard, start, stop)

    monkeypatch.setattr(array_store, "_write_marker", crash_at_shard_3)
    with pytest.raises(KeyboardInterrupt):
        _write(path, tokens_NT, meta, batch_size=2)
    monkeypatch.undo()

    # Shard 3's data is on disk (the crash came after its commit) but it is not complete.
    ids_NTK, logp_NTK = _expected(tokens_NT, "float32")
    store = tc.ShardedArrayStore.open(path)
    raw_ids = store._array("ids")[6:8].read().result()
    np.testing.assert_array_equal(raw_ids, ids_NTK[6:8])
    assert store.missing_shards.tolist() == list(range(3, 10))

    with pytest.raises(tc.IncompleteStoreError, match="7 of 10 shards missing.*resume"):
        tc.TeacherCacheReader(path, meta)
    partial = tc.TeacherCacheReader(path, meta, allow_partial=True)
    assert len(partial) == 6 and partial.indices_N.tolist() == list(range(6))
    np.testing.assert_array_equal(partial.read([5, 0])[1], logp_NTK[[5, 0]])
    with pytest.raises(tc.IncompleteStoreError, match=r"incomplete shards \[3\]"):
        partial.read([6])
    assert sum(len(b.indices_B) for b in partial.iter_batches(4)) == 6

    teacher = CountingTeacher()
    reader = _write(path, tokens_NT, meta, teacher, batch_size=2)
    assert len(teacher.rows_seen) == 14  # shards 3..9 only, shard 3 included
    ids, logp = _read_all(reader)
    np.testing.assert_array_equal(ids, ids_NTK)
    np.testing.assert_array_equal(logp, logp_NTK)


def test_sigkill_then_resume(tmp_path):
    """A writer process killed mid-run: the reader refuses, resume completes it exactly."""
    path = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.teacher_cache_writer",
                             str(path), "0.1"], cwd=REPO)
    done_dir = path / "done"

    def num_markers():  # a killed writer may leave a hidden temp marker: not a marker
        return len([n for n in os.listdir(done_dir) if not n.startswith(".")])

    num_shards = fake.NUM_SEQ // fake.ROWS_PER_SHARD
    deadline = time.monotonic() + 30
    try:
        while not (done_dir.is_dir() and num_markers() >= 3):
            assert proc.poll() is None, "writer exited before it could be killed"
            assert time.monotonic() < deadline, "writer made no progress"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    complete = num_markers()
    assert 3 <= complete < num_shards

    tokens_NT = fake.make_tokens()
    meta = fake.make_meta(tokens_NT)
    with pytest.raises(tc.IncompleteStoreError,
                       match=f"{num_shards - complete} of {num_shards} shards missing"):
        tc.TeacherCacheReader(path, meta)

    teacher = CountingTeacher()
    resumed = _write(path, tokens_NT, meta, teacher, batch_size=2)
    assert len(teacher.rows_seen) == (num_shards - complete) * fake.ROWS_PER_SHARD
    fresh = _write(tmp_path / "fresh", tokens_NT, meta)
    for got, want in zip(_read_all(resumed), _read_all(fresh)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    # Markers are well-formed JSON naming their rows.
    with open(done_dir / "00000000.json") as f:
        assert json.load(f) == {"shard": 0, "rows": [0, 2]}


def test_writer_subprocess_does_not_import_jax():
    code = ("import sys; import tests.support.teacher_cache_writer; "
            "sys.exit(int('jax' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_topk_from_logits_matches_reference():
    rng = np.random.default_rng(0)
    logits_BTV = rng.normal(size=(2, 5, 50)).astype(np.float32) * 3
    temperature = 0.6
    ids, logp = jax.jit(losses.topk_from_logits, static_argnums=(1, 2))(
        logits_BTV.astype(ml_dtypes.bfloat16), 7, temperature)
    scaled = logits_BTV.astype(ml_dtypes.bfloat16).astype(np.float64) / temperature
    ref_logp_BTV = scaled - np.log(np.exp(scaled).sum(-1, keepdims=True))
    ref_ids = np.argsort(-ref_logp_BTV, axis=-1, kind="stable")[..., :7]
    assert ids.dtype == np.int32 and logp.dtype == np.float32
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(logp, np.take_along_axis(ref_logp_BTV, ref_ids, -1),
                               rtol=1e-5, atol=1e-5)


def test_fingerprints(tmp_path):
    params = {"b": np.arange(3, dtype=np.float32), "a": {"w": np.ones((2, 2), ml_dtypes.bfloat16)}}
    fp = fingerprint.fingerprint_arrays(params)
    assert fp.startswith("sha256:")
    assert fingerprint.fingerprint_arrays({"a": params["a"], "b": params["b"]}) == fp  # key order
    assert fingerprint.fingerprint_arrays({**params, "b": jax.numpy.asarray(params["b"])}) == fp
    changed = [
        {**params, "b": params["b"] + 1},  # value
        {**params, "b": params["b"].astype(np.float64)},  # dtype
        {**params, "b": params["b"].reshape(3, 1)},  # shape
        {"c": params["b"], "a": params["a"]},  # name
    ]
    assert len({fp, *map(fingerprint.fingerprint_arrays, changed)}) == 5

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "vocab.json").write_text('{"a": 0}')
    (tok / "sub").mkdir()
    (tok / "sub" / "merges.txt").write_text("a b")
    fp = fingerprint.fingerprint_path(tok)
    assert fingerprint.fingerprint_path(tok) == fp
    (tok / "sub" / "merges.txt").write_text("a c")
    assert fingerprint.fingerprint_path(tok) != fp
    assert fingerprint.fingerprint_path(tok / "vocab.json") != fingerprint.fingerprint_path(tok)
    with pytest.raises(FileNotFoundError):
        fingerprint.fingerprint_path(tmp_path / "absent")

    tokens_NT = fake.make_tokens()
    fp = fingerprint.fingerprint_tokens(tokens_NT)
    assert fingerprint.fingerprint_tokens(tokens_NT.astype(np.int64), rows_per_block=3) == fp
    assert fingerprint.fingerprint_tokens(tokens_NT.reshape(10, -1)) != fp
    assert fingerprint.fingerprint_tokens(tokens_NT[::-1]) != fp


def _layout(tokens_NT, split_at):
    """Positions and segment ids of rows that pack two sequences, the second from `split_at`."""
    t_NT = np.broadcast_to(np.arange(tokens_NT.shape[1], dtype=np.int32), tokens_NT.shape)
    return (np.where(t_NT < split_at, t_NT, t_NT - split_at).astype(np.int32),
            np.where(t_NT < split_at, 1, 2).astype(np.int32))


def test_the_teacher_is_given_the_layout_and_the_cache_records_it(tmp_path):
    """With a layout, the teacher gets (tokens, positions, segment_ids) of each batch; the
    cache's metadata records the layout, so a cache of the same tokens packed differently is
    refused naming layout_fingerprint, before the teacher runs."""
    tokens_NT = fake.make_tokens(num_seq=5)
    layout = _layout(tokens_NT, split_at=2)
    seen = []

    def teacher(tokens_BT, positions_BT, segment_ids_BT):
        assert tokens_BT.dtype == positions_BT.dtype == segment_ids_BT.dtype == np.int32
        seen.append((positions_BT.copy(), segment_ids_BT.copy()))
        return fake.fake_teacher(tokens_BT)

    meta = fake.make_meta(tokens_NT, layout_fingerprint=tc.layout_fingerprint(*layout))
    reader = _write(tmp_path / "c", tokens_NT, meta, teacher, layout=layout)
    assert len(seen) == 2  # 5 rows in batches of 3
    np.testing.assert_array_equal(np.concatenate([p for p, _ in seen])[:5], layout[0])
    np.testing.assert_array_equal(np.concatenate([s for _, s in seen])[:5], layout[1])
    assert tc.read_cache_meta(tmp_path / "c").layout_fingerprint == meta.layout_fingerprint
    np.testing.assert_array_equal(_read_all(reader)[0], _expected(tokens_NT, "bfloat16")[0])

    other = _layout(tokens_NT, split_at=3)
    assert tc.layout_fingerprint(*other) != meta.layout_fingerprint
    assert tc.layout_fingerprint(other[1], other[0]) != tc.layout_fingerprint(*other)  # which array is which counts
    other_meta = dataclasses.replace(meta, layout_fingerprint=tc.layout_fingerprint(*other))
    with pytest.raises(tc.MetadataMismatchError, match="layout_fingerprint is 'sha256:"):
        tc.TeacherCacheReader(tmp_path / "c", other_meta)
    with pytest.raises(tc.MetadataMismatchError, match="layout_fingerprint"):
        _write(tmp_path / "c", tokens_NT, other_meta, lambda *a: pytest.fail("the teacher ran"), layout=other)
    with pytest.raises(tc.MetadataMismatchError, match="meta.layout_fingerprint is"):  # meta and layout disagree
        _write(tmp_path / "d", tokens_NT, meta, teacher, layout=other)
    with pytest.raises(tc.MetadataMismatchError, match="meta.layout_fingerprint is"):  # a layout, not given
        _write(tmp_path / "d", tokens_NT, meta, teacher)


def test_a_cache_of_the_old_format_is_refused_not_misread(tmp_path):
    """A format-1 cache (its teacher recovered the layout from <bos> / <pad> tokens) is
    refused by the reader and the writer with the format named, and nothing is computed."""
    tokens_NT = fake.make_tokens(num_seq=4)
    meta = fake.make_meta(tokens_NT)
    old = {k: v for k, v in dataclasses.replace(meta, format_version=1).store_metadata().items()
           if k != "layout_fingerprint"}
    store = tc.ShardedArrayStore.open_or_create(tmp_path / "old", fields=meta.fields(fake.SEQ_LEN), num_rows=4,
                                                metadata=old, rows_per_shard=4)
    ids, logp = fake.fake_teacher(tokens_NT)
    store.write_shard(0, {"ids": ids, "logp": logp})
    message = f"has format_version 1, this code reads format_version {tc.FORMAT_VERSION} .*cannot be reused"
    with pytest.raises(tc.MetadataMismatchError, match=message):
        tc.TeacherCacheReader(tmp_path / "old", meta)
    with pytest.raises(tc.MetadataMismatchError, match=message):
        _write(tmp_path / "old", tokens_NT, meta, lambda *a: pytest.fail("the teacher ran"))
    assert tc.read_cache_meta(tmp_path / "old").format_version == 1  # still inspectable
