"""plot_steps: per-step ratios and acceptance of bench_tlt ABBA results."""
import json
import math

import pytest

from experiments import plot_steps


def _mode(steps, times, acceptance=None):
    return dict(steady_steps=steps, steady_times={"time_step_s": times},
                acceptance_length=acceptance or [0.0] * (steps[-1]))


def test_per_step_pairs_each_baseline_run_with_its_tlt_run():
    runs = [dict(run=1, pair=1, mode="baseline", result={"modes": {"baseline": _mode([2, 3], [4.0, 6.0])}}),
            dict(run=2, pair=1, mode="tlt", result={"modes": {"tlt": _mode([2, 3], [2.0, 6.0], [0, 2.0, 3.0])}}),
            dict(run=3, pair=2, mode="tlt", result={"modes": {"tlt": _mode([2, 3], [4.0, 2.0], [0, 4.0, 5.0])}}),
            dict(run=4, pair=2, mode="baseline", result={"modes": {"baseline": _mode([2, 3], [2.0, 8.0])}})]
    pairs = [dict(pair=1, baseline_run=1, tlt_run=2), dict(pair=2, baseline_run=4, tlt_run=3)]
    steps = plot_steps.per_step(dict(runs=runs, pairs=pairs))
    assert steps[1] == (0.0, None)  # a warm-up step: no ratio
    assert steps[2][0] == 3.0 and steps[2][1] == pytest.approx(math.sqrt(2.0 * 0.5))
    assert steps[3][0] == 4.0 and steps[3][1] == pytest.approx(math.sqrt(1.0 * 4.0))
    runs[3]["result"]["modes"]["baseline"]["steady_steps"] = [3, 4]
    with pytest.raises(ValueError, match="pair 2"):
        plot_steps.per_step(dict(runs=runs, pairs=pairs))


def test_main_prints_and_plots(tmp_path, capsys):
    runs = [dict(run=1, pair=1, mode="baseline", result={"modes": {"baseline": _mode([2], [3.0])}}),
            dict(run=2, pair=1, mode="tlt", result={"modes": {"tlt": _mode([2], [2.0], [1.5, 2.5])}})]
    path = tmp_path / "abba.json"
    path.write_text(json.dumps(dict(runs=runs, pairs=[dict(pair=1, baseline_run=1, tlt_run=2)])))
    plot_steps.main([f"--runs=warm={path}", f"--out={tmp_path / 'steps.png'}"])
    assert "1.50x" in capsys.readouterr().out and (tmp_path / "steps.png").stat().st_size > 0
