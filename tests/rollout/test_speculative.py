"""Speculative rollouts: drafter bookkeeping and the features the engine feeds it, greedy
equivalence (every step speculative, or plain and speculative chunks in one run), the
shipped drafter's acceptance (the sampled distribution against the exact one:
test_speculative_distribution.py)."""
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support import REPO, tiny
from tlt_jax import sampling, sharding
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer as tfm
from tlt_jax.rollout import profile
from tlt_jax.rollout import speculative as spec_lib
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.rollout.timeline import SpecChunk

CFG = tiny.config(vocab_size=40, num_layers=3)  # three layers: a fused drafter reads several
DCFG = drafter_lib.DrafterConfig(num_layers=1)
FUSED = drafter_lib.DrafterConfig(num_layers=1, feature_layers=(0, 1, 2))
PROMPTS = [[1, 2, 3, 1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]


@pytest.fixture(scope="module")
def params():
    return tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.3)


def _engine(params, dcfg=None, dparams=None, num_slots=4, **rollout):
    rollout = {"max_length": 32, "steps_per_sync": 4, "max_draft_depth": 4, **rollout}
    return tiny.engine(CFG, params, num_slots, drafter_config=dcfg, drafter_params=dparams, **rollout)


def test_drafter_bookkeeping_matches_teacher_forced_forward(params):
    """Prefill, appends of varying counts and catch-ups leave the drafter predicting
    exactly what a teacher-forced pass over the whole sequence predicts."""
    dparams = drafter_lib.init_drafter(CFG, DCFG, jax.random.PRNGKey(1), init_std=0.3)
    drafter = spec_lib.Drafter(CFG, DCFG)
    b, total, p = 2, 18, 5
    x = jax.random.randint(jax.random.PRNGKey(2), (b, total), 0, CFG.vocab_size)

    @jax.jit
    def teacher_forced(x):
        h = tfm.forward(params, CFG, x)
        return h, drafter_lib.forward(dparams, params, CFG, DCFG, x[:, 1:], h[:, :-1])  # entry t: (x_{t+1}, h_t)

    # Each step jitted, as the engine runs it (run op by op, each of their operations
    # compiles a program of its own: 2.3x the CPU from an empty compilation cache).
    prefill_rows, append, catch_up = map(jax.jit, (drafter.prefill_rows, drafter.append, drafter.catch_up))
    h, g = jax.device_get(teacher_forced(x))
    x = np.asarray(x)
    state = drafter.init_state(b, 32, capacity=4)
    lengths = np.array([p, p - 2], np.int32)
    tokens = np.stack([np.where(np.arange(p) < n - 1, x[i, 1:p + 1], x[i, n]) for i, n in enumerate(lengths)])
    state = prefill_rows(dparams, params, state, np.arange(b, dtype=np.int32), tokens, h[:, :p], lengths)
    committed = lengths  # target length + 1 = entries the drafter has seen or holds pending
    for count in ([3, 1], [1, 4], [2, 2]):
        count = np.asarray(count, np.int32)
        at = committed[:, None] + np.arange(4)[None]
        state = append(dparams, params, state, np.take_along_axis(x, at + 1, 1),
                       np.take_along_axis(h, at[..., None], 1), count)
        committed = committed + count
        state, _, g_last = catch_up(dparams, params, state)
        np.testing.assert_array_equal(state.cache.lengths, committed)
        np.testing.assert_allclose(g_last, g[np.arange(b), committed - 1], atol=2e-5, rtol=2e-5)


def _target_pass(params, dparams, dcfg, x_BS):
    """The target forward over right-padded rows: (drafter features f_t [B, S, D], greedy
    next token after each position [B, S])."""
    out = tfm.forward(params, CFG, x_BS, layer_ids=dcfg.feature_layers)
    h, layers = out if dcfg.feature_layers else (out, None)
    return (drafter_lib.target_features(dparams, dcfg, h, layers),
            jnp.argmax(tfm.logits_from_hidden(params, CFG, h), axis=-1))


def _sequences(state, prompts, width):
    """Each slot's prompt and generated tokens, right-padded to width: (x [B, width], lengths)."""
    out, n = jax.device_get((state.out_tokens, state.num_generated))
    x = np.zeros((len(prompts), width), np.int32)
    for b, prompt in enumerate(prompts):
        x[b, :len(prompt) + n[b]] = np.concatenate([prompt, out[b, :n[b]]])
    return x, np.asarray([len(p) for p in prompts]) + n


def _check_pending_entries(state, prompts, target_pass, width):
    """Every slot's pending drafter entries are (x_{t+1}, f_t) of its sequence x (prompt
    and generated tokens) with f the target forward's features, and the drafter's cache
    plus its pending entries cover the target's cache. Returns the entries checked."""
    x, lengths = _sequences(state, prompts, width)
    f = np.asarray(target_pass(x)[0])
    st = jax.device_get(state)
    drafter = st.spec.drafter
    checked = 0
    for b in range(len(prompts)):
        start, count = int(drafter.cache.lengths[b]), int(drafter.pending_count[b])
        assert start + count == st.cache.lengths[b] == lengths[b] - 1, b
        t = start + np.arange(count)
        np.testing.assert_array_equal(drafter.pending_tokens[b, :count], x[b, t + 1], err_msg=f"slot {b}")
        np.testing.assert_allclose(drafter.pending_features[b, :count], f[b, t], atol=1e-4, err_msg=f"slot {b}")
        checked += count
    return checked


@pytest.mark.parametrize("dcfg", [DCFG, FUSED], ids=["final", "fused"])
def test_engine_feeds_the_drafter_the_target_features(params, dcfg):
    """The feature the engine hands the drafter with each committed token is the target
    forward's at the position that predicted it: after prefill, after plain steps, and
    after verifying a tree whose accepted path skips a rejected sibling (the features
    come from the accepted nodes, not from the first nodes of the tree)."""
    sp = sampling.SamplingParams(temperature=0.0, max_tokens=20)
    dparams = drafter_lib.init_drafter(CFG, dcfg, jax.random.PRNGKey(4), init_std=0.3)
    engine = _engine(params, dcfg, dparams, time_spec_phases=True)
    group, width = engine.groups[0], engine.rollout_config.max_length
    target_pass = jax.jit(functools.partial(_target_pass, params, dparams, dcfg))
    r, key = len(PROMPTS), jax.random.PRNGKey(3)
    padded = np.zeros((r, 6), np.int32)
    for i, prompt in enumerate(PROMPTS):
        padded[i, :len(prompt)] = prompt
    ids = np.arange(r, dtype=np.int32)
    state = group.insert(group.empty_state(sp, speculative=True), padded,
                         np.asarray([len(p) for p in PROMPTS], np.int32), ids, ids, ids, key, sp)
    prompts = [np.asarray(p, np.int32) for p in PROMPTS]
    _check_pending_entries(state, prompts, target_pass, width)
    # Root, a wrong first child, then the greedy continuation three deep under the root's
    # second child: nodes 0 2 3 4 emit, node 1 is rejected.
    parents = np.asarray([[-1, 0, 0, 2, 3]] * r, np.int32)
    from_verify = 0
    for _ in range(2):
        state = group.run_chunk(state, key, False, None, sp)[0]  # 4 plain steps
        _check_pending_entries(state, prompts, target_pass, width)
        x, lengths = _sequences(state, prompts, width)
        rows = np.arange(r)
        tokens = np.zeros((r, 5), np.int32)
        tokens[:, 0] = x[rows, lengths - 1]
        for node in (2, 3, 4):  # the greedy continuation
            x[rows, lengths] = tokens[:, node] = np.asarray(target_pass(x)[1])[rows, lengths - 1]
            lengths = lengths + 1
        tokens[:, 1] = (tokens[:, 2] + 1) % CFG.vocab_size
        state, kept = group.spec_verify(state, spec_lib.DraftTree(jnp.asarray(tokens), jnp.asarray(parents), None),
                                        key, sp)
        assert (np.asarray(kept) == 4).any()  # three drafts accepted, one token sampled after them
        from_verify += _check_pending_entries(state, prompts, target_pass, width)
    assert from_verify >= 8
    # Every token is still the greedy one.
    x, lengths = _sequences(state, prompts, width)
    greedy = np.asarray(target_pass(x)[1])
    for b, prompt in enumerate(prompts):
        np.testing.assert_array_equal(x[b, len(prompt):lengths[b]], greedy[b, len(prompt) - 1:lengths[b] - 1])


ASSETS = os.path.join(REPO, "assets")


def test_trained_drafter_reaches_its_acceptance_through_the_engine():
    """The shipped drafter, trained to match the shipped SFT target, drafts 4-deep chains
    through the engine at temperature 1 with the acceptance length it was measured at
    (3.6 on these 8 held-out prompts x 2; docs/benchmarks.md: ~4 on 32): the features
    the engine feeds it at every step are the ones it was trained on."""
    from configs.common import tasks_tiny
    from tlt_jax import evaluation
    from tlt_jax.data import tasks
    from tlt_jax.drafter_training.io import load_drafter
    from tlt_jax.models.hf_io import load_hf
    from tlt_jax.tokenizer import load_tokenizer

    target = os.path.join(ASSETS, "sft_tiny")
    cfg, target_params = load_hf(target)
    dcfg, dparams = load_drafter(os.path.join(ASSETS, "drafter_tiny"), cfg)
    examples = tasks.make_split(tasks.from_spec(tasks_tiny().to_dict()), "eval", 8, seed=2, unique=True)
    prompts = evaluation.encode_prompts(load_tokenizer(target), examples)
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    rc = RolloutConfig(num_slots=16, max_prompt_length=24, max_length=64, eos_token_id=cfg.eos_token_id,
                       max_draft_depth=4)
    out = RolloutEngine(cfg, target_params, mesh, rc, dcfg, dparams).generate(
        prompts, 2, sampling.SamplingParams(temperature=1.0, max_tokens=40), jax.random.PRNGKey(0),
        speculation=spec_lib.FixedSpeculation(spec_lib.Strategy("eagle", depth=4), max_active=16))
    assert out.timeline.summary()["acceptance_length"] > 3.0


STRATEGIES = [spec_lib.Strategy("eagle", depth=3), spec_lib.Strategy("eagle", depth=3, topk=2, num_nodes=6),
              spec_lib.Strategy("ngram", depth=3, topk=2)]


@pytest.fixture(scope="module")
def plain_greedy(params):
    """Plain greedy decode of PROMPTS, 2 samples each: what both drafters' runs must match."""
    sp = sampling.SamplingParams(temperature=0.0, max_tokens=20)
    return _engine(params).generate(PROMPTS, 2, sp, jax.random.PRNGKey(3))


@pytest.mark.parametrize("dcfg", [DCFG, FUSED], ids=["final", "fused"])
def test_greedy_speculation_equals_plain_greedy(params, plain_greedy, dcfg):
    sp = sampling.SamplingParams(temperature=0.0, max_tokens=20)
    plain = plain_greedy
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
    warm.warm_up(sp, speculation, strategies=True)
    spec = warm.generate(PROMPTS, 2, sp, jax.random.PRNGKey(3), speculation=speculation)
    chunks = [c for c in spec.timeline.groups[0].chunks if isinstance(c, SpecChunk)]
    assert [tokens for _, tokens, _ in speculation.heard] == [sum(c.tokens_per_step) for c in chunks] != []


def test_coupled_speculation_draws_the_plain_samples(params):
    """Coupled verification (`RolloutConfig.spec_coupled`) at temperature 1 with top-k:
    EAGLE chains and n-gram tries (branching), every chunk speculative, return token for
    token the samples plain decode draws with the same key, while accepting drafts (the
    chain from a drafter that draws with the target's keys: most of them)."""
    sp = sampling.SamplingParams(temperature=1.0, top_k=8, max_tokens=16)
    plain = _engine(params).generate(PROMPTS, 2, sp, jax.random.PRNGKey(8))
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    rc = RolloutConfig(num_slots=4, max_prompt_length=6, max_length=32, steps_per_sync=4, eos_token_id=0,
                       max_draft_depth=4, spec_coupled=True)
    engine = RolloutEngine(CFG, params, mesh, rc, *_mimic_drafter(params, CFG))
    for strategy, least_acceptance in ((STRATEGIES[0], 1.4), (STRATEGIES[2], 1.0)):
        spec = engine.generate(PROMPTS, 2, sp, jax.random.PRNGKey(8), speculation=_Recording(strategy))
        for a, b in zip(plain.tokens, spec.tokens):
            np.testing.assert_array_equal(a, b, err_msg=strategy.name)
        np.testing.assert_allclose(np.concatenate(plain.logprobs), np.concatenate(spec.logprobs), atol=1e-5)
        summary = spec.timeline.summary()
        assert summary["speculative_steps"] > 0 and summary["acceptance_length"] > least_acceptance, (
            strategy.name, summary["acceptance_length"])


def test_speculative_steps_stop_on_every_end_token(params):
    """Two end tokens, each the end of some greedy answer: a speculative step that accepts
    either of them, wherever it falls among the tokens committed at once, ends the answer
    there with finish reason "eos", as plain decode does (n-gram drafts and EAGLE chains)."""
    sp = sampling.SamplingParams(temperature=0.0, max_tokens=20)
    free = _engine(params, eos_token_id=None).generate(PROMPTS, 1, sp, jax.random.PRNGKey(3))
    ends = (int(free.tokens[0][4]), int(free.tokens[2][4]))
    cut = [full[:np.flatnonzero(np.isin(full, ends))[0] + 1] if np.isin(full, ends).any() else full
           for full in free.tokens]
    assert {int(c[-1]) for c in cut} >= set(ends)  # each end token ends some answer
    plain = _engine(params, eos_token_id=ends).generate(PROMPTS, 1, sp, jax.random.PRNGKey(3))
    dparams = drafter_lib.init_drafter(CFG, DCFG, jax.random.PRNGKey(4), init_std=0.3)
    engine = _engine(params, DCFG, dparams, eos_token_id=ends)
    for r in [plain] + [engine.generate(PROMPTS, 1, sp, jax.random.PRNGKey(3), speculation=_Recording(strategy))
                        for strategy in (STRATEGIES[0], STRATEGIES[2])]:
        for expected, tokens in zip(cut, r.tokens):
            np.testing.assert_array_equal(tokens, expected)
        assert r.finish_reason == ["eos" if c[-1] in ends else "max_tokens" for c in cut]
        assert r is plain or r.timeline.summary()["speculative_steps"] > 0


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


# Eight prompts, greedy, whose stop tokens end the answers at staggered lengths.
STAGGERED_PROMPTS = PROMPTS + [[11, 12], [13], [14, 15, 16], [17, 18, 19, 20]]
STAGGERED_GREEDY = sampling.SamplingParams(temperature=0.0, max_tokens=20, stop_tokens=(18, 29))


def test_speculation_starts_as_soon_as_the_batch_drains(params):
    """A plain chunk stops once the active count falls to the policy's threshold, so the
    next chunk speculates at once (not up to steps_per_sync steps later)."""
    # The engine, prompts and sampling parameters of the unbucketed runs of
    # test_attention_buckets_keep_every_token (the same programs, compiled once): stop
    # tokens stagger the ends (answers of 1, 2, 3, 7, 10, 10, 14 and 20 tokens), so the
    # active count falls from 4 to 2 at the first step of the third plain chunk.
    dparams = drafter_lib.init_drafter(CFG, DCFG, jax.random.PRNGKey(4), init_std=0.3)
    engine = _engine(params, DCFG, dparams, num_slots=8, kv_bucket=0)
    policy = spec_lib.FixedSpeculation(STRATEGIES[2], max_active=3)
    out = engine.generate(STAGGERED_PROMPTS, 1, STAGGERED_GREEDY, jax.random.PRNGKey(3), speculation=policy)
    chunks = out.timeline.groups[0].chunks
    plain = [c for c in chunks if not isinstance(c, SpecChunk)]
    assert plain and all(a > 3 for c in plain for a in c.active_per_step)
    assert any(isinstance(c, SpecChunk) for c in chunks)


@dataclasses.dataclass(frozen=True)
class _Band:
    """Speculates while lo < active <= hi, with fixed thresholds: plain decode while the
    batch is full, speculation as it drains, plain decode again below the band."""

    strategy: spec_lib.Strategy
    lo: int
    hi: int

    @property
    def strategies(self):
        return (self.strategy,)

    def strategy_for(self, num_active):
        return self.strategy if self.lo < num_active <= self.hi else None

    def chunk_floor(self, num_active):
        return self.hi + 1 if num_active > self.hi else self.lo + 1 if num_active > self.lo else 0

    def observe(self, strategy, num_active, tokens, seconds):
        del strategy, num_active, tokens, seconds


def _modes(rollouts):
    """The run's chunks as a string, one letter per change of mode: P plain, S speculative."""
    kinds = ["S" if isinstance(c, SpecChunk) else "P" for g in rollouts.timeline.groups for c in g.chunks]
    return "".join(k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1])


def test_switching_between_plain_and_speculative_mid_run_keeps_greedy_tokens(params):
    """One generate that decodes plainly, then speculatively, then plainly again (a fixed
    band of active counts; stop tokens stagger the ends, one prompt ends at its first
    token) gives the all-plain greedy tokens."""
    prompts, sp = STAGGERED_PROMPTS, STAGGERED_GREEDY
    plain = _engine(params, num_slots=8).generate(prompts, 1, sp, jax.random.PRNGKey(3))
    assert sorted(plain.lengths.tolist()) == [1, 2, 3, 7, 10, 10, 14, 20]
    dparams = drafter_lib.init_drafter(CFG, DCFG, jax.random.PRNGKey(4), init_std=0.3)
    mixed = _engine(params, DCFG, dparams, num_slots=8).generate(prompts, 1, sp, jax.random.PRNGKey(3),
                                                                 speculation=_Band(STRATEGIES[1], lo=2, hi=5))
    assert _modes(mixed) == "PSP"
    for a, b in zip(plain.tokens, mixed.tokens):
        np.testing.assert_array_equal(a, b)
    assert plain.finish_reason == mixed.finish_reason
    np.testing.assert_allclose(np.concatenate(plain.logprobs), np.concatenate(mixed.logprobs), atol=1e-5)


def test_attention_buckets_keep_every_token(params):
    """Chunks whose attention reads only the cache slots their sequences reach (buckets of
    4, 8, 16 and 32 slots) give the tokens of chunks that read all 32: plain and each
    speculative strategy greedy, plain and an EAGLE chain sampled."""
    prompts, greedy = STAGGERED_PROMPTS, STAGGERED_GREEDY
    dparams = drafter_lib.init_drafter(CFG, DCFG, jax.random.PRNGKey(4), init_std=0.3)
    sampled = sampling.SamplingParams(temperature=1.0, max_tokens=20)
    # At max_length 32 the unbucketed engine's chunks are the bucketed engine's widest (the
    # same programs, compiled once); each engine runs every case.
    engines = {bucket: _engine(params, DCFG, dparams, num_slots=8, max_length=32, kv_bucket=bucket)
               for bucket in (0, 4)}
    read = {bucket: _record_buckets(engine.groups[0]) for bucket, engine in engines.items()}
    for sp, strategies in ((greedy, STRATEGIES), (sampled, STRATEGIES[:1])):
        for strategy in strategies:
            speculation = _Band(strategy, lo=0, hi=5)  # plain while more than 5 run, then speculative
            runs = {}
            for bucket, engine in engines.items():
                read[bucket].clear()
                runs[bucket] = engine.generate(prompts, 1, sp, jax.random.PRNGKey(3), speculation=speculation)
                assert read[bucket] == {32} if bucket == 0 else len(read[bucket]) >= 2 and min(read[bucket]) <= 16, (
                    strategy.name, read[bucket])
            assert _modes(runs[4]) == "PS", strategy.name
            for a, b in zip(runs[0].tokens, runs[4].tokens):
                np.testing.assert_array_equal(a, b, err_msg=strategy.name)
            assert runs[0].finish_reason == runs[4].finish_reason
            np.testing.assert_allclose(np.concatenate(runs[0].logprobs), np.concatenate(runs[4].logprobs), atol=1e-5)


def _record_buckets(group):
    """Records in the returned set the cache slots each chunk the group runs reads."""
    read, run_chunk = set(), group.run_chunk

    def recorded(state, key, refill_wanted, strategy, sp, floor=0, attended=None):
        read.add(attended)
        return run_chunk(state, key, refill_wanted, strategy, sp, floor, attended)

    group.run_chunk = recorded
    return read


def test_a_chunk_stops_where_its_bucket_is_full(params):
    """The attention bucket holds one step's reach past the longest sequence, not a whole
    chunk's: the chunk runs speculative steps while the next one fits, then stops, so no
    step reads or writes a slot past the bucket (the token equality above is what that
    keeps)."""
    dparams = drafter_lib.init_drafter(CFG, DCFG, jax.random.PRNGKey(4), init_std=0.3)
    engine = _engine(params, DCFG, dparams, num_slots=4, max_length=32, eos_token_id=None, kv_bucket=8)
    group, strategy = engine.groups[0], STRATEGIES[0]
    sp = sampling.SamplingParams(temperature=0.0, max_tokens=24)
    key = jax.random.PRNGKey(3)
    state = profile.filled_state(group, PROMPTS, key, sp)
    lengths, active = jax.device_get((state.cache.lengths, state.active))
    attended = group.kv_bucket_for(lengths, active, strategy, True)
    reach = engine.rollout_config.step_reach(strategy, True)
    assert max(lengths) + reach <= attended < max(lengths) + engine.rollout_config.spec_steps_per_sync * reach
    state, steps = group.run_chunk(state, key, False, strategy, sp, 0, attended)[:2]
    lengths, active, steps = jax.device_get((state.cache.lengths, state.active, steps))
    assert active.all() and 1 <= steps < engine.rollout_config.spec_steps_per_sync
    assert max(lengths) <= attended < max(lengths) + reach


def _mimic_drafter(params, config):
    """A drafter that runs the target's own layers on the token embeddings (fc passes the
    embedding and drops the feature): the target's prediction without the first prompt
    token in view, so its drafts are often, not always, what the target would sample."""
    d = config.hidden_size
    return (drafter_lib.DrafterConfig(num_layers=config.num_layers),
            {"fc": np.concatenate([np.eye(d, dtype=np.float32), np.zeros((d, d), np.float32)]),
             "layers": params["layers"]})


def test_strategy_names_round_trip():
    for strategy in STRATEGIES + [spec_lib.Strategy("eagle", depth=6)]:
        assert spec_lib.Strategy.from_name(strategy.name) == strategy
    assert spec_lib.Strategy.from_name("history-d6-b3") == spec_lib.Strategy("history", depth=6, topk=3)
    for bad in ("eagle", "eagle-x4", "beam-d4", "eagle-d4-q2", "ngram-d4-k2", "eagle-d4-b2", "history-d4-k2"):
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
        np.testing.assert_array_equal(jax.jit(spec_lib.ancestors)(jnp.asarray(parents, jnp.int32)), expected)


class _TableDrafter(spec_lib.Drafter):
    """A drafter whose next-token logits depend only on the token fed: a fixed table."""

    def _decode(self, drafter_params, target_params, cache, tokens, features, positions, mask=None,
                return_logits=True):
        return drafter_params[tokens], features, cache


def _eagle2_by_hand(root_logits, table, k, depth, t):
    """EAGLE-2 in plain Python for one sequence: level 1 the top k of the root's logits; each
    further level the top k children of each of the k best nodes of the level before;
    the t - 1 best candidates of all levels (by cumulative log-prob), in level order, under
    the root. Returns (tokens, parents) of the tree."""
    log_softmax = lambda x: x - np.log(np.exp(x - x.max()).sum()) - x.max()
    top = lambda x: list(np.argsort(-x, kind="stable")[:k])
    root = log_softmax(root_logits)
    cands = [(int(v), float(root[v]), -1) for v in top(root)]  # (token, score, parent candidate)
    level = list(range(k))
    for _ in range(1, depth):
        new = []
        for parent in level:
            lp = log_softmax(table[cands[parent][0]])
            new += [(int(v), cands[parent][1] + float(lp[v]), parent) for v in top(lp)]
        start = len(cands)
        cands += new
        level = [start + i for i in top(np.array([score for _, score, _ in new]))]
    chosen = sorted(np.argsort([-score for _, score, _ in cands], kind="stable")[:t - 1])
    node = {c: i + 1 for i, c in enumerate(chosen)}
    return [cands[c][0] for c in chosen], [node.get(cands[c][2], 0) for c in chosen]


def test_tree_strategy_drafts_the_eagle2_tree():
    """`eagle-d4-k3-t8` on a drafter given by a table: the nodes and parents of an EAGLE-2
    expansion done by hand, for each sequence of a batch."""
    v, b = 12, 3
    strategy = spec_lib.Strategy.from_name("eagle-d4-k3-t8")
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(v, v)) * 2.0, jnp.float32)
    root_logits = jnp.asarray(rng.normal(size=(b, v)) * 2.0, jnp.float32)
    drafter = _TableDrafter(CFG.replace(vocab_size=v), drafter_lib.DrafterConfig(num_layers=1))
    cache = tfm.KVCache(jnp.zeros((1, b, 1, 1, 1)), jnp.zeros((1, b, 1, 1, 1)), jnp.zeros((b,), jnp.int32))
    root = jnp.array([5, 6, 7], jnp.int32)
    # Jitted, as the engine runs it (op by op, each of its operations compiles a program of its own).
    tree = jax.jit(functools.partial(drafter._tree, strategy=strategy))(table, None, cache, root, root_logits,
                                                                       jnp.zeros((b, 4)))
    assert tree.tokens.shape == tree.parents.shape == (b, strategy.num_nodes)
    for i in range(b):
        tokens, parents = _eagle2_by_hand(np.asarray(root_logits[i]), np.asarray(table), strategy.topk,
                                          strategy.depth, strategy.num_nodes)
        np.testing.assert_array_equal(tree.tokens[i], [int(root[i])] + tokens)
        np.testing.assert_array_equal(tree.parents[i], [-1] + parents)
        assert max(parents) > 0  # nodes below the first level
