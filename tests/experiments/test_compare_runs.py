"""The seed-noise comparison of RL run groups (experiments/compare_runs.py)."""
import json
import os

import numpy as np

from experiments import compare_runs
from tlt_jax import metrics


def _write_run(run_dir, rng, accuracy_shift=0.0):
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step in range(7):
            record = {"step": step, "reward_mean": 0.5 + 0.01 * step + rng.normal(0, 0.02),
                      "response_length_mean": 30 + rng.normal(0, 1)}
            if step % 3 == 0:
                record["eval_accuracy"] = 0.5 + 0.02 * step + accuracy_shift + rng.normal(0, 0.01)
            f.write(json.dumps(record) + "\n")


def test_groups_from_one_distribution_agree_and_a_shifted_one_does_not(tmp_path):
    rng = np.random.default_rng(0)
    for label, shift in (("base", 0.0), ("same", 0.0), ("shifted", 0.1)):
        for seed in range(3):
            _write_run(str(tmp_path / f"{label}_{seed}"), rng, shift)
    groups = {label: compare_runs.group_stats(compare_runs.load_group(str(tmp_path / f"{label}_*")))
              for label in ("base", "same", "shifted")}
    result = compare_runs.compare(groups)
    assert result["groups"]["base"]["eval_steps"] == [0, 3, 6]
    same, shifted = (result["groups"][k]["versus_reference"] for k in ("same", "shifted"))
    assert same["final_eval_accuracy"]["within_noise"] and same["mean_reward_mean"]["within_noise"]
    assert not shifted["final_eval_accuracy"]["within_noise"]
    assert shifted["eval_steps_within_noise"] == 0 and same["eval_steps_within_noise"] == 3
    np.testing.assert_allclose(shifted["final_eval_accuracy"]["difference"], 0.1, atol=0.03)
    compare_runs.plot(groups, str(tmp_path / "compare.png"))
    assert os.path.getsize(tmp_path / "compare.png") > 0
    metrics.write_json(tmp_path / "compare.json", result)  # JSON-serialisable as written by the launcher


def test_a_pattern_matching_no_run_is_named():
    import pytest

    with pytest.raises(ValueError, match="No run directory with a metrics.jsonl matches 'nowhere/\\*'"):
        compare_runs.load_group("nowhere/*")
