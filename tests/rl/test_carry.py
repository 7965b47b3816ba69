"""Partial rollouts in the RL run (tlt_jax/rl/carry.py): with the weights unchanged a carried
sample draws what it would have drawn uncarried; a carried token keeps the behaviour
log-prob of the policy that drew it; every sample is learned once, none dropped; a run
killed between steps resumes mid-carry exactly."""
import os

import jax
import numpy as np
import pytest

from tests.rl.test_train import (
    OVERRIDES,
    _assert_trees_equal,
    _checkpoint,
    _config,
    _learning_records,
    _length_reward,
    kill_at_step_2_checkpoint,
)
from tests.support import REPO
from tlt_jax import checkpoint, evaluation, metrics, rewards, sampling
from tlt_jax.models import transformer as tfm
from tlt_jax.rl import carry, train

SFT_TINY = os.path.join(REPO, "assets", "sft_tiny")
# The shipped SFT checkpoint: its answers end at lengths spread enough that a step stops
# with samples mid-answer (a random policy's run to max_tokens together). Short chunks: the
# stop rule is heard at each harvest.
PARTIAL = {"rollout.partial_share": 0.5, "rollout.max_carry_steps": 2, "reward": "length", "rollout.max_tokens": 32,
           "rollout.steps_per_sync": 4}
STEPS = 5


def _run_steps(config, steps):
    """Runs `steps` RL steps of `config` by hand; returns (the run, [(Learned, params
    after the step, the engine's rollouts)] per step)."""
    run = train._Run(config)
    loop, position, out = run.loop, run.data_position, []
    absorb, generate = loop.carry.absorb, loop.engine.generate
    seen = {}
    loop.carry.absorb = lambda step, r: seen.setdefault("learned", absorb(step, r))
    loop.engine.generate = lambda *a, **k: seen.setdefault("rollouts", generate(*a, **k))
    for step in range(steps):
        seen.clear()
        run.state, record, position, _ = loop.step(run.state, step, position)
        out.append((seen["learned"], jax.device_get(run.state.params), seen["rollouts"], record))
    del loop.carry.absorb, loop.engine.generate  # the methods again
    run.data_position = position
    return run, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs by hand: with the learning rate 0, and learning (the length reward)."""
    rewards.REWARDS["length"] = _length_reward
    frozen = _run_steps(_config(SFT_TINY, str(tmp_path_factory.mktemp("frozen")), **PARTIAL,
                                **{"learner.optimizer.learning_rate": 0.0}), STEPS)
    learning = _run_steps(_config(SFT_TINY, str(tmp_path_factory.mktemp("learning")), **PARTIAL,
                                  **{"learner.optimizer.learning_rate": 3e-3, "learner.optimizer.warmup_steps": 0}),
                          STEPS)
    yield {"frozen": frozen, "learning": learning}
    for run, _ in (frozen, learning):
        run.close()


def _learned_samples(steps):
    """(data position, sample) -> (tokens, log-probs, drawn_at, learning step) of every learned sample."""
    out = {}
    for step, (learned, *_) in enumerate(steps):
        for group in learned.groups:
            for s in range(len(group.tokens)):
                key = (group.data_position, s)
                assert key not in out, f"sample {key} learned at steps {out[key][3]} and {step}"
                out[key] = (group.tokens[s], group.logprobs[s], group.drawn_at[s], step)
    return out


def test_with_the_weights_unchanged_a_carried_sample_draws_its_uncarried_tokens(runs):
    run, steps = runs["frozen"]
    learned = _learned_samples(steps)
    carried = {k for k, (_, _, drawn, _) in learned.items() if len(set(drawn.tolist())) > 1}
    assert carried, "no sample was carried across steps"
    assert max(r["token_age_max"] for *_, r in steps) >= 1 and max(r["carried_samples"] for *_, r in steps) > 0
    loop = run.loop
    positions = sorted({p for p, _ in learned})
    examples = [loop.example_at(p) for p in positions]
    prompts = evaluation.encode_prompts(loop.tokenizer, examples, loop.prompt_format)
    g = loop.config.num_samples
    whole = loop.engine.generate(prompts, g, loop.sampling_params, jax.random.fold_in(loop.key, carry.STREAM),
                                 prompt_ids=positions)
    for i in range(len(whole)):
        key = (positions[whole.prompt_index[i]], int(whole.sample_index[i]))
        np.testing.assert_array_equal(learned[key][0], whole.tokens[i], err_msg=str(key))


def _answer_logprobs(forward, params, prompt, tokens):
    """The log-prob of each answer token after the prompt under `params`."""
    x = np.asarray([list(prompt) + tokens.tolist()], np.int32)
    logp = np.asarray(forward(params, x))[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)]
    return np.take_along_axis(logp, tokens[:, None], 1)[:, 0]


def test_a_carried_token_keeps_the_log_prob_of_the_policy_that_drew_it(runs):
    """Each token's behaviour log-prob, as the learner reads it, is the one of the weights
    that drew it (those after the step before), not the weights that finished the sample."""
    run, steps = runs["learning"]
    loop, cfg, sp = run.loop, run.loop.learner.model_config, run.loop.sampling_params
    forward = jax.jit(lambda p, x: sampling.processed_logprobs(tfm.logits_from_hidden(p, cfg, tfm.forward(p, cfg, x)),
                                                               sp))
    weights = [jax.device_get(loop.ref_params)] + [params for _, params, _, _ in steps]  # before step v: weights[v]
    checked = 0
    for (position, s), (tokens, logp, drawn, _) in _learned_samples(steps).items():
        if drawn[0] == drawn[-1]:
            continue  # one policy drew it all
        prompt = evaluation.encode_prompts(loop.tokenizer, [loop.example_at(position)], loop.prompt_format)[0]
        last = _answer_logprobs(forward, weights[drawn[-1]], prompt, tokens)
        for version in sorted(set(drawn.tolist()))[:-1]:
            mine = drawn == version
            drawing = _answer_logprobs(forward, weights[version], prompt, tokens)
            np.testing.assert_allclose(logp[mine], drawing[mine], atol=2e-4,
                                       err_msg=f"sample {position, s}, tokens of step {version}")
            assert np.abs(last[mine] - logp[mine]).max() > 1e-3  # the policy moved since: distinguishable
            checked += 1
    assert checked, "no learned sample held tokens of two policies"


def test_every_sample_is_learned_once_and_none_is_dropped(runs):
    run, steps = runs["learning"]
    learned = _learned_samples(steps)  # raises on a sample learned twice
    g = run.loop.config.num_samples
    in_flight = {(group.data_position, s) for group in run.loop.carry.in_flight for s in range(g)}
    assert not in_flight & set(learned)
    assert set(learned) | in_flight == {(p, s) for p in range(run.data_position) for s in range(g)}
    for step, (learned_step, _, _, record) in enumerate(steps):
        assert all(group.done for group in learned_step.groups)
        assert len(learned_step.rollouts) == g * record["learned_groups"]
        for group in learned_step.groups:
            assert all(len(t) == len(d) == len(lp) for t, d, lp in zip(group.tokens, group.drawn_at, group.logprobs))
            # Learned in the step its last sample finished, no earlier, no later.
            assert max(int(d.max()) for d in group.drawn_at) == step
    assert sum(r["learned_groups"] for *_, r in steps) == len({p for p, _ in learned})


def test_a_run_killed_between_steps_resumes_mid_carry_exactly(tmp_path, monkeypatch):
    monkeypatch.setitem(rewards.REWARDS, "length", _length_reward)
    extra = {**PARTIAL, "steps": 4, "eval_every": 4}
    full = str(tmp_path / "full")
    train.train_rl(_config(SFT_TINY, full, **extra), progress=False)
    killed = str(tmp_path / "killed")
    kill_at_step_2_checkpoint(SFT_TINY, killed, {**OVERRIDES, **extra})
    with checkpoint.Checkpointer(os.path.join(killed, "checkpoints")) as ckpt:
        resumed_at = ckpt.latest_step()
        assert 2 <= resumed_at < 4, "the kill came too late to leave steps to resume"
        assert ckpt.read_meta(resumed_at)["carry"], "the checkpoint it resumes from carries nothing"
    train.train_rl(_config(SFT_TINY, killed, **extra), progress=False)
    a, b = _learning_records(full), _learning_records(killed)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3, 4]
    for step in range(resumed_at + 1, 5):
        assert a[step] == b[step], step
    (want, want_meta), (got, got_meta) = _checkpoint(full, 4), _checkpoint(killed, 4)
    assert want_meta["carry"] == got_meta["carry"] and want_meta["data_position"] == got_meta["data_position"]
    _assert_trees_equal(want["train"], got["train"], "train")


def test_partial_rollouts_with_tlt_speculate_and_train_the_drafter(tmp_path, monkeypatch):
    """TLT on: carried samples resume in speculative slots (the drafter's state re-prefilled
    with the prompt and their tokens), the tuner speculates, the drafter trains on the spot."""
    from tests.rl.test_tlt import TLT

    monkeypatch.setitem(rewards.REWARDS, "length", _length_reward)
    run_dir = str(tmp_path / "tlt")
    # One rollout group: on this CPU backend a drafter step on one group's devices beside
    # another group's decode can stall XLA's collectives (with partial rollouts off too).
    one_group = {"mesh.data": 1, "mesh.fsdp": 8, "tlt.drafter.batch_size": 8, "tlt.drafter.eval_rows": 8}
    config = _config(SFT_TINY, run_dir, **{**TLT, **PARTIAL, **one_group, "steps": 4, "eval_every": 4})
    summary = train.train_rl(config, progress=False)
    records = [r for r in metrics.read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "time_step_s" in r]
    assert max(r["carried_samples"] for r in records) > 0 and max(r["token_age_max"] for r in records) >= 1
    assert sum(r["speculative_token_share"] for r in records) > 0
    assert summary["tlt"]["drafter_version"] > 0 and sum(r["spot/steps"] for r in records) > 0


@pytest.mark.parametrize("overrides, message", [
    ({"rollout.partial_share": 1.5}, r"rollout.partial_share=1.5 must lie in \[0, 1\]"),
    ({"rollout.max_carry_steps": 0}, "rollout.max_carry_steps=0 must be >= 1"),
    ({"grpo.tis_cap": 0.0}, r"needs the per-token importance weight, grpo.tis_cap > 0"),
    ({"learner.num_minibatches": 3, "num_samples": 4, "prompts_per_step": 3},
     "learner.num_minibatches=3 must divide num_samples=4"),
])
def test_partial_rollout_settings_that_cannot_run_name_their_field(tmp_path, overrides, message):
    config = _config(SFT_TINY, str(tmp_path / "run"), **{**PARTIAL, **overrides})
    with pytest.raises(ValueError, match=message):
        train.check_config(config)
