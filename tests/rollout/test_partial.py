"""Partial rollouts in the engine: a sample stopped and resumed in a later generate (its
prompt and tokens re-prefilled) draws the tokens it would have drawn uninterrupted, and
keeps the log-probs of the weights that drew each token."""
import jax
import numpy as np
import pytest

from tests.support import tiny
from tlt_jax import sampling, sharding
from tlt_jax.models import transformer as tfm
from tlt_jax.rollout.engine import PartialRequests, RolloutConfig, RolloutEngine

CFG = tiny.config()
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
G = 3
SP = sampling.SamplingParams(temperature=1.0, top_k=20, max_tokens=24)
KEY = jax.random.PRNGKey(11)


@pytest.fixture(scope="module")
def params():
    return tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.3)


@pytest.fixture(scope="module")
def engine(params):
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    rc = RolloutConfig(num_slots=4, max_prompt_length=6, max_length=32, steps_per_sync=4, eos_token_id=0,
                       kv_bucket=16)
    return RolloutEngine(CFG, params, mesh, rc)


def _stop_after(count):
    return lambda finished, requests: len(finished) >= count


def _resume_all(engine, stopped, n):
    """The unfinished samples of `stopped` run again to the end, resuming their tokens."""
    unfinished = [i for i in range(len(stopped)) if not stopped.finish_reason[i]]
    ids = [int(stopped.prompt_index[i]) * G + int(stopped.sample_index[i]) for i in unfinished]
    resumed = {rid: (stopped.tokens[i], stopped.logprobs[i]) for rid, i in zip(ids, unfinished)}
    return unfinished, engine.generate(PROMPTS, G, SP, KEY, partial=PartialRequests(ids, resumed))


def test_a_resumed_sample_draws_the_tokens_it_would_have_drawn_uninterrupted(engine):
    whole = engine.generate(PROMPTS, G, SP, KEY)
    stopped = engine.generate(PROMPTS, G, SP, KEY, partial=PartialRequests(range(len(PROMPTS) * G),
                                                                            stop=_stop_after(6)))
    assert len(stopped) == len(whole)
    unfinished, resumed = _resume_all(engine, stopped, len(whole))
    # Some were stopped mid-answer (tokens drawn), some before they started.
    assert any(len(stopped.tokens[i]) for i in unfinished) and any(not len(stopped.tokens[i]) for i in unfinished)
    assert all(resumed.finish_reason) and len(resumed) == len(unfinished)
    for j, i in enumerate(unfinished):
        assert (resumed.prompt_index[j], resumed.sample_index[j]) == (stopped.prompt_index[i],
                                                                       stopped.sample_index[i])
        np.testing.assert_array_equal(resumed.tokens[j], whole.tokens[i])
        np.testing.assert_allclose(resumed.logprobs[j], whole.logprobs[i], atol=1e-5)
        assert resumed.finish_reason[j] == whole.finish_reason[i]
    for i in set(range(len(whole))) - set(unfinished):  # finished before the stop: as uninterrupted
        np.testing.assert_array_equal(stopped.tokens[i], whole.tokens[i])


def test_carried_tokens_keep_the_log_probs_of_the_weights_that_drew_them(engine, params):
    stopped = engine.generate(PROMPTS, G, SP, KEY, partial=PartialRequests(range(len(PROMPTS) * G),
                                                                            stop=_stop_after(6)))
    moved = jax.tree.map(lambda x: x * 1.5, params)
    engine.update_params(moved)
    try:
        unfinished, resumed = _resume_all(engine, stopped, len(stopped))
        fresh = engine.generate(PROMPTS, G, SP, KEY)  # the new weights' own samples
    finally:
        engine.update_params(params)
    carried = [(j, i) for j, i in enumerate(unfinished) if len(stopped.tokens[i])]
    assert carried
    for j, i in carried:
        k = len(stopped.tokens[i])
        np.testing.assert_array_equal(resumed.tokens[j][:k], stopped.tokens[i])
        np.testing.assert_array_equal(resumed.logprobs[j][:k], stopped.logprobs[i])
    # The new weights drew the rest: a sample resumed on them is not what the old ones drew on.
    assert any(not np.array_equal(resumed.tokens[j], fresh.tokens[i]) or len(stopped.tokens[i]) == 0
               for j, i in carried)


def test_partial_requests_reject_bad_input(engine):
    with pytest.raises(ValueError, match="distinct requests in"):
        engine.generate(PROMPTS, G, SP, KEY, partial=PartialRequests([0, 0]))
    with pytest.raises(ValueError, match="names requests that do not run"):
        engine.generate(PROMPTS, G, SP, KEY, partial=PartialRequests([0], {5: (np.ones(2, np.int32),
                                                                               np.zeros(2, np.float32))}))
