"""Pieces of one RL step: the learner batch layout and reward scoring in a process pool."""
import concurrent.futures
import multiprocessing

import numpy as np
import pytest

from tlt_jax.rl import loop, tasks
from tlt_jax.rollout.engine import Rollouts
from tlt_jax.rollout.timeline import RolloutTimeline


def _rollouts(prompt_index, answers, logps):
    return Rollouts(prompt_index=np.asarray(prompt_index, np.int32), sample_index=np.zeros(len(answers), np.int32),
                    tokens=[np.asarray(a, np.int32) for a in answers],
                    logprobs=[np.asarray(l, np.float32) for l in logps], finish_reason=["eos"] * len(answers),
                    group=np.zeros(len(answers), np.int32), timeline=RolloutTimeline([]))


def test_build_batch_aligns_answers_with_their_predicting_positions():
    prompts = [[1, 5, 6], [1, 7]]
    r = _rollouts([0, 1], [[8, 9, 2], [3, 2]], [[-0.1, -0.2, -0.3], [-0.4, -0.5]])
    batch = loop.build_batch(prompts, r, np.array([1.0, -1.0]), seq_len=7, pad_id=0)
    np.testing.assert_array_equal(batch["tokens"], [[1, 5, 6, 8, 9, 2, 0], [1, 7, 3, 2, 0, 0, 0]])
    # Position t predicts token t+1: the answer of row 0 starts at token 3, predicted from position 2.
    np.testing.assert_array_equal(batch["loss_mask"], [[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]])
    np.testing.assert_allclose(batch["rollout_logp"][0, 2:5], [-0.1, -0.2, -0.3])
    np.testing.assert_allclose(batch["rollout_logp"][1, 1:3], [-0.4, -0.5])
    with pytest.raises(ValueError, match="exceed the learner's seq_len=4"):
        loop.build_batch(prompts, r, np.zeros(2), seq_len=4, pad_id=0)


def test_scoring_in_a_process_pool_equals_scoring_inline():
    examples = tasks.make_split(tasks.get_task("addition", max_digits=4), "train", 12, seed=3)
    completions = [e.solution if i % 3 else e.solution.replace("answer: ", "answer: 9") for i, e in enumerate(examples)]
    prompts = [e.prompt for e in examples]
    fields = tasks.reward_fields(examples)
    inline, failures = loop.score("task", prompts, completions, fields)
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        pooled, pooled_failures = loop.score("task", prompts, completions, fields, pool)
    np.testing.assert_array_equal(inline, pooled)
    assert failures == pooled_failures == 0
    np.testing.assert_allclose(inline, [0.1 if i % 3 == 0 else 1.0 for i in range(12)], rtol=1e-6)
