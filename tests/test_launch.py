"""Launchers: overrides, clear flag and config errors, a quiet console, the compilation cache,
the sweep runner, multi-host flags, the drafter export."""
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import generate, models
from experiments import sweep
from tests.support import sweep_config, xla_flags
from tlt_jax import metrics
from tlt_jax.drafter_training.io import load_drafter
from tlt_jax.models.config import from_config_dict


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout)


def test_every_preset_builds_a_model_config():
    for name in models.PRESET_NAMES:
        cfg = from_config_dict(models.model_config(name))
        assert cfg.num_params() > 0
    with pytest.raises(ValueError, match="presets"):
        models.model_config("gpt-5")


@pytest.mark.parametrize("name,published", [
    ("qwen2.5-0.5b", 0.494e9), ("qwen2.5-1.5b", 1.54e9), ("qwen2.5-7b", 7.62e9), ("qwen2.5-32b", 32.8e9),
    ("llama3.3-70b", 70.6e9),
])
def test_real_presets_have_their_published_parameter_counts(name, published):
    # The counts the model cards state: a wrong hidden, MLP or vocabulary size misses them.
    assert from_config_dict(models.model_config(name)).num_params() == pytest.approx(published, rel=0.01)


def test_generate_with_override_and_sweep_dry_run():
    out = _run("experiments.generate", "--config=configs/generate.py:tiny", "--config.model.num_layers=1",
               "--config.max_new_tokens=4", "--config.batch_size=2", "--strategy=ngram-d2-b1")
    assert out.returncode == 0, out.stderr
    summaries = [json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("{")]
    assert [s["mode"] for s in summaries] == ["plain", "ngram-d2-b1"]
    assert all(s["batch_size"] == 2 and s["new_tokens"] == 8 and s["tokens_per_s"] > 0 for s in summaries)

    out = _run("experiments.sweep", "--launcher=experiments.generate", "--config=configs/generate.py:tiny",
               "--sweep_dir=/tmp/sweep_test", "--dry_run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == len(generate.get_sweep()) == 4
    assert all("--config.run_dir=/tmp/sweep_test/" in line for line in lines)
    # --set overrides every point, before the point's own overrides (which win).
    todo = sweep.commands("experiments.train_drafter", "configs/drafter.py:long_tail",
                          [{"ttt_steps": 3}, {"steps": 5}], "/tmp/s", ("steps=100", "acceptance.depth=8"))
    common = ["--config.steps=100", "--config.acceptance.depth=8"]
    assert [c[-4:] for _, c in todo] == [common + ["--config.ttt_steps=3", "--config.run_dir=/tmp/s/ttt_steps=3"],
                                         common + ["--config.steps=5", "--config.run_dir=/tmp/s/steps=5"]]
    with pytest.raises(ValueError, match="--set='steps': write key=value"):
        sweep.commands("experiments.train_drafter", "configs/drafter.py:long_tail", [{}], "/tmp/s", ("steps",))


def test_generate_with_the_shipped_target_and_drafter():
    """As README.md runs it: plain and speculative completions (the same, greedy), the
    drafter's acceptance and the cost of a speculative step in plain steps."""
    out = _run("experiments.generate", "--target=assets/sft_tiny", "--drafter=assets/drafter_tiny",
               "--prompt=add 12+34\n", "--config.max_new_tokens=12", "--config.batch_size=2",
               "--config.timed_runs=1")
    assert out.returncode == 0, out.stderr
    summaries = {s["mode"]: s for s in map(json.loads, re.findall(r"^\{.*\}$", out.stdout, re.M))}
    assert list(summaries) == ["plain", "eagle-d4"]
    completions = re.findall(r"^--- (\S+): .*\n((?:\[.*\n(?: {6}.*\n)*)+)", out.stdout, re.M)
    assert [mode for mode, _ in completions] == ["plain", "eagle-d4"]
    assert completions[0][1] == completions[1][1]  # greedy: speculation changes nothing
    assert summaries["eagle-d4"]["acceptance_length"] > 1.5 and summaries["plain"]["acceptance_length"] == 0
    assert re.search(r"took [\d.]+ ms, [\d.]+ plain steps of [\d.]+ ms, and committed [\d.]+ tokens", out.stdout)


LAUNCHERS = sorted(f[:-3] for f in os.listdir("experiments") if f.endswith(".py")
                   and "launch.run(" in open(os.path.join("experiments", f)).read())


def test_every_launchers_help_says_what_it_does_and_lists_its_flags():
    procs = {name: subprocess.Popen([sys.executable, "-m", f"experiments.{name}", "--help"], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for name in LAUNCHERS}
    assert len(procs) >= 15
    for name, proc in procs.items():
        text = proc.communicate(timeout=300)[0]
        assert proc.returncode in (0, 1), (name, text)  # absl exits 1 after printing --help
        source = open(f"experiments/{name}.py").read()
        summary = re.search(r'^r?"""(.*)$', source, re.M).group(1).strip()
        own = re.findall(r'DEFINE_\w+\(\s*"(\w+)"', source)
        assert text.startswith(summary), (name, text[:200])
        missing = [f for f in own if f"--{f}" not in text and f"--[no]{f}" not in text]  # absl: --[no]bool
        assert not missing, (name, missing)
        assert "--verbosity=0" in text  # the shared flags


def test_sweep_runs_each_point_as_its_own_process(tmp_path):
    out = subprocess.run([sys.executable, "-m", "experiments.sweep", "--launcher=tests.support.sweep_point",
                          "--config=tests/support/sweep_config.py", f"--sweep_dir={tmp_path}", "--parallel=2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr  # one point fails, so the sweep does
    status = json.loads((tmp_path / "sweep.json").read_text())
    assert {name: r["returncode"] for name, r in status.items()} == {
        "lr=0.1,seed=0": 0, "lr=0.1,seed=1": 0, "lr=0.2,seed=0": 0, "lr=0.2,seed=1": 0, "seed=9,fail=True": 3}
    points = {name: json.loads((tmp_path / name / "point.json").read_text()) for name in status}
    assert len({p["pid"] for p in points.values()} | {os.getpid()}) == len(points) + 1  # a process each
    for overrides in sweep_config.get_sweep():  # each with its own overrides, run directory and log
        name = sweep.point_name(overrides)
        want = {**sweep_config.get_config().to_dict(), **overrides, "run_dir": str(tmp_path / name)}
        assert points[name]["config"] == want
        assert (tmp_path / f"{name}.log").exists()


@pytest.mark.parametrize("override,message", [
    ("--config.model.num_layerz=2", "unknown config key num_layerz"),
    ("--config.model.num_layers=2.5", "invalid literal for int()"),
])
def test_bad_override_is_a_flag_error(override, message):
    out = _run("experiments.generate", "--config=configs/generate.py:tiny", override)
    assert out.returncode == 1
    assert "FATAL Flags parsing error" in out.stderr and message in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_config_value_is_one_line_and_leaves_the_run_directory_alone(tmp_path):
    recorded = '{"rollout": {"max_tokens": 96}}'
    (tmp_path / "config.json").write_text(recorded)
    out = _run("experiments.train_rl", "--config=configs/rl.py:tiny", f"--config.run_dir={tmp_path}",
               "--config.rollout.max_tokens=-5")
    assert out.returncode == 1
    assert "rollout.max_tokens must be >= 1, got -5" in out.stderr and "Traceback" not in out.stderr
    assert (tmp_path / "config.json").read_text() == recorded
    assert sorted(os.listdir(tmp_path)) == ["config.json"]

    out = _run("experiments.train_rl", "--config=configs/rl.py:tiny", f"--config.run_dir={tmp_path}",
               "--config.rollout.max_tokens=-5", "--verbosity=1")
    assert out.returncode == 1 and "Traceback" in out.stderr


def test_missing_checkpoint_is_one_line_naming_the_flag():
    out = _run("experiments.check_hf", "--hf_dir=/missing")
    assert out.returncode == 1
    assert "--hf_dir='/missing' does not exist" in out.stderr and "Traceback" not in out.stderr


def test_compilation_cache_is_filled_unless_turned_off(tmp_path):
    args = ("experiments.generate", "--config=configs/generate.py:tiny", "--config.model.num_layers=1",
            "--config.max_new_tokens=2", "--config.batch_size=1")
    # Without the flag: in $JAX_COMPILATION_CACHE_DIR; run again, nothing new compiles.
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    entries = set(os.listdir(tmp_path / "cache"))
    assert len(entries) > 1
    assert "Prompt: token ids [1, 2, 3, 4]" in out.stderr and "greedy" in out.stderr
    assert subprocess.run([sys.executable, "-m", *args], capture_output=True, timeout=300, env=env).returncode == 0
    assert set(os.listdir(tmp_path / "cache")) == entries

    out = _run(*args, f"--compilation_cache_dir={tmp_path / 'off'}", "--nocompilation_cache")
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "off").exists()


_ON_TWO_DEVICES = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tlt_jax import launch
launch.enable_compilation_cache(sys.argv[1])
devices = jax.devices()[int(sys.argv[2]):][:2]
x = jax.device_put(jnp.arange(8.0), NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec("x")))
print(jax.jit(lambda a: (a * 2).sum())(x))
"""


def test_a_program_on_one_process_s_devices_loads_in_a_process_of_other_devices(tmp_path):
    """A CPU program's cache key names neither its devices nor the process's others: a
    process of 4 devices loads what one of 8 compiled on devices 4-5 (an 8-device process's
    second rollout group, a process of a 2-process run)."""
    cache = str(tmp_path / "cache")
    for count, first in ((8, 4), (4, 0)):
        env = dict(os.environ, XLA_FLAGS=xla_flags(count))
        out = subprocess.run([sys.executable, "-c", _ON_TWO_DEVICES, cache, str(first)], capture_output=True,
                             text=True, timeout=120, env=env)
        assert out.returncode == 0 and out.stdout.strip() == "56.0", out.stderr
        if count == 8:
            entries = set(os.listdir(cache))
    assert entries and set(os.listdir(cache)) == entries


def test_partial_multihost_flags_are_refused():
    out = _run("experiments.generate", "--config=configs/generate.py:tiny", "--num_processes=2")
    assert out.returncode != 0
    assert "--coordinator_address, --num_processes and --process_id" in out.stderr


def test_train_drafter_writes_a_loadable_drafter_and_resumes_exactly(tmp_path):
    def train_drafter(run_dir, steps):
        return subprocess.Popen(
            [sys.executable, "-m", "experiments.train_drafter", "--config=configs/drafter.py:tiny",
             f"--config.run_dir={run_dir}", f"--config.steps={steps}", "--config.data.num_train=64",
             "--config.data.num_eval=8", "--config.batch_size=8", "--config.eval_every=2",
             "--config.checkpoint_every=2", "--config.eval_batch_size=8", "--config.acceptance.num_prompts=0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    uninterrupted = train_drafter(tmp_path / "full", 4)
    proc = train_drafter(tmp_path, 2)
    stdout, stderr = proc.communicate(timeout=300)
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert out.returncode == 0, out.stderr
    # Library INFO logs (orbax writes ~40 lines per checkpoint save) stay off by default.
    assert not [line for line in out.stderr.splitlines() if re.match(r"I\d{4} ", line)], out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and 0 <= summary["eval_top1_agree"] <= 1
    # The default drafter (one layer on the last hidden state) is EAGLE's layout: its export
    # carries the copy SGLang and vLLM load, which reads back as the same drafter.
    dcfg, dparams = load_drafter(tmp_path / "drafter")
    assert (dcfg.num_layers, dcfg.layout) == (1, "eagle")
    ecfg, eparams = load_drafter(tmp_path / "drafter" / "eagle")
    assert ecfg == dcfg and sorted(eparams) == sorted(dparams)
    for a, b in zip(jax.tree.leaves(eparams), jax.tree.leaves(dparams)):
        np.testing.assert_array_equal(a, b)
    assert (tmp_path / "drafter_curves.png").exists()
    # Run again with more steps, it resumes and ends where an uninterrupted run does.
    resumed = train_drafter(tmp_path, 4)
    for proc in (resumed, uninterrupted):
        assert proc.wait(timeout=300) == 0, proc.communicate()[1]
    losses = lambda run_dir: {r["step"]: r["loss"]
                              for r in metrics.read_metrics(os.path.join(run_dir, "metrics.jsonl"))}
    assert losses(tmp_path) == losses(tmp_path / "full") and sorted(losses(tmp_path)) == [1, 2, 3, 4]
    _, a = load_drafter(tmp_path / "drafter")
    _, b = load_drafter(tmp_path / "full" / "drafter")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_dw_accum_error_reports_both_accumulators(tmp_path):
    out = _run("experiments.dw_accum_error", "--tokens_n=1024", "--vocab=256", "--block_tokens=128",
               f"--out={tmp_path / 'e.json'}")
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "e.json").read_text())["rows"]
    errors = {r["accumulator"]: r["rel_error"] for r in rows}
    assert [r["blocks"] for r in rows] == [None, 8, 8]
    # float32 accumulation stays near one bf16 rounding; bf16 accumulation adds its own
    assert errors["float32"] < 2 * errors["exact, rounded to bf16 once"] < errors["param"]


def test_compare_drafters_reads_each_recipe_from_its_summary(tmp_path):
    from experiments import compare_drafters

    run = tmp_path / "ttt_steps=3"
    metrics.write_json(run / "summary.json", {
        "steps": 600, "train_seconds": 12.5, "eval_accept_rate": 0.8, "eval_accept_rate_pass2": 0.6,
        "eval_accept_rate_pass1": 0.7, "eval_top1_agree": 0.9,
        "acceptance": {"acceptance_length": 3.1, "acceptance_by_depth": [0.9, 0.8, None]}})
    row = compare_drafters.read_run(str(run))
    assert row["run"] == "ttt_steps=3" and row["eval_accept_rate"] == [0.8, 0.7, 0.6]
    assert row["acceptance_by_depth"] == [0.9, 0.8, None] and row["acceptance_length"] == 3.1
    with pytest.raises(ValueError, match="has no summary.json: the run did not finish"):
        compare_drafters.read_run(str(tmp_path / "missing"))
    # As a sweep lays it out: each point's log beside its run directory.
    (tmp_path / "ttt_steps=3.log").write_text("log")
    out = _run("experiments.compare_drafters", f"--runs={tmp_path}/*", f"--out={tmp_path}/cmp.json")
    assert out.returncode == 0, out.stderr
    assert "ttt_steps=3" in out.stdout and os.path.getsize(tmp_path / "cmp.png") > 0
