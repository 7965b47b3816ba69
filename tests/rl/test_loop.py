"""Pieces of one RL step: the learner's packed batch layout, its unpacking, and reward
scoring in a process pool."""
import functools

import numpy as np
import pytest

from tests.support import tiny
from tlt_jax import evaluation, rewards
from tlt_jax.data import tasks
from tlt_jax.data.packing import pack_spans
from tlt_jax.rl import loop
from tlt_jax.rollout.engine import Rollouts
from tlt_jax.rollout.timeline import RolloutTimeline


def _rollouts(prompt_index, answers, logps):
    return Rollouts(prompt_index=np.asarray(prompt_index, np.int32), sample_index=np.zeros(len(answers), np.int32),
                    tokens=[np.asarray(a, np.int32) for a in answers],
                    logprobs=[np.asarray(l, np.float32) for l in logps], finish_reason=["eos"] * len(answers),
                    group=np.zeros(len(answers), np.int32), timeline=RolloutTimeline([]))


def test_build_batch_packs_samples_with_their_own_positions_segments_and_advantages():
    prompts = [[1, 5, 6], [1, 7]]
    # Sequences of 6, 4, 5 and 4 tokens, two minibatches: [6 | 4] and [5 | 4] in rows of 10.
    r = _rollouts([0, 1, 1, 0], [[8, 9, 2], [3, 2], [4, 4, 2], [9]],
                  [[-0.1, -0.2, -0.3], [-0.4, -0.5], [-0.6, -0.7, -0.8], [-0.9]])
    batch, packing = loop.build_batch(prompts, r, np.array([1.0, -1.0, 0.5, 2.0]), seq_len=10, pad_id=0,
                                      num_minibatches=2, minibatch_rows=lambda rows: rows + 1)
    # Each minibatch needs one row and gets a padding row: minibatch i is rows 2i, 2i + 1.
    np.testing.assert_array_equal(packing.row_N, [0, 0, 2, 2])
    np.testing.assert_array_equal(batch["tokens"], [[1, 5, 6, 8, 9, 2, 1, 7, 3, 2], [0] * 10,
                                                    [1, 7, 4, 4, 2, 1, 5, 6, 9, 0], [0] * 10])
    np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3], [0] * 10,
                                                       [0, 1, 2, 3, 4, 0, 1, 2, 3, 0], [0] * 10])
    np.testing.assert_array_equal(batch["segment_ids"], [[1] * 6 + [2] * 4, [0] * 10,
                                                         [1] * 5 + [2] * 4 + [0], [0] * 10])
    # Position t predicts token t+1; a sample's last position (5 in row 0, 4 in row 2)
    # predicts the next sample's first token and is never in the loss.
    np.testing.assert_array_equal(batch["loss_mask"], [[0, 0, 1, 1, 1, 0, 0, 1, 1], [0] * 9,
                                                       [0, 1, 1, 1, 0, 0, 0, 1, 0], [0] * 9])
    np.testing.assert_allclose(batch["rollout_logp"][0], [0, 0, -0.1, -0.2, -0.3, 0, 0, -0.4, -0.5])
    np.testing.assert_allclose(batch["rollout_logp"][2], [0, -0.6, -0.7, -0.8, 0, 0, 0, -0.9, 0])
    np.testing.assert_allclose(batch["advantages"][0], [0, 0, 1, 1, 1, 0, 0, -1, -1])
    np.testing.assert_allclose(batch["advantages"][2], [0, 0.5, 0.5, 0.5, 0, 0, 0, 2, 0])
    assert not batch["rollout_logp"][1::2].any() and not batch["advantages"][1::2].any()
    assert {k: v.dtype.name for k, v in batch.items()} == {
        "tokens": "int32", "positions": "int32", "segment_ids": "int32", "loss_mask": "bool",
        "rollout_logp": "float32", "advantages": "float32"}
    with pytest.raises(ValueError, match="exceed the learner's seq_len=4"):
        loop.build_batch(prompts, r, np.zeros(4), seq_len=4, pad_id=0)
    with pytest.raises(ValueError, match="4 samples do not split into 3 minibatches"):
        loop.build_batch(prompts, r, np.zeros(4), seq_len=10, pad_id=0, num_minibatches=3)


def test_unpack_samples_inverts_the_packing():
    packing = pack_spans([3, 4, 2, 5], seq_len=7)  # rows [3 + 4], [2 + 5]
    values = [np.arange(n) + 10 * i for i, n in enumerate(packing.lengths_N)]
    packed = packing.scatter(values, np.int32)
    got = loop.unpack_samples(packing, packed, width=6, fill=-1)
    want = np.full((4, 6), -1)
    for i, v in enumerate(values):
        want[i, :len(v)] = v
    np.testing.assert_array_equal(got, want)
    # Per-position data of S - 1 columns: a sample ending at a row's last column loses its last entry.
    got = loop.unpack_samples(packing, packed[:, :-1, None].repeat(2, -1), width=6)
    assert got.shape == (4, 6, 2)
    np.testing.assert_array_equal(got[1, :, 0], [10, 11, 12, 0, 0, 0])
    np.testing.assert_array_equal(got[3, :, 1], [30, 31, 32, 33, 0, 0])
    np.testing.assert_array_equal(got[[0, 2], :3, 0], [[0, 1, 2], [20, 21, 0]])


def test_scoring_in_worker_processes_equals_scoring_inline():
    examples = tasks.make_split(tasks.get_task("addition", max_digits=4), "train", 12, seed=3)
    completions = [e.solution if i % 3 else e.solution.replace("answer: ", "answer: 9") for i, e in enumerate(examples)]
    prompts = [e.prompt for e in examples]
    fields = tasks.reward_fields(examples)
    inline = rewards.Scorer("task")(prompts, completions, fields)
    scorer = rewards.Scorer("task", workers=2)
    pooled = scorer(prompts, completions, fields)
    scorer.close()
    np.testing.assert_array_equal(inline.scores, pooled.scores)
    assert inline.failures == pooled.failures == inline.timed_out == pooled.timed_out == 0
    np.testing.assert_allclose(inline.scores, [0.1 if i % 3 == 0 else 1.0 for i in range(12)], rtol=1e-6)


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_rollout_logp_gap_of_a_step_is_the_top_p_kept_mass(tmp_path, top_p):
    """One real RL step: the engine reports log-probs under the distribution it sampled
    from (after top-p), the learner's old log-probs are the temperature-only policy's, and
    the step's `rollout_logp_gap` is their mean absolute difference: -log(kept mass) per
    token under top-p, the engine's numerics alone without it. Against a reference policy
    of other weights, `policy_kl_from_start` is the token mean of the k3 estimate of
    KL(policy || reference) on the step's own response tokens."""
    import jax
    import jax.numpy as jnp

    from tlt_jax import sampling, sharding
    from tlt_jax.models import transformer as tfm
    from tlt_jax.rl.learner import Learner, LearnerConfig
    from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
    from tlt_jax.train_state import OptimizerConfig

    tokenizer = tasks.build_task_tokenizer(str(tmp_path / "tokenizer"))
    cfg = tiny.policy_config(tokenizer)
    params = tfm.init_params(cfg, jax.random.PRNGKey(3), init_std=0.3)  # a spread-out next-token distribution
    ref_params = tfm.init_params(cfg, jax.random.PRNGKey(4), init_std=0.3)  # "the start": another policy
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    temperature, max_tokens = 0.9, 12
    sp = sampling.SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
    seq_len = 24 + max_tokens
    engine = RolloutEngine(cfg, params, mesh, RolloutConfig(num_slots=8, max_prompt_length=24, max_length=seq_len,
                                                            eos_token_id=cfg.eos_token_id))
    # A learning rate of 0: the step's only minibatch measures the gap at the old policy.
    learner = Learner(cfg, LearnerConfig(optimizer=OptimizerConfig(learning_rate=0.0), num_minibatches=1,
                                         micro_batch_size=8, temperature=temperature, remat=False), mesh)
    examples = tasks.make_split(tasks.get_task("addition", max_digits=3), "train", 16, seed=0)
    rl = loop.RLLoop(engine=engine, learner=learner, tokenizer=tokenizer, train_examples=examples,
                     eval_examples=examples[:2], sampling_params=sp,
                     step_config=loop.RLStepConfig(prompts_per_step=2, num_samples=4), seq_len=seq_len, seed=0,
                     ref_params=ref_params)
    _, step_metrics, _, rollouts = rl.step(learner.init_state(params), step=0, data_position=0)
    rl.close()

    # The reference: a plain forward of each sample, its sampled tokens' log-probs under
    # the temperature-only and the processed (top-p) distributions.
    prompt_ids = evaluation.encode_prompts(tokenizer, rl.prompts_for(0))
    # One jitted program per (prompt, answer) shape, not op by op.
    @functools.partial(jax.jit, static_argnums=4)
    def picked_logps(params, ref_params, seq, answer, prompt_len):
        h = tfm.forward(params, cfg, seq)
        logits = tfm.logits_from_hidden(params, cfg, h)[0, prompt_len - 1:-1]
        plain = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature)
        processed = sampling.processed_logprobs(logits, sp)
        pick = lambda lp: jnp.take_along_axis(lp, answer[:, None], 1)[:, 0]
        ref_logits = tfm.logits_from_hidden(ref_params, cfg, tfm.forward(ref_params, cfg, seq))
        ref = jax.nn.log_softmax(ref_logits[0, prompt_len - 1:-1].astype(jnp.float32) / temperature)
        return pick(plain), pick(processed), pick(ref)

    gaps, engine_errors, kls = [], [], []
    for i, answer in enumerate(rollouts.tokens):
        prompt = np.asarray(prompt_ids[rollouts.prompt_index[i]], np.int32)
        seq = np.concatenate([prompt, answer])[None]
        plain, processed, ref = map(np.asarray, picked_logps(params, ref_params, jnp.asarray(seq),
                                                             jnp.asarray(answer), len(prompt)))
        gaps.append(np.abs(plain - processed))
        d = ref - plain
        kls.append(np.exp(d) - d - 1)
        engine_errors.append(np.abs(processed - rollouts.logprobs[i]))
    assert max(e.max() for e in engine_errors) < 1e-4  # the engine's log-probs are the processed ones
    want = np.concatenate(gaps).mean()
    np.testing.assert_allclose(step_metrics["rollout_logp_gap"], want, rtol=1e-3, atol=1e-5)
    want_kl = np.concatenate(kls).mean()
    assert want_kl > 0.05  # the two policies differ: the check has power
    np.testing.assert_allclose(step_metrics["policy_kl_from_start"], want_kl, rtol=1e-3)
    if top_p < 1:
        assert want > 0.05  # top-p cut real mass here: the check has power
    else:
        assert want < 1e-5


class _ScriptedEngine:
    """Answers every prompt's samples with the given texts, in request order."""

    def __init__(self, tokenizer, answers):
        self.tokenizer, self.answers = tokenizer, answers

    def generate(self, prompt_ids, num_samples, sampling_params, key):
        assert len(prompt_ids) * num_samples == len(self.answers)
        ids = [np.asarray(self.tokenizer(a, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id],
                          np.int32) for a in self.answers]
        return _rollouts(np.repeat(np.arange(len(prompt_ids)), num_samples), ids, [np.zeros(len(t)) for t in ids])


def test_evaluation_counts_the_correct_answers(tmp_path):
    """Accuracy is the share of samples whose parsed answer solves its own prompt: right,
    wrong, missing and another prompt's answer, on a scripted engine."""
    tokenizer = tasks.build_task_tokenizer(str(tmp_path / "tok"))
    examples = tasks.make_split(tasks.get_task("addition", max_digits=3), "eval", 4, seed=1, unique=True)
    assert len({e.answer for e in examples}) == 4
    prefix = tasks.ANSWER_PREFIX
    answers = [examples[0].solution, f"{prefix}{examples[0].answer}",  # both right (the trace is not needed)
               examples[1].solution, f"{prefix}{examples[0].answer}",  # right; another prompt's answer
               f"{prefix}{int(examples[2].answer) + 1}", "12+3",       # off by one; no answer line
               examples[3].solution, examples[3].solution]              # right twice
    out = evaluation.evaluate(_ScriptedEngine(tokenizer, answers), tokenizer, examples, None, key=None,
                              num_samples=2)
    assert out["accuracy"] == 5 / 8
    lengths = [len(a) + 1 for a in answers]  # one token a character, and the <eos>
    assert out["length_mean"] == pytest.approx(np.mean(lengths)) and out["length_max"] == max(lengths)


def test_balanced_tasks_put_every_task_in_every_step():
    """With balance_tasks each step of 2 prompts holds one prompt of each of 2 tasks, even
    with one task 9 times rarer, and the order is a fixed function of (seed, epoch); without
    it some steps hold one task only."""
    import types

    examples = [tasks.Example(f"p{i}", "", "", "a" if i % 10 else "b") for i in range(100)]

    def steps(balance):
        rl = types.SimpleNamespace(config=loop.RLStepConfig(prompts_per_step=2, balance_tasks=balance), seed=3,
                                   _epoch_order=None, train_examples=examples)
        rl._order = lambda epoch, n: loop.RLLoop._order(rl, epoch, n)
        return [[e.task for e in loop.RLLoop.prompts_for(rl, pos)] for pos in range(0, 200, 2)]

    assert all(sorted(step) == ["a", "b"] for step in steps(True))
    assert steps(True) == steps(True)
    assert any(step == ["a", "a"] for step in steps(False))


def test_accuracy_is_reported_per_task_only_for_a_mixture():
    assert evaluation.accuracy_by_task(["b", "a", "b", "a"], [1.0, 0.0, 0.0, 0.0]) == {"accuracy/a": 0.0,
                                                                                      "accuracy/b": 0.5}
    assert evaluation.accuracy_by_task(["a", "a"], [1.0, 0.0]) == {}
