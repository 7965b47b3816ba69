"""bench_tlt's speed-ups: the same steps of the two modes, paired. In a child process:
bench_tlt's absl flags share names (steps, out) with other launchers the tests import."""
import json
import subprocess
import sys

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
    done = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    s = out["speedups"]
    assert abs(s["step_speedup"] - 17.0 / 13.0) < 1e-9  # ratios 1.33, 1.31, 1.125, 1.33, 1.31
    assert abs(s["step_speedup_total"] - 58.5 / 45.5) < 1e-9
    assert abs(s["rollout_speedup"] - 2.0) < 1e-9  # ratios 2, 1.6, 2, 1.6, 2
    assert abs(s["rollout_speedup_total"] - 28.0 / 15.5) < 1e-9
    assert "same --steps" in out["unlike_steps"]
