"""bench_peers without training anything: a framework that cannot be installed is reported
with the wheel it misses and the others still run; the figures and ratios of the table; the
tunix worker's two run-time workarounds. The bench in a child process: its absl flags share
names with other launchers the tests import."""
import json
import subprocess
import sys
import types

import jax
import numpy as np

from experiments import _peer_tunix
from tests.support.child import printed_json

_RUN_ALL = r"""
import json, re, sys
from absl import flags
from experiments import bench_peers

flags.FLAGS(["bench_peers", "--setup=sft_tiny", "--frameworks=baseline,trl,tunix", "--steps=3",
             "--warmup_steps=1", f"--work_dir={sys.argv[1]}", f"--out={sys.argv[1]}/out.json"])

def no_tunix(venv_dir, wheel):
    return None, f"tunix: cannot install the wheel {wheel} into {venv_dir} (pip exit status 1: No matching "\
                 "distribution)"

bench_peers.trl_missing = lambda: "trl: cannot import TRL's GRPOTrainer (No module named 'trl'); pip install trl"
ran = []

def launch(command):
    # What a run writes: its forward check and three steps of 2, 4 and 6 s (rollout half).
    name = re.search(r"--single=(\w+)", " ".join(command)).group(1)
    ran.append(name)
    out = next(a.split("=", 1)[1] for a in command if a.startswith("--out="))
    steps = [dict(step=i + 1, time_step_s=t, time_rollout_s=t / 2, time_reward_s=0.0, tokens=100 * t,
                  reward_mean=0.1 * (i + 1)) for i, t in enumerate([2.0, 4.0, 6.0])]
    with open(out, "w") as f:
        json.dump(dict(framework=name, forward_max_abs_diff=1e-6, steps=steps), f)
    return 0, ""

result = bench_peers.run_all(launch, lambda n, w, o: bench_peers.framework_command(n, w, o, python_of=no_tunix))
print(json.dumps(dict(ran=ran, frameworks=result["frameworks"], prompts=len(json.load(open(
    sys.argv[1] + "/work_sft_tiny.json"))["prompts"]))))
"""


def test_a_framework_that_cannot_install_is_named_and_the_others_run(tmp_path):
    done = subprocess.run([sys.executable, "-c", _RUN_ALL, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ran"] == ["baseline"] and out["prompts"] == 3
    frameworks = out["frameworks"]
    assert "google-tunix==0.1.7" in frameworks["tunix"]["missing"]
    assert "trl" in frameworks["trl"]["missing"]
    s = frameworks["baseline"]["summary"]
    assert s["median"]["time_step_s"] == 5.0 and s["median"]["time_rollout_s"] == 2.5  # steps 2 and 3
    assert s["rollout_tokens_per_s"] == 200.0 and s["step_speedup_vs_baseline"] == 1.0
    assert abs(s["reward_last"] - 0.3) < 1e-9
    on_disk = json.loads((tmp_path / "out.json").read_text())
    assert set(on_disk["frameworks"]) == {"baseline", "trl", "tunix"}


_TUNIX_PYTHON = r"""
import json, sys, types
from experiments import bench_peers

def pip_fails(command, **kwargs):
    failed = "pip" in command or "-c" in command
    return types.SimpleNamespace(returncode=1 if failed else 0, stdout="",
                                 stderr="ERROR: No matching distribution found for google-tunix==0.1.7\n")

print(json.dumps(bench_peers.tunix_python(sys.argv[1], "google-tunix==0.1.7", run=pip_fails)))
"""


def test_tunix_environment_that_cannot_be_built_names_the_wheel(tmp_path):
    python, why = printed_json(_TUNIX_PYTHON, str(tmp_path / "venv"))
    assert python is None
    assert "google-tunix==0.1.7" in why and "No matching distribution" in why


def test_rope_patch_gives_attention_the_checkpoint_base():
    def apply_rope(inputs, positions, head_dim, rope_theta=1_000_000):
        return rope_theta

    model_lib = types.SimpleNamespace(apply_rope=apply_rope)
    _peer_tunix.patch_rope(model_lib, 10_000.0)
    assert model_lib.apply_rope(None, None, head_dim=32) == 10_000.0  # as llama3's attention calls it
    _peer_tunix.patch_rope(model_lib, 500_000.0)  # patching again replaces the base, never stacks
    assert model_lib.apply_rope(None, None, head_dim=32) == 500_000.0


def test_rollout_seed_patch_gives_every_call_its_own_key():
    import dataclasses

    @dataclasses.dataclass
    class Config:
        seed: object = None

    def keys(seed: int, calls: int) -> list:
        class VanillaRollout:
            def generate(self, prompts, rollout_config, **kwargs):
                return np.asarray(rollout_config.seed).tolist()

        _peer_tunix.patch_rollout_seed(types.SimpleNamespace(VanillaRollout=VanillaRollout), jax, seed)
        return [VanillaRollout().generate(["p"], Config()) for _ in range(calls)]

    first = keys(3, 3)
    assert len({tuple(k) for k in first}) == 3  # each call (each RL step) its own key
    assert keys(3, 3) == first and keys(4, 1)[0] != first[0]  # a function of the seed
