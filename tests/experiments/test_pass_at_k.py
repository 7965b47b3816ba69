"""experiments/pass_at_k.py's estimator (in a child process: its absl flags share names with
other launchers the tests import)."""
from tests.support.child import printed_json

_CHECK = r"""
import json
import numpy as np
from experiments.pass_at_k import pass_at_k
c = np.array([0, 1, 4, 2])  # correct samples of 4, per prompt
out = dict(any=pass_at_k(c, 4, 4), one=pass_at_k(c, 4, 1), two=pass_at_k(c, 4, 2))
try:
    pass_at_k(c, 4, 5)
except ValueError as e:
    out["error"] = str(e)
from experiments.pass_at_k import by_format
samples = [dict(completion="1+2=3\nanswer: 3", reward=1.0), dict(completion="at once\nanswer: 4", reward=0.0),
           dict(completion="at once\nanswer: 3", reward=1.0), dict(completion="at once\nanswer: 5", reward=0.1)]
out["formats"] = by_format(samples)
print(json.dumps(out))
"""


def test_pass_at_k_is_the_unbiased_estimator_and_splits_formats():
    out = printed_json(_CHECK)
    assert out["any"] == 0.75  # 3 of 4 prompts have a correct sample
    assert abs(out["one"] - (0 + 1 + 4 + 2) / 16) < 1e-12  # the share of correct samples
    # k = 2: 1 - C(4 - c, 2) / C(4, 2) = 0, 1/2, 1, 5/6
    assert abs(out["two"] - (0 + 0.5 + 1 + 5 / 6) / 4) < 1e-12
    assert "--k=5 must be between 1 and --num_samples=4" in out["error"]
    # Each format's share and accuracy (a well-formed wrong answer's format credit, 0.1, is
    # not a right answer): in one child with the estimator, as a child costs seconds.
    assert out["formats"] == dict(trace_share=0.25, trace_accuracy=1.0, bare_share=0.75, bare_accuracy=1 / 3)


_BAND = r"""
import sys
from absl import app
from experiments import pass_at_k
app.run(pass_at_k.main, ["pass_at_k", *sys.argv[1:]])
"""


def test_the_drift_shift_warm_start_leaves_its_countdowns_to_learn():
    """bench_tlt's cpu_drift_shift wants its shipped warm start's countdowns (B) at pass@4 of
    about 5-15%: at 0 every group of B earns the same reward and GRPO has nothing to learn
    there, near 1 nothing is left to learn. 64 held-out prompts (0.125 when the model was
    shipped); the band is widened by the estimate's standard error there (about 0.04)."""
    out = printed_json(_BAND, "--model_dir=assets/sft_drift_shift", "--tasks=drift_shift", "--only=countdown")
    assert list(out) == ["countdown"]
    assert 0.03 <= out["countdown"]["pass@4"] <= 0.2
    assert out["countdown"]["pass@1"] < out["countdown"]["pass@4"]
