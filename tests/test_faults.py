"""Faults across the run: SIGKILL at each scripted point of tlt_jax/faults.py, then resume;
a reward that hangs; the disk filling up under a checkpoint or the teacher cache."""
import dataclasses
import errno
import json
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import time

import filelock
import jax
import numpy as np
import pytest

from tests import support
from tests.rl.test_tlt import TLT
from tests.rl.test_train import OVERRIDES, _learning_records
from tests.support import rewards as test_rewards
from tests.support import teacher_cache_writer as fake
from tlt_jax import checkpoint, faults, metrics, rewards
from tlt_jax.distill import array_store
from tlt_jax.distill import teacher_cache as tc
from tlt_jax.models.hf_io import load_hf

pytestmark = pytest.mark.costly  # killed runs and their resumes, each a process of its own
REPO = pathlib.Path(support.REPO)
# The shipped SFT checkpoint: its answers earn reward with spread within a group, so the
# policy moves every step (a random one would not, and a resume that restored nothing would
# look exact).
SFT_TINY = str(REPO / "assets" / "sft_tiny")
STEPS = 3
BASELINE = {**OVERRIDES, "steps": STEPS, "eval_every": STEPS, "checkpoint_every": 1, "save_hf": True}
# TLT with plain decode as the tuner's one arm: the drafter trains, is published and
# checkpointed, the tuner keeps its statistics, and no speculative program compiles.
# One update per RL step (test_tlt's TLT, on-policy) and no learning-rate warm-up: a warm-up
# from 0 spends the first step's one update at rate 0, and the step-1 checkpoint a kill
# leaves would hold the warm start, which a resume that restored nothing also gives.
WITH_TLT = {**TLT, "steps": STEPS, "tlt.tuner.arms": [["plain"]], "learner.optimizer.warmup_steps": 0}


@dataclasses.dataclass(frozen=True)
class Fault:
    fault: str  # TLT_FAULT of the killed run
    tlt: bool
    torn: str | None = None  # the checkpoint directory in which the kill leaves a torn step
    overrides: tuple = ()


# RL steps count from 0: step 2 is the last of the three, after checkpoints 1 and 2.
FAULTS = {
    "reward": Fault("reward:2", tlt=False),
    # Two drafter steps an RL step: drafter step 4 runs after RL step 1 ends, so after checkpoint 1.
    "drafter_step": Fault("drafter_step:4", tlt=True, overrides=(("tlt.spot.max_steps_per_rl_step", 2),)),
    "learner": Fault("learner:2", tlt=False),
    "drafter_checkpoint_write": Fault("commit/drafter_checkpoints:2", tlt=True, torn="drafter_checkpoints"),
    "checkpoint_write": Fault("commit/checkpoints:2", tlt=False, torn="checkpoints"),
    "hf_export": Fault("hf_export", tlt=False),
    # With speculation: the EAGLE and n-gram arms of tests/rl/test_tlt.py.
    "rollout": Fault("rollout:2", tlt=True, overrides=(("tlt.tuner.arms", TLT["tlt.tuner.arms"]),)),
}
# Run with -m slow, each covered elsewhere by a kill at another point of the same kind:
# a kill in a rollout with TLT on, and in the spot trainer's step, by tests/rl/test_tlt.py's
# SIGKILL test (it kills as the step-2 checkpoints appear, and checks drafter, tuner and
# buffer restored); a kill in the reward or the learner, between two checkpoints, by
# tests/rl/test_train.py's, which resumes bit for bit; a kill as the policy's checkpoint
# commits, by tests/test_checkpoint.py's kill mid-save (the previous step restores and training
# goes on bit for bit) with the drafter_checkpoint_write case here (a kill at the same commit
# point of an RL run leaves a torn step that verification refuses and the resume passes over).
_SLOW = {"rollout", "drafter_step", "reward", "learner", "checkpoint_write"}


# Every run is a process of its own (killed, or resumed with `_spy` recording what it
# started from) sharing one persistent compilation cache, so that only the first run of a
# configuration compiles.
_RUN = """
import json, pickle, sys
from tlt_jax import launch
launch.cache_programs_for_any_devices()  # a program of one rollout group serves the other (tests/conftest.py)
from tests.support import rewards as own_rewards
from tests.test_faults import _spy
from tests.rl.test_train import _config
from tlt_jax import rewards
from tlt_jax.rl.loop import RLLoop
from tlt_jax.rl.train import train_rl
run_dir, overrides, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
if overrides.pop("hang_on_batch", None):
    rewards.REWARDS["task"] = own_rewards.hang_on_second_batch
seen = []
RLLoop.step = _spy(RLLoop.step, seen)
summary = train_rl(_config(sys.argv[4], run_dir, **overrides), progress=False)
with open(out, "wb") as f:
    pickle.dump({"seen": seen, "summary": summary}, f)
"""


def _shared_dir(tmp_path_factory, worker_id, name: str) -> pathlib.Path:
    """A directory of this session that every test process sees."""
    if worker_id == "master":
        return tmp_path_factory.getbasetemp() / name
    return tmp_path_factory.getbasetemp().parent / name


@pytest.fixture(scope="module")
def run(tmp_path_factory, worker_id):
    """run(run_dir, overrides, fault=None): the RL run in a process of its own, killed by
    SIGKILL at `fault` (asserted) or else to its end; returns its record (`_spy`'s calls
    and the summary) when it ends."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(_shared_dir(tmp_path_factory, worker_id, "jax_cache")),
                           JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")

    def run_rl(run_dir: str, overrides: dict, fault: str | None = None) -> dict | None:
        out = f"{run_dir}.record.pkl"
        proc = subprocess.run([sys.executable, "-c", _RUN, run_dir, json.dumps(overrides), out, SFT_TINY], cwd=REPO,
                              env={**env, faults.ENV: fault} if fault else env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, timeout=900)
        if fault:
            assert proc.returncode == -signal.SIGKILL, f"the run was not killed at {fault}:\n{proc.stderr[-3000:]}"
            return None
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(out, "rb") as f:
            return pickle.load(f)

    return run_rl


@pytest.fixture(scope="module")
def reference(run, tmp_path_factory, worker_id):
    """The run directory of an uninterrupted baseline run, made once for all test processes."""
    root = _shared_dir(tmp_path_factory, worker_id, "faults_reference")
    with filelock.FileLock(f"{root}.lock"):
        if not (root / "done").exists():
            run(str(root), BASELINE)
            (root / "done").touch()
    return str(root)


def _params(train_state):
    return jax.device_get(train_state.params if hasattr(train_state, "params") else train_state["params"])


def _saved(run_dir: str, tlt: bool) -> dict:
    """What a resume must restore, read from the run directory: the newest checkpoint that
    verifies (step, data position, policy, tuner) and the newest drafter checkpoint that
    verifies and is not after it (drafter, version, buffer)."""
    with checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints")) as ckpt:
        state, meta = ckpt.restore()
    out = {"step": meta["step"], "data_position": meta["data_position"], "params": _params(state["train"])}
    if tlt:
        out["tuner"] = meta["tlt"]["tuner"]
        with checkpoint.Checkpointer(os.path.join(run_dir, "drafter_checkpoints")) as ckpt:
            for step in sorted((s for s in ckpt.all_steps() if s <= meta["step"]), reverse=True):
                try:
                    tree, dmeta = ckpt.restore(step)
                    break
                except checkpoint.CheckpointIntegrityError:
                    continue
        out.update(drafter=_params(tree["train"]), drafter_version=dmeta["version"],
                   buffer_steps=np.asarray(tree["buffer"].get("steps", [])))
    return out


def _spy(step_fn, seen: list):
    """RLLoop.step that records each call's step and data position, and what the first
    call starts from: policy; with TLT tuner state, drafter, its version and buffer."""
    def step(self, state, step, data_position, *args, **kwargs):
        call = {"step": step, "data_position": data_position}
        if not seen:
            call["params"] = jax.device_get(state.params)
            if self.tlt is not None:
                drafter = self.tlt.drafter
                call.update(tuner=self.tlt.tuner.state_dict(), drafter=jax.device_get(drafter.state.params),
                            drafter_version=drafter.version,
                            buffer_steps=np.asarray(drafter.buffer.state_dict().get("steps", [])))
        seen.append(call)
        return step_fn(self, state, step, data_position, *args, **kwargs)
    return step


def _moved(params) -> bool:
    """Whether every weight differs from the warm start's."""
    _, start = load_hf(SFT_TINY)
    return all(not np.array_equal(np.asarray(x), np.asarray(y, np.asarray(x).dtype))
               for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(start)))


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("point", [pytest.param(p, marks=pytest.mark.slow) if p in _SLOW else p for p in FAULTS])
def test_sigkill_at_a_scripted_point_then_resume(point, run, reference, tmp_path):
    f = FAULTS[point]
    overrides = {**(WITH_TLT if f.tlt else BASELINE), **dict(f.overrides)}
    run_dir = str(tmp_path / "run")
    run(run_dir, overrides, fault=f.fault)
    saved = _saved(run_dir, f.tlt)
    if f.torn:  # committed by orbax, without its manifest: never valid
        directory = pathlib.Path(run_dir, f.torn)
        torn = [int(p.name) for p in directory.iterdir()
                if p.name.isdigit() and not (p / checkpoint.MANIFEST_NAME).exists()]
        assert torn, f"no torn step in {directory}: {sorted(os.listdir(directory))}"
        with checkpoint.Checkpointer(directory) as ckpt:
            for step in torn:
                with pytest.raises(checkpoint.CheckpointIntegrityError, match=checkpoint.MANIFEST_NAME):
                    ckpt.verify(step)

    resumed = run(run_dir, overrides)

    # No step lost, none done twice: the resumed run starts at the restored step and runs each later one once.
    seen = resumed["seen"]
    assert resumed["summary"]["steps"] == STEPS
    assert [c["step"] for c in seen] == list(range(saved["step"], STEPS))
    records = metrics.read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    if seen:  # it resumed from what was saved: policy, data position, tuner, drafter and its buffer
        first = seen[0]
        assert first["data_position"] == saved["data_position"]
        _assert_trees_equal(first["params"], saved["params"])
        assert _moved(first["params"]), "the saved policy is the warm start: a resume restoring nothing would pass"
        if f.tlt:
            assert json.loads(json.dumps(first["tuner"])) == saved["tuner"]
            assert first["drafter_version"] == saved["drafter_version"]
            _assert_trees_equal(first["drafter"], saved["drafter"])
            np.testing.assert_array_equal(first["buffer_steps"], saved["buffer_steps"])
    if not f.tlt:  # learning is exactly that of the uninterrupted run
        assert _learning_records(run_dir) == _learning_records(reference)
        if point == "hf_export":
            _, exported = load_hf(os.path.join(run_dir, "hf"))
            _, want = load_hf(os.path.join(reference, "hf"))
            _assert_trees_equal(exported, want)
            assert _moved(exported)


# -- a reward that hangs


@pytest.mark.parametrize("workers", [0, 2])
def test_a_hanging_reward_scores_zero_by_the_deadline_and_the_next_batch_is_scored(workers):
    scorer = rewards.Scorer(test_rewards.hang_on_marker, workers=workers, timeout_s=2.0)
    try:
        assert scorer(["p"] * 4, ["a", "b", "c", "d"], {}).scores.tolist() == [1.0] * 4
        t0 = time.monotonic()
        hung = scorer(["p"] * 4, ["a", "hang", "c", "d"], {})
        assert time.monotonic() - t0 < 10  # the deadline, not the hang
        # Inline the whole batch is one call; in workers only the part that holds the hang.
        expected = [0.0] * 4 if workers == 0 else [0.0, 0.0, 1.0, 1.0]
        assert hung.scores.tolist() == expected
        assert hung.failures == hung.timed_out == expected.count(0.0)
        again = scorer(["p"] * 4, ["a", "b", "c", "d"], {})
        assert again.scores.tolist() == [1.0] * 4 and again.timed_out == 0
    finally:
        scorer.close()


@pytest.mark.parametrize("per_sample", [False, True])
def test_a_dead_reward_worker_scores_its_sample_zero_at_once_and_is_replaced(per_sample, caplog):
    """A worker killed while it scores: its sample scores 0, counted and shown once, the
    others score as usual, and the batch does not wait for reward_timeout_s."""
    scorer = rewards.Scorer(test_rewards.die_on_marker, workers=2, timeout_s=60.0)

    def score(completions):
        if not per_sample:
            return scorer(["p"] * len(completions), completions, {})
        scoring = scorer.begin()
        for i, completion in enumerate(completions):
            scoring.submit(i, "p", completion, {})
        return scoring.result(len(completions))

    try:
        t0 = time.monotonic()
        died = score(["a", "die", "c", "d"])
        assert time.monotonic() - t0 < 15  # the deadline is 60 s
        assert died.scores.tolist() == [1.0, 0.0, 1.0, 1.0]
        assert (died.failures, died.died, died.timed_out) == (1, 1, 0)
        shown = [r.message for r in caplog.records if "died" in r.message]
        assert len(shown) == 1 and "killed by SIGKILL" in shown[0] and "'die'" in shown[0], shown
        again = score(["a", "b", "c", "d"])  # on the replacements
        assert again.scores.tolist() == [1.0] * 4 and (again.failures, again.died) == (0, 0)
    finally:
        scorer.close()


def test_a_run_whose_reward_hangs_goes_on(run, reference, tmp_path):
    """The second batch's reward never returns (tests/support/rewards.py): it scores 0 by
    reward_timeout_s and is counted, and the run trains on to its end."""
    run_dir = str(tmp_path / "run")
    # The reward counts its calls: scored as one batch per step (overlap would call it per sample).
    summary = run(run_dir, {**BASELINE, "steps": 2, "eval_every": 2, "save_hf": False, "reward_timeout_s": 1.0,
                            "reward_overlap": False, "hang_on_batch": True})["summary"]
    records = {r["step"]: r for r in metrics.read_metrics(os.path.join(run_dir, "metrics.jsonl"))}
    samples = OVERRIDES["prompts_per_step"] * OVERRIDES["num_samples"]
    assert records[1]["reward_timeouts"] == 0 and records[1]["reward_mean"] > 0
    assert records[2]["reward_timeouts"] == records[2]["reward_failures"] == samples
    assert records[2]["reward_mean"] == 0.0 and "eval_accuracy" in records[2]
    assert summary["steps"] == 2 and summary["reward_failures"] == samples


# -- disk full


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user and mount namespaces (unshare -rm)")
def test_disk_full_on_a_small_filesystem(tmp_path):
    """A checkpoint and a teacher cache written to a 4 MiB tmpfs that fills up
    (tests/support/disk_full.py, in a private mount namespace)."""
    mount = tmp_path / "small"
    mount.mkdir()
    script = 'mount -t tmpfs -o size=4m tmpfs "$1" || exit 77; exec "$2" -m tests.support.disk_full "$1"'
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(mount), sys.executable], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode == 77:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    ck = out["checkpoint"]
    assert ck["error"].startswith(f"Out of disk space writing checkpoint step 2 to {mount / 'checkpoints'}.")
    assert "run the same command again: it resumes from step 1" in ck["error"]
    assert ck["restored_step"] == 1 and ck["intact"]
    assert ck["after_freeing_space"] == 2

    cache = out["teacher_cache"]
    assert cache["error"].startswith(f"Out of disk space writing the teacher cache at {mount / 'cache'}.")
    assert f"its {cache['complete_shards']} complete shard(s) are kept" in cache["error"]
    assert 0 < cache["complete_shards"] < cache["num_shards"]
    assert cache["recomputed_rows"] == (cache["num_shards"] - cache["complete_shards"]) * cache["rows_per_shard"]
    assert cache["equal_to_the_teacher"]


def test_disk_full_in_a_patched_write(tmp_path, monkeypatch):
    """The same, with writes patched to fail with ENOSPC (any machine)."""
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    directory = tmp_path / "checkpoints"
    first = {"w": np.arange(8, dtype=np.float32)}
    ckpt = checkpoint.Checkpointer(directory)
    ckpt.save(1, first, {"n": 1})
    ckpt.wait()
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "write_manifest", full)
        ckpt.save(2, {"w": np.ones(8, np.float32)}, {"n": 2})
        with pytest.raises(faults.DiskFullError, match=f"writing checkpoint step 2 to {directory}.*resumes from "
                                                       f"step 1.*left {directory / '2'}, which can be deleted"):
            ckpt.wait()
    ckpt.close()  # the failure is not raised a second time
    with checkpoint.Checkpointer(directory) as again:
        state, meta = again.restore()
    assert meta["step"] == 1
    np.testing.assert_array_equal(state["w"], first["w"])

    tokens = fake.make_tokens(12, 4)
    meta = fake.make_meta(tokens)
    path = tmp_path / "cache"
    write_marker = array_store._write_marker
    with monkeypatch.context() as patch:
        patch.setattr(array_store, "_write_marker",
                      lambda p, shard, *a: full() if shard == 2 else write_marker(p, shard, *a))
        with pytest.raises(faults.DiskFullError, match=f"teacher cache at {path}.*its 2 complete shard"):
            tc.write_teacher_cache(path, tokens, fake.fake_teacher, meta, batch_size=2, rows_per_shard=2,
                                   progress=False)
    rows = []
    reader = tc.write_teacher_cache(path, tokens, lambda t: rows.append(len(t)) or fake.fake_teacher(t), meta,
                                    batch_size=2, rows_per_shard=2, progress=False)
    assert sum(rows) == 12 - 2 * 2 and len(reader) == 12
