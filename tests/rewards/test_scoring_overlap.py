"""Rewards scored sample by sample as the samples finish decoding (`Scorer.begin`, the RL
loop's reward_overlap): the batch's scores bit for bit, every sample scored once, a
deadline that still holds; and one RL step that scores while the rest decode."""
import dataclasses
import time

import numpy as np
import pytest

from tests.support import tiny
from tlt_jax import rewards
from tlt_jax.data import tasks


def _batch(n=12):
    """Task samples, every third one with a wrong answer."""
    examples = tasks.make_split(tasks.get_task("addition", max_digits=4), "train", n, seed=3)
    completions = [e.solution if i % 3 else e.solution.replace("answer: ", "answer: 9") for i, e in enumerate(examples)]
    return [e.prompt for e in examples], completions, tasks.reward_fields(examples)


def _one(fields, i):
    return {k: v[i] for k, v in fields.items()}


def _per_sample(scorer, prompts, completions, fields, order):
    scoring = scorer.begin()
    for i in order:
        scoring.submit(i, prompts[i], completions[i], _one(fields, i))
    return scoring.result(len(completions))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("reward", ["task", "tests.support.rewards:raises_on_boom"])
def test_per_sample_scoring_gives_the_batch_scores(reward, workers):
    prompts, completions, fields = _batch()
    completions[4], completions[7] = "nan", "boom"  # a NaN score, and a sample that raises
    fields["answer"] = [c if i % 2 else a for i, (c, a) in enumerate(zip(completions, fields["answer"]))]
    batch = rewards.Scorer(reward)(prompts, completions, fields)
    scorer = rewards.Scorer(reward, workers=workers, timeout_s=60.0)
    try:
        # Submitted in the order samples finish, not the batch's order.
        scored = _per_sample(scorer, prompts, completions, fields, np.random.default_rng(0).permutation(12))
    finally:
        scorer.close()
    np.testing.assert_array_equal(scored.scores, batch.scores)
    assert scored.scores.dtype == np.float32
    assert (scored.failures, scored.timed_out, scored.failed_sample) == (
        batch.failures, batch.timed_out, batch.failed_sample)
    assert scored.scoring_s > 0
    if reward != "task":
        assert batch.failures == 2 and batch.failed_sample.completion == "nan"  # the test has power
        assert len(set(batch.scores.tolist())) == 2


@pytest.mark.parametrize("workers", [0, 1])
def test_every_sample_is_scored_once(tmp_path, workers):
    prompts, completions, fields = _batch(6)
    fields["log"] = [str(tmp_path / "scored.log")] * 6
    completions = [f"sample {i}" for i in range(6)]
    scorer = rewards.Scorer("tests.support.rewards:logged", workers=workers)
    try:
        scoring = scorer.begin()
        for i in (5, 0, 3, 1, 2):
            scoring.submit(i, prompts[i], completions[i], _one(fields, i))
        with pytest.raises(ValueError, match="Sample 3 was submitted twice"):
            scoring.submit(3, prompts[3], completions[3], _one(fields, 3))
        with pytest.raises(ValueError, match=r"samples \[4\] were never submitted"):
            scoring.result(6)
        scoring.submit(4, prompts[4], completions[4], _one(fields, 4))
        with pytest.raises(ValueError, match=r"\[5\] are not of it"):
            scoring.result(5)
        scored = scoring.result(6)
    finally:
        scorer.close()
    logged = sorted(line.rsplit(" ", 1)[0] for line in (tmp_path / "scored.log").read_text().splitlines())
    assert logged == sorted(repr(c) for c in completions)
    assert scored.scores.shape == (6,) and scored.failures == 0


@pytest.mark.parametrize("workers", [0, 1])
def test_the_deadline_counts_from_the_wait_and_the_next_batch_is_scored(tmp_path, workers):
    prompts, completions, fields = _batch(4)
    fields["log"] = [str(tmp_path / "scored.log")] * 4
    completions = list(completions)
    completions[3] = "sleep"  # its scoring takes 5 s
    scorer = rewards.Scorer("tests.support.rewards:logged", workers=workers, timeout_s=1.0)
    try:
        first = {k: v[:3] for k, v in fields.items()}
        want = rewards.Scorer("tests.support.rewards:logged")(prompts[:3], completions[:3], first)
        scoring = scorer.begin()
        for i in range(4):
            scoring.submit(i, prompts[i], completions[i], _one(fields, i))
        time.sleep(1.5)  # past the deadline, were it counted from the first sample
        t0 = time.monotonic()
        scored = scoring.result(4)
        assert time.monotonic() - t0 < 3.0
        np.testing.assert_array_equal(scored.scores[:3], want.scores)
        assert scored.scores[3] == 0 and (scored.failures, scored.timed_out) == (1, 1)
        # A fresh thread or pool scores the next batch; the one left behind skips what it held.
        again = _per_sample(scorer, prompts[:3], completions[:3], fields, range(3))
        np.testing.assert_array_equal(again.scores, want.scores)
        assert again.timed_out == 0
    finally:
        scorer.close()


def test_a_step_scores_each_sample_once_while_the_rest_decode_as_the_batch_would(tmp_path, monkeypatch):
    """One real RL step with and without reward_overlap, from the same state and key: the
    same scores reach the learner, each sample is scored once, and with overlap the first
    scores land before the rollout ends (without it, after)."""
    import jax

    from tlt_jax import sampling, sharding
    from tlt_jax.models import transformer as tfm
    from tlt_jax.rl import loop
    from tlt_jax.rl.learner import Learner, LearnerConfig
    from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
    from tlt_jax.train_state import OptimizerConfig

    tokenizer = tasks.build_task_tokenizer(str(tmp_path / "tokenizer"))
    cfg = tiny.policy_config(tokenizer)
    params = tfm.init_params(cfg, jax.random.PRNGKey(3), init_std=0.3)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    sp = sampling.SamplingParams(temperature=1.0, max_tokens=12)
    seq_len = 36
    # Four slots for eight samples, two decode steps a chunk: samples finish chunks apart.
    engine = RolloutEngine(cfg, params, mesh, RolloutConfig(num_slots=4, max_prompt_length=24, max_length=seq_len,
                                                            steps_per_sync=2, eos_token_id=cfg.eos_token_id))
    learner = Learner(cfg, LearnerConfig(optimizer=OptimizerConfig(learning_rate=0.0), num_minibatches=1,
                                         micro_batch_size=8, remat=False), mesh)
    log = tmp_path / "scored.log"
    examples = [dataclasses.replace(e, fields={**e.fields, "log": str(log)})
                for e in tasks.make_split(tasks.get_task("addition", max_digits=3), "train", 4, seed=0)]
    sent = []  # what the step hands the learner: (scores, failures)
    broadcast = loop.multihost.broadcast_object
    monkeypatch.setattr(loop.multihost, "broadcast_object", lambda x: sent.append(x) or broadcast(x))
    generate, rollout_end = engine.generate, []
    monkeypatch.setattr(engine, "generate", lambda *a, **k: (generate(*a, **k), rollout_end.append(time.time()))[0])
    for overlap in (True, False):
        rl = loop.RLLoop(engine=engine, learner=learner, tokenizer=tokenizer, train_examples=examples,
                         eval_examples=examples[:1], sampling_params=sp, seq_len=seq_len, seed=0,
                         step_config=loop.RLStepConfig(prompts_per_step=2, num_samples=4, reward_overlap=overlap,
                                                       reward="tests.support.rewards:logged"))
        try:
            _, metrics, _, rollouts = rl.step(learner.init_state(params), step=0, data_position=0)
        finally:
            rl.close()
        lines = [line.rsplit(" ", 1) for line in log.read_text().splitlines()]
        log.unlink()
        from tlt_jax import evaluation

        completions = evaluation.decode_completions(tokenizer, rollouts.tokens)
        assert sorted(c for c, _ in lines) == sorted(map(repr, completions))  # each sample once
        scored_at = sorted(float(t) for _, t in lines)
        assert (scored_at[0] < rollout_end[-1]) == overlap
        assert metrics["time_reward_scoring_s"] > 0 and 0 <= metrics["time_reward_wait_s"] <= metrics["time_reward_s"]
    assert len(set(rollouts.lengths.tolist())) > 1  # samples finished apart: the overlap had a tail to fill
    (with_overlap, failures_with), (batch, failures) = sent
    np.testing.assert_array_equal(with_overlap, batch)
    assert len(set(batch.tolist())) > 2  # scores that tell samples apart: the check has power
    assert failures_with == failures == 0


def test_a_slow_verifier_sleeps_per_sample_and_scores_as_its_reward():
    from experiments import slow_reward

    name = slow_reward.name("task", 20)
    assert name == "experiments.slow_reward:task_after_20ms" and slow_reward.name("task", 2.5).endswith("_2.5ms")
    prompts, completions, fields = _batch(3)
    t0 = time.perf_counter()
    scored = rewards.Scorer(name)(prompts, completions, fields)
    assert time.perf_counter() - t0 >= 0.06 and scored.scoring_s >= 0.06
    np.testing.assert_array_equal(scored.scores, rewards.Scorer("task")(prompts, completions, fields).scores)
    with pytest.raises(ValueError, match=r"slow_reward_ms=-1 must be >= 0"):
        slow_reward.name("task", -1)
    with pytest.raises(ValueError, match="has no attribute 'nope_after_3ms'"):
        rewards.get_reward("experiments.slow_reward:nope_after_3ms")
