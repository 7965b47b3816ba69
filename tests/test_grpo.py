import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rl import grpo

R = jnp.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])


def test_advantages():
    a = grpo.get_advantage_estimator("grpo")(R, 4)
    np.testing.assert_allclose(a[:4], np.array([0.5, -0.5, -0.5, 0.5]) / (0.5 + 1e-6), rtol=1e-5)
    np.testing.assert_allclose(a[4:], 0, atol=1e-6)  # equal rewards: no signal
    np.testing.assert_allclose(grpo.get_advantage_estimator("dr_grpo")(R, 4)[:4], [0.5, -0.5, -0.5, 0.5])
    # Leave-one-out: 1 - (0 + 0 + 1) / 3.
    np.testing.assert_allclose(grpo.get_advantage_estimator("rloo")(R, 4)[:4], [2 / 3, -2 / 3, -2 / 3, 2 / 3],
                               rtol=1e-6)
    with pytest.raises(ValueError, match="Unknown advantage estimator"):
        grpo.get_advantage_estimator("ppo")
    with pytest.raises(ValueError, match="groups of 3"):
        grpo.grpo_advantages(R, 3)


def test_aggregations():
    loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1], [1, 0, 0]], jnp.float32)
    agg = lambda name, **kw: float(jnp.sum(loss * grpo.get_aggregation(name)(mask, **kw)))
    assert agg("token_mean") == pytest.approx(10 / 4)
    assert agg("seq_mean") == pytest.approx((2 + 4) / 2)
    assert agg("seq_sum_const", max_len=5) == pytest.approx(10 / 10)


def test_clipping_stops_gradient_outside_the_trust_region():
    cfg = grpo.GRPOConfig(clip_eps=0.2, clip_eps_high=0.3, tis_cap=0.0)
    old = jnp.zeros((1, 3))
    mask = jnp.ones((1, 3))

    def loss(logp, adv):
        return grpo.policy_loss(logp, old, old, adv, mask, mask / 3, cfg)[0]

    logp = jnp.log(jnp.array([[1.0, 1.5, 0.7]]))  # ratios 1.0, 1.5 (above 1.3), 0.7 (below 0.8)
    g_pos = jax.grad(loss)(logp, jnp.array([1.0]))
    g_neg = jax.grad(loss)(logp, jnp.array([-1.0]))
    # Positive advantage: the too-high ratio is clipped (no gradient), the low one is not.
    assert g_pos[0, 1] == 0 and g_pos[0, 0] != 0 and g_pos[0, 2] != 0
    # Negative advantage: the too-low ratio is clipped, the high one is not.
    assert g_neg[0, 2] == 0 and g_neg[0, 1] != 0
    _, m = grpo.policy_loss(logp, old, old, jnp.array([1.0]), mask, mask / 3, cfg)
    assert float(m["clip_fraction"]) == pytest.approx(2 / 3)


def test_kl_and_truncated_importance_sampling():
    logp = jnp.log(jnp.array([[0.5, 0.2]]))
    ref = jnp.log(jnp.array([[0.4, 0.3]]))
    kl = grpo.k3_kl(logp, ref)
    assert (kl >= 0).all() and float(grpo.k3_kl(logp, logp).sum()) == 0
    mask = jnp.ones((1, 2)) / 2  # token means
    adv = jnp.array([1.0])
    cfg = grpo.GRPOConfig(kl_coef=0.1, tis_cap=2.0, aggregation="token_mean")
    # Rollout engine thought the tokens 4x less likely than the learner: weight capped at 2.
    loss, m = grpo.policy_loss(logp, logp, logp - jnp.log(4.0), adv, mask, mask, cfg, ref_logp_nT=ref)
    assert float(loss) == pytest.approx(-2.0 + 0.1 * float(kl.mean()), rel=1e-5)
    assert float(m["kl"]) == pytest.approx(float(kl.mean()), rel=1e-6)
    with pytest.raises(ValueError, match="Unknown loss aggregation"):
        grpo.get_aggregation("median")
