"""GRPO learner: log-probs, micro-batching, sharded equality, non-finite guard."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax import sharding
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig
from tlt_jax.rl import grpo
from tlt_jax.rl.learner import Learner, LearnerConfig, token_logprobs
from tlt_jax.train_state import OptimizerConfig

CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)


def _batch(n=8, t=10, seed=0):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(1, CFG.vocab_size, (n, t)).astype(np.int32)
    mask = np.zeros((n, t - 1), bool)
    for i in range(n):
        mask[i, 3:3 + rng.randint(2, t - 3)] = True
    rewards = jnp.asarray(np.arange(n) % 3 == 0, jnp.float32)  # every group of 4 mixes 0 and 1
    adv = np.asarray(grpo.grpo_advantages(rewards, 4))
    return dict(tokens=tokens, loss_mask=mask, advantages=adv.astype(np.float32))


def _mesh(shape):
    return sharding.make_mesh(dict(zip(sharding.MESH_AXES, shape)), jax.devices()[:int(np.prod(shape))])


def _prepare(learner, state, batch):
    old = np.asarray(learner.logprobs(state.params, batch["tokens"]))
    return dict(batch, old_logp=old, rollout_logp=old)


def test_token_logprobs_match_dense():
    params = tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.2)
    tokens = jnp.asarray(_batch()["tokens"])
    logp, ent = token_logprobs(params, CFG, tokens, temperature=0.7, with_entropy=True)
    logits = tfm.logits_from_hidden(params, CFG, tfm.forward(params, CFG, tokens[:, :-1])) / 0.7
    ref = jax.nn.log_softmax(logits)
    np.testing.assert_allclose(logp, jnp.take_along_axis(ref, tokens[:, 1:, None], -1)[..., 0], atol=1e-5)
    np.testing.assert_allclose(ent, -(jnp.exp(ref) * ref).sum(-1), atol=1e-4)


def test_old_policy_outputs_share_the_forward_with_the_logprobs():
    """The drafter's data comes from the old-policy pass itself: its log-probs and entropy
    are the plain pass's (bit for bit on one device; on a sharded mesh the two programs
    partition the blockwise projection differently, within float32 rounding), hidden
    states and layer outputs the forward's, and the top-K the dense log_softmax's."""
    params = tfm.init_params(CFG, jax.random.PRNGKey(1), init_std=0.2)
    tokens = jnp.asarray(_batch(seed=2)["tokens"])
    for shape, atol in (((1, 1, 1), 0.0), ((2, 4, 1), 1e-5)):
        learner = Learner(CFG, LearnerConfig(temperature=0.9), _mesh(shape))
        logp, ent, data = learner.logprobs_and_drafter_data(params, tokens, top_k=5, feature_layers=(0, 1))
        ref_logp, ref_ent = learner.logprobs(params, tokens, with_entropy=True)
        np.testing.assert_allclose(np.asarray(logp), np.asarray(ref_logp), rtol=0, atol=atol)
        np.testing.assert_allclose(np.asarray(ent), np.asarray(ref_ent), rtol=0, atol=atol)
    h, layers = tfm.forward(params, CFG, tokens[:, :-1], layer_ids=(0, 1))
    np.testing.assert_allclose(data.hidden, h, atol=1e-5)
    np.testing.assert_allclose(data.layers, jnp.moveaxis(layers, 0, 2), atol=1e-5)
    ref = jax.nn.log_softmax(tfm.logits_from_hidden(params, CFG, h) / 0.9)
    top, top_ids = jax.lax.top_k(ref, 5)
    np.testing.assert_array_equal(data.ids, top_ids)
    np.testing.assert_allclose(data.logp, top, atol=1e-5)


def test_update_raises_advantaged_logprobs_and_is_shard_invariant():
    params = tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.2)
    batch = _batch()
    lcfg = LearnerConfig(optimizer=OptimizerConfig(learning_rate=3e-3), micro_batch_size=2, num_minibatches=2,
                         grpo=grpo.GRPOConfig(tis_cap=0.0))
    results = {}
    for shape, micro in (((1, 1, 1), 2), ((1, 1, 1), 4), ((2, 2, 2), 2)):
        learner = Learner(CFG, LearnerConfig(**{**lcfg.__dict__, "micro_batch_size": micro}), _mesh(shape))
        state = learner.init_state(params)
        full = _prepare(learner, state, batch)
        state, metrics = learner.update(state, full)
        assert len(metrics) == 2 and all(m["skipped"] == 0 for m in metrics)
        assert int(state.step) == 2
        results[(shape, micro)] = (np.asarray(learner.logprobs(state.params, batch["tokens"])), full["old_logp"])
    new, old = results[((1, 1, 1), 2)]
    gain = ((new - old) * batch["loss_mask"]).sum(1)
    pos, neg = batch["advantages"] > 0, batch["advantages"] < 0
    assert gain[pos].mean() > 0 > gain[neg].mean()
    for key in (((1, 1, 1), 4), ((2, 2, 2), 2)):
        np.testing.assert_allclose(results[key][0], new, atol=2e-4)


def test_non_finite_step_is_skipped():
    params = tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.2)
    learner = Learner(CFG, LearnerConfig(micro_batch_size=4), _mesh((1, 1, 1)))
    state = learner.init_state(params)
    batch = _prepare(learner, state, _batch())
    batch["advantages"] = batch["advantages"].copy()
    batch["advantages"][0] = np.nan
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = learner.update(state, batch)
    assert metrics[0]["skipped"] == 1 and int(state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, state.params))


def test_bad_batch_split():
    learner = Learner(CFG, LearnerConfig(num_minibatches=3), _mesh((1, 1, 1)))
    state = learner.init_state(tfm.init_params(CFG, jax.random.PRNGKey(0)))
    with pytest.raises(ValueError, match="does not split into 3 minibatches"):
        learner.update(state, _prepare(learner, state, _batch()))
