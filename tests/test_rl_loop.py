"""Pieces of one RL step: the learner's packed batch layout, its unpacking, and reward
scoring in a process pool."""
import concurrent.futures
import multiprocessing

import numpy as np
import pytest

from tlt_jax.drafter_training import buffer
from tlt_jax.rl import loop, tasks
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
    packing = buffer.pack_spans([3, 4, 2, 5], seq_len=7)  # rows [3 + 4], [2 + 5]
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
