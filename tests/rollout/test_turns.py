"""Multi-turn rollouts in the engine: continuation in a sample's own slot, stop sequences."""
import threading
import time

import jax
import numpy as np
import pytest

from tests.support import tiny
from tlt_jax import sampling, sharding
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer as tfm
from tlt_jax.rollout import speculative as spec_lib
from tlt_jax.rollout.engine import Rollouts

CFG = tiny.config()
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
OBSERVATIONS = ([41, 42, 43], [44, 45, 46, 47, 48, 49, 41])  # after turns 1 and 2; the episode ends after turn 3
# Turns end on a third of the vocabulary, so every sample takes its turns within the budget.
SP = sampling.SamplingParams(temperature=1.0, max_tokens=40, stop_tokens=tuple(range(30, 41)))
DCFG = drafter_lib.DrafterConfig(num_layers=1)


@pytest.fixture(scope="module")
def params(tiny_params):
    return tiny_params


def _engine(params, num_slots=4, drafter_params=None):
    return tiny.engine(CFG, params, num_slots, max_length=48, drafter_params=drafter_params,
                       drafter_config=DCFG if drafter_params is not None else None)


@pytest.fixture(scope="module")
def engine(params):
    """The 4-slot engine without a drafter, shared by the tests that need no fresh one."""
    return _engine(params)


@pytest.fixture(scope="module")
def spec_engine(params):
    """The 4-slot engine with an EAGLE drafter, shared by the speculative tests: each
    program they have in common compiles once."""
    return _engine(params, drafter_params=drafter_lib.init_drafter(CFG, DCFG, jax.random.PRNGKey(4), init_std=0.3))


# Log-probs of every position of a batch of transcripts, right-padded to the cache length
# (causal: the padding changes no earlier position's logits): one program for every check.
_forward = jax.jit(lambda p, x: jax.nn.log_softmax(tfm.logits_from_hidden(p, CFG, tfm.forward(p, CFG, x))))


class Scripted:
    """Fixed observations, the same for every request; records each turn it is handed."""

    def __init__(self, overlap=True):
        self.turns, self.lock, self.overlap = {}, threading.Lock(), overlap
        self.threads, self.spans = set(), []  # where and when each step ran

    def step(self, request, action, finish_reason):
        t0 = time.perf_counter()
        time.sleep(0.002)
        with self.lock:
            self.turns.setdefault(request, []).append((action.tolist(), finish_reason))
            turn = len(self.turns[request])
            self.threads.add(threading.current_thread().name)
            self.spans.append((t0, time.perf_counter()))
        return OBSERVATIONS[turn - 1] if turn <= len(OBSERVATIONS) else ""


def _check_against_one_prefill(params, rollouts, episodes):
    """Every model token's log-prob equals, within 1e-4 (float32), the one forward over
    the whole transcript (prompt, turns and observations) gives it; the observations sit
    where the mask says, and each turn the environment saw is the transcript's."""
    batch = np.zeros((len(rollouts), 48), np.int32)
    for i in range(len(rollouts)):
        x = PROMPTS[rollouts.prompt_index[i]] + rollouts.tokens[i].tolist()
        batch[i, :len(x)] = x
    logp_all = np.asarray(_forward(params, batch))
    turns_seen = 0
    for i in range(len(rollouts)):
        prompt, tokens, observed = PROMPTS[rollouts.prompt_index[i]], rollouts.tokens[i], rollouts.observation_mask[i]
        assert len(observed) == len(tokens) == len(rollouts.logprobs[i])
        logp = logp_all[i]
        model = np.flatnonzero(~observed)
        expected = logp[len(prompt) + model - 1, tokens[model]]
        np.testing.assert_allclose(rollouts.logprobs[i][model], expected, atol=1e-4, err_msg=f"sample {i}")
        assert (rollouts.logprobs[i][observed] == 0).all()
        # The transcript: turn, observation, turn, ...; the environment saw each turn's ids.
        turns = episodes.turns[i]
        pieces = []
        for k, (action, reason) in enumerate(turns):
            pieces.append(action)
            assert (reason, action[-1] in SP.stop_tokens) in (("stop", True), ("eos", False)) and action[-1] != 41
            if k < len(OBSERVATIONS) and k + 1 < len(turns):
                pieces.append(list(OBSERVATIONS[k]))
        assert sum(pieces, []) == tokens.tolist()
        assert observed.sum() == sum(len(o) for o in OBSERVATIONS[:len(turns) - 1])
        turns_seen += len(turns)
    return turns_seen


def test_continuation_equals_one_prefill_of_the_whole_transcript(params, engine):
    episodes = Scripted()
    rollouts = engine.generate(PROMPTS, 2, SP, jax.random.PRNGKey(3), episodes=episodes)
    assert _check_against_one_prefill(params, rollouts, episodes) >= 2 * len(rollouts)
    assert set(rollouts.finish_reason) <= {"stop", "eos"}  # the episode's end keeps the turn's reason
    # The key stream counts the model's tokens alone: the same samples on 2 slots, where
    # samples wait and continue in another order.
    again = _engine(params, num_slots=2).generate(PROMPTS, 2, SP, jax.random.PRNGKey(3), episodes=Scripted())
    for a, b in zip(rollouts.tokens, again.tokens):
        np.testing.assert_array_equal(a, b)


def test_warm_up_runs_the_multi_turn_chunks_and_serial_environments_change_no_sample(params):
    """warm_up(..., turns=True) compiles and runs the chunks of the multi-turn slot layout:
    a rollout with environments compiles no chunk and runs none for the first time. With
    env.overlap False (`Episodes.overlap`) every step runs on the group's own thread while
    no decode chunk runs, and the samples are those of the overlapped rollout, whose steps
    ran on worker threads. One engine for both: its programs compile once."""
    engine = _engine(params)
    engine.warm_up(SP, turns=True)
    group = engine.groups[0]
    warmed, has_run = group.chunk_programs(), set(group.warm_steps)
    assert has_run
    overlapped, serial = Scripted(), Scripted(overlap=False)
    a = engine.generate(PROMPTS, 2, SP, jax.random.PRNGKey(3), episodes=overlapped)
    assert group.chunk_programs() == warmed and group.warm_steps == has_run
    b = engine.generate(PROMPTS, 2, SP, jax.random.PRNGKey(3), episodes=serial)
    for x, y in zip(a.tokens, b.tokens):
        np.testing.assert_array_equal(x, y)
    assert serial.threads == {threading.current_thread().name} and len(serial.spans) >= len(b)
    assert all(name.startswith("env") for name in overlapped.threads)
    chunk_spans = [(c.start, c.end) for c in b.timeline.groups[0].chunks]
    assert not [(s, c) for s in serial.spans for c in chunk_spans if s[0] < c[1] and c[0] < s[1]]


@pytest.mark.parametrize("strategy", [spec_lib.Strategy("eagle", depth=3), spec_lib.Strategy("ngram", depth=3)],
                         ids=lambda s: s.name)
def test_continuation_under_speculation_is_lossless(params, spec_engine, strategy):
    """Speculative turns after a continuation: the drafter's entries and the n-gram
    context were extended with the observation, and what is committed is still exactly
    the target's distribution (log-probs of one prefill)."""
    episodes = Scripted()
    rollouts = spec_engine.generate(
        PROMPTS, 2, SP, jax.random.PRNGKey(3), episodes=episodes,
        speculation=spec_lib.FixedSpeculation(strategy, max_active=8))
    _check_against_one_prefill(params, rollouts, episodes)
    assert rollouts.timeline.summary()["speculative_steps"] > 0


def test_stop_sequence_of_two_tokens_cuts_speculative_tokens_past_it(engine, spec_engine):
    """A stop sequence of two tokens ends each greedy answer right after its first
    occurrence, finish reason "stop", wherever it falls among the tokens a speculative
    step commits at once (plain decode, EAGLE chains, n-gram drafts)."""
    greedy = sampling.SamplingParams(temperature=0.0, max_tokens=30)
    free = engine.generate(PROMPTS, 1, greedy, jax.random.PRNGKey(3))
    stop = tuple(int(t) for t in free.tokens[0][3:5])
    sp = sampling.SamplingParams(temperature=0.0, max_tokens=30, stop_sequences=(stop,))

    def cut(tokens):
        ends = [j for j in range(1, len(tokens)) if tuple(tokens[j - 1:j + 1].tolist()) == stop]
        return tokens[:ends[0] + 1] if ends else tokens

    expected = [cut(t) for t in free.tokens]
    assert len(expected[0]) == 5
    for strategy in (None, spec_lib.Strategy("eagle", depth=4), spec_lib.Strategy("ngram", depth=4)):
        speculation = None if strategy is None else spec_lib.FixedSpeculation(strategy, max_active=8)
        r = spec_engine.generate(PROMPTS, 1, sp, jax.random.PRNGKey(3), speculation=speculation)
        for want, got in zip(expected, r.tokens):
            np.testing.assert_array_equal(got, want, err_msg=str(strategy))
        assert r.finish_reason[0] == "stop"


def test_observation_tokens_are_context_never_actions():
    """build_batch puts observation tokens off the loss mask with advantage 0, so neither
    the GRPO loss, the ratios nor the KL read them; the model's tokens keep their advantage."""
    from tlt_jax.rl.loop import build_batch
    from tlt_jax.rollout.timeline import RolloutTimeline

    tokens = [np.asarray([5, 6, 41, 42, 7], np.int32)]
    observed = [np.asarray([False, False, True, True, False])]
    rollouts = lambda mask: Rollouts(
        np.zeros(1, np.int32), np.zeros(1, np.int32), tokens, [np.full(5, -1.0, np.float32)], ["eos"],
        np.zeros(1, np.int32), RolloutTimeline([]), mask)
    batch, _ = build_batch([[1, 2]], rollouts(observed), np.asarray([0.5]), seq_len=8, pad_id=0)
    # Position t predicts token t + 1: the prompt's 2 tokens, then the transcript.
    np.testing.assert_array_equal(batch["loss_mask"][0, :7], [False, True, True, False, False, True, False])
    np.testing.assert_array_equal(batch["advantages"][0, :7], [0, 0.5, 0.5, 0, 0, 0.5, 0])
    single, _ = build_batch([[1, 2]], rollouts(None), np.asarray([0.5]), seq_len=8, pad_id=0)
    assert single["loss_mask"][0, 1:6].all() and not single["loss_mask"][0, 0]


def test_gradient_is_unchanged_when_observation_tokens_change(params):
    """Observation tokens carry no loss: a transcript that ends in an observation (cut at
    its token budget) gives the same GRPO loss and gradient whatever the observation's
    tokens and whatever log-probs the engine put there; no later token reads them, so only
    a loss on them could tell them apart."""
    from tlt_jax.rl.learner import Learner, LearnerConfig
    from tlt_jax.rl.loop import build_batch
    from tlt_jax.rollout.timeline import RolloutTimeline

    learner = Learner(CFG, LearnerConfig(micro_batch_size=2), sharding.make_mesh({"data": 1}, jax.devices()[:1]))
    observed = [np.asarray([0, 0, 1, 1, 1, 0, 0, 1, 1], bool), np.asarray([0, 0, 0, 1, 1], bool)]

    def loss_and_grads(observation, logp_at_observations):
        tokens = [np.asarray([5, 6, 41, 42, 43, 7, 8, *observation[:2]], np.int32),
                  np.asarray([9, 10, 11, *observation[2:]], np.int32)]
        logp = [np.where(m, logp_at_observations, -1.0).astype(np.float32) for m in observed]
        rollouts = Rollouts(np.asarray([0, 0], np.int32), np.asarray([0, 1], np.int32), tokens, logp,
                            ["max_tokens"] * 2, np.zeros(2, np.int32), RolloutTimeline([]), observed)
        batch, _ = build_batch([[1, 2, 3]], rollouts, np.asarray([1.0, -1.0]), seq_len=16, pad_id=0)
        batch["old_logp"] = np.asarray(learner.logprobs(params, batch["tokens"], batch["positions"],
                                                        batch["segment_ids"])) - 0.05
        loss, _, grads = learner.loss_and_grads(params, batch)
        return float(loss), jax.device_get(grads)

    loss_a, grads_a = loss_and_grads([44, 45, 46, 47], 0.0)
    loss_b, grads_b = loss_and_grads([12, 3, 49, 20], -3.0)
    assert loss_a == loss_b
    jax.tree.map(np.testing.assert_array_equal, grads_a, grads_b)
    assert any(np.abs(g).max() > 0 for g in jax.tree.leaves(grads_a))
