"""One-step-off training in the RL run (tlt_jax/rl/off_policy.py): a token's behaviour log-prob
is the one of the policy one update older than the learner's; with the weights unchanged the
samples are the synchronous run's; speculation stays lossless and the drafter trains; a run
killed between steps resumes exactly; settings that cannot run name their field."""
import os

import jax
import numpy as np
import pytest

from tests.rl.test_carry import _answer_logprobs
from tests.rl.test_train import (
    OVERRIDES,
    _assert_trees_equal,
    _checkpoint,
    _config,
    _learning_records,
    _length_reward,
    kill_at_step_2_checkpoint,
    warm_start,  # noqa: F401 (a fixture)
)
from tlt_jax import checkpoint, evaluation, rewards, sampling
from tlt_jax.models import transformer as tfm
from tlt_jax.rl import train

STEPS = 3
# One update a step (the drafter's data from the update's own forward, as TLT runs it) and
# coupled speculation (`rollout.spec_coupled`): a run with TLT draws the samples of one without.
OFF = {"off_policy_steps": 1, "reward": "length", "learner.num_minibatches": 1, "rollout.spec_coupled": True}
LEARNING = {"learner.optimizer.learning_rate": 3e-3, "learner.optimizer.warmup_steps": 0}
FROZEN = {"learner.optimizer.learning_rate": 0.0}
TLT = {"tlt.enabled": True, "tlt.drafter.init": "", "tlt.drafter.batch_size": 4, "tlt.drafter.seq_len": 48,
       "tlt.drafter.publish_scored": False, "tlt.drafter.optimizer.learning_rate": 3e-3,
       "tlt.spot.catch_up_steps": 2, "tlt.spot.max_steps_per_rl_step": 6,
       # every chunk speculative: one EAGLE chain, no plain arm, at any batch the step runs
       "tlt.tuner.buckets": [1], "tlt.tuner.arms": [["eagle-d3"]], "tlt.tuner.max_active": 16}


def _run_steps(config, steps=STEPS):
    """Runs `steps` RL steps of `config` by hand; returns (the run, [(params after the step,
    the step's rollouts, its record)] per step)."""
    run = train._Run(config)
    position, out = run.data_position, []
    for step in range(steps):
        run.state, record, position, rollouts = run.loop.step(run.state, step, position)
        out.append((jax.device_get(run.state.params), rollouts, record))
    run.data_position = position
    return run, out


@pytest.fixture(scope="module")
def runs(warm_start, tmp_path_factory):  # noqa: F811
    """Runs by hand: one-step-off learning (the length reward), with TLT too, and both modes
    with the learning rate 0."""
    rewards.REWARDS["length"] = _length_reward
    made = {}
    for name, extra in (("learning", {**OFF, **LEARNING}), ("tlt", {**OFF, **LEARNING, **TLT}),
                        ("frozen", {**OFF, **FROZEN}), ("frozen_sync", {**OFF, **FROZEN, "off_policy_steps": 0})):
        made[name] = _run_steps(_config(warm_start, str(tmp_path_factory.mktemp(name)), **extra))
    yield made
    for run, _ in made.values():
        run.close()


def test_a_token_carries_the_log_prob_of_the_policy_one_update_older(runs):
    """Step t's tokens were drawn, and their behaviour log-probs recorded, by the weights
    step t-1 started from, not by the learner's (those step t starts from)."""
    run, steps = runs["learning"]
    loop, cfg = run.loop, run.loop.learner.model_config
    forward = jax.jit(lambda p, x: sampling.processed_logprobs(tfm.logits_from_hidden(p, cfg, tfm.forward(p, cfg, x)),
                                                               loop.sampling_params))
    weights = [jax.device_get(loop.ref_params)] + [params for params, _, _ in steps]  # before step v: weights[v]
    for step, (_, rollouts, record) in enumerate(steps):
        behaviour = weights[max(step - 1, 0)]
        age = min(step, 1)  # step 0 is on-policy
        assert (record["token_age_mean"], record["token_age_max"], record["stale_token_share"]) == (age, age, age)
        assert record["carried_samples"] == 0
        prompts = evaluation.encode_prompts(loop.tokenizer, loop.prompts_for(step * loop.config.prompts_per_step),
                                            loop.prompt_format)
        for i in range(len(rollouts)):
            prompt, tokens = prompts[rollouts.prompt_index[i]], rollouts.tokens[i]
            np.testing.assert_allclose(rollouts.logprobs[i], _answer_logprobs(forward, behaviour, prompt, tokens),
                                       atol=2e-4, err_msg=f"step {step}, sample {i}")
            if step >= 1:  # the learner's policy had moved on: distinguishable
                learner = _answer_logprobs(forward, weights[step], prompt, tokens)
                assert np.abs(learner - rollouts.logprobs[i]).max() > 1e-3, (step, i)
    # Evaluating the learner's policy leaves the engine with the behaviour weights.
    before = jax.device_get(loop.engine.groups[0].params)
    loop.evaluate(STEPS, run.state.params)
    _assert_trees_equal(before, jax.device_get(loop.engine.groups[0].params), "engine after eval")


def test_with_the_weights_unchanged_the_samples_are_the_synchronous_runs(runs):
    (_, off), (_, sync) = runs["frozen"], runs["frozen_sync"]
    for step, ((_, a, ra), (_, b, rb)) in enumerate(zip(off, sync)):
        assert ra["samples_digest"] == rb["samples_digest"], step
        for x, y in zip(a.tokens + a.logprobs, b.tokens + b.logprobs):
            np.testing.assert_array_equal(x, y)
        assert ra["loss"] == rb["loss"] and ra["rollout_logp_gap"] == rb["rollout_logp_gap"], step


def test_speculation_stays_lossless_and_the_drafter_trains(runs):
    """TLT on (coupled speculation): the samples of every step are those of the run without
    a drafter, while the engine holds weights one update behind the learner's."""
    (tlt_run, with_tlt), (_, without) = runs["tlt"], runs["learning"]
    for step, ((_, a, ra), (_, b, rb)) in enumerate(zip(with_tlt, without)):
        assert ra["samples_digest"] == rb["samples_digest"], step
        for x, y in zip(a.tokens, b.tokens):
            np.testing.assert_array_equal(x, y)
        assert ra["token_age_max"] == min(step, 1)
    assert sum(r["speculative_token_share"] for _, _, r in with_tlt) > 0
    assert tlt_run.tlt.drafter.version > 0  # trained on the spot and published


def test_a_run_killed_between_steps_resumes_exactly(warm_start, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setitem(rewards.REWARDS, "length", _length_reward)
    extra = {"off_policy_steps": 1, "reward": "length"}
    full = str(tmp_path / "full")
    train.train_rl(_config(warm_start, full, **extra), progress=False)
    killed = str(tmp_path / "killed")
    kill_at_step_2_checkpoint(warm_start, killed, {**OVERRIDES, **extra})
    with checkpoint.Checkpointer(os.path.join(killed, "checkpoints")) as ckpt:
        resumed_at = ckpt.latest_step()
        assert 2 <= resumed_at < 4, "the kill came too late to leave steps to resume"
    train.train_rl(_config(warm_start, killed, **extra), progress=False)
    a, b = _learning_records(full), _learning_records(killed)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3, 4]
    assert all(a[step]["token_age_max"] == 1 for step in (2, 3, 4))
    for step in range(resumed_at + 1, 5):
        assert a[step] == b[step], step
    (want, want_meta), (got, got_meta) = _checkpoint(full, 4), _checkpoint(killed, 4)
    assert want_meta["off_policy"] == got_meta["off_policy"] == {"version": 3}
    for part in ("train", "behaviour"):
        _assert_trees_equal(want[part], got[part], part)
    step3, _ = _checkpoint(full, 3)  # the engine's weights after step 3: those step 3 started from
    _assert_trees_equal(step3["train"]["params"], want["behaviour"], "behaviour")
    # Synchronous steps resume no one-step-off checkpoint (nor the other way round).
    with pytest.raises(ValueError, match="was saved with off_policy_steps=1.*resume with --config.off_policy_steps=1"):
        train._Run(_config(warm_start, full, reward="length", steps=5))


@pytest.mark.parametrize("overrides, message", [
    ({"off_policy_steps": 2}, r"off_policy_steps=2: choose 0 \(synchronous steps\) or 1"),
    ({"off_policy_steps": -1}, r"off_policy_steps=-1: choose 0"),
    ({"off_policy_steps": 1, "grpo.tis_cap": 0.0},
     r"off_policy_steps=1 learns tokens drawn by older policies: it needs the per-token importance weight, "
     r"grpo.tis_cap > 0"),
    ({"off_policy_steps": 1, "rollout.partial_share": 0.5},
     r"off_policy_steps=1 with rollout.partial_share=0.5: choose one"),
])
def test_off_policy_settings_that_cannot_run_name_their_field(warm_start, tmp_path, overrides, message):  # noqa: F811
    with pytest.raises(ValueError, match=message):
        train.check_config(_config(warm_start, str(tmp_path / "run"), **overrides))


# Both realisations of one-step-off on one device (the overlap needs every program there), in
# a process of its own with one CPU device: the runs' learning records and final policies.
_ONE_DEVICE_RUNS = """
import json, sys
from tests.rl.test_train import _config, _length_reward
from tlt_jax import fingerprint, rewards
from tlt_jax.rl import off_policy, train
from tlt_jax.rl.train import learning_metrics

rewards.REWARDS["length"] = _length_reward
taken, take = [], off_policy.OneStepOff.take
off_policy.OneStepOff.take = lambda self, step: taken.append(take(self, step)) or taken[-1]
out = {}
for overlap in (True, False):
    config = _config(sys.argv[1], sys.argv[2] + str(overlap), **json.loads(sys.argv[3]))
    run = train._Run(config)
    detected, run.loop.off_policy.overlap = run.loop.off_policy.overlap, overlap
    taken.clear()
    position, records = run.data_position, []
    for step in range(config.steps):
        run.state, record, position, _ = run.loop.step(run.state, step, position, last=step + 1 == config.steps)
        records.append(learning_metrics(record))
    run.close()
    out[str(overlap)] = {"detected": detected, "records": records, "overlapped": sum(t is not None for t in taken),
                         "params": fingerprint.fingerprint_arrays(run.state.params)}
print("RESULT " + json.dumps(out))
"""


def test_the_overlap_on_one_device_learns_what_the_in_turn_run_does(warm_start, tmp_path):  # noqa: F811
    """With every program on one device, the next step's rollout runs on a thread while the
    learner trains: the samples, updates and final policy are bit for bit the in-turn run's."""
    import json
    import subprocess
    import sys

    from tests.support import REPO, xla_flags

    settings = {**OFF, **LEARNING, "mesh.data": 1, "mesh.fsdp": 1, "steps": STEPS}
    env = {**os.environ, "XLA_FLAGS": xla_flags()}  # one CPU device
    done = subprocess.run([sys.executable, "-c", _ONE_DEVICE_RUNS, warm_start, str(tmp_path / "run"),
                           json.dumps(settings)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    overlapped, in_turn = result["True"], result["False"]
    assert overlapped["detected"], "one device, TLT off: the overlap should be on"
    assert overlapped["overlapped"] == STEPS - 1 and in_turn["overlapped"] == 0
    assert [r["token_age_max"] for r in overlapped["records"]] == [0] + [1] * (STEPS - 1)
    assert overlapped["records"] == in_turn["records"]
    assert overlapped["params"] == in_turn["params"]
