"""experiments.cache_ranking.TargetPositions: bench_distill_caches holds the teacher's targets at
the target positions alone and spreads them back over [B, T, K] batches; the batches must train
and evaluate the student as the whole rows' targets do."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.cache_ranking import TargetPositions
from tlt_jax import losses


def _rows(rng, rows=5, seq_len=9, k=3):
    mask_RT = rng.random((rows, seq_len - 1)) < 0.4
    mask_RT[2] = False  # a row without a target position
    ids_RTK = np.argsort(rng.random((rows, seq_len, 11)), -1)[..., :k].astype(np.int32)  # distinct per position
    logp_RTK = np.log(rng.dirichlet(np.ones(k + 1), (rows, seq_len))[..., :k]).astype(np.float32)
    return mask_RT, ids_RTK, logp_RTK


def test_scatter_puts_each_rows_targets_back_at_its_positions():
    rng = np.random.default_rng(0)
    mask_RT, ids_RTK, _ = _rows(rng)
    where = TargetPositions(mask_RT)
    # Gathered in chunks of rows, as the teacher runs over them.
    ids_PK = np.concatenate([where.gather(idx, ids_RTK[idx]) for idx in (np.arange(0, 3), np.arange(3, 5))])
    assert where.count == mask_RT.sum() == len(ids_PK)
    idx = np.array([4, 2, 0, 4, 1])  # any order, repeats
    out = where.scatter(idx, ids_PK, -1)
    assert out.shape == (5, 9, 3)
    target = np.zeros((5, 9), bool)
    target[:, :-1] = mask_RT[idx]
    np.testing.assert_array_equal(out[target], ids_RTK[idx][target])
    assert (out[~target] == -1).all()
    with pytest.raises(ValueError, match="target positions"):
        where.scatter(idx, ids_PK[1:], -1)
    with pytest.raises(ValueError, match=r"must be \[2, 9, K\]"):
        where.gather(np.arange(2), ids_RTK[:2, :-1])


@pytest.mark.parametrize("tail", [False, True])
def test_scattered_targets_give_the_loss_of_the_whole_rows(tail):
    rng = np.random.default_rng(1)
    mask_RT, ids_RTK, logp_RTK = _rows(rng)
    where = TargetPositions(mask_RT)
    idx = np.arange(len(mask_RT))
    ids_BTK = where.scatter(idx, where.gather(idx, ids_RTK), -1)
    logp_BTK = where.scatter(idx, where.gather(idx, logp_RTK), 0)
    h_ND = jnp.asarray(rng.normal(size=(5 * 8, 4)), jnp.float32)
    w_DV = jnp.asarray(rng.normal(size=(4, 11)), jnp.float32)
    mask_N = jnp.asarray(mask_RT.reshape(-1))
    # The trainer reads positions 0 .. T-2 (position t predicts token t + 1).
    flat = lambda x: jnp.asarray(x[:, :-1].reshape(5 * 8, 3))

    def loss(ids, logp):
        return jax.value_and_grad(lambda h: losses.linear_topk_kl(h, w_DV, flat(ids), flat(logp), mask_N=mask_N,
                                                                  tail=tail, reduction="mean"))(h_ND)

    (want, want_grad), (got, got_grad) = loss(ids_RTK, logp_RTK), loss(ids_BTK, logp_BTK)
    assert np.isfinite(float(got)) and float(want) > 0
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-7)
