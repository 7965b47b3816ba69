"""experiments/bench_rollout.py's prefill comparison: both sides fill the same slots."""
import pytest

from experiments.bench_rollout import bench_prefill
from tests.support import tiny


@pytest.mark.parametrize("samples", [1, 3])
def test_prefill_shared_and_per_sample_fill_the_same_slots(tiny_params, samples):
    row = bench_prefill(tiny.config(), tiny_params, samples, 5, min_seconds=0.01)
    assert row["samples"] == samples and row["calls"] >= 5
    assert row["shared_ms"] > 0 and row["per_sample_ms"] > 0
