"""RL through an environment: two GRPO steps with the python tool and TLT on, observations
kept out of the drafter's targets, and the environment's turns in eval_samples.jsonl."""
import json
import os

import numpy as np
import pytest

from tests.rl.test_tlt import TLT
from tests.rl.test_train import _config, _length_reward, warm_start  # noqa: F401 (a fixture)
from tlt_jax import envs, metrics, rewards
from tlt_jax.drafter_training.online import OnlineDrafter
from tlt_jax.rl.train import train_rl
from tlt_jax.tokenizer import load_tokenizer

pytestmark = pytest.mark.costly
OBSERVATION = "\n42\n```\n"  # what the sandbox prints for the block below, closing the output block


class FirstTurnRuns(envs.PythonTool):
    """python_tool whose first turn runs a fixed block, whatever the model wrote (a random
    policy never writes one): every sample whose first turn ends gets an observation from
    the sandbox, then answers."""

    def step(self, action):
        if not self.cells:
            return super().step("```python\nx = 6 * 7\nprint(x)\n```\n```output")
        return super().step(action)


def test_two_rl_steps_with_the_python_tool_and_tlt(warm_start, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setitem(rewards.REWARDS, "length", _length_reward)  # spread within groups: a gradient
    added = []
    add = OnlineDrafter.add
    monkeypatch.setattr(OnlineDrafter, "add", lambda self, *a, **k: (added.append((a, k)), add(self, *a, **k))[1])
    run_dir = str(tmp_path / "env")
    # Turns end at a digit (or the end token): short turns from a random policy.
    env = {"env.name": "tests.rl.test_train_env:FirstTurnRuns", "env.max_turns": 2,
           "env.stop_strings": ("1", "2", "3", "4", "5")}
    # Checkpoints at the end, two arms: few programs to compile.
    small = {"steps": 2, "eval_every": 2, "checkpoint_every": 2,
             "tlt.drafter.checkpoint_every": 0, "tlt.tuner.arms": [["eagle-d3", "plain"]], "data.num_eval": 4}
    summary = train_rl(_config(warm_start, run_dir, **{**TLT, **small, "reward": "length", **env}), progress=False)
    assert summary["steps"] == 2
    records = {r["step"]: r for r in metrics.read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "step" in r}
    for r in (records[1], records[2]):
        assert r["env_steps"] > 0 and r["env_step_s"] > 0 and r["env_failures"] == 0
        assert 1 < r["env_turns_mean"] <= r["env_turns_max"] == 2 and 0 < r["observation_token_share"] < 1
        assert r["grad_norm"] > 0
    assert records[2]["drafter_steps_total"] > 0
    # The drafter's buffer was told which tokens are the sandbox's: exactly the observation's,
    # after the sample's first turn.
    tokenizer = load_tokenizer(warm_start)
    want = tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
    assert len(added) == 2
    for args, kwargs in added:
        tokens_nT, prompt_lengths = args[1], args[2]
        observed = kwargs["observed_nT"]
        assert observed.shape == tokens_nT.shape and observed.any()
        for i in np.flatnonzero(observed.any(axis=1)):
            at = np.flatnonzero(observed[i])
            assert at[0] > prompt_lengths[i] and (np.diff(at) == 1).all()
            assert tokens_nT[i, at].tolist() == want[:len(at)]
    # Evaluation ran the environment too: each record's turns, the total reward.
    with open(os.path.join(run_dir, metrics.EVAL_SAMPLES_FILENAME)) as f:
        samples = [json.loads(line) for line in f]
    assert {s["step"] for s in samples} == {0, 2}
    assert all(s["turns"] for s in samples if s["finish_reason"] != "max_tokens")
    observed_turns = [s for s in samples if len(s["turns"]) == 2]
    assert observed_turns and all(s["turns"][0]["observation"] == OBSERVATION for s in observed_turns)
    for s in observed_turns:
        steps = sum(t["reward"] for t in s["turns"])
        assert s["reward"] >= steps and "\n42\n" in s["completion"]
