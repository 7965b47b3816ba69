"""The machine record and the decode regime of the CPU benchmarks (experiments/machine.py)."""
import jax
import numpy as np
import pytest

from experiments import machine
from tests.support import tiny
from tlt_jax.models import transformer as tfm

CFG = tiny.policy_config(vocab_size=40)


def _sysfs(root, entries):
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return str(root)


def test_the_last_level_cache_is_the_highest_data_or_unified_one(tmp_path):
    root = _sysfs(tmp_path / "a", [(1, "Data", "48K"), (1, "Instruction", "64K"), (2, "Unified", "2048K"),
                                   (3, "Unified", "491520K")])
    assert machine.last_level_cache_bytes.__wrapped__(root) == 480 << 20
    # An instruction cache never counts, however high its level.
    root = _sysfs(tmp_path / "b", [(1, "Data", "32K"), (2, "Instruction", "1M")])
    assert machine.last_level_cache_bytes.__wrapped__(root) == 32 << 10
    assert machine.last_level_cache_bytes.__wrapped__(str(tmp_path / "none")) is None


def test_the_padded_width_is_the_narrowest_whose_weights_are_three_caches(monkeypatch):
    monkeypatch.setattr(machine, "memory_available_bytes", lambda: 1 << 40)
    params = tfm.init_params(CFG, jax.random.PRNGKey(0))
    cache = 1 << 20
    width = machine.mlp_size_for_cache(CFG, params, cache)
    padded = lambda w: machine.weight_bytes(jax.eval_shape(lambda p: tfm.pad_mlp(p, CFG, w)[1], params))
    assert width % 256 == 0 and padded(width) >= 3 * cache > padded(width - 256)
    # A model already 3x the cache is not padded beyond its own width (rounded to 256).
    assert machine.mlp_size_for_cache(CFG, params, 16) == 256


def test_a_width_the_memory_cannot_hold_or_an_unknown_cache_is_refused_in_one_line(monkeypatch):
    params = tfm.init_params(CFG, jax.random.PRNGKey(0))
    monkeypatch.setattr(machine, "memory_available_bytes", lambda: 64 << 20)
    with pytest.raises(ValueError, match=r"exceed 25% of its 0.1 GiB of free memory.*--decode_mlp_size"):
        machine.mlp_size_for_cache(CFG, params, 480 << 20)
    monkeypatch.setattr(machine, "last_level_cache_bytes", lambda: None)
    with pytest.raises(ValueError, match="cache size cannot be read.*--decode_mlp_size=N"):
        machine.mlp_size_for_cache(CFG, params)


def test_the_regime_check_passes_steps_within_fifteen_percent():
    assert machine.regime_check({1: 1.0, 2: 1.1, 4: 1.14})["passed"]
    failed = machine.regime_check({1: 1.0, 2: 1.3, 4: 2.0})
    assert not failed["passed"] and np.isclose(failed["spread"], 1.0)


def test_decode_steps_are_timed_at_each_batch():
    params = tfm.init_params(CFG, jax.random.PRNGKey(0))
    got = machine.decode_step_seconds(CFG, params, 128, [1, 5, 6, 7], batches=(1, 2), min_seconds=0.01)
    assert set(got) == {1, 2} and all(0 < v < 1 for v in got.values())
