"""experiments.plan_memory: the micro-batch search, every step compiled from abstract
shapes at the tiny preset, and its named input errors."""
import json

import numpy as np
import pytest

from experiments import plan_memory as pm


def _affine(intercept, slope, calls):
    def measure_at(b):
        calls.append(b)
        return {"total": intercept + slope * b}

    return measure_at


@pytest.mark.parametrize("unit,limit,cap,want,capped", [
    (2, 100, 4096, 30, False),  # 10 + 3b <= 100
    (2, 101, 4096, 30, False),
    (1, 100, 4096, 30, False),
    (8, 1000, 64, 64, True),  # the cap fits
    (2, 17, 64, 2, False),  # only the smallest fits
    (2, 5, 64, None, False),  # nothing fits
])
def test_search_finds_largest_fit_in_few_compiles(unit, limit, cap, want, capped):
    calls = []
    found = pm.largest_fitting(_affine(10, 3, calls), unit, limit, cap)
    assert (found["batch"], found["capped"]) == (want, capped)
    assert len(calls) == len(set(calls)) <= 3  # each size once; the line needs no fourth
    assert found["at"]["total"] == 10 + 3 * (want or unit)


def test_search_off_the_line_still_exact():
    # A jump in memory past 20 rows: the line through 2 and 4 misleads, bisection corrects.
    calls = []
    found = pm.largest_fitting(lambda b: calls.append(b) or {"total": 3 * b + (50 if b >= 20 else 10)}, 2, 100)
    assert found["batch"] == 18 and len(calls) <= 8


def _args(tmp_path, **kw):
    argv = ["--presets=tiny", "--mesh=1x2x1", "--seq_lens=64", f"--out={tmp_path / 'plan.json'}"]
    argv += [f"--{k}={v}" for k, v in kw.items()]
    return pm._arg_parser().parse_args(argv)


def test_every_step_compiles_at_the_tiny_shape(tmp_path, capsys):
    # A limit nothing meets: one compile per step, at the smallest micro-batch (2 rows on
    # fsdp=2; decode: 2 slots), reported with what it needs.
    rows = pm.run(_args(tmp_path, device_memory_gb=1e-6))
    assert [r["step"] for r in rows] == list(pm.STEPS)
    for r in rows:
        assert r["micro_batch"] is None and r["probes"] == [2]
        assert r["args_gb"] > 0 and r["temp_gb"] > 0
        assert r["total_gb"] == pytest.approx(r["args_gb"] + r["out_gb"] + r["temp_gb"] - r["alias_gb"]
                                              + r["resident_gb"])
    by_step = {r["step"]: r for r in rows}
    # A learner micro-step donates its float32 gradient accumulator (the new sum is the old
    # one's buffers), beside AdamW's resident state of twice that (two moments).
    learner = by_step["learner"]
    assert learner["resident_gb"] > 0 and learner["alias_gb"] == pytest.approx(learner["resident_gb"] / 2, rel=0.01)
    assert all(r["resident_gb"] == 0 for r in rows if not r["step"].startswith("learner"))
    # The on-policy TLT update hands the drafter's data (hidden states, top-K) out beside the sum.
    assert by_step["learner_tlt"]["out_gb"] > by_step["learner_remat"]["out_gb"]
    assert "does not fit in 1e-06 GB at any micro-batch: the smallest (2) needs" in capsys.readouterr().out
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["complete"] and len(saved["results"]) == len(pm.STEPS)


def test_decode_search_matches_its_compiles(tmp_path):
    cache = {}
    first = pm.run(_args(tmp_path, steps="decode", max_micro_batch=8), cache)[0]
    assert first["micro_batch"] == 8 and first["capped"]
    total = {b: m["total"] for (_, b), m in cache.items()}
    assert total[2] < total[4] < total[8]  # slots hold KV cache
    limit = (total[4] + total[8]) / 2
    row = pm.run(_args(tmp_path, steps="decode", max_micro_batch=8, device_memory_gb=limit / pm.GB), cache)[0]
    b = row["micro_batch"]
    assert b in (4, 6) and total.get(b, cache[(pm.Case("tiny", "decode", (1, 2, 1), 64), b)]["total"]) <= limit
    nxt = cache.get((pm.Case("tiny", "decode", (1, 2, 1), 64), b + 2))
    assert nxt is None and b == 6 or nxt["total"] > limit  # 8 over the limit, or 6 over it


def test_blockwise_attention_frees_what_dense_scores_take(tmp_path):
    # Rows of 1536 tokens (three 512-token blocks): dense attention holds [rows, heads, T, T]
    # float32 scores (and more of their size) per layer, blockwise a tile of them.
    rows = pm.run(_args(tmp_path, steps="learner_remat,old_logp", seq_lens=1536, attention_impl="dense,auto",
                        device_memory_gb=1e-6))
    temp = {(r["step"], r["attention_impl"]): r["temp_gb"] * pm.GB for r in rows}
    scores = 4 * 1535 * 1535 * 4  # a device's row (of 2 over fsdp=2): 4 heads x (T-1)^2 float32
    for step in ("learner_remat", "old_logp"):
        assert temp[(step, "dense")] - temp[(step, "auto")] > scores, (step, temp)


@pytest.mark.parametrize("argv,message", [
    (["--presets=nope"], "Error: Unknown model preset 'nope'"),
    (["--presets=tiny", "--mesh=3x1x1", "--devices=2"], "has 3 devices but 2 are available"),
    (["--presets=tiny", "--mesh=-1x3x1", "--devices=8"], "cannot fill 8 devices"),
    (["--presets=tiny", "--mesh=2x2"], "expected DATAxFSDPxTENSOR"),
    (["--presets=tiny", "--steps=prefill"], "Unknown steps ['prefill']"),
    (["--presets=tiny", "--attention_impl=flash"], "--attention_impl=flash: choose from auto, dense"),
    (["--presets=tiny", "--steps=learner", "--execute"], "--execute runs the distill step only; pass --steps=distill"),
])
def test_bad_input_is_one_named_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pm.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and message in err and len(err.strip().splitlines()) == 1


def test_an_executed_step_reports_its_plan_beside_the_measured_peak(tmp_path):
    """--execute runs one real distill update (the CPU has no device memory stats: the
    peak is None) and reads the planned total of the same case from a plan JSON."""
    plan = pm.run(_args(tmp_path, steps="distill", device_memory_gb=1e-6))[0]

    def executed(planned):
        args = _args(tmp_path, steps="distill", planned=planned, out=tmp_path / "executed.json")
        args.execute = True
        return pm.run(args)[0]

    row = executed(tmp_path / "plan.json")
    assert row["planned_total_gb"] == pytest.approx(plan["smallest_total_gb"])
    assert row["total_gb"] == pytest.approx(row["args_gb"] + row["out_gb"] + row["temp_gb"] - row["alias_gb"])
    assert row["measured_peak_gb"] is None and np.isfinite(row["loss"])
    other = json.loads((tmp_path / "plan.json").read_text())
    other["results"][0]["seq_len"] = 128
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="has no row for"):
        executed(tmp_path / "other.json")
