"""experiments/bench_rollout.py's prefill comparison: both sides fill the same slots."""
import jax
import pytest

from experiments.bench_rollout import bench_prefill
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig

CFG = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)


@pytest.mark.parametrize("samples", [1, 3])
def test_prefill_shared_and_per_sample_fill_the_same_slots(samples):
    row = bench_prefill(CFG, tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.3), samples, 5,
                        min_seconds=0.01)
    assert row["samples"] == samples and row["calls"] >= 5
    assert row["shared_ms"] > 0 and row["per_sample_ms"] > 0
