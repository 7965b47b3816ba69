"""Tests of tlt_jax/checkpoint.py: round trip, corruption fallback, SIGKILL resume."""

import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support import REPO, xla_flags
from tests.support import checkpoint_worker as worker
from tlt_jax.checkpoint import MANIFEST_NAME, Checkpointer, CheckpointIntegrityError


def _mesh(shape=(2, 4)):
    return Mesh(np.asarray(jax.devices()[:8]).reshape(shape), ("data", "fsdp"))


def _state(mesh, seed):
    rng = np.random.default_rng(seed)
    return {
        "params": {"w": jax.device_put(jnp.asarray(rng.normal(size=(8, 16)), jnp.bfloat16),
                                       NamedSharding(mesh, P("data", "fsdp"))),
                   "b": jax.device_put(jnp.asarray(rng.normal(size=(16,)), jnp.float32),
                                       NamedSharding(mesh, P()))},
        "opt": {"count": jnp.int32(seed), "mu": jax.device_put(
            jnp.asarray(rng.normal(size=(16, 4)), jnp.float32), NamedSharding(mesh, P("fsdp")))},
        "key": jax.random.key(seed),
    }


def _assert_trees_equal(actual, expected):
    actual_leaves, actual_def = jax.tree.flatten(actual)
    expected_leaves, expected_def = jax.tree.flatten(expected)
    assert actual_def == expected_def
    for a, e in zip(actual_leaves, expected_leaves):
        if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
            assert a.dtype == e.dtype
            a, e = jax.random.key_data(a), jax.random.key_data(e)
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _save_steps(directory, steps, **kwargs):
    mesh = _mesh()
    with Checkpointer(directory, **kwargs) as ckpt:
        for step in steps:
            ckpt.save(step, _state(mesh, step), {"data_position": 10 * step})
    return {step: _state(mesh, step) for step in steps}


def _largest_array_file(step_dir):
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("async_save", [True, False])
def test_round_trip_sharded_bf16_into_target_sharding(tmp_path, async_save):
    mesh = _mesh()
    state = _state(mesh, 7)
    config = {"lr": 1e-6, "layers": [1, 2], "name": "toy"}
    with Checkpointer(tmp_path, async_save=async_save) as ckpt:
        ckpt.save(7, state, {"data_position": 123, "config": config})
        ckpt.wait()
        assert ckpt.all_steps() == [7] and ckpt.latest_step() == 7
        assert (tmp_path / "7" / MANIFEST_NAME).is_file()

        # Into a different mesh layout: every leaf takes the target's sharding.
        other = _mesh((4, 2))
        target_shardings = {"params": {"w": NamedSharding(other, P("fsdp", "data")),
                                       "b": NamedSharding(other, P("data"))},
                            "opt": {"count": NamedSharding(other, P()),
                                    "mu": NamedSharding(other, P(None, "fsdp"))},
                            "key": NamedSharding(other, P())}
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                              state, target_shardings)
        restored, meta = ckpt.restore(target=target)
        _assert_trees_equal(restored, state)
        for leaf, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(target_shardings)):
            assert leaf.sharding == sharding
        assert meta == {"step": 7, "data_position": 123, "config": config}

        # Arrays as the target, and no target (the shardings recorded at save time).
        restored_like, _ = ckpt.restore(7, target=state)
        _assert_trees_equal(restored_like, state)
        assert restored_like["params"]["w"].sharding == state["params"]["w"].sharding
        restored_untargeted, _ = ckpt.restore()
        _assert_trees_equal(restored_untargeted, state)


def test_retention_keeps_newest(tmp_path):
    _save_steps(tmp_path, range(1, 6), max_to_keep=3)
    with Checkpointer(tmp_path, max_to_keep=3) as ckpt:
        assert ckpt.all_steps() == [3, 4, 5]
        for step in ckpt.all_steps():
            ckpt.verify(step)


def test_argument_checks(tmp_path):
    with pytest.raises(ValueError, match="max_to_keep"):
        Checkpointer(tmp_path, max_to_keep=1)
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ValueError, match="disagrees"):
            ckpt.save(3, {"x": jnp.zeros(2)}, {"step": 4})
        with pytest.raises(FileNotFoundError, match="No checkpoint"):
            ckpt.restore()


def _truncate(step_dir):
    path = _largest_array_file(step_dir)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _delete(step_dir):
    _largest_array_file(step_dir).unlink()


def _flip_a_bit(step_dir):
    path = _largest_array_file(step_dir)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _drop_manifest(step_dir):  # as if killed between orbax's commit and the manifest
    (step_dir / MANIFEST_NAME).unlink()


def _garble_manifest(step_dir):
    (step_dir / MANIFEST_NAME).write_text('{"format": 1, "step": ')


@pytest.mark.parametrize("damage,checksum,reason", [
    (_truncate, True, "bytes"),
    (_truncate, False, "bytes"),
    (_delete, True, "missing"),
    (_flip_a_bit, True, "sha256"),
    (_drop_manifest, True, "did not finish"),
    (_garble_manifest, True, "unreadable"),
])
def test_damaged_newest_falls_back_to_previous(tmp_path, caplog, damage, checksum, reason):
    states = _save_steps(tmp_path, [1, 2, 3], checksum=checksum)
    damage(tmp_path / "3")
    with Checkpointer(tmp_path, checksum=checksum) as ckpt:
        with pytest.raises(CheckpointIntegrityError, match=reason):
            ckpt.restore(step=3)  # an explicit step never falls back
        with caplog.at_level(logging.WARNING):
            restored, meta = ckpt.restore(target=states[2])
        assert meta["step"] == 2 and meta["data_position"] == 20
        _assert_trees_equal(restored, states[2])
        assert any("Skipping checkpoint" in r.getMessage() and reason in r.getMessage()
                   for r in caplog.records)
        assert (tmp_path / "3").is_dir()  # left in place for inspection

        # Training resumes from step 2: the bad step 3 is set aside, not deleted.
        new_state = _state(_mesh(), 33)
        ckpt.save(3, new_state, {"data_position": 30})
        ckpt.wait()
        assert (tmp_path / "3.rejected").is_dir()
        restored, meta = ckpt.restore(target=new_state)
        assert meta["step"] == 3
        _assert_trees_equal(restored, new_state)


def test_orbax_read_failure_falls_back(tmp_path, caplog):
    """A file damaged without a size change, sizes-only manifest: orbax's error decides."""
    states = _save_steps(tmp_path, [1, 2], checksum=False)
    meta_file = tmp_path / "2" / "meta" / "metadata"
    meta_file.write_bytes(b"\0" * meta_file.stat().st_size)
    with Checkpointer(tmp_path, checksum=False) as ckpt, caplog.at_level(logging.WARNING):
        restored, meta = ckpt.restore(target=states[1])
    assert meta["step"] == 1
    _assert_trees_equal(restored, states[1])
    assert any("orbax could not restore" in r.getMessage() for r in caplog.records)


def test_every_step_bad_raises(tmp_path):
    _save_steps(tmp_path, [1, 2])
    for step in (1, 2):
        _truncate(tmp_path / str(step))
    with Checkpointer(tmp_path) as ckpt, pytest.raises(FileNotFoundError, match="every step failed"):
        ckpt.restore()


def test_tmp_dir_of_interrupted_save_is_ignored(tmp_path, caplog):
    states = _save_steps(tmp_path, [1, 2])
    partial = tmp_path / "3.orbax-checkpoint-tmp"
    shutil.copytree(tmp_path / "2", partial)
    _delete(partial)
    with caplog.at_level(logging.WARNING):
        ckpt = Checkpointer(tmp_path)
    assert any("did not finish" in r.getMessage() for r in caplog.records)
    with ckpt:
        assert ckpt.all_steps() == [1, 2]
        _, meta = ckpt.restore(target=states[2])
        assert meta["step"] == 2
        ckpt.save(3, states[2], {"data_position": 30})
        ckpt.wait()
        assert ckpt.restore()[1]["step"] == 3


def test_resuming_from_an_older_step_sets_newer_ones_aside(tmp_path):
    states = _save_steps(tmp_path, [1, 2, 3])
    with Checkpointer(tmp_path) as ckpt:
        restored, _ = ckpt.restore(step=1, target=states[1])
        ckpt.save(2, restored, {"data_position": 20})
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
    assert (tmp_path / "2.superseded").is_dir() and (tmp_path / "3.superseded").is_dir()


def _saves_in_flight(directory, from_step):
    """Steps >= from_step that orbax is writing (still in their tmp directory)."""
    return [p for p in directory.glob("*.orbax-checkpoint-tmp*")
            if int(p.name.split(".")[0]) >= from_step]


def test_sigkill_mid_save_then_resume_matches_uninterrupted_run(tmp_path):
    kill_after_step = 5
    directory = tmp_path / "checkpoints"
    log_path = tmp_path / "worker.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.checkpoint_worker", str(directory)],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        # Kill while a step after kill_after_step is being written: `save` starts a step
        # only once the previous one is committed, so that one is restorable.
        deadline = time.monotonic() + 60
        while not _saves_in_flight(directory, kill_after_step + 1):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "worker too slow"
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()

    mesh = worker.make_mesh()
    initial_state, initial_meta = worker.initial_state(mesh)
    reference_state, reference_losses = worker.train(initial_state, initial_meta, worker.NUM_STEPS)

    with Checkpointer(directory) as ckpt:
        state, meta = ckpt.restore(target=initial_state)
        resumed_from = meta["step"]
        assert kill_after_step <= resumed_from < worker.NUM_STEPS
        assert meta["loss"] == reference_losses[resumed_from]
        assert meta["data_position"] == resumed_from * worker.BATCH
        state, resumed_losses = worker.train(state, meta, worker.NUM_STEPS, checkpointer=ckpt)
        assert resumed_losses == {s: reference_losses[s]
                                  for s in range(resumed_from + 1, worker.NUM_STEPS + 1)}
        _assert_trees_equal(state, reference_state)
        final_state, final_meta = ckpt.restore(target=initial_state)
        assert final_meta["step"] == worker.NUM_STEPS
        _assert_trees_equal(final_state, reference_state)


def test_resume_returns_the_template_until_a_step_exists(tmp_path):
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("a", "b"))
    like = {"w": jax.device_put(jnp.arange(16.0).reshape(4, 4), NamedSharding(mesh, P("a", "b")))}
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        state, meta = ckpt.resume(like)
        assert meta is None and state is like
        ckpt.save(3, {"w": like["w"] * 2}, {"position": 7})
        ckpt.wait()
        state, meta = ckpt.resume(like)
    assert meta == {"position": 7, "step": 3}
    np.testing.assert_array_equal(state["w"], np.arange(16.0).reshape(4, 4) * 2)
    assert state["w"].sharding == like["w"].sharding


def test_a_shared_save_after_one_process_saved_alone_counts_saves_alike_on_every_process(tmp_path):
    """orbax numbers each save with a per-process counter and keys a shared save's signals by
    it: after process 0 saved alone twice the counts stand apart ([2, 0]: the state in which
    RL runs hung at their next shared save); the shared save brings them together first, and
    completes."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.save_count_worker", str(tmp_path),
                               f"localhost:{port}", str(i)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    for out, _ in outs:
        lines = [line for line in out.splitlines() if not line.startswith("[Gloo]")]  # gloo's own report
        assert [json.loads(line) for line in lines[:2]] == [[2, 0], [3, 3]] and lines[2:] == ["saved"]
