"""N-gram drafter: chains, group borrowing, fallback, trie invariants, and agreement
with a pure-Python reference of the matching on random inputs."""
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rollout.ngram import NgramConfig, propose


def _propose(rows, group, config, width=None, garbage=None):
    """Pads the rows into a [B, S] buffer (filled with `garbage`, default -7) and proposes."""
    width = width or max(len(r) for r in rows) + 1
    context = np.full((len(rows), width), -7 if garbage is None else garbage, np.int32)
    for b, r in enumerate(rows):
        context[b, :len(r)] = r
    tokens, parents = propose(jnp.asarray(context), jnp.asarray([len(r) for r in rows], jnp.int32),
                              jnp.asarray(group, jnp.int32), config)
    return np.asarray(tokens), np.asarray(parents)


def _paths(tokens_T, parents_T):
    """Token strings spelled from the root's child down to every non-padding node."""
    paths = set()
    for i in range(1, len(tokens_T)):
        if parents_T[i] < 0:
            continue
        path, node = [], i
        while node > 0:
            path.append(int(tokens_T[node]))
            node = parents_T[node]
        paths.add(tuple(reversed(path)))
    return paths


def _check_tree(tokens_T, parents_T):
    assert parents_T[0] == -1
    children = {}
    for i in range(1, len(tokens_T)):
        if parents_T[i] >= 0:
            assert parents_T[i] < i
            assert parents_T[i] == 0 or parents_T[parents_T[i]] >= 0, "child of a padding node"
            children.setdefault(int(parents_T[i]), []).append(int(tokens_T[i]))
    for toks in children.values():
        assert len(toks) == len(set(toks)), "children must carry distinct tokens"


def _reference(context, lengths, group, config, history=None):
    """Per row: (root token or None, the taken continuations, the winning n), by the
    matching rules in plain Python; history[b] is row b's history row (-1 separated)."""
    out = []
    B = len(lengths)
    for b in range(B):
        L = int(lengths[b])
        if group[b] < 0 or L == 0:
            out.append((None, [], 0))
            continue
        rows = [b] + [r for r in range(B) if r != b and group[r] == group[b] and lengths[r] > 0]
        for n in range(min(config.max_ngram, L), config.min_ngram - 1, -1):
            suffix = list(context[b, L - n:L])
            sites = []
            for r in rows:
                c = list(context[r, :lengths[r]])
                for p in reversed(range(n - 1, len(c) - 1)):
                    if c[p - n + 1:p + 1] == suffix:
                        sites.append(tuple(c[p + 1:p + 1 + config.depth]))
            if history is not None:
                h = [int(t) for t in history[b]]
                for p in reversed(range(n - 1, len(h))):
                    follow = h[p + 1:p + 1 + config.depth]
                    follow = tuple(follow[:follow.index(-1)] if -1 in follow else follow)
                    if h[p - n + 1:p + 1] == suffix and follow:
                        sites.append(follow)
            if sites:
                break
        else:
            out.append((int(context[b, L - 1]), [], 0))
            continue
        taken = []
        for s in sites:
            if len(taken) < config.branches and not any(t[:len(s)] == s for t in taken):
                taken.append(s)
        out.append((int(context[b, L - 1]), taken, n))
    return out


def test_chain_from_repeated_pattern_in_own_context():
    tokens, parents = _propose([[5, 1, 2, 3, 4, 9, 8, 1, 2]], [0], NgramConfig(depth=4))
    np.testing.assert_array_equal(tokens[0], [2, 3, 4, 9, 8])
    np.testing.assert_array_equal(parents[0], [-1, 0, 1, 2, 3])


def test_chain_stops_where_the_context_ends_and_prefers_the_latest_match():
    # "1 2" occurs at 0 (followed by 7 7 7 7) and at 5 (followed by 3 then the suffix).
    tokens, parents = _propose([[1, 2, 7, 7, 7, 1, 2, 3, 1, 2]], [0], NgramConfig(max_ngram=2, depth=4))
    assert _paths(tokens[0], parents[0]) == {(3,), (3, 1), (3, 1, 2)}
    np.testing.assert_array_equal(parents[0], [-1, 0, 1, 2, -1])


def test_borrows_from_same_group_only():
    rows = [[4, 6, 1, 2], [3, 3, 1, 2, 8, 9, 7], [1, 2, 5, 5, 5], [9, 1, 2, 6, 6, 6]]
    config = NgramConfig(max_ngram=2, depth=3)
    tokens, parents = _propose(rows, [0, 0, 1, -1], config)
    np.testing.assert_array_equal(tokens[0], [2, 8, 9, 7])
    np.testing.assert_array_equal(parents[0], [-1, 0, 1, 2])
    # Row 0 in another group finds nothing: not in row 1 (group 0), nor in the inactive
    # row 3 ("1 2 -> 6 6 6"); the inactive row gets only padding.
    tokens, parents = _propose(rows, [1, 0, 0, -1], config)
    np.testing.assert_array_equal(parents[0], [-1, -1, -1, -1])
    np.testing.assert_array_equal(tokens[0, :1], [2])
    np.testing.assert_array_equal(parents[3], [-1, -1, -1, -1])
    np.testing.assert_array_equal(tokens[3], [0, 0, 0, 0])
    # Two inactive rows do not form a group.
    tokens, parents = _propose(rows, [-1, -1, 1, 1], config)
    assert (parents[:2] == -1).all() and (tokens[:2] == 0).all()


def test_own_context_preferred_over_a_sibling():
    rows = [[1, 2, 4, 1, 2], [1, 2, 3, 3]]
    tokens, parents = _propose(rows, [0, 0], NgramConfig(max_ngram=2, depth=1))
    np.testing.assert_array_equal(tokens[0], [2, 4])


def test_falls_back_to_shorter_ngrams():
    # "1 2 3" never recurs; "2 3" does not either; "3" does, followed by 6 5.
    tokens, parents = _propose([[3, 6, 5, 1, 2, 3]], [0], NgramConfig(max_ngram=3, depth=2))
    np.testing.assert_array_equal(tokens[0], [3, 6, 5])
    # With min_ngram 2 the unigram match is not enough.
    tokens, parents = _propose([[3, 6, 5, 1, 2, 3]], [0], NgramConfig(max_ngram=3, min_ngram=2, depth=2))
    np.testing.assert_array_equal(parents[0], [-1, -1, -1])
    # A longer match wins over a more recent shorter one.
    tokens, parents = _propose([[1, 2, 8, 0, 2, 9, 1, 2]], [0], NgramConfig(max_ngram=2, depth=1))
    np.testing.assert_array_equal(tokens[0], [2, 8])


def test_garbage_beyond_lengths_is_ignored():
    rows = [[1, 2, 3, 1, 2], [4, 1, 2]]
    config = NgramConfig(max_ngram=2, depth=4)
    want = _propose(rows, [0, 0], config, width=12, garbage=0)
    for garbage in (1, 2, 3):  # garbage that would match the suffix or extend the chain
        got = _propose(rows, [0, 0], config, width=12, garbage=garbage)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(want[0][0, :4], [2, 3, 1, 2])
    np.testing.assert_array_equal(want[1][0], [-1, 0, 1, 2, -1])


def test_no_match_gives_only_the_root():
    tokens, parents = _propose([[1, 2, 3, 4], [5]], [0, 1], NgramConfig(branches=2))
    np.testing.assert_array_equal(tokens[:, 0], [4, 5])
    assert (parents == -1).all() and parents.shape == (2, 9)


def test_tree_merges_a_shared_prefix():
    # Suffix "1": sites followed by "5 6" (latest), "5 7", and "4".
    row = [1, 4, 9, 1, 5, 7, 1, 5, 6, 1]
    tokens, parents = _propose([row], [0], NgramConfig(max_ngram=1, depth=2, branches=3))
    _check_tree(tokens[0], parents[0])
    assert _paths(tokens[0], parents[0]) == {(5,), (5, 6), (5, 7), (4,), (4, 9)}
    np.testing.assert_array_equal(parents[0], [-1, 0, 1, -1, 1, 0, 5])
    np.testing.assert_array_equal(tokens[0], [1, 5, 6, 0, 7, 4, 9])


def test_tree_skips_continuations_that_add_no_node():
    # Sites in order: "5 6" (row 0), "5 6" again, "5" (row 1, where its context ends),
    # "5 6", then "7" (row 2). The repeats and the prefix add no node and are skipped.
    rows = [[1, 5, 6, 1, 5, 6, 1], [1, 5, 6, 1, 5], [1, 7]]
    tokens, parents = _propose(rows, [0, 0, 0], NgramConfig(max_ngram=1, depth=2, branches=2))
    _check_tree(tokens[0], parents[0])
    assert _paths(tokens[0], parents[0]) == {(5,), (5, 6), (7,)}


@pytest.mark.parametrize("config", [NgramConfig(), NgramConfig(max_ngram=2, min_ngram=2, depth=3, branches=3),
                                    NgramConfig(max_ngram=4, depth=2, branches=4),
                                    NgramConfig(max_ngram=1, depth=5, branches=2)])
def test_matches_reference_on_random_inputs(config):
    rng = np.random.default_rng(hash(config) % 2**32)
    B, S = 6, 14
    for trial in range(25):
        vocab = 2 + trial % 4
        context = rng.integers(0, vocab, (B, S)).astype(np.int32)
        lengths = rng.integers(0, S + 1, B).astype(np.int32)
        group = rng.integers(-1, 3, B).astype(np.int32)
        tokens, parents = propose(jnp.asarray(context), jnp.asarray(lengths), jnp.asarray(group), config)
        tokens, parents = np.asarray(tokens), np.asarray(parents)
        assert tokens.shape == parents.shape == (B, config.num_nodes)
        for b, (root, taken, n) in enumerate(_reference(context, lengths, group, config)):
            _check_tree(tokens[b], parents[b])
            if root is None:
                assert (parents[b] == -1).all() and (tokens[b] == 0).all()
                continue
            assert tokens[b, 0] == root
            paths = _paths(tokens[b], parents[b])
            assert paths == {t[:j] for t in taken for j in range(1, len(t) + 1)}, (b, context, lengths, group)
            # Independently of the preference order: every leaf path follows the suffix
            # somewhere it is allowed to look.
            suffix = tuple(context[b, lengths[b] - n:lengths[b]])
            allowed = [tuple(context[r, :lengths[r]]) for r in range(B) if group[r] == group[b]]
            for path in paths:
                assert any(c[p:p + n] == suffix and c[p + n:p + n + len(path)] == path
                           for c in allowed for p in range(len(c) - n)), (path, suffix)
