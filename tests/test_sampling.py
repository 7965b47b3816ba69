import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.sampling import SamplingParams, processed_logprobs, sample


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
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


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
