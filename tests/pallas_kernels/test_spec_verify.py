"""pallas_kernels.spec_verify: emitted tokens follow the target exactly (chi-square against
exact enumeration, with negative controls that must fail it), temperature 0, padding,
shapes, and the pallas kernel (interpret mode) against the reference bit for bit."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import gammaincc

from pallas_kernels import spec_verify as sv

# Losslessness setup. Target and draft distributions depend on the emitted prefix only
# (a tiny autoregressive model over V tokens), so node i's rows are the tables' rows at
# the prefix code of i. Emitted tokens are a prefix of a target sample iff completing
# them with fresh target draws to a fixed length L gives exactly the target's joint
# distribution over V^L sequences, whatever the drafts were.
V = 5
L = 4  # depth 3 trees emit at most 4 tokens
N = 200_000
N_CODES = (V + 1) ** (L - 1)  # codes of prefixes of length < L
CHAIN = (-1, 0, 1, 2, -1, -1, -1, -1)  # depth 3, nodes 4..7 padding
TREE = (-1, 0, 0, 1, 1, 3, 0, -1)  # root children 1, 2, 6; 1 -> 3, 4; 3 -> 5; node 7 padding
# Deterministic (top-k) drafts: node i proposes the RANKS[tree][i]-th most likely token of the
# draft row of its parent's prefix. TREE's node 6 repeats node 1's token (a duplicate).
RANKS = {CHAIN: (0, 0, 0, 0, 0, 0, 0, 0), TREE: (0, 0, 1, 0, 1, 0, 0, 0)}
P_MIN = 1e-3


def _code(code, y):
    """Code of prefix + (y,) from the prefix's code (the empty prefix is 0)."""
    return code * (V + 1) + y + 1


def _tables(seed):
    """Target and draft log-prob tables [N_CODES, V]; about half the target rows and a
    third of the draft rows exclude one token (-inf), as top-k / top-p would."""
    rng = np.random.default_rng(seed)

    def table(p_drop):
        x = rng.normal(size=(N_CODES, V)) * 1.5
        drop = rng.random(N_CODES) < p_drop
        x[np.flatnonzero(drop), rng.integers(0, V, N_CODES)[drop]] = -np.inf
        return jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1)

    return table(0.5), table(0.3)


def _exact_probs(target_table):
    """Target probability of every length-L sequence, indexed by base-V code, float64."""
    p_table = np.exp(np.asarray(target_table, np.float64))
    probs = np.ones(V**L)
    for idx, ys in enumerate(itertools.product(range(V), repeat=L)):
        code = 0
        for y in ys:
            probs[idx] *= p_table[code, y]
            code = _code(code, y)
    return probs


# The sampling helpers run jitted (op by op, each operation per shape compiles a program
# of its own); parents (a tuple) and drafts are static.
@functools.partial(jax.jit, static_argnums=1)
def _draft_tree(key, parents, draft_table):
    """Per-sample tokens [N, T]: each node's children drawn one after another without
    replacement from the draft row of the node's prefix."""
    tokens, codes = [jnp.zeros(N, jnp.int32)], [jnp.zeros(N, jnp.int32)]
    for i in range(1, len(parents)):
        p = parents[i]
        if p < 0:
            tokens.append(jnp.zeros(N, jnp.int32))
            codes.append(jnp.zeros(N, jnp.int32))
            continue
        logits_NV = draft_table[codes[p]]
        for j in range(1, i):
            if parents[j] == p:
                logits_NV = jnp.where(jnp.arange(V) == tokens[j][:, None], -jnp.inf, logits_NV)
        tok = jax.random.categorical(jax.random.fold_in(key, i), logits_NV).astype(jnp.int32)
        tokens.append(tok)
        codes.append(_code(codes[p], tok))
    return jnp.stack(tokens, 1)


def _top_k_tree(parents, draft_table):
    """Tokens [T] of the deterministic drafts (RANKS)."""
    order = np.argsort(-np.asarray(draft_table), axis=1, kind="stable")
    tokens, codes = [0], [0]
    for i in range(1, len(parents)):
        p = parents[i]
        tokens.append(int(order[codes[p], RANKS[parents][i]]) if p >= 0 else 0)
        codes.append(_code(codes[p], tokens[i]) if p >= 0 else 0)
    return jnp.asarray(tokens, jnp.int32)


@functools.partial(jax.jit, static_argnums=1)
def _node_codes(tokens_NT, parents):
    codes = [jnp.zeros(tokens_NT.shape[0], jnp.int32)]
    for i in range(1, len(parents)):
        codes.append(_code(codes[parents[i]], tokens_NT[:, i]) if parents[i] >= 0 else codes[0])
    return jnp.stack(codes, 1)


@jax.jit
def _outcomes(key, tokens_NT, path_NT, n_acc_N, next_N, target_table):
    """Emitted tokens completed to length L with fresh target draws -> base-V codes [N]."""
    emitted_NT = jnp.take_along_axis(tokens_NT, jnp.maximum(path_NT, 0), axis=1)
    code, outcome = jnp.zeros_like(n_acc_N), jnp.zeros_like(n_acc_N)
    for t in range(L):
        fresh = jax.random.categorical(jax.random.fold_in(key, t), target_table[code]).astype(jnp.int32)
        y = jnp.where(t < n_acc_N, emitted_NT[:, t], jnp.where(t == n_acc_N, next_N, fresh))
        code, outcome = _code(code, y), outcome * V + y
    return outcome


def _chi2_pvalue(outcomes_N, probs):
    """Chi-square goodness of fit; cells expecting < 5 are pooled. Impossible outcomes
    must never appear."""
    counts = np.bincount(np.asarray(outcomes_N), minlength=probs.size)
    assert counts[probs == 0].sum() == 0, "an outcome of target probability 0 was emitted"
    expected = probs * counts.sum()
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    if (~big & (probs > 0)).any():
        obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expected[~big].sum())
    stat = float(np.sum((obs - exp) ** 2 / exp))
    return float(gammaincc((obs.size - 1) / 2, stat / 2))


def _check_paths(path_NT, n_acc_N, parents):
    """Paths walk down the tree from the root's child, -1 after num_accepted entries."""
    path, n_acc, parents = np.asarray(path_NT), np.asarray(n_acc_N), np.asarray(parents)
    steps = np.arange(path.shape[1])
    assert ((path >= 0) == (steps < n_acc[:, None])).all()
    prev = np.concatenate([np.zeros_like(path[:, :1]), path[:, :-1]], axis=1)
    assert (np.where(path >= 0, parents[np.maximum(path, 0)] == prev, True)).all()


def _lossless_run(drafts, parents, seed, verifier=None):
    """Samples N verifications of one tree shape; returns (p-value, path, num_accepted).

    drafts: "sampled" (children drawn from the draft rows, verified with them), "fixed"
    (top-k drafts by RANKS, draft_logp None), "sampled_as_fixed" (sampled drafts verified as
    deterministic ones: lossless too, since the verifier's randomness is not used to
    pick them), "draft_told_target" (negative control: the verifier is told the
    drafts came from the target, so it accepts whatever the target allows).
    verifier: (tokens, parents, target, draft, key) -> outputs; default sv.verify.
    """
    target_table, draft_table = _tables(seed)
    key_draft, key_verify, key_complete = jax.random.split(jax.random.key(seed), 3)
    if drafts == "fixed":
        tokens_NT = jnp.broadcast_to(_top_k_tree(parents, draft_table), (N, len(parents)))
    else:
        tokens_NT = _draft_tree(key_draft, parents, draft_table)
    parents_NT = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), tokens_NT.shape)
    target_NTV, draft_NTV = _node_rows(tokens_NT, parents, drafts, target_table, draft_table)
    verifier = verifier or sv.verify
    path_NT, n_acc_N, next_N = verifier(tokens_NT, parents_NT, target_NTV, draft_NTV, key_verify)
    outcomes_N = _outcomes(key_complete, tokens_NT, path_NT, n_acc_N, next_N, target_table)
    return _chi2_pvalue(outcomes_N, _exact_probs(target_table)), path_NT, n_acc_N


@functools.partial(jax.jit, static_argnums=(1, 2))
def _node_rows(tokens_NT, parents, drafts, target_table, draft_table):
    """Target and draft rows [N, T, V] of each node's prefix (draft None unless sampled)."""
    codes_NT = _node_codes(tokens_NT, parents)
    # Padding nodes' rows are NaN: the walk must never read them into r or q.
    padding_T1 = (jnp.asarray(parents) < 0).at[0].set(False)[:, None]
    target_NTV = jnp.where(padding_T1, jnp.nan, target_table[codes_NT])
    draft_NTV = {
        "sampled": jnp.where(padding_T1, jnp.nan, draft_table[codes_NT]),
        "draft_told_target": target_NTV,
    }.get(drafts)
    return target_NTV, draft_NTV


@pytest.mark.parametrize("drafts", ["sampled", "fixed", "sampled_as_fixed"])
@pytest.mark.parametrize("parents", [CHAIN, TREE], ids=["chain", "tree"])
def test_lossless(drafts, parents):
    pvalue, path_NT, n_acc_N = _lossless_run(drafts, parents, seed=0)
    assert pvalue > P_MIN, pvalue
    _check_paths(path_NT, n_acc_N, parents)
    # The walks went deep: the test sees whole accepted chains, not only final draws.
    assert np.sum(np.asarray(n_acc_N) == L - 1) > N // 1000


@pytest.mark.parametrize("parents", [CHAIN, TREE], ids=["chain", "tree"])
def test_lossless_negative_controls(parents, monkeypatch):
    # The same test must reject broken verifiers: accepting every draft the target
    # allows (the verifier is told the wrong draft distribution) ...
    pvalue, _, _ = _lossless_run("draft_told_target", parents, seed=1)
    assert pvalue < 1e-12, pvalue

    # ... and RRS without the residual update (r kept after a rejection). A fresh
    # trace of the reference, since verify's jit cache holds the correct one.
    def no_residual(r_bV, q_bV, onehot_bV, reject=sv._reject_sampled):
        return r_bV, reject(r_bV, q_bV, onehot_bV)[1]

    monkeypatch.setattr(sv, "_reject_sampled", no_residual)

    @jax.jit
    def broken(tokens_BT, parents_BT, target_BTV, draft_BTV, key):
        (b, t, v), (k_u, k_g) = target_BTV.shape, jax.random.split(key)
        noise = jax.random.uniform(k_u, (b, t)), jax.random.gumbel(k_g, (b, v))
        return sv._reference(tokens_BT, parents_BT, target_BTV, draft_BTV, *noise)

    pvalue, _, _ = _lossless_run("sampled", parents, seed=1, verifier=broken)
    assert pvalue < 1e-12, pvalue


# ------------------------------------------------------------------------------------
# Small random trees: temperature 0, padding, shapes, pallas == reference.
# ------------------------------------------------------------------------------------

B, T, VS = 3, 7, 13


def _random_inputs(seed, peak=3.0):
    """Random trees with padding (and orphans under padding), peaked rows with -inf
    entries, tokens mostly drawn from the parent's target row (so walks go deep)."""
    rng = np.random.default_rng(seed)
    parents = np.full((B, T), -1)
    for b, i in itertools.product(range(B), range(1, T)):
        parents[b, i] = rng.integers(0, i) if rng.random() > 0.2 else -1

    def rows():
        x = rng.normal(size=(B, T, VS)) * peak
        x[rng.random((B, T, VS)) < 0.2] = -np.inf
        x[..., 0] = np.maximum(x[..., 0], -5.0)  # every row keeps some mass
        return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1))

    target, draft = rows(), rows()
    tokens = rng.integers(0, VS, (B, T))
    for b, i in itertools.product(range(B), range(1, T)):
        if parents[b, i] >= 0 and rng.random() < 0.7:
            p_V = np.exp(target[b, parents[b, i]].astype(np.float64))
            tokens[b, i] = rng.choice(VS, p=p_V / p_V.sum())
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32), jnp.asarray(target), jnp.asarray(draft)


def _greedy_walk(tokens, parents, target):
    """Expected argmax path: the first child carrying the argmax token is taken."""
    paths, nexts = [], []
    for b in range(tokens.shape[0]):
        cur, path = 0, []
        for i in range(1, tokens.shape[1]):
            if parents[b, i] == cur and tokens[b, i] == np.argmax(target[b, cur]):
                cur = i
                path.append(i)
        paths.append(path + [-1] * (tokens.shape[1] - len(path)))
        nexts.append(np.argmax(target[b, cur]))
    return np.array(paths), np.array(nexts)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_temperature_zero_is_argmax_path(impl):
    tokens, parents, target, draft = _random_inputs(seed=3)
    target = jnp.where(jax.nn.one_hot(jnp.argmax(target, -1), VS, dtype=bool), 0.0, -jnp.inf)
    want_path, want_next = _greedy_walk(np.asarray(tokens), np.asarray(parents), np.asarray(target))
    assert (want_path[:, 0] >= 0).any()
    for draft_logp in (draft, None):
        for seed in range(3):
            path, n_acc, next_token = sv.verify(tokens, parents, target, draft_logp, jax.random.key(seed), impl=impl)
            assert (path.shape, n_acc.shape, next_token.shape) == ((B, T), (B,), (B,))
            assert path.dtype == n_acc.dtype == next_token.dtype == jnp.int32
            np.testing.assert_array_equal(path, want_path)
            np.testing.assert_array_equal(n_acc, (want_path >= 0).sum(1))
            np.testing.assert_array_equal(next_token, want_next)


# The kernel over blocks of 4 entries: with VS = 13, four blocks, the last overlapping.
_pallas_blocks_of_4 = jax.jit(functools.partial(sv._pallas, block_v=4))


def test_pallas_matches_reference():
    """Same key -> identical outputs, over keys and random trees; with V (odd) below one
    block (padded up to it) and over several blocks of 4, the last overlapping the one
    before it."""
    blocks_of_4 = _pallas_blocks_of_4
    n_accepted = 0
    for seed in range(4):
        tokens, parents, target, draft = _random_inputs(seed)
        for draft_logp in (draft, None):
            key = jax.random.key(seed)
            want = sv.verify(tokens, parents, target, draft_logp, key, impl="reference")
            got = sv.verify(tokens, parents, target, draft_logp, key, impl="pallas")
            k_u, k_g = jax.random.split(key)
            noise = jax.random.uniform(k_u, (B, T)), jax.random.gumbel(k_g, (B, VS))
            got_blocks = blocks_of_4(tokens, parents, target, draft_logp, *noise)
            for w, g, gb in zip(want, got, got_blocks):
                np.testing.assert_array_equal(g, w)
                np.testing.assert_array_equal(gb, w)
            padding = np.asarray(parents)[np.arange(B)[:, None], np.maximum(want[0], 0)] < 0
            assert not (padding & (np.asarray(want[0]) >= 0)).any()
            # A node drafting a token outside [0, V) is padding, with its subtree.
            for bad in (-3, VS):
                got = sv.verify(tokens.at[:, 1].set(bad), parents, target, draft_logp, key, impl="reference")
                want_bad = sv.verify(tokens, parents.at[:, 1].set(-1), target, draft_logp, key, impl="reference")
                for w, g in zip(want_bad, got):
                    np.testing.assert_array_equal(g, w)
            n_accepted += int(want[1].sum())
    assert n_accepted >= 8  # the walks went past the root


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "deterministic"])
def test_acceptance_at_exact_thresholds(sampled):
    """The accept test after a chain of rejections, against float64 arithmetic: root
    children 1, 2, 3 are rejected, then child 4 is tried with u just below (row 0:
    accepted) or just above (rows 1, 2: rejected) its exact threshold r'(x)/q'(x)
    (sampled) or r'(x)/sum(r') (deterministic); node 4's children are tried with
    u ~ 1. With zero Gumbel noise the final token is the argmax of the exact final r."""
    rng = np.random.default_rng(11)
    parents = np.broadcast_to(np.array([-1, 0, 0, 0, 0, 4, 4]), (B, T))
    target = rng.normal(size=(B, T, VS))
    draft = target + rng.normal(size=(B, T, VS)) * 0.5
    tokens = np.zeros((B, T), np.int64)
    for b in range(B):
        tokens[b, 1:5] = rng.permutation(VS)[:4]
        tokens[b, 5:] = rng.permutation(VS)[:2]
        draft[b, 0, tokens[b, 1:4]] += 3.0  # the draft over-proposes these: q > r
        draft[b, 4, tokens[b, 5:]] += 3.0
    target = np.asarray(jax.nn.log_softmax(jnp.asarray(target, jnp.float32), -1))
    draft = np.asarray(jax.nn.log_softmax(jnp.asarray(draft, jnp.float32), -1))

    def exact_walk(b, node, rejected):  # float64 (r, q) at node after rejecting `rejected`
        r, q = np.exp(target[b, node].astype(np.float64)), np.exp(draft[b, node].astype(np.float64))
        for x in rejected:
            if sampled:
                res = np.maximum(r - q, 0.0)
                r = res / res.sum() if res.sum() > 0 else r
                q[x] = 0.0
                q = q / q.sum()
            else:
                r[x] = 0.0
        return r, q

    def threshold(r, q, x):
        return r[x] / q[x] if sampled else r[x] / r.sum()

    u = np.full((B, T), 1.0 - 1e-7)
    want_next = np.zeros(B, np.int64)
    for b in range(B):
        r, q = exact_walk(b, 0, tokens[b, 1:4])
        assert all(threshold(*exact_walk(b, 0, tokens[b, 1:i]), tokens[b, i]) < 0.99 for i in range(1, 4))
        assert all(threshold(*exact_walk(b, 4, tokens[b, 5:i]), tokens[b, i]) < 0.99 for i in range(5, 7))
        u[b, 4] = threshold(r, q, tokens[b, 4]) * (1 - 1e-3 if b == 0 else 1 + 1e-3)
        final = exact_walk(b, 4, tokens[b, 5:]) if b == 0 else exact_walk(b, 0, tokens[b, 1:5])
        want_next[b] = np.argmax(final[0])
    args = (jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32), jnp.asarray(target),
            jnp.asarray(draft) if sampled else None, jnp.asarray(u, jnp.float32), jnp.zeros((B, VS), jnp.float32))
    for impl in (jax.jit(sv._reference), _pallas_blocks_of_4):
        path, n_acc, next_token = impl(*args)
        np.testing.assert_array_equal(n_acc, [1, 0, 0])
        np.testing.assert_array_equal(path[:, 0], [4, -1, -1])
        np.testing.assert_array_equal(next_token, want_next)


def test_pallas_matches_reference_at_qwen_vocabulary():
    """V = 151936 (Qwen2.5) in blocks of 2048, the last overlapping: rows with a few
    likely tokens over a flat floor, drafts from the target's likely tokens so that
    walks go deep and meet rejections with real residuals."""
    b, t, v, n_likely = 2, 6, 151936, 4
    rng = np.random.default_rng(5)
    parents = np.array([[-1, 0, 0, 1, 3, 3], [-1, 0, 1, 2, 0, -1]], np.int32)
    likely = rng.integers(0, v, (n_likely,))

    def rows():
        x = np.full((b, t, v), -4.0, np.float32) + rng.normal(size=(b, t, v)).astype(np.float32)
        x[..., likely] += 12.0 + 2.0 * rng.normal(size=(b, t, n_likely))
        return jax.nn.log_softmax(jnp.asarray(x), axis=-1)

    target, draft = rows(), rows()
    tokens = jnp.asarray(rng.choice(likely, (b, t)), jnp.int32)
    accepted = rejected = 0
    for draft_logp in (draft, None):
        for seed in range(3):
            key = jax.random.key(seed)
            want = sv.verify(tokens, parents, target, draft_logp, key, impl="reference")
            got = sv.verify(tokens, parents, target, draft_logp, key, impl="pallas")
            for w, g in zip(want, got):
                np.testing.assert_array_equal(g, w)
            accepted += int(want[1].sum())
            rejected += int(np.sum(np.asarray(want[1]) < 3))
    assert accepted >= 6 and rejected >= 2


@pytest.mark.skipif(sv._pltriton is None,
                    reason="this jax has no Pallas Triton backend: the verification kernel's lowering for CUDA is "
                           "unchecked (its math is checked in interpret mode; experiments/device_check.sh runs it)")
def test_pallas_lowers_to_triton_for_cuda():
    # Pallas -> Triton IR needs no GPU: catches ops the Triton lowering rejects.
    ints, rows = jax.ShapeDtypeStruct((B, T), jnp.int32), jax.ShapeDtypeStruct((B, T, VS), jnp.float32)
    noise = jax.ShapeDtypeStruct((B, T), jnp.float32), jax.ShapeDtypeStruct((B, VS), jnp.float32)
    for draft in (rows, None):
        fn = jax.jit(functools.partial(sv._pallas, interpret=False))
        text = fn.trace(ints, ints, rows, draft, *noise).lower(lowering_platforms=("cuda",)).as_text()
        assert 'name = "spec_verify"' in text


def test_bad_inputs():
    tokens, parents = jnp.zeros((2, 4), jnp.int32), jnp.full((2, 4), -1, jnp.int32)
    rows, key = jnp.zeros((2, 4, 6)), jax.random.key(0)
    cases = [
        ((tokens, parents[:, :3], rows, None), "parents_BT"),
        ((tokens[:, :0], parents[:, :0], rows[:, :0], None), "T >= 1"),
        ((tokens, parents, rows[:, :3], None), "target_logp_BTV"),
        ((tokens, parents, rows[0], None), "target_logp_BTV"),
        ((tokens, parents, rows, rows[..., :5]), "draft_logp_BTV"),
        ((tokens.astype(jnp.float32), parents, rows, None), "tokens_BT must be integer"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            sv.verify(*args, key)
    with pytest.raises(ValueError, match="impl"):
        sv.verify(tokens, parents, rows, None, key, impl="triton")
    assert sv.resolve_impl("auto", "gpu") == "reference"
