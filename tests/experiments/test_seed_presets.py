"""bench_tlt's code and planning presets: their runs read the shipped dataset and warm start
and score by the task's reward; the planning reward plays a plan between any two pegs. In a
child process: bench_tlt's absl flags share names with other launchers the tests import."""
import json

import pytest

from experiments import make_plan_dataset
from tests.support.child import printed_json

_SEED_PRESETS = r"""
import json, sys
from absl import flags
from experiments import bench_tlt
flags.FLAGS(["bench_tlt", *sys.argv[1:]])
out = {}
for name, warm_start in (("cpu_code", "code"), ("cpu_plan", "plan")):
    preset = bench_tlt.PRESETS[name]
    configs = {m: bench_tlt.mode_config(m, preset, "t", "d", 0, 2, built=False) for m in ("baseline", "frozen")}
    c = configs["baseline"]
    out[name] = dict(shipped=bench_tlt.build_warm_start(warm_start, "no-cache"), source=c.data.source,
                     train=c.data.train, response_field=c.data.response_field, reward=c.reward,
                     code_timeout_s=c.code.timeout_s, arms=configs["frozen"].tlt.tuner.arms,
                     coupled=c.rollout.spec_coupled)
print(json.dumps(out))
"""


def test_the_seed_presets_run_their_shipped_warm_start_on_their_dataset_and_reward(tmp_path):
    out = printed_json(_SEED_PRESETS, f"--run_dir={tmp_path}")
    code, plan = out["cpu_code"], out["cpu_plan"]
    # Shipped, so that a fresh machine trains neither warm start nor drafter.
    assert code["shipped"] == ["assets/sft_code", "assets/drafter_code"]
    assert plan["shipped"] == ["assets/sft_plan", "assets/drafter_plan"]
    assert code["source"] == plan["source"] == "files"
    assert code["train"] == "assets/code_data/train.parquet" and plan["train"] == "assets/plan_data/train.parquet"
    # RL samples its answers: no reference solution is read into the rollout's data.
    assert code["response_field"] == plan["response_field"] == ""
    assert code["reward"] == "code" and code["code_timeout_s"] == 2.0
    assert plan["reward"] == "experiments.make_plan_dataset:plan_reward"
    assert code["arms"] == plan["arms"] == [["eagle-d6"]] and code["coupled"] and plan["coupled"]


def test_the_plan_reward_plays_the_plan_between_the_rows_pegs():
    rows = make_plan_dataset.make_rows(40, seed=0)
    assert {(r["source"], r["target"]) for r in rows} - {("A", "C")}, "the rows use other pairs of pegs"
    scores = make_plan_dataset.plan_reward([r["prompt"] for r in rows], [r["solution"] for r in rows],
                                           [r["num_disks"] for r in rows], [r["source"] for r in rows],
                                           [r["target"] for r in rows])
    assert scores == [1.0] * len(rows)
    # One move short, an illegal move, the disks left on the spare peg: none solves it.
    short = make_plan_dataset.plan_of(3, "B", "A").rsplit(" ", 1)[0]
    spare = make_plan_dataset.plan_of(3, "B", "C")
    assert make_plan_dataset.plan_reward([""] * 3, [short, "B->C B->C", spare], [3] * 3, ["B"] * 3,
                                         ["A"] * 3) == [0.0, 0.0, 0.0]


def test_bars_from_merges_each_modes_first_run_and_refuses_another_seed(tmp_path):
    from experiments import bars_from

    def write(name, seed, mode, accept):
        summary = dict(thirds=dict(acceptance_length=dict(first=3.0, last=accept)), eval_accuracy=[0.1, 0.2])
        path = tmp_path / name
        path.write_text(json.dumps(dict(preset="cpu_code", seed=seed, runs=[dict(result=dict(modes={mode: summary}))])))
        return str(path)

    paths = [write("tlt.json", 0, "tlt", 3.0), write("frozen.json", 0, "frozen", 2.0),
             write("frozen_again.json", 0, "frozen", 1.0)]
    result = bars_from.merged(paths)
    assert sorted(result["modes"]) == ["frozen", "tlt"] and result["seed"] == 0
    assert "tlt over frozen, live acceptance over the last third: 1.500x" in bars_from.describe(result)
    with pytest.raises(ValueError, match="seed 1"):
        bars_from.merged([*paths, write("other.json", 1, "baseline", 0.0)])
