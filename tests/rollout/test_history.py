"""History drafts: the per-prompt store (layout, eviction by step, the memory bound,
repeats kept once), the n-gram matcher searching it (after the row and its siblings,
never across a separator, a tree from several matches, agreement with the reference),
the engine's history arm (greedy answers unchanged, drafts from the store, the store
filled by each generate, compiled by warm_up) and its bad input. Its losslessness at
temperature 1 is `test_speculative`'s exact-distribution case history-d4-b2."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.rollout.test_ngram import _check_tree, _paths, _reference
from tests.rollout.test_speculative import PROMPTS, _engine, _Recording
from tlt_jax import sampling
from tlt_jax.models import transformer as tfm
from tlt_jax.rollout import speculative as spec_lib
from tlt_jax.rollout import tuner as tuner_lib
from tlt_jax.rollout.history import HistoryStore
from tlt_jax.rollout.ngram import NgramConfig, propose
from tlt_jax.rollout.timeline import SpecChunk


def _propose(rows, group, history_rows, config, width=None):
    width = width or max(len(r) for r in rows) + 1
    context = np.full((len(rows), width), -7, np.int32)
    for b, r in enumerate(rows):
        context[b, :len(r)] = r
    tokens, parents = propose(jnp.asarray(context), jnp.asarray([len(r) for r in rows], jnp.int32),
                              jnp.asarray(group, jnp.int32), config, jnp.asarray(history_rows, jnp.int32))
    return np.asarray(tokens), np.asarray(parents)


def _segments(row):
    """The -1-separated pieces of a history row."""
    pieces, piece = [], []
    for t in row.tolist():
        if t < 0:
            if piece:
                pieces.append(piece)
            piece = []
        else:
            piece.append(t)
    return pieces


# -- the store


def test_row_holds_lead_and_completions_oldest_first():
    store = HistoryStore(max_tokens=16, keep_steps=4, lead_tokens=2)
    prompt = [7, 8, 9]
    assert (store.row(prompt) == -1).all() and store.row(prompt).shape == (16,)
    store.add(prompt, [[1, 2, 3], [], [4, 5]])
    np.testing.assert_array_equal(store.row(prompt), [8, 9, 1, 2, 3, -1, 8, 9, 4, 5, -1, -1, -1, -1, -1, -1])
    assert (store.row([7, 8]) == -1).all()  # another prompt (a prefix) shares nothing
    assert store.rows([prompt, [1]]).shape == (2, 16)


def test_eviction_by_step():
    store = HistoryStore(max_tokens=64, keep_steps=2)
    for step in range(4):
        store.begin_step(step)
        store.add([1], [[10 + step]])
        store.add([step + 100], [[5]])  # a prompt seen once
    assert [s[-1] for s in _segments(store.row([1]))] == [12, 13]
    assert store.num_prompts == 3  # [1], [102], [103]; [100] and [101] left with their steps
    store.begin_step(5)
    assert store.num_prompts == 0 and store.num_tokens == 0 and (store.row([1]) == -1).all()


def test_memory_bound_per_prompt_keeps_the_newest():
    store = HistoryStore(max_tokens=12, keep_steps=100, lead_tokens=1)
    rng = np.random.default_rng(0)
    for step in range(20):
        store.begin_step(step)
        for prompt in ([1, 2], [3]):
            store.add(prompt, [rng.integers(0, 50, rng.integers(1, 9)).tolist() for _ in range(3)])
            assert sum(len(s) + 1 for s in _segments(store.row(prompt))) <= 12
    assert store.num_tokens <= 2 * 12
    # The newest completion is last; a completion beyond the budget keeps its head.
    store.add([1, 2], [[9, 8, 7]])
    assert _segments(store.row([1, 2]))[-1] == [2, 9, 8, 7]
    store.add([1, 2], [list(range(30))])
    assert _segments(store.row([1, 2])) == [[2] + list(range(10))]


def test_a_repeated_completion_is_kept_once_as_its_newest():
    store = HistoryStore(max_tokens=32, keep_steps=2, lead_tokens=0)
    store.add([1], [[5, 6], [7], [5, 6]])
    assert _segments(store.row([1])) == [[7], [5, 6]]
    store.begin_step(1)
    store.add([1], [[7]])
    store.begin_step(2)  # the step-0 copy of [7] would have gone; the step-1 copy stays
    assert _segments(store.row([1])) == [[7]]


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="max_tokens"):
        HistoryStore(max_tokens=3, lead_tokens=2)
    with pytest.raises(ValueError, match="keep_steps"):
        HistoryStore(keep_steps=0)
    with pytest.raises(ValueError, match="non-negative"):
        HistoryStore().add([1], [[3, -1]])


# -- the matcher on history rows


def test_history_continues_where_the_siblings_have_no_text_yet():
    # Both samples of the prompt just started; an earlier completion knows what follows "5".
    store = HistoryStore(max_tokens=16, lead_tokens=2)
    store.add([1, 2], [[5, 6, 7, 8, 9]])
    rows = [[1, 2, 5], [1, 2, 4]]
    config = NgramConfig(depth=4)
    tokens, parents = _propose(rows, [0, 0], store.rows([[1, 2]] * 2), config)
    np.testing.assert_array_equal(tokens[0], [5, 6, 7, 8, 9])
    np.testing.assert_array_equal(parents[0], [-1, 0, 1, 2, 3])
    # Without the history row nothing follows.
    tokens, parents = _propose(rows, [0, 0], np.full((2, 16), -1), config)
    assert (parents == -1).all()


def test_history_ranks_after_the_row_and_its_siblings():
    history = [[3, 9, 9, -1, -1, -1]] * 2
    config = NgramConfig(max_ngram=1, depth=2, branches=1)
    own = _propose([[3, 4, 4, 3], [8]], [0, 0], history, config)[0]
    np.testing.assert_array_equal(own[0], [3, 4, 4])
    sibling = _propose([[2, 3], [3, 5, 5]], [0, 0], history, config)[0]
    np.testing.assert_array_equal(sibling[0], [3, 5, 5])
    # A longer match in history beats a shorter one in the row.
    longer = _propose([[2, 7, 3], [7, 3, 5, 5]], [0, 0], [[2, 7, 3, 9, 9, -1]] * 2,
                      NgramConfig(max_ngram=3, depth=2))[0]
    np.testing.assert_array_equal(longer[0], [3, 9, 9])


def test_separators_stop_matches_and_continuations():
    # "4 5" spans a separator only: no 2-gram match; the unigram "5" is followed by 6 then -1.
    history = [[9, 4, -1, 5, 6, -1, 1, 1]]
    tokens, parents = _propose([[4, 5]], [0], history, NgramConfig(max_ngram=2, depth=3))
    assert _paths(tokens[0], parents[0]) == {(6,)}
    # A site whose next token is a separator (or the row's end) is no site.
    tokens, parents = _propose([[8, 6]], [0], [[2, 6, -1, 7, 7, 6]], NgramConfig(max_ngram=1, depth=3))
    assert (parents[0] == -1).all()


def test_several_matches_make_a_tree():
    # Three earlier completions after "1": "5 6" (newest, first), "5 7", "4 9".
    store = HistoryStore(max_tokens=32, lead_tokens=0)
    store.add([0], [[1, 4, 9], [1, 5, 7], [1, 5, 6]])
    tokens, parents = _propose([[0, 1]], [0], store.rows([[0]]), NgramConfig(max_ngram=1, depth=2, branches=3))
    _check_tree(tokens[0], parents[0])
    assert _paths(tokens[0], parents[0]) == {(5,), (5, 6), (5, 7), (4,), (4, 9)}
    np.testing.assert_array_equal(tokens[0], [1, 5, 6, 0, 7, 4, 9])


def test_inactive_rows_use_no_history():
    tokens, parents = _propose([[1, 2]], [-1], [[1, 2, 3, -1]], NgramConfig(max_ngram=2, depth=2))
    assert (parents == -1).all() and (tokens == 0).all()


@pytest.mark.parametrize("config", [NgramConfig(), NgramConfig(max_ngram=2, min_ngram=2, depth=3, branches=3),
                                    NgramConfig(max_ngram=1, depth=4, branches=4)])
def test_matches_reference_with_history(config):
    rng = np.random.default_rng(hash(config) % 2**32)
    B, S, H = 5, 10, 12
    for trial in range(20):
        vocab = 2 + trial % 4
        context = rng.integers(0, vocab, (B, S)).astype(np.int32)
        lengths = rng.integers(0, S + 1, B).astype(np.int32)
        group = rng.integers(-1, 3, B).astype(np.int32)
        history = rng.integers(-1, vocab, (B, H)).astype(np.int32)  # separators anywhere
        tokens, parents = propose(jnp.asarray(context), jnp.asarray(lengths), jnp.asarray(group), config,
                                  jnp.asarray(history))
        tokens, parents = np.asarray(tokens), np.asarray(parents)
        for b, (root, taken, _) in enumerate(_reference(context, lengths, group, config, history)):
            _check_tree(tokens[b], parents[b])
            if root is None:
                assert (parents[b] == -1).all() and (tokens[b] == 0).all()
                continue
            assert tokens[b, 0] == root and (tokens[b] >= 0).all()
            assert _paths(tokens[b], parents[b]) == {t[:j] for t in taken for j in range(1, len(t) + 1)}, (
                b, context, lengths, group, history)


# -- the engine's history arm


@dataclasses.dataclass
class _WithHistory(_Recording):
    history: HistoryStore | None = None


def _chunk_compiles(engine):
    return engine.groups[0].chunk_programs()


def test_engine_drafts_from_the_store_and_fills_it():
    """Greedy answers are plain decode's with the history arm; a generate fills the store
    (the two identical greedy samples of a prompt kept once) and the next one drafts
    whole answers from it; warm_up compiled the history layout's chunks."""
    from tests.rollout.test_speculative import CFG

    params = tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.3)
    sp = sampling.SamplingParams(temperature=0.0, max_tokens=20)
    key = jax.random.PRNGKey(3)
    plain = _engine(params).generate(PROMPTS, 2, sp, key)
    store = HistoryStore(max_tokens=64, keep_steps=2)
    policy = _WithHistory(spec_lib.Strategy("history", depth=4, topk=2), history=store)
    engine = _engine(params)
    engine.warm_up(sp, policy, strategies=True)
    compiled = _chunk_compiles(engine)
    acceptance = []
    for _ in range(2):
        out = engine.generate(PROMPTS, 2, sp, key, speculation=policy)
        for a, b in zip(plain.tokens, out.tokens):
            np.testing.assert_array_equal(a, b)
        assert plain.finish_reason == out.finish_reason
        assert all(isinstance(c, SpecChunk) for c in out.timeline.groups[0].chunks)
        acceptance.append(out.timeline.summary()["acceptance_length"])
        assert [store.num_completions(p) for p in PROMPTS] == [1] * len(PROMPTS)
    assert _chunk_compiles(engine) == compiled
    # Lockstep siblings lend nothing ahead of a sample; its prompt's earlier answer does
    # (measured: 1.40, then 3.93; runs of one token in these answers leave some steps to
    # the row's own latest match, whose continuation the row's end cuts short).
    assert acceptance[0] < 2 < 3.5 < acceptance[1], acceptance
    np.testing.assert_array_equal(store.row(PROMPTS[1])[:2 + len(plain.tokens[2])],
                                  np.concatenate([PROMPTS[1][-2:], plain.tokens[2]]))


def test_bad_history_arms_name_the_field():
    from tests.rollout.test_speculative import CFG

    params = tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.3)
    engine = _engine(params)  # max_draft_depth 4
    sp = sampling.SamplingParams(temperature=0.0, max_tokens=4)
    deep = spec_lib.FixedSpeculation(spec_lib.Strategy("history", depth=6, topk=3), history=HistoryStore())
    with pytest.raises(ValueError, match=r"history-d6-b3 drafts 6 deep .*max_draft_depth=4"):
        engine.generate(PROMPTS, 1, sp, jax.random.PRNGKey(0), speculation=deep)
    with pytest.raises(ValueError, match=r"history-d6-b3 drafts 6 deep .*max_draft_depth=4"):
        engine.warm_up(sp, deep)
    no_store = spec_lib.FixedSpeculation(spec_lib.Strategy("history", depth=3, topk=2))
    with pytest.raises(ValueError, match=r"history-d3-b2 .*`history` must be a history.HistoryStore"):
        engine.generate(PROMPTS, 1, sp, jax.random.PRNGKey(0), speculation=no_store)


def test_tuner_makes_the_store_for_history_arms():
    cfg = dict(buckets=[1, 5], arms=[["history-d6-b3", "ngram-d4-b2", "plain"], ["history-d3-b1", "plain"]])
    tuner = tuner_lib.from_config(dict(cfg, history=dict(max_tokens=128, keep_steps=3)))
    assert isinstance(tuner.history, HistoryStore) and (tuner.history.max_tokens, tuner.history.keep_steps) == (128, 3)
    assert tuner.strategy_for(1) == spec_lib.Strategy("history", depth=6, topk=3)  # untried arms first
    assert tuner_lib.from_config(cfg).history.max_tokens == HistoryStore().max_tokens
    assert tuner_lib.from_config(dict(buckets=[1], arms=[["ngram-d4-b2"]])).history is None
    with pytest.raises(ValueError, match=r"tlt\.tuner\.history\.max_tokens=2 must be at least"):
        tuner_lib.from_config(dict(cfg, history=dict(max_tokens=2)))
    with pytest.raises(ValueError, match=r"tlt\.tuner\.history has unknown keys \['steps'\]"):
        tuner_lib.from_config(dict(cfg, history=dict(steps=2)))
    with pytest.raises(ValueError, match=r"tlt\.tuner\.arms\[0\].*history-d6-b3"):
        tuner_lib.from_config(dict(buckets=[1], arms=[["history-d6-k3"]]))
