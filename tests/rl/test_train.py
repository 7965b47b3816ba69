"""The RL run: exact resumption after SIGKILL, a finished run run again, and a clean stop on
non-finite steps."""
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import rl
from tests.support import tiny
from tlt_jax import checkpoint, metrics, rewards
from tlt_jax.data import tasks
from tlt_jax.models import transformer as tfm
from tlt_jax.models.hf_io import save_hf
from tlt_jax.rl.loop import RLLoop, TooManyNonFiniteSteps
from tlt_jax.rl.train import learning_metrics, train_rl

OVERRIDES = {
    "data.num_train": 64, "data.num_eval": 8, "rollout.num_slots": 16, "rollout.max_tokens": 24,
    "prompts_per_step": 4, "num_samples": 4, "learner.micro_batch_size": 8, "learner.num_minibatches": 2,
    "steps": 4, "eval_every": 2, "checkpoint_every": 1, "save_hf": False,
    "mesh.data": 2, "mesh.fsdp": 4,  # two rollout groups; the learner shards over all 8 devices
    "tlt.enabled": False,  # the baseline; tests/rl/test_tlt.py runs TLT
}


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    """A random tiny policy with the task tokenizer, standing in for an SFT checkpoint."""
    out = tmp_path_factory.mktemp("sft") / "hf"
    tokenizer = tasks.build_task_tokenizer(str(out) + "_tokenizer")
    cfg = tiny.policy_config(tokenizer)
    save_hf(str(out), cfg, jax.device_get(tfm.init_params(cfg, jax.random.PRNGKey(3), init_std=0.3)),
            tokenizer=tokenizer)
    return str(out)


def _config(model_dir, run_dir, **extra):
    c = rl.get_config("tiny")
    c.model_dir, c.run_dir = model_dir, run_dir
    for key, value in {**OVERRIDES, **extra}.items():
        *parents, leaf = key.split(".")
        target = c
        for part in parents:
            target = target[part]
        target[leaf] = value
    return c


def kill_at_step_2_checkpoint(model_dir, run_dir, settings: dict) -> None:
    """Runs the tiny RL config with `settings` in a process of its own and SIGKILLs it as soon
    as its step-2 checkpoint is written."""
    args = [f"--config.{k}={v}" for k, v in settings.items()]
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, "--config=configs/rl.py:tiny",
                             f"--config.model_dir={model_dir}", f"--config.run_dir={run_dir}", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = os.path.join(run_dir, "checkpoints", "2", checkpoint.MANIFEST_NAME)
    deadline = time.time() + 300
    while not os.path.exists(marker) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert os.path.exists(marker), "the killed run never reached its step-2 checkpoint"


def _launch_rl(warm_start, run_dir, **popen_kwargs):
    args = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
    return subprocess.Popen([sys.executable, "-m", "experiments.train_rl", "--config=configs/rl.py:tiny",
                             f"--config.model_dir={warm_start}", f"--config.run_dir={run_dir}", *args], **popen_kwargs)


def _learning_records(run_dir):
    return {r["step"]: learning_metrics(r) for r in metrics.read_metrics(os.path.join(run_dir, "metrics.jsonl"))}


def _length_reward(prompts, completions, **_):
    """Longer answers score more: a reward with spread within every group even for a
    random policy, so that the policy and the optimizer state move from the first step
    (the task reward gives a random policy 0 everywhere, and nothing would move)."""
    return [len(c) / 10 for c in completions]


# The killed run: the launcher, with the length reward registered first.
_KILLED_RUN = """
from experiments import train_rl
from tests.rl.test_train import _length_reward
from tests.support import tiny
from tlt_jax import launch
from tests.support import tiny
from tlt_jax import rewards
rewards.REWARDS["length"] = _length_reward
launch.run(train_rl.main)
"""


def _checkpoint(run_dir, step):
    with checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints")) as ckpt:
        return ckpt.restore(step)


def _assert_trees_equal(a, b, what):
    paths_a, leaves_a = zip(*jax.tree_util.tree_flatten_with_path(a)[0])
    paths_b, leaves_b = zip(*jax.tree_util.tree_flatten_with_path(b)[0])
    assert paths_a == paths_b, what
    for path, x, y in zip(paths_a, leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{what} {jax.tree_util.keystr(path)}")


def test_resume_after_sigkill_continues_exactly(warm_start, tmp_path, monkeypatch):
    """A run killed with SIGKILL after its step-2 checkpoint and started again ends with
    the parameters, optimizer state, RNG key and metrics of an uninterrupted run, bit for
    bit; the policy moves at every step, so a resume that dropped any of them would differ."""
    monkeypatch.setitem(rewards.REWARDS, "length", _length_reward)
    full = str(tmp_path / "full")
    summary = train_rl(_config(warm_start, full, reward="length"), progress=False)
    assert summary["steps"] == 4
    evals = {r["step"]: r["eval_accuracy"] for r in metrics.read_metrics(os.path.join(full, "metrics.jsonl"))
             if "eval_accuracy" in r}
    assert sorted(evals) == [0, 2, 4]  # the warm start's, then every eval_every steps
    assert (summary["sft_eval_accuracy"], summary["final_eval_accuracy"]) == (evals[0], evals[4])
    a = _learning_records(full)
    assert all(a[step]["grad_norm"] > 0 for step in (1, 2, 3, 4)), a
    # Run again, a finished run trains nothing and returns the result it recorded.
    with monkeypatch.context() as m:
        m.setattr(RLLoop, "step", lambda *a, **k: pytest.fail("a finished run trained again"))
        assert train_rl(_config(warm_start, full, reward="length"), progress=False) == summary

    killed = str(tmp_path / "killed")
    kill_at_step_2_checkpoint(warm_start, killed, {**OVERRIDES, "reward": "length"})
    with checkpoint.Checkpointer(os.path.join(killed, "checkpoints")) as ckpt:
        assert ckpt.latest_step() < 4, "the kill came too late to leave steps to resume"

    train_rl(_config(warm_start, killed, reward="length"), progress=False)
    b = _learning_records(killed)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        assert a[step] == b[step], step
    assert "eval_accuracy" in a[4] and "kl" in a[4]
    (want, want_meta), (got, got_meta) = _checkpoint(full, 4), _checkpoint(killed, 4)
    assert want_meta["step"] == got_meta["step"] == 4 and want_meta["data_position"] == got_meta["data_position"]
    for part in ("train", "key", "ref"):  # policy and optimizer state; RNG key; reference policy
        _assert_trees_equal(want[part], got[part], part)
    # The resumed steps started from trained weights, not from the warm start.
    step2, _ = _checkpoint(full, 2)
    moved = [not np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(step2["train"]["params"]), jax.tree.leaves(want["ref"]))]
    assert all(moved), moved
    for name in ("reward.png", "time_split.png", "response_lengths.png", "rollout_timeline.png"):
        assert os.path.getsize(os.path.join(killed, name)) > 0


def test_non_finite_steps_stop_the_run_with_the_last_good_checkpoint(warm_start, tmp_path, monkeypatch):
    # A reward with variance even for a random policy, so that there is a gradient to blow up.
    monkeypatch.setitem(rewards.REWARDS, "length", _length_reward)
    run_dir = str(tmp_path / "nan")
    config = _config(warm_start, run_dir, steps=8, max_consecutive_skips=2, reward="length")
    config.learner.optimizer.learning_rate = 1e30  # the first update overflows the weights
    with pytest.raises(TooManyNonFiniteSteps, match="2 RL steps in a row"):
        train_rl(config, progress=False)
    ckpt = checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints"))
    good = ckpt.latest_step()
    assert good is not None and good <= 3
    ckpt.verify(good)
    records = metrics.read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["skipped_updates"] for r in records if "skipped_updates" in r][-2:] == [2, 2]
