"""experiments/pass_at_k.py's estimator (in a child process: its absl flags share names with
other launchers the tests import)."""
from tests._child import printed_json

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
print(json.dumps(out))
"""


def test_pass_at_k_is_the_unbiased_estimator():
    out = printed_json(_CHECK)
    assert out["any"] == 0.75  # 3 of 4 prompts have a correct sample
    assert abs(out["one"] - (0 + 1 + 4 + 2) / 16) < 1e-12  # the share of correct samples
    # k = 2: 1 - C(4 - c, 2) / C(4, 2) = 0, 1/2, 1, 5/6
    assert abs(out["two"] - (0 + 0.5 + 1 + 5 / 6) / 4) < 1e-12
    assert "--k=5 must be between 1 and --num_samples=4" in out["error"]
