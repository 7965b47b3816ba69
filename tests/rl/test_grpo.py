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


def test_advantages_are_per_group():
    """Groups with different means and spreads, each normalised by its own statistics; a
    group of near-equal rewards stays finite; RLOO from groups of 2."""
    r = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])  # means 0.5 and 0.75
    np.testing.assert_allclose(grpo.dr_grpo_advantages(r, 4), [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75],
                               rtol=1e-6)
    std2 = np.sqrt(3) / 4
    np.testing.assert_allclose(grpo.grpo_advantages(r, 4)[4:], np.array([0.25, 0.25, 0.25, -0.75]) / (std2 + 1e-6),
                               rtol=1e-5)
    np.testing.assert_allclose(grpo.grpo_advantages(jnp.array([0.0, 2e-6]), 2), [-0.5, 0.5], rtol=1e-5)
    np.testing.assert_allclose(grpo.rloo_advantages(jnp.array([1.0, 0.0]), 2), [1.0, -1.0])
    with pytest.raises(ValueError, match="RLOO needs at least 2 samples per prompt"):
        grpo.rloo_advantages(r, 1)


def test_sequence_stats_count_sequences_not_rows():
    # Row 0 packs two sequences (segments 1 and 2), row 1 one sequence then padding, row 2 is padding.
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 0, 0, 0], [0] * 7])  # per token: a column more
    mask = jnp.array([[0, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], bool)
    tokens, num = grpo.sequence_stats(mask, seg)
    np.testing.assert_array_equal(np.where(mask, tokens, -1), [[-1, 1, -1, -1, 1, -1], [3, 3, 3, -1, -1, -1],
                                                               [-1] * 6])
    assert float(num) == 3
    # One sequence per row: segment ids 1.
    tokens, num = grpo.sequence_stats(mask, jnp.ones((3, 7), jnp.int32))
    np.testing.assert_array_equal(tokens[:2, 1], [2, 3])
    assert float(num) == 3


def test_aggregations_weigh_sequences_alike_packed_or_not():
    loss_unpacked = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask_unpacked = jnp.array([[1, 1, 1], [1, 0, 0]], bool)
    seg_unpacked = jnp.ones((2, 4), jnp.int32)
    # The same two sequences packed into one row, then empty padding rows.
    loss_packed = jnp.array([[1.0, 2.0, 3.0, 7.0, 4.0, 0.0], [5.0] * 6, [5.0] * 6])
    mask_packed = jnp.array([[1, 1, 1, 0, 1, 0], [0] * 6, [0] * 6], bool)
    seg_packed = jnp.array([[1, 1, 1, 1, 2, 2, 0], [0] * 7, [0] * 7])

    def agg(name, loss, mask, seg, **kw):
        return float(jnp.sum(loss * grpo.get_aggregation(name)(mask, *grpo.sequence_stats(mask, seg), **kw)))

    expected = {"token_mean": 10 / 4, "seq_mean": (2 + 4) / 2, "seq_sum_const": 10 / (2 * 5)}
    for name, want in expected.items():
        kw = {"max_len": 5} if name == "seq_sum_const" else {}
        assert agg(name, loss_unpacked, mask_unpacked, seg_unpacked, **kw) == pytest.approx(want), name
        assert agg(name, loss_packed, mask_packed, seg_packed, **kw) == pytest.approx(want), name


def test_positions_off_the_loss_contribute_exactly_nothing():
    """An overflowing log-ratio off the loss (an improbable padding token) must not turn
    0 * inf into a NaN: not in the loss, the metrics or the gradient."""
    cfg = grpo.GRPOConfig(kl_coef=0.1, tis_cap=2.0)
    mask = jnp.array([[1, 1, 0, 0]], bool)
    weights = grpo.token_mean(mask)
    old = jnp.array([[-1.0, -2.0, -200.0, -1.0]])
    ref = jnp.array([[-1.5, -2.5, -1.0, -1.0]])
    rollout = jnp.array([[-1.1, -2.0, 0.0, -300.0]])
    adv = jnp.array([[1.0, 1.0, 0.0, jnp.inf]])

    def loss(logp):
        return grpo.policy_loss(logp, old, rollout, adv, weights, weights, cfg, ref_logp_nT=ref)

    logp = jnp.array([[-0.9, -2.1, 0.0, -150.0]])
    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp)
    assert np.isfinite(float(value)) and all(np.isfinite(float(m)) for m in metrics.values())
    np.testing.assert_array_equal(grad[0, 2:], 0.0)
    assert np.all(grad[0, :2] != 0)
    # The live positions' loss is that of the two tokens alone.
    alone, _ = grpo.policy_loss(logp[:, :2], old[:, :2], rollout[:, :2], adv[:, :2], weights[:, :2],
                                weights[:, :2], cfg, ref_logp_nT=ref[:, :2])
    assert float(value) == float(alone)


def test_clipping_stops_gradient_outside_the_trust_region():
    cfg = grpo.GRPOConfig(clip_eps=0.2, clip_eps_high=0.3, tis_cap=0.0)
    old = jnp.zeros((1, 3))
    mask = jnp.ones((1, 3))

    def loss(logp, adv):
        return grpo.policy_loss(logp, old, old, jnp.full((1, 3), adv), mask, mask / 3, cfg)[0]

    logp = jnp.log(jnp.array([[1.0, 1.5, 0.7]]))  # ratios 1.0, 1.5 (above 1.3), 0.7 (below 0.8)
    g_pos = jax.grad(loss)(logp, 1.0)
    g_neg = jax.grad(loss)(logp, -1.0)
    # Positive advantage: the too-high ratio is clipped (no gradient), the low one is not.
    assert g_pos[0, 1] == 0 and g_pos[0, 0] != 0 and g_pos[0, 2] != 0
    # Negative advantage: the too-low ratio is clipped, the high one is not.
    assert g_neg[0, 2] == 0 and g_neg[0, 1] != 0
    _, m = grpo.policy_loss(logp, old, old, jnp.ones((1, 3)), mask, mask / 3, cfg)
    assert float(m["clip_fraction"]) == pytest.approx(2 / 3)
    # A clip range of width 0 on a side halves the gradient at ratio 1 (every on-policy update).
    for name in ("clip_eps", "clip_eps_high"):
        with pytest.raises(ValueError, match=f"GRPOConfig.{name}=0.0 must be > 0"):
            grpo.GRPOConfig(**{name: 0.0})


def test_kl_and_truncated_importance_sampling():
    logp = jnp.log(jnp.array([[0.5, 0.2]]))
    ref = jnp.log(jnp.array([[0.4, 0.3]]))
    kl = grpo.k3_kl(logp, ref)
    assert (kl >= 0).all() and float(grpo.k3_kl(logp, logp).sum()) == 0
    mask = jnp.ones((1, 2)) / 2  # token means
    adv = jnp.ones((1, 2))
    cfg = grpo.GRPOConfig(kl_coef=0.1, tis_cap=2.0, aggregation="token_mean")
    # Rollout engine thought the tokens 4x less likely than the learner: weight capped at 2.
    loss, m = grpo.policy_loss(logp, logp, logp - jnp.log(4.0), adv, mask, mask, cfg, ref_logp_nT=ref)
    assert float(loss) == pytest.approx(-2.0 + 0.1 * float(kl.mean()), rel=1e-5)
    assert float(m["kl"]) == pytest.approx(float(kl.mean()), rel=1e-6)
    with pytest.raises(ValueError, match="Unknown loss aggregation"):
        grpo.get_aggregation("median")
