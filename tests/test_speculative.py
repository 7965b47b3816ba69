"""Speculative rollouts: drafter bookkeeping, greedy equivalence, and the sampled
distribution against the exact one on a tiny model."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax import sampling, sharding
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig
from tlt_jax.rollout import speculative as spec_lib
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.rollout.timeline import SpecChunk

CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8)
DCFG = drafter_lib.DrafterConfig(num_layers=1)
FUSED = drafter_lib.DrafterConfig(num_layers=1, feature_layers=(0, 1, 2))
PROMPTS = [[1, 2, 3, 1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]


@pytest.fixture(scope="module")
def params():
    return tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.3)


def _engine(params, dcfg=None, dparams=None, num_slots=4, max_length=32, time_spec_phases=False):
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    rc = RolloutConfig(num_slots=num_slots, max_prompt_length=6, max_length=max_length, steps_per_sync=4,
                       eos_token_id=0, max_draft_depth=4, time_spec_phases=time_spec_phases)
    return RolloutEngine(CFG, params, mesh, rc, dcfg, dparams)


def test_drafter_bookkeeping_matches_teacher_forced_forward(params):
    """Prefill, appends of varying counts and catch-ups leave the drafter predicting
    exactly what a teacher-forced pass over the whole sequence predicts."""
    dparams = drafter_lib.init_drafter(CFG, DCFG, jax.random.PRNGKey(1), init_std=0.3)
    drafter = spec_lib.Drafter(CFG, DCFG)
    b, total, p = 2, 18, 5
    x = jax.random.randint(jax.random.PRNGKey(2), (b, total), 0, CFG.vocab_size)
    h = tfm.forward(params, CFG, x)
    g = drafter_lib.forward(dparams, params, CFG, DCFG, x[:, 1:], h[:, :-1])  # entry t: (x_{t+1}, h_t)
    state = drafter.init_state(b, 32, capacity=4)
    lengths = jnp.array([p, p - 2])
    tokens = jnp.stack([jnp.where(jnp.arange(p) < n - 1, x[i, 1:p + 1], x[i, n]) for i, n in enumerate(lengths)])
    state = drafter.prefill_rows(dparams, params, state, jnp.arange(b), tokens, h[:, :p], lengths)
    committed = np.asarray(lengths)  # target length + 1 = entries the drafter has seen or holds pending
    for count in ([3, 1], [1, 4], [2, 2]):
        count = jnp.asarray(count)
        at = committed[:, None] + np.arange(4)[None]
        state = drafter.append(dparams, params, state, jnp.take_along_axis(x, jnp.asarray(at + 1), 1),
                               jnp.take_along_axis(h, jnp.asarray(at)[..., None], 1), count)
        committed = committed + np.asarray(count)
        state, _, g_last = drafter.catch_up(dparams, params, state)
        np.testing.assert_array_equal(state.cache.lengths, committed)
        np.testing.assert_allclose(g_last, g[np.arange(b), committed - 1], atol=2e-5, rtol=2e-5)


STRATEGIES = [spec_lib.Strategy("eagle", depth=3), spec_lib.Strategy("eagle", depth=3, topk=2, num_nodes=6),
              spec_lib.Strategy("ngram", depth=3, topk=2)]


@pytest.mark.parametrize("dcfg", [DCFG, FUSED], ids=["final", "fused"])
def test_greedy_speculation_equals_plain_greedy(params, dcfg):
    sp = sampling.SamplingParams(temperature=0.0, max_tokens=20)
    plain = _engine(params).generate(PROMPTS, 2, sp, jax.random.PRNGKey(3))
    dparams = drafter_lib.init_drafter(CFG, dcfg, jax.random.PRNGKey(4), init_std=0.3)
    # The fused drafter runs each step as two timed device calls, the other in device loops.
    engine = _engine(params, dcfg, dparams, time_spec_phases=dcfg is FUSED)
    for strategy in STRATEGIES:
        speculation = _Recording(strategy)
        spec = engine.generate(PROMPTS, 2, sp, jax.random.PRNGKey(3), speculation=speculation)
        for a, b in zip(plain.tokens, spec.tokens):
            np.testing.assert_array_equal(a, b, err_msg=strategy.name)
        assert plain.finish_reason == spec.finish_reason
        summary = spec.timeline.summary()
        assert summary["speculative_steps"] > 0 and summary["acceptance_length"] > 1, strategy.name
        assert (summary["draft_s"] > 0) == (dcfg is FUSED)
        # The policy hears every speculative chunk but the first, whose time includes the compile.
        chunks = [c for c in spec.timeline.groups[0].chunks if isinstance(c, SpecChunk)]
        assert [tokens for _, tokens, _ in speculation.heard] == [sum(c.tokens_per_step) for c in chunks[1:]]
        assert all(s == strategy and seconds > 0 for s, _, seconds in speculation.heard)
    # Once warmed up, the policy hears every chunk from the first: none compiles any more.
    speculation = _Recording(STRATEGIES[0])
    warm = _engine(params, dcfg, dparams, time_spec_phases=dcfg is FUSED)
    warm.warm_up(sp, speculation)
    spec = warm.generate(PROMPTS, 2, sp, jax.random.PRNGKey(3), speculation=speculation)
    chunks = [c for c in spec.timeline.groups[0].chunks if isinstance(c, SpecChunk)]
    assert [tokens for _, tokens, _ in speculation.heard] == [sum(c.tokens_per_step) for c in chunks] != []


@dataclasses.dataclass
class _Recording:
    """A fixed strategy that records what the engine reports back."""

    strategy: spec_lib.Strategy
    heard: list = dataclasses.field(default_factory=list)

    @property
    def strategies(self):
        return (self.strategy,)

    def strategy_for(self, num_active):
        return self.strategy

    def chunk_floor(self, num_active):
        return 0

    def observe(self, strategy, num_active, tokens, seconds):
        if strategy is not None:  # plain chunks are reported too
            self.heard.append((strategy, tokens, seconds))


SMALL = ModelConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=8)


def test_speculation_starts_as_soon_as_the_batch_drains(params):
    """A plain chunk stops once the active count falls to the policy's threshold, so the
    next chunk speculates at once (not up to steps_per_sync steps later)."""
    engine = _engine(params, num_slots=8, max_length=40)
    policy = spec_lib.FixedSpeculation(spec_lib.Strategy("ngram", depth=3, topk=1), max_active=3)
    sp = sampling.SamplingParams(temperature=1.0, max_tokens=30, stop_tokens=(5, 6, 7))  # staggered ends
    out = engine.generate(PROMPTS * 2, 1, sp, jax.random.PRNGKey(11), speculation=policy)
    chunks = out.timeline.groups[0].chunks
    plain = [c for c in chunks if not isinstance(c, SpecChunk)]
    assert plain and all(a > 3 for c in plain for a in c.active_per_step)
    assert any(isinstance(c, SpecChunk) for c in chunks)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_sampled_sequences_follow_the_target_distribution(strategy):
    """Every 3-token answer of a 6-token vocabulary, enumerated: speculative rollouts at
    temperature 1 (with a top-k filter) match the target's exact probabilities."""
    from scipy import stats

    params = tfm.init_params(SMALL, jax.random.PRNGKey(5), init_std=0.5)
    dparams = drafter_lib.init_drafter(SMALL, DCFG, jax.random.PRNGKey(6), init_std=0.5)
    sp = sampling.SamplingParams(temperature=1.0, top_k=4, max_tokens=3)
    prompt = [1, 2]
    answers = np.stack(np.meshgrid(*[np.arange(6)] * 3, indexing="ij"), -1).reshape(-1, 3)
    seqs = jnp.asarray(np.concatenate([np.tile(prompt, (len(answers), 1)), answers], 1))
    logp = sampling.processed_logprobs(tfm.logits_from_hidden(params, SMALL, tfm.forward(params, SMALL, seqs)), sp)
    exact = np.exp(np.take_along_axis(np.asarray(logp[:, 1:-1], np.float64), answers[..., None], 2)[..., 0].sum(1))
    assert abs(exact.sum() - 1) < 1e-5

    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    rc = RolloutConfig(num_slots=512, max_prompt_length=2, max_length=8, max_draft_depth=3)
    engine = RolloutEngine(SMALL, params, mesh, rc, DCFG, dparams)
    n = 20000
    out = engine.generate([prompt], n, sp, jax.random.PRNGKey(7),
                          speculation=spec_lib.FixedSpeculation(strategy, max_active=rc.num_slots))
    assert out.timeline.summary()["acceptance_length"] > 1.05  # drafts do get accepted
    index = np.stack(out.tokens) @ np.array([36, 6, 1])
    counts = np.bincount(index, minlength=len(exact))
    assert counts[exact == 0].sum() == 0  # nothing outside the top-k support
    support = exact > 0
    expected = exact[support] * n
    # Pool the rare outcomes so every cell expects at least 5 samples.
    rare = expected < 5
    observed = np.append(counts[support][~rare], counts[support][rare].sum())
    expected = np.append(expected[~rare], expected[rare].sum())
    p_value = stats.chisquare(observed, expected / expected.sum() * observed.sum()).pvalue
    assert p_value > 1e-3, p_value


def test_strategy_names_round_trip():
    for strategy in STRATEGIES + [spec_lib.Strategy("eagle", depth=6)]:
        assert spec_lib.Strategy.from_name(strategy.name) == strategy
    for bad in ("eagle", "eagle-x4", "beam-d4", "eagle-d4-q2", "ngram-d4-k2", "eagle-d4-b2"):
        with pytest.raises(ValueError, match="Cannot read strategy"):
            spec_lib.Strategy.from_name(bad)


def test_ancestors_match_walking_up_the_parents():
    rng = np.random.default_rng(0)
    for t in (1, 2, 5, 12, 33):
        parents = np.full((8, t), -1)
        for row in parents:
            for i in range(1, t):  # some nodes are padding (-1); children may hang under them
                row[i] = -1 if rng.random() < 0.15 else rng.integers(0, i)
        expected = np.zeros((8, t, t), bool)
        for b, row in enumerate(parents):
            for i in range(t):
                j = i
                while j >= 0:
                    expected[b, i, j], j = True, row[j]
        np.testing.assert_array_equal(spec_lib.ancestors(jnp.asarray(parents, jnp.int32)), expected)
