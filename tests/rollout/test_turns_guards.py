"""The multi-turn driver's guards (`rollout.turns`): a step that never answers ends its own
sample at `step_timeout_s`, a step that answers nonsense ends its own sample, and every
environment's `close()` runs once its episode ends, a raising one costing no sample."""
import threading
import warnings

import jax
import numpy as np
import pytest

from tests.rollout.test_turns import OBSERVATIONS, PROMPTS, SP, _engine


@pytest.fixture(scope="module")
def engine(tiny_params):
    return _engine(tiny_params)


class _Env:
    def __init__(self, fail_close=False):
        self.closed, self.fail_close = 0, fail_close

    def close(self):
        self.closed += 1
        if self.fail_close:
            raise RuntimeError("the sandbox would not stop")


class _Episodes:
    """Fixed observations for two turns; request `bad` misbehaves as `how` says on its first step."""

    def __init__(self, n, bad=-1, how="", step_timeout_s=0.0, fail_close=False):
        self.envs = [_Env(fail_close) for _ in range(n)]
        self.bad, self.how, self.step_timeout_s = bad, how, step_timeout_s
        self.turns, self.failures, self.lock = {}, [], threading.Lock()
        self.release = threading.Event()  # lets a hung step's abandoned thread end with the test

    def step(self, request, action, finish_reason):
        with self.lock:
            turn = self.turns[request] = self.turns.get(request, 0) + 1
        if request == self.bad and self.how == "hang":
            self.release.wait()
            return ""
        if request == self.bad and self.how == "malformed":
            return {"observation": "not token ids"}
        return OBSERVATIONS[turn - 1] if turn <= len(OBSERVATIONS) else ""

    def sample_failed(self, request, error):
        with self.lock:
            self.failures.append((request, error))

    def close_episode(self, request):
        self.envs[request].close()


def _generate(engine, episodes, seconds=120):
    """The rollout on a thread: a rollout that waits for a hung step forever fails the test."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", engine.generate(
        PROMPTS, 2, SP, jax.random.PRNGKey(3), episodes=episodes)), daemon=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        thread.start()
        thread.join(seconds)
    episodes.release.set()
    assert not thread.is_alive(), "the rollout waited for a hung environment past its deadline"
    return out["r"], [str(w.message) for w in caught]


def test_a_hung_step_ends_its_sample_at_the_deadline_and_the_rest_goes_on(engine):
    reference, _ = _generate(engine, _Episodes(len(PROMPTS) * 2))
    episodes = _Episodes(len(PROMPTS) * 2, bad=1, how="hang", step_timeout_s=1.0)
    out, messages = _generate(engine, episodes)
    assert out.finish_reason[1] == "env_timeout"
    assert [(r, type(e).__name__) for r, e in episodes.failures] == [(1, "StepTimeout")]
    assert "step_timeout_s" in str(episodes.failures[0][1])
    assert sum("env_timeout" in m for m in messages) == 1, messages
    for i in range(len(out)):  # nothing else lost: every other sample is the undisturbed rollout's
        if i != 1:
            np.testing.assert_array_equal(out.tokens[i], reference.tokens[i])
            assert out.finish_reason[i] == reference.finish_reason[i]
    assert [env.closed for env in episodes.envs] == [1] * len(out)  # the hung one's too


def test_a_malformed_step_result_ends_its_sample_alone(engine):
    reference, _ = _generate(engine, _Episodes(len(PROMPTS) * 2))
    episodes = _Episodes(len(PROMPTS) * 2, bad=2, how="malformed")
    out, messages = _generate(engine, episodes)
    assert out.finish_reason[2] == "env_error"
    (request, error), = episodes.failures
    assert request == 2 and isinstance(error, TypeError) and "token ids" in str(error)
    assert sum("env_error" in m for m in messages) == 1, messages
    for i in range(len(out)):
        if i != 2:
            np.testing.assert_array_equal(out.tokens[i], reference.tokens[i])


def test_close_runs_once_per_episode_and_a_raising_close_loses_nothing(engine):
    reference, _ = _generate(engine, _Episodes(len(PROMPTS) * 2))
    episodes = _Episodes(len(PROMPTS) * 2, fail_close=True)
    out, messages = _generate(engine, episodes)
    assert [env.closed for env in episodes.envs] == [1] * len(out)
    assert sum("close() raised" in m for m in messages) == 1, messages
    for a, b, x, y in zip(reference.tokens, out.tokens, reference.finish_reason, out.finish_reason):
        np.testing.assert_array_equal(a, b)
        assert x == y


def test_close_runs_when_the_rollout_itself_fails(engine):
    episodes = _Episodes(len(PROMPTS) * 2)

    def on_sample_done(request, tokens):
        raise RuntimeError("the scorer is gone")

    with pytest.raises(RuntimeError, match="the scorer is gone"):
        engine.generate(PROMPTS, 2, SP, jax.random.PRNGKey(3), episodes=episodes, on_sample_done=on_sample_done)
    assert [env.closed for env in episodes.envs] == [1] * len(episodes.envs)


def test_a_negative_deadline_is_refused(engine):
    with pytest.raises(ValueError, match=r"step_timeout_s=-1.0 must be >= 0"):
        engine.generate(PROMPTS, 1, SP, jax.random.PRNGKey(3), episodes=_Episodes(3, step_timeout_s=-1.0))
