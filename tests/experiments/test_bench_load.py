"""Memory under load (experiments/bench_load.py): the rollout engine serves 20k requests of
mixed lengths through 200 generate calls with host and device memory flat after warm-up;
the drafter buffer and the metrics writer stay bounded over a 1000-step run."""
import sys

import pytest

from experiments import bench_load

MiB = 1 << 20
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RSS from /proc"),
              pytest.mark.costly]


def test_engine_memory_is_flat_over_20k_requests_of_mixed_lengths():
    out = bench_load.serve(calls=200, requests=100, warmup=20)
    assert out["requests"] == 20_000
    lengths = out["answer_length"]
    assert lengths["min"] < lengths["max"] and lengths["distinct"] >= 8, lengths  # answers of every length
    # Device: not one array (nor byte) more after warm-up, whatever the lengths were.
    for key in ("live_arrays", "live_array_bytes"):
        assert out[key]["max"] <= out[key]["after_warmup"], (key, out[key])
    # Host: the Python heap grows by what the benchmark records (~1 KiB a call, 0.23 MiB in
    # all); keeping each call's answers adds 3.1 MiB, its timeline 0.96 MiB. RSS drifts by
    # 1-3 MiB of native allocator noise, so it only bounds a gross leak.
    assert out["python_heap"]["growth"] < 0.75 * MiB, out["python_heap"]
    assert out["rss"]["growth"] < 16 * MiB, out["rss"]


def test_drafter_buffer_and_metrics_writer_stay_bounded_over_1000_steps(tmp_path):
    # A max_bytes that binds (the tiny job's 256 MiB holds its two RL steps many times over).
    max_bytes = 2 * MiB
    out = bench_load.long_run(1000, str(tmp_path), keep_steps=2, max_bytes=max_bytes)
    assert out["buffer_bytes"]["max"] <= max_bytes < 2 * out["buffer_bytes"]["after_warmup"]
    assert abs(out["buffer_bytes"]["growth"]) <= max_bytes // 4, out["buffer_bytes"]
    assert out["rss"]["growth"] < 16 * MiB, out["rss"]
    assert out["metrics_file_bytes_per_step"] < 4096  # one line a step on disk; nothing kept in memory
