"""bench_tlt's speed-ups: the same steps of the two modes, paired; each mode a fresh process
in ABBA order, the geometric mean over pairs. In a child process: bench_tlt's absl flags
share names (steps, out) with other launchers the tests import."""
import json
import math
import os
import shlex
import subprocess
import sys

import pytest

from tests.support.child import printed_json

_CHECK = r"""
import json, sys
from experiments import bench_tlt

def mode(rollout, step, steps=None):
    return dict(steady_steps=steps or list(range(4, 4 + len(step))),
                steady_times=dict(time_rollout_s=rollout, time_step_s=step))

# Light and heavy steps with a gap between them: TLT is faster at every step, yet the
# baseline's median (9.0) sits below the gap and TLT's (8.0) above it.
baseline = mode([4.0, 4.0, 4.0, 8.0, 8.0], [8.0, 8.5, 9.0, 16.0, 17.0])
tlt = mode([2.0, 2.5, 2.0, 5.0, 4.0], [6.0, 6.5, 8.0, 12.0, 13.0])
out = dict(speedups=bench_tlt.paired_speedups(baseline, tlt))
try:
    bench_tlt.paired_speedups(mode([1.0], [2.0], [4]), mode([1.0], [2.0], [5]))
except ValueError as e:
    out["unlike_steps"] = str(e)
print(json.dumps(out))
"""


def test_speedups_pair_the_same_steps_and_refuse_unlike_ones():
    out = printed_json(_CHECK)
    s = out["speedups"]
    assert abs(s["step_speedup"] - 17.0 / 13.0) < 1e-9  # ratios 1.33, 1.31, 1.125, 1.33, 1.31
    assert abs(s["step_speedup_total"] - 58.5 / 45.5) < 1e-9
    assert abs(s["rollout_speedup"] - 2.0) < 1e-9  # ratios 2, 1.6, 2, 1.6, 2
    assert abs(s["rollout_speedup_total"] - 28.0 / 15.5) < 1e-9
    assert abs(s["baseline_rollout_share"] - 28.0 / 58.5) < 1e-9
    # Per step, the baseline's step with TLT's rollout: 6, 7, 7, 13, 13 s; what it allows
    # (8/6, 8.5/7, 9/7, 16/13, 17/13) has median 9/7, and it over TLT's step (1, 1.077,
    # 0.875, 1.083, 1) has median 1: TLT added nothing outside the rollout but at step 6.
    assert abs(s["step_allowed"] - 9.0 / 7.0) < 1e-9
    assert abs(s["step_of_allowed"] - 1.0) < 1e-9
    assert abs(s["step_of_allowed_total"] - 46.0 / 45.5) < 1e-9
    assert "same --steps" in out["unlike_steps"]


_PREAMBLE = r"""
import json, os, shlex, sys
from experiments import bench_tlt

def summary(rollout, step, steps=None):
    # A mode's summary as a run writes it: per-step times of the timed steps and medians.
    med = {k: 0.1 for k in bench_tlt._TIMES}
    med.update(time_rollout_s=sorted(rollout)[len(rollout) // 2], time_step_s=sorted(step)[len(step) // 2])
    return dict(steady_steps=steps or list(range(4, 4 + len(step))), median=med, compile_s=1.0,
                steady_times=dict(time_rollout_s=rollout, time_step_s=step), new_compiled_programs=0,
                acceptance_length=[3.0] * len(step), final_eval_accuracy=0.5)

def scaled(times, ratio):
    return [t / ratio for t in times]

# Per pair, baseline and TLT per-step times whose per-step ratios are (rollout, step):
# pair 1 (3.0, 2.0), pair 2 (1.5, 1.25), pair 3 (2.0, 1.6). Unequal steps, equal ratios.
RATIOS = {1: (3.0, 2.0), 2: (1.5, 1.25), 3: (2.0, 1.6)}
ROLLOUT, STEP = [6.0, 7.5, 5.0], [10.0, 12.0, 9.0]

def scripted(mode, pair):
    r, s = RATIOS[pair]
    if mode == "baseline":
        return summary([x * pair for x in ROLLOUT], [x * pair for x in STEP])
    return summary(scaled([x * pair for x in ROLLOUT], r), scaled([x * pair for x in STEP], s))
"""

_AGGREGATE = _PREAMBLE + r"""
out = dict(abba=[(r["run"], r["pair"], r["mode"]) for r in bench_tlt.abba_order(["baseline", "tlt"], 2)],
           abba_tlt_first=[r["mode"] for r in bench_tlt.abba_order(["tlt", "baseline"], 3)],
           abba_three=[r["mode"] for r in bench_tlt.abba_order(["tlt", "frozen", "ngram"], 2)])
runs = [dict(r, result=dict(modes={r["mode"]: scripted(r["mode"], r["pair"])}))
        for r in bench_tlt.abba_order(["baseline", "tlt"], 3)]
out["agg"] = bench_tlt.aggregate(runs)
three = [dict(r, result=dict(modes={r["mode"]: scripted(r["mode"], r["pair"])}))
         for r in bench_tlt.abba_order(["baseline", "tlt", "frozen"], 2)]
out["versus"] = bench_tlt.aggregate(three).get("versus_baseline")
out["versus_two"] = bench_tlt.aggregate(runs).get("versus_baseline")
envs = {}
thp = sys.argv[1]
envs["linux"] = bench_tlt.child_environment({"A": "1"}, "linux", thp)
envs["linux_other_tunables"] = bench_tlt.child_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "linux", thp)
envs["linux_set"] = bench_tlt.child_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "linux", thp)
envs["linux_no_thp"] = bench_tlt.child_environment({}, "linux", thp + ".absent")
envs["darwin"] = bench_tlt.child_environment({}, "darwin", thp)
out["envs"] = envs
stat = thp + ".stat"
ticks = []
for line in ("cpu  100 0 50 800 0 0 0 50 0 0", "cpu  400 0 100 1100 0 0 0 400 0 0"):
    with open(stat, "w") as f:
        f.write(line + "\ncpu0 1 2 3\n")
    ticks.append(bench_tlt.cpu_ticks(stat))
out["steal"] = [ticks, bench_tlt.steal_fraction(*ticks), bench_tlt.cpu_ticks(stat + ".absent"),
                bench_tlt.steal_fraction(None, ticks[1])]
print(json.dumps(out))
"""


def test_abba_order_pairs_by_position_and_geometric_mean(tmp_path):
    thp = tmp_path / "enabled"
    thp.write_text("always [madvise] never\n")
    out = printed_json(_AGGREGATE, str(thp))
    assert out["abba"] == [[1, 1, "baseline"], [2, 1, "tlt"], [3, 2, "tlt"], [4, 2, "baseline"]]
    assert out["abba_tlt_first"] == ["tlt", "baseline", "baseline", "tlt", "tlt", "baseline"]
    assert out["abba_three"] == ["tlt", "frozen", "ngram", "ngram", "frozen", "tlt"]
    agg = out["agg"]
    assert [(p["pair"], p["baseline_run"], p["tlt_run"], p["first"]) for p in agg["pairs"]] == [
        (1, 1, 2, "baseline"), (2, 4, 3, "tlt"), (3, 5, 6, "baseline")]
    assert [round(p["step_speedup"], 9) for p in agg["pairs"]] == [2.0, 1.25, 1.6]
    assert agg["pairs_complete"] == 3
    # Geometric means: (3 * 1.5 * 2)^(1/3) and (2 * 1.25 * 1.6)^(1/3); arithmetic would be 2.17 and 1.62.
    assert abs(agg["rollout_speedup"] - 9.0 ** (1 / 3)) < 1e-9
    assert abs(agg["step_speedup"] - 4.0 ** (1 / 3)) < 1e-9
    assert (agg["rollout_speedup_min"], agg["rollout_speedup_max"]) == (1.5, 3.0)
    assert (agg["step_speedup_min"], agg["step_speedup_max"]) == (1.25, 2.0)
    assert abs(agg["step_speedup_total"] - 4.0 ** (1 / 3)) < 1e-9  # every step's ratio is the pair's
    of_allowed = [p["step_of_allowed"] for p in agg["pairs"]]
    assert abs(agg["step_of_allowed"] - math.prod(of_allowed) ** (1 / 3)) < 1e-9
    assert (agg["step_of_allowed_min"], agg["step_of_allowed_max"]) == (min(of_allowed), max(of_allowed))
    assert set(agg["modes"]) == {"baseline", "tlt"}
    # A third mode (scripted as TLT is) against the baseline of its pair: pairs 1 and 2.
    assert out["versus_two"] is None and list(out["versus"]) == ["frozen"]
    frozen = out["versus"]["frozen"]
    assert abs(frozen["rollout_speedup"] - 4.5 ** 0.5) < 1e-9 and abs(frozen["step_speedup"] - 2.5 ** 0.5) < 1e-9
    assert (frozen["rollout_speedup_min"], frozen["rollout_speedup_max"]) == (1.5, 3.0)
    assert agg["step_time_s"]["baseline"] == 20.0  # the median of the runs' medians 10, 20, 30
    envs = out["envs"]
    assert envs["linux"][0] == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert "added by bench_tlt" in envs["linux"][1]
    assert envs["linux_other_tunables"][0]["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert envs["linux_set"][0]["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
    assert "from the environment" in envs["linux_set"][1]
    assert envs["linux_no_thp"][0] == {} and envs["darwin"][0] == {}
    # The steal column is the 8th; between the readings 350 of 1000 ticks were stolen.
    assert out["steal"] == [[[50, 1000], [400, 2000]], 0.35, None, None]


_FAILED_RUN = _PREAMBLE + r"""
from absl import flags
tmp = sys.argv[1]
out_path = os.path.join(tmp, "out.json")
os.makedirs(f"{tmp}/target")
with open(f"{tmp}/target/config.json", "w") as f:  # a --target is decoded as it is: its own 3 layers
    json.dump({"num_hidden_layers": 3}, f)
flags.FLAGS(["bench_tlt", f"--out={out_path}", f"--run_dir={tmp}/runs", f"--target={tmp}/target",
             f"--drafter={tmp}/drafter", "--preset=cpu_tail", "--seed=5", "--steps=6", "--noregime_check"])
seen = []

def launch(command, env):
    mode = next(a.split("=", 1)[1] for a in command if a.startswith("--single_mode="))
    part = next(a.split("=", 1)[1] for a in command if a.startswith("--out="))
    with open(out_path) if os.path.exists(out_path) else open(os.devnull) as f:
        text = f.read()
    seen.append(dict(mode=mode, command=command, glibc=env.get("GLIBC_TUNABLES"),
                     runs_written=len(json.loads(text)["runs"]) if text else 0))
    if len(seen) == 1:
        return 1, "Traceback ...\nError: boom"
    pair = 1 if len(seen) == 2 else 2
    os.makedirs(os.path.dirname(part), exist_ok=True)
    with open(part, "w") as f:
        json.dump(dict(backend="cpu", modes={mode: scripted(mode, pair)}), f)
    return 0, ""

rc = bench_tlt.run_repeats(launch)
with open(out_path) as f:
    print(json.dumps(dict(rc=rc, seen=seen, result=json.load(f))))
"""


def test_a_failed_run_is_reported_and_the_others_kept(tmp_path):
    done = subprocess.run([sys.executable, "-c", _FAILED_RUN, str(tmp_path)], capture_output=True, text=True,
                          check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["rc"] == 1
    assert "failed, exit status 1: Traceback ...\nError: boom" in done.stdout
    assert "1 of 4 runs failed (runs 1)" in done.stdout
    seen = out["seen"]
    assert [s["mode"] for s in seen] == ["baseline", "tlt", "tlt", "baseline"]
    assert [s["runs_written"] for s in seen] == [0, 1, 2, 3]  # --out rewritten after every run
    result = out["result"]
    runs = result["runs"]
    assert [(r["run"], r["pair"], r["mode"], r["rc"]) for r in runs] == [
        (1, 1, "baseline", 1), (2, 1, "tlt", 0), (3, 2, "tlt", 0), (4, 2, "baseline", 0)]
    assert runs[0]["error"].endswith("Error: boom") and "result" not in runs[0]
    assert all("result" in r for r in runs[1:])
    assert result["pairs"][0]["missing"] == "run 1 (baseline) failed"
    # Pair 2 is runs 3 and 4 (by ABBA position), not the first TLT run that finished (run 2).
    assert result["pairs_complete"] == 1
    assert abs(result["step_speedup"] - 1.25) < 1e-9 and abs(result["rollout_speedup"] - 1.5) < 1e-9
    assert result["order"] == ["baseline", "tlt", "tlt", "baseline"] and result["backend"] == "cpu"
    assert result["layers"] == 3  # the --target's, not the preset's 16
    assert set(result["machine"]) == {"cpu", "last_level_cache_bytes", "cpus"} and "regime" not in result
    for s in seen:
        args = s["command"][s["command"].index("experiments.bench_tlt") + 1:]
        assert args[-2:] == [f"--single_mode={s['mode']}", args[-1]]
        assert args[-1].startswith(f"--out={tmp_path}/runs/runs_parts/")
        assert {"--preset=cpu_tail", "--seed=5", "--steps=6", f"--target={tmp_path}/target"} <= set(args)
        assert not any(a.startswith(f"--out={tmp_path}/out.json") for a in args)


def test_print_commands_shows_the_runs_with_the_same_flags(tmp_path):
    flags_given = ["--preset=cpu_tail", "--seed=3", "--steps=5", "--tlt_set=tlt.tuner.max_active=32",
                   "--tlt_set", "tlt.tuner.arms=[['plain'], ['plain', 'eagle-d4']]", f"--cache_dir={tmp_path}/c",
                   f"--run_dir={tmp_path}/r", "--modes=tlt,baseline", "--repeats=2"]
    done = subprocess.run([sys.executable, "-m", "experiments.bench_tlt", "--print_commands", *flags_given,
                           f"--out={tmp_path}/out.json"], capture_output=True, text=True, check=True)
    lines = done.stdout.strip().splitlines()
    commands = [shlex.split(line) for line in lines if not line.startswith("#")][1:]
    assert [c[-2] for c in commands] == [f"--single_mode={m}" for m in ("tlt", "baseline", "baseline", "tlt")]
    for n, command in enumerate(commands, start=1):
        assert command[1:3] == ["-m", "experiments.bench_tlt"]
        passed = command[3:-2]
        tlt_set = ["--tlt_set=tlt.tuner.max_active=32", "--tlt_set=tlt.tuner.arms=[['plain'], ['plain', 'eagle-d4']]"]
        assert sorted(passed) == sorted(["--preset=cpu_tail", "--seed=3", "--steps=5", *tlt_set,
                                         f"--cache_dir={tmp_path}/c", f"--run_dir={tmp_path}/r"])
        assert [a for a in passed if a.startswith("--tlt_set")] == tlt_set  # in the order given
        assert command[-1] == f"--out={tmp_path}/r/runs_parts/run{n}_{command[-2].split('=')[1]}.json"
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "c").exists()  # nothing ran, nothing built


def test_a_negative_slow_reward_is_an_error_naming_the_flag(tmp_path):
    done = subprocess.run([sys.executable, "-m", "experiments.bench_tlt", "--slow_reward_ms=-5", "--print_commands",
                           f"--run_dir={tmp_path}/r"], capture_output=True, text=True)
    assert done.returncode != 0
    assert "--slow_reward_ms=-5.0 must be >= 0" in done.stderr


_DECODE_WIDTHS = r"""
import json, sys
from absl import flags
from experiments import bench_tlt
flags.FLAGS(["bench_tlt", *sys.argv[1:]])
preset = bench_tlt.PRESETS["cpu_wide_decode"]
bench_tlt._mlp_size_for_cache = lambda target_dir: {"t": 5120}[target_dir]  # what this machine's cache asks
print(json.dumps({m: bench_tlt.mode_config(m, preset, "t", "d", 0, 2).rollout.decode_mlp_size
                  for m in ("baseline", "tlt")}))
"""


@pytest.mark.parametrize("given, want", [([], 5120), (["--decode_mlp_size=8192"], 8192), (["--decode_mlp_size=0"], 0)])
def test_decode_mlp_size_is_sized_from_the_cache_or_overridden_in_both_modes(given, want, tmp_path):
    assert printed_json(_DECODE_WIDTHS, f"--run_dir={tmp_path}", *given) == {"baseline": want, "tlt": want}


_OVERRIDDEN = """
import json, sys
from absl import flags
from experiments import bench_tlt
flags.FLAGS(["bench_tlt", *sys.argv[1:]])
configs = {m: bench_tlt.mode_config(m, bench_tlt.PRESETS["cpu_tail"], "t", "d", 0, 2) for m in ("baseline", "tlt")}
print(json.dumps({m: [c.rollout.kv_bucket, c.rollout.top_p] for m, c in configs.items()}))
"""


def test_set_overrides_every_mode_and_tlt_set_the_tlt_modes_after_it(tmp_path):
    overridden = printed_json(_OVERRIDDEN, f"--run_dir={tmp_path}", "--set=rollout.kv_bucket=0",
                              "--set=rollout.top_p=0.9", "--tlt_set=rollout.top_p=0.8")
    assert overridden == {"baseline": [0, 0.9], "tlt": [0, 0.8]}


_LEARNER = """
import json, sys
from absl import flags
from experiments import bench_tlt
flags.FLAGS(["bench_tlt", *sys.argv[1:]])
configs = {m: bench_tlt.mode_config(m, bench_tlt.PRESETS["cpu_wide_pair"], "t", "d", 0, 2, built=False)
           for m in ("baseline", "tlt")}
print(json.dumps({m: [c.learner.micro_batch_size, c.learner.num_minibatches, c.tlt.drafter.batch_size,
                      c.tlt.drafter.optimizer.learning_rate, c.tlt.drafter.optimizer.b2,
                      c.tlt.spot.catch_up_max_share] for m, c in configs.items()}))
"""


@pytest.mark.parametrize("given, want", [
    ([], {"baseline": [8, 1, 4, 1e-4, 0.95, 0.02], "tlt": [8, 1, 4, 1e-4, 0.95, 0.02]}),
    (["--set=learner.num_minibatches=2", "--tlt_set=tlt.drafter.batch_size=16",
      "--tlt_set=tlt.drafter.optimizer.learning_rate=1e-3", "--tlt_set=tlt.spot.catch_up_max_share=1.0"],
     {"baseline": [8, 2, 4, 1e-4, 0.95, 0.02], "tlt": [8, 2, 16, 1e-3, 0.95, 1.0]})])
def test_a_presets_learner_and_drafter_reach_the_modes_under_the_overrides(given, want, tmp_path):
    assert printed_json(_LEARNER, f"--run_dir={tmp_path}", *given) == want


_PRESET_NAMES = """
import json
import math
from absl import flags
from experiments import bench_tlt
print(json.dumps([sorted(flags.FLAGS["preset"].parser.enum_values), sorted(bench_tlt.PRESETS)]))
"""


def test_every_preset_is_a_value_of_the_preset_flag():
    # In a child: the experiments' flags would clash with other modules' in this process.
    flag_values, presets = printed_json(_PRESET_NAMES)
    assert flag_values == presets


def test_an_override_of_no_field_is_an_error_naming_it_before_any_run(tmp_path):
    done = subprocess.run([sys.executable, "-m", "experiments.bench_tlt", "--tlt_set=rollout.spec_step_per_sync=16",
                           "--print_commands", f"--run_dir={tmp_path}/r"], capture_output=True, text=True)
    assert done.returncode != 0
    assert "--set/--tlt_set 'rollout.spec_step_per_sync=16'" in done.stderr
    assert "# run 1" not in done.stdout and not os.path.exists(f"{tmp_path}/r")


_DRAFTERS = r"""
import json
from experiments import bench_tlt

def run(n, pair, mode, acceptance, tokens_per_s, digests):
    thirds = dict(acceptance_length=bench_tlt.thirds(acceptance),
                  rollout_tokens_per_s=bench_tlt.thirds(tokens_per_s))
    return dict(run=n, pair=pair, mode=mode, result=dict(modes={mode: dict(thirds=thirds, samples_digest=digests)}))

# Six steps a run: thirds of two steps. TLT holds its acceptance, frozen loses a third of it.
# Pair 1 drew the same samples throughout (coupled); pair 2's parted after step 3.
runs = [run(1, 1, "frozen", [6, 6, 5, 5, 4, 4], [100] * 6, [1, 2, 3, 4, 5, 6]),
        run(2, 1, "tlt", [6, 6, 6, 6, 6, 6], [150] * 6, [1, 2, 3, 4, 5, 6]),
        run(3, 2, "tlt", [6, 6, 6, 6, 6, 6], [120] * 6, [1, 2, 3, 7, 8, 9]),
        run(4, 2, "frozen", [6, 6, 6, 6, 4, 4], [100] * 6, [1, 2, 3, 4, 5, 6])]
print(json.dumps(dict(cmp=bench_tlt.drafter_comparisons(runs), short=bench_tlt.thirds([1, 2, 3, 4, 5]),
                      gaps=bench_tlt.thirds([None, 2, 3, 4, 5, None]))))
"""


def test_a_trained_drafter_is_compared_with_the_frozen_one_of_its_pair_over_the_last_third():
    out = printed_json(_DRAFTERS)
    versus = out["cmp"]["tlt_versus_frozen"]
    assert [(p["pair"], p["acceptance_length"], p["rollout_tokens_per_s"], p["same_samples_steps"])
            for p in versus["pairs"]] == [(1, 1.5, 1.5, 6), (2, 1.5, 1.2, 3)]
    assert abs(versus["acceptance_length_last_third"] - 1.5) < 1e-9
    assert abs(versus["rollout_tokens_per_s_last_third"] - (1.5 * 1.2) ** 0.5) < 1e-9
    assert list(out["cmp"]) == ["tlt_versus_frozen"]
    assert out["short"] is None  # fewer than 6 steps: no thirds
    assert out["gaps"] == {"first": 2.0, "last": 5.0, "last_over_first": 2.5}  # a step with no figure is skipped


def test_a_drift_preset_with_no_thirds_is_refused_naming_the_steps(tmp_path):
    done = subprocess.run([sys.executable, "-m", "experiments.bench_tlt", "--preset=cpu_drift_shift", "--steps=8",
                           "--print_commands", f"--run_dir={tmp_path}/r"], capture_output=True, text=True)
    assert done.returncode != 0
    assert "--steps=8: preset cpu_drift_shift compares the first and the last third" in done.stderr
    assert "needs at least 9" in done.stderr


_PINNED = r"""
import json, sys
from absl import flags
from experiments import bench_tlt
flags.FLAGS(["bench_tlt", *sys.argv[1:]])
preset = bench_tlt.PRESETS["cpu_drift_shift"]
modes = ("baseline", "tlt", "frozen", "scratch")
configs = {m: bench_tlt.mode_config(m, preset, "t", "d", 0, 2, built=False) for m in modes}
from tlt_jax.rollout import tuner
for c in configs.values():
    tuner.from_config(c.tlt.tuner)  # what the run checks first
print(json.dumps({m: [c.tlt.tuner.arms, c.tlt.tuner.max_active, c.balance_tasks, sorted(c.data.tasks),
                      c.data.tasks.countdown.weight, c.tlt.drafter.init, c.tlt.drafter.optimizer.learning_rate,
                      c.tlt.drafter.publish_scored, c.tlt.spot.catch_up_max_share, c.tlt.spot.catch_up_steps,
                      c.rollout.spec_coupled]
                  for m, c in configs.items()}))
"""


@pytest.mark.parametrize("given, arm", [([], "eagle-d6"), (["--pin_arm=eagle-d4"], "eagle-d4")])
def test_the_drift_presets_pin_one_arm_for_the_drafter_modes_and_balance_the_tasks(given, arm, tmp_path):
    out = printed_json(_PINNED, f"--run_dir={tmp_path}", *given)
    modes = ("baseline", "tlt", "frozen", "scratch")
    for mode in modes[1:]:
        assert out[mode][:5] == [[[arm]], 8, True, ["addition", "countdown"], 1.0]
    assert out["baseline"][0] != [[arm]] and out["baseline"][2:5] == [True, ["addition", "countdown"], 1.0]
    # The warm start at 3e-4, scored, with 8 catch-up steps uncapped; a drafter from nothing
    # at 1e-3, every version published, with 8 up to 10% of the run.
    assert out["tlt"][5] == "d" and out["tlt"][6:10] == [3e-4, True, 1.0, 8]
    assert out["scratch"][5:10] == ["", 1e-3, False, 0.1, 8]
    # Every mode, the baseline too, speculates coupled: one trajectory of the policy for all.
    assert all(out[m][10] is True for m in modes)


def test_a_tlt_override_trains_the_trained_modes_and_never_the_frozen_one(tmp_path):
    out = printed_json(_PINNED, f"--run_dir={tmp_path}", "--tlt_set=tlt.spot.catch_up_steps=4")
    assert out["tlt"][9] == out["scratch"][9] == 4 and out["frozen"][9] == 0


_ENV = r"""
import json, sys
from absl import flags
from experiments import bench_tlt, scripted_env
from tlt_jax import envs
flags.FLAGS(["bench_tlt", *sys.argv[1:]])
preset = bench_tlt.PRESETS[flags.FLAGS.preset]
out = {}
for m in ("baseline", "tlt"):
    c = bench_tlt.mode_config(m, preset, "t", "d", 0, 2, built=False)
    e = envs.EnvConfig.from_config(c)
    out[m] = [e.name, e.max_turns, e.overlap, c.reward]
# The environment the runs resolve: its latency, stop string, observation and reward.
make = lambda: envs.env_class(out["tlt"][0])({"prompt": "add 2+3\n", "answer": "5", "task": "addition"})
env = make()
shown = lambda result: [result.observation, result.reward, result.done]
out["env"] = [env.delay_s, list(env.stop_strings), shown(env.step("2+3=5\nanswer:")), shown(env.step("5"))]
out["wrong"] = shown(make().step("2+3=6\nanswer:")) + shown(make().step("no answer line"))
# Decode (the chunks alone), rollout and step paired per step, as each mode's summary gives them.
mode = lambda chunks, rollout, step: dict(steady_steps=[4, 5, 6], steady_times=dict(
    time_rollout_chunks_s=chunks, time_rollout_s=rollout, time_step_s=step))
speedups = bench_tlt.paired_speedups(mode([2.0, 3.0, 4.0], [3.0, 4.0, 5.0], [4.0, 5.0, 6.0]),
                                     mode([1.0, 1.0, 2.0], [2.0, 2.0, 3.0], [3.0, 3.0, 4.0]))
out["decode"] = [speedups["decode_speedup"], speedups["decode_speedup_total"], speedups["rollout_speedup"]]
try:
    scripted_env.name(-1.0)
except ValueError as e:
    out["bad"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.parametrize("given, want", [
    ([], ["experiments.scripted_env:after_20ms", 2, True, ""]),
    (["--env_latency_ms=7.5", "--noenv_overlap"], ["experiments.scripted_env:after_7.5ms", 2, False, ""])])
def test_the_env_preset_runs_a_scripted_environment_in_both_modes_and_pairs_decode(given, want, tmp_path):
    out = printed_json(_ENV, "--preset=cpu_wide_env", f"--run_dir={tmp_path}", *given)
    assert out["baseline"] == out["tlt"] == want
    # Two turns: the worked answer up to "answer:", a space back, then the answer, scored whole.
    assert out["env"] == [float(want[0].rsplit("_", 1)[1][:-2]) / 1e3, ["answer:"], [" ", 0.0, False],
                          [None, 1.0, True]]
    assert out["wrong"] == [" ", 0.0, False, None, 0.0, True]
    assert out["decode"] == [2.0, 9.0 / 4.0, 5.0 / 3.0]  # per step: decode 2, 3, 2; rollout 1.5, 2, 5/3
    assert out["bad"].startswith("env_latency_ms=-1.0 must be >= 0")


def test_env_flags_are_refused_on_a_preset_without_environment_steps(tmp_path):
    done = subprocess.run([sys.executable, "-m", "experiments.bench_tlt", "--preset=cpu_tail", "--env_latency_ms=5",
                           "--print_commands", f"--run_dir={tmp_path}/r"], capture_output=True, text=True)
    assert done.returncode != 0 and "--env_latency_ms and --env_overlap apply to a preset with environment steps" \
        in done.stderr


_PLOT_FROM = r"""
import json, sys
from experiments import bench_tlt

drawn = {}
bench_tlt.plot_acceptance = lambda modes, path: drawn.update(modes=modes, path=path)
mode = lambda name, a: dict(run=1, pair=1, mode=name, result=dict(modes={name: dict(acceptance_length=a)}))
pair, alone = sys.argv[1], sys.argv[2]
json.dump(dict(runs=[mode("tlt", [1]), mode("frozen", [2]), mode("tlt", [9])]), open(pair, "w"))
json.dump(dict(runs=[mode("scratch", [3]), mode("frozen", [9])]), open(alone, "w"))
bench_tlt.plot_from([pair, alone], sys.argv[3])
errors = []
for paths, out in (([pair], ""), ([sys.argv[4]], "x.json")):
    try:
        bench_tlt.plot_from(paths, out)
    except ValueError as e:
        errors.append(str(e))
print(json.dumps(dict(modes={m: s["acceptance_length"] for m, s in drawn["modes"].items()}, path=drawn["path"],
                      errors=errors)))
"""


def test_plot_from_draws_each_mode_from_its_first_run_among_earlier_results(tmp_path):
    """`--plot_from`: one acceptance plot of the modes of several earlier results (a pair
    and a run of a third mode); a mode two of them ran is drawn from the first."""
    (tmp_path / "baseline.json").write_text(json.dumps(dict(runs=[dict(result=dict(modes={"baseline": {}}))])))
    args = [str(tmp_path / n) for n in ("pair.json", "scratch.json", "three.json", "baseline.json")]
    out = printed_json(_PLOT_FROM, *args)
    assert out["modes"] == {"tlt": [1], "frozen": [2], "scratch": [3]}
    assert out["path"] == str(tmp_path / "three_acceptance.png")
    assert "needs --out" in out["errors"][0] and "no drafter mode" in out["errors"][1]


_DRIFT_LEARN = r"""
import json, sys
from absl import flags
from experiments import bench_tlt
flags.FLAGS(["bench_tlt", *sys.argv[1:]])
preset = bench_tlt.PRESETS["cpu_drift_learn"]
configs = {m: bench_tlt.mode_config(m, preset, "t", "d", 0, 2, built=False) for m in ("baseline", "frozen")}
print(json.dumps(dict(shipped=bench_tlt.build_warm_start("drift_learn", "no-cache"),
                      tasks=configs["baseline"].data.tasks.to_dict(),
                      arms=configs["frozen"].tlt.tuner.arms, coupled=configs["baseline"].rollout.spec_coupled,
                      lr=configs["baseline"].learner.optimizer.learning_rate)))
"""


def test_the_learning_drift_preset_starts_from_its_shipped_warm_start(tmp_path):
    out = printed_json(_DRIFT_LEARN, f"--run_dir={tmp_path}")
    # Shipped, so that a fresh machine trains neither (about 15 minutes on 2 cores).
    assert out["shipped"] == ["assets/sft_drift_learn", "assets/drafter_drift_learn"]
    addition = out["tasks"]["addition"]
    assert (addition["min_digits"], addition["max_digits"]) == (3, 5) and addition["trace_share"] < 0.5
    assert out["arms"] == [["eagle-d6"]] and out["coupled"] is True and out["lr"] == 3e-5
