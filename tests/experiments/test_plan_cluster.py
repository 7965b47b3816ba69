"""experiments.plan_cluster: its memory is plan_memory's, its derived times follow their
stated assumptions, and a rollout group must lie on one node."""
import dataclasses
import json

import pytest

from experiments import plan_cluster as pc
from experiments import plan_memory as pm

TINY = ["--plans=tiny:2x1x2", "--max_length=64", "--prompt_length=8", "--mean_response=16", "--prompts=4",
        "--samples=2", "--max_micro_batch=1"]


# One xdist worker runs this module (setup.cfg: --dist loadgroup), so its module fixture
# (the plan) is built once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_plan_cluster")


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    args = pc._arg_parser().parse_args([*TINY, f"--out={out}"])
    return args, pc.run(args)[0], json.loads(out.read_text())


def test_memory_is_plan_memorys_for_the_same_case(planned):
    _, row, saved = planned
    # plan_memory's own compile of the learner's slice (1 x fsdp x tensor), one row.
    case = pm.Case("tiny", "learner_remat", (1, 1, 2), 64)
    _, mesh = pm.resolve_mesh(case.mesh, pm.compile_devices(2, "cpu"))
    mine = pm.measure(case, pm.configs_of(["tiny"])["tiny"], mesh, 1)
    theirs = row["memory"]["steps"]["learner_remat"]
    assert theirs["smallest_total_gb"] == saved["results"][0]["memory"]["steps"]["learner_remat"][
        "smallest_total_gb"] == mine["total"] / pm.GB
    assert theirs["micro_batch"] == 1 and theirs["capped"]  # the search's cap: tiny fits


def test_a_slot_costs_its_kv_cache(planned):
    # The compiles' bytes per decode slot: the KV cache (K and V x 2 layers x 1 kv head per
    # device on tensor=2 x 16 dims x float32 x 64 positions) and a little slot state.
    memory = planned[1]["memory"]
    assert memory["kv_slot_gb"] * pm.GB == 2 * 2 * 1 * 16 * 4 * 64
    assert memory["kv_slot_gb"] <= memory["slot_gb"] < 1.2 * memory["kv_slot_gb"]


def test_derived_times_follow_their_assumptions(planned):
    args, row, _ = planned
    cfg = pm.configs_of(["tiny"])["tiny"]
    hw, workload = pc.Hardware(), pc.Workload(prompts=4, samples=2, prompt_length=8, mean_response=16, max_length=64)
    base = pc.plan_times(cfg, (2, 1, 2), row["memory"], workload, hw, drafter_bytes=1000)
    fast = pc.plan_times(cfg, (2, 1, 2), row["memory"], workload,
                         dataclasses.replace(hw, hbm_bytes_s=2 * hw.hbm_bytes_s), drafter_bytes=1000)
    assert fast["rollout_s"] == pytest.approx(base["rollout_s"] / 2)  # decode reads bytes
    assert fast["learner_s"] == base["learner_s"] == pytest.approx(4 * base["old_logp_s"])  # FLOPs, remat
    # One update per step: its own forward gives the old log-probs, no pass of their own.
    on_policy = pc.plan_times(cfg, (2, 1, 2), row["memory"], dataclasses.replace(workload, minibatches=1), hw,
                              drafter_bytes=1000)
    assert on_policy["old_logp_s"] == 0 and on_policy["learner_s"] == base["learner_s"]
    # Eight sequences of at most 32 running: the whole rollout is the paper's tail.
    assert base["tail_share"] == 1 and base["rollout_tlt_s"] == pytest.approx(base["rollout_s"] / 2.61)


def test_continuous_batching_refills_in_order():
    # Two slots, unit steps: 10 and 20 start; 5 takes the first free slot at step 10.
    got = pc.simulate_group([10, 20, 5], slots=2, prompt_length=0, step_s=lambda active, kv: 1.0)
    assert got["plain_s"] == 20


def test_a_group_across_nodes_is_one_named_line(capsys):
    with pytest.raises(SystemExit):
        pc.main(["--plans=tiny:4x4x4"])
    err = capsys.readouterr().err
    assert "must lie on one node of 8" in err and len(err.strip().splitlines()) == 1
