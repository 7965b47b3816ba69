"""The Pallas kernels (interpret mode) serve every use of the fused projection outside the
learner (tests/rl/test_learner.py covers its log-probs and drafter data): SFT's log-likelihood,
the distillation student's loss and held-out sums, the distillation teacher's top-K, the
drafter's loss and its target's top-K. Each gives chunked_xla's values and gradients, and a
spy checks the kernels ran, so a silent fallback to XLA cannot pass."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fused_linear_kl
from tlt_jax import sft, sharding
from tlt_jax.distill import train as distill
from tlt_jax.drafter_training import trainer as dt
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig
from tlt_jax.train_state import OptimizerConfig

CFG = ModelConfig(vocab_size=37, hidden_size=24, intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=12)
B, T, K = 2, 11, 5  # odd sizes: padded token blocks and vocabulary tiles
IMPLS = ("chunked_xla", "pallas")


@pytest.fixture(scope="module")
def setup():
    params = tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.3)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    rows = {"tokens": tokens, "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
            "segment_ids": np.ones((B, T), np.int32), "mask": rng.random((B, T - 1)) < 0.8}
    return params, rows, sharding.make_mesh({"data": 1}, jax.devices()[:1])


@pytest.fixture
def pallas_ran(monkeypatch):
    """Counts traces of the Pallas engine's statistics and gradient passes."""
    calls = {"stats": 0, "grads": 0}
    for name, key in (("_pallas_row_stats", "stats"), ("_pallas_grads", "grads")):
        fn = getattr(fused_linear_kl, name)
        monkeypatch.setattr(fused_linear_kl, name,
                            lambda *a, fn=fn, key=key, **k: calls.__setitem__(key, calls[key] + 1) or fn(*a, **k))
    return calls


def _close(got, want, what):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6, err_msg=what)


def test_sft_log_likelihood(setup, pallas_ran):
    params, rows, mesh = setup
    out = {impl: jax.jit(jax.value_and_grad(sft.SFTTrainer(CFG, OptimizerConfig(), mesh, logprob_impl=impl).loss))(
        params, rows) for impl in IMPLS}
    _close(out["pallas"], out["chunked_xla"], "sft loss and gradient")
    assert pallas_ran["stats"] and pallas_ran["grads"]


def test_distillation_student_and_teacher(setup, pallas_ran):
    params, rows, mesh = setup
    teacher = {impl: distill.teacher_topk_step(CFG, params, mesh, k=K, temperature=0.8, logp_dtype="float32",
                                               impl=impl)(params, rows["tokens"], rows["positions"],
                                                          rows["segment_ids"]) for impl in IMPLS}
    np.testing.assert_array_equal(teacher["pallas"][0], teacher["chunked_xla"][0])
    _close(teacher["pallas"][1], teacher["chunked_xla"][1], "teacher top-K log-probs")
    assert pallas_ran["stats"]

    batch = {**rows, "ids": teacher["chunked_xla"][0], "logp": teacher["chunked_xla"][1]}
    out = {}
    for impl in IMPLS:
        trainer = distill.DistillTrainer(CFG, OptimizerConfig(), mesh, temperature=0.8, tail=True, top_k=K,
                                         loss_impl=impl)
        out[impl] = jax.jit(jax.value_and_grad(trainer.loss))(params, batch), trainer.eval_sums(params, batch)
    _close(out["pallas"], out["chunked_xla"], "student loss, gradient and held-out sums")
    assert pallas_ran["grads"]


def test_drafter_loss_and_its_targets(setup, pallas_ran):
    params, rows, _ = setup
    dcfg = drafter_lib.DrafterConfig(num_layers=1)
    dparams = drafter_lib.init_drafter(CFG, dcfg, jax.random.PRNGKey(1), init_std=0.3)
    out = {}
    for impl in IMPLS:
        batch = {**rows, **jax.jit(lambda p, r, impl=impl: dt.target_outputs(p, CFG, dcfg, r, top_k=K, impl=impl))(
            params, rows)}
        loss = jax.jit(jax.value_and_grad(lambda d, batch, impl=impl: dt.drafter_loss(
            d, params, CFG, dcfg, batch, feature_weight=0.3, kl_weight=0.7, loss_impl=impl)[0]))(dparams, batch)
        out[impl] = batch["ids"], batch["logp"], loss
    np.testing.assert_array_equal(out["pallas"][0], out["chunked_xla"][0])
    _close(out["pallas"][1:], out["chunked_xla"][1:], "drafter targets, loss and gradient")
    assert pallas_ran["stats"] and pallas_ran["grads"]
    assert jnp.isfinite(out["pallas"][2][0])
