"""bench_tlt's speed-ups: the same steps of the two modes, paired."""
import pytest

from experiments import bench_tlt


def _mode(rollout, step, steps=None):
    return dict(steady_steps=steps or list(range(4, 4 + len(step))),
                steady_times=dict(time_rollout_s=rollout, time_step_s=step))


def test_speedups_pair_the_same_steps():
    # Light and heavy steps with a gap between them: TLT is faster at every step, yet the
    # baseline's median (9.0) sits below the gap and TLT's (8.0) above it.
    baseline = _mode([4.0, 4.0, 4.0, 8.0, 8.0], [8.0, 8.5, 9.0, 16.0, 17.0])
    tlt = _mode([2.0, 2.5, 2.0, 5.0, 4.0], [6.0, 6.5, 8.0, 12.0, 13.0])
    s = bench_tlt.paired_speedups(baseline, tlt)
    assert s["step_speedup"] == pytest.approx(17.0 / 13.0)  # ratios 1.33, 1.31, 1.125, 1.33, 1.31
    assert s["step_speedup_total"] == pytest.approx(58.5 / 45.5)
    assert s["rollout_speedup"] == pytest.approx(2.0)  # ratios 2, 1.6, 2, 1.6, 2
    assert s["rollout_speedup_total"] == pytest.approx(28.0 / 15.5)


def test_speedups_refuse_unlike_steps():
    with pytest.raises(ValueError, match="same --steps"):
        bench_tlt.paired_speedups(_mode([1.0], [2.0], [4]), _mode([1.0], [2.0], [5]))
