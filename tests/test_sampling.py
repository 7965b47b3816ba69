import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support import REPO, xla_flags
from tlt_jax.sampling import SamplingParams
from tlt_jax.sampling import processed_logprobs as _processed_logprobs
from tlt_jax.sampling import sample as _sample

# Jitted, as the engine runs them (op by op, each operation compiles a program of its own).
processed_logprobs = jax.jit(_processed_logprobs, static_argnums=1)
sample = jax.jit(_sample, static_argnums=2)


def _logits():
    return jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]]))


def test_temperature_and_greedy():
    lp = processed_logprobs(_logits(), SamplingParams(temperature=0.5))
    ref = jax.nn.log_softmax(_logits() / 0.5)
    np.testing.assert_allclose(lp, ref, rtol=1e-6)
    g = processed_logprobs(_logits(), SamplingParams(temperature=0.0))
    assert g[0, 0] == 0 and np.all(np.isneginf(np.asarray(g[0, 1:])))


def test_filters():
    p = lambda **kw: np.exp(np.asarray(processed_logprobs(_logits(), SamplingParams(**kw))))[0]
    np.testing.assert_allclose(p(top_k=2), [2 / 3, 1 / 3, 0, 0], rtol=1e-6)
    # Mass before the 3rd token is 0.75 < 0.8, so top_p=0.8 keeps three tokens.
    np.testing.assert_allclose(p(top_p=0.8), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0], rtol=1e-5)
    np.testing.assert_allclose(p(top_p=0.5), [1, 0, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(p(min_p=0.3), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0], rtol=1e-5)


def test_sample_frequencies_match_processed_distribution():
    params = SamplingParams(temperature=1.3, top_k=3)
    keys = jax.random.split(jax.random.PRNGKey(0), 20000)
    tokens, logp = jax.vmap(lambda k: sample(k, _logits()[0], params))(keys)
    expected = np.exp(np.asarray(processed_logprobs(_logits()[0], params)))
    freq = np.bincount(np.asarray(tokens), minlength=4) / len(keys)
    np.testing.assert_allclose(freq, expected, atol=0.015)
    np.testing.assert_allclose(logp, np.log(expected[np.asarray(tokens)]), rtol=1e-5)


def test_bad_params():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    for bad in (dict(top_p=0), dict(top_p=1.5)):
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(**bad)
    for bad in (dict(top_k=-1), dict(min_p=1.0), dict(min_p=-0.1)):
        with pytest.raises(ValueError, match="top_k must be >= 0 and min_p in"):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(max_tokens=1, top_p=1.0, min_p=0.0).max_tokens == 1


def test_filters_act_on_each_row_along_the_vocabulary():
    """Rows with different distributions, in a batch of any rank, each filtered as alone;
    filters combine; the defaults drop nothing, however small."""
    rows = jax.nn.log_softmax(jax.random.normal(jax.random.PRNGKey(1), (3, 7)) * 3.0)
    for params in (SamplingParams(top_p=0.7), SamplingParams(min_p=0.2), SamplingParams(top_k=3, top_p=0.8),
                   SamplingParams(temperature=0.0)):
        batch = processed_logprobs(rows, params)
        assert batch.shape == rows.shape
        for b in range(3):
            np.testing.assert_array_equal(batch[b], processed_logprobs(rows[b], params))
            np.testing.assert_array_equal(batch[b], processed_logprobs(rows[b][None, None], params)[0, 0])
    assert np.argmax(np.asarray(processed_logprobs(jnp.array([0.1, 0.2, 3.0, 0.3]), SamplingParams(temperature=0))))\
        == 2
    # A peaked row beside a flat one: top-p 0.7 keeps 2 tokens of the first (the third, at
    # log 0.09, is out) and 12 of the second, whose cutoff (~log 1/19) lies below log 0.09.
    peaked = np.log(np.array([0.6, 0.3, 0.09] + [0.01 / 13] * 13))
    flat = np.log(np.linspace(1.0, 0.9, 16) / np.linspace(1.0, 0.9, 16).sum())
    kept = np.isfinite(np.asarray(processed_logprobs(jnp.asarray(np.stack([peaked, flat]), jnp.float32),
                                                     SamplingParams(top_p=0.7))))
    assert kept.sum(1).tolist() == [2, 12]
    p = lambda **kw: np.exp(np.asarray(processed_logprobs(_logits(), SamplingParams(**kw))))[0]
    np.testing.assert_allclose(p(top_k=2, top_p=0.9), [2 / 3, 1 / 3, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(p(top_k=1, min_p=0.1), [1, 0, 0, 0], rtol=1e-6)
    assert np.all(np.isfinite(processed_logprobs(jnp.array([[0.0, -25.0, -30.0]]), SamplingParams())))


def test_sample_reads_each_rows_log_prob():
    rows = jax.random.normal(jax.random.PRNGKey(2), (3, 11)) * 2.0
    params = SamplingParams(temperature=0.9, top_p=0.9)
    tokens, logp = sample(jax.random.PRNGKey(0), rows, params)
    processed = processed_logprobs(rows, params)
    assert tokens.shape == logp.shape == (3,)
    np.testing.assert_array_equal(logp, processed[jnp.arange(3), tokens])


def test_processed_logprob_exceeds_the_temperature_one_by_the_kept_mass():
    """What GRPO's TIS ratio and rollout_logp_gap compare under top-p: the engine's log-prob
    (processed) minus the learner's (temperature only) is -log(kept mass) >= 0."""
    logits = jax.random.normal(jax.random.PRNGKey(3), (5, 17)) * 2.0
    params = SamplingParams(temperature=0.7, top_p=0.6)
    processed = processed_logprobs(logits, params)
    plain = jax.nn.log_softmax(logits / 0.7, axis=-1)
    kept = jnp.isfinite(processed)
    kept_mass = jnp.sum(jnp.where(kept, jnp.exp(plain), 0.0), axis=-1, keepdims=True)
    assert bool(jnp.all(kept_mass < 1.0)) and bool(jnp.all(jnp.sum(kept, -1) >= 1))
    np.testing.assert_allclose(jnp.where(kept, processed - plain, 0.0),
                               jnp.where(kept, -jnp.log(kept_mass), 0.0), atol=1e-5)


_KEPT_UNDER_LOOP_EMITTERS = """
import jax, numpy as np
from tlt_jax.sampling import SamplingParams, processed_logprobs
logits = jax.random.normal(jax.random.PRNGKey(3), (5, 17)) * 2.0
for params in (SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=0.7, top_p=0.6),
               SamplingParams(temperature=0.7, top_k=2, top_p=0.3, min_p=0.1)):
    kept = np.isfinite(np.asarray(jax.jit(lambda x: processed_logprobs(x, params))(logits))).sum(-1)
    print(params.top_k, params.top_p, kept.tolist())
"""


def test_filters_keep_a_token_where_fusions_round_logp_apart():
    """top-k 1 keeps one token and a small top-p at least one in a program where XLA
    recomputes the log-probs in several fusions that round them apart (XLA:CPU's loop
    emitters at optimisation level 0): a threshold read from one copy and compared with
    another kept no token in two rows of five."""
    env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags())
    out = subprocess.run([sys.executable, "-c", _KEPT_UNDER_LOOP_EMITTERS], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:3] == ["1 1.0 [1, 1, 1, 1, 1]", "0 0.6 [2, 1, 1, 1, 2]", "2 0.3 [1, 1, 1, 1, 1]"], \
        out.stdout
