"""One run directory, one experiment: a resume that changes what is learned is refused,
accepted changes are recorded with their step, and a given path that does not exist is
an error naming its flag (tlt_jax/launch.py, in every launcher)."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from configs import distill, drafter, rl, sft
from tests.rl.test_train import OVERRIDES, warm_start  # noqa: F401 (a fixture)
from tlt_jax import checkpoint, launch, metrics
from tlt_jax.distill import train as distill_train
from tlt_jax.drafter_training import trainer as drafter_trainer
from tlt_jax.rl import train as rl_train
from tlt_jax.rl.tlt import TLT
from tlt_jax.rollout import tuner as tuner_lib


@pytest.fixture(autouse=True)
def _input_phase(monkeypatch):
    """prepare_run_dir ends the launcher's input phase; each test starts in it again."""
    monkeypatch.setattr(launch, "_checking_input", True)


def _set(config, key, value):
    *parents, leaf = key.split(".")
    for part in parents:
        config = config[part]
    config[leaf] = value


def _first_run(run_dir, module, preset="tiny"):
    """A run's first config recorded in run_dir; returns (the config.json text, a fresh
    copy of that config to change)."""
    config = module.get_config(preset)
    config.run_dir = str(run_dir)
    launch.prepare_run_dir(str(run_dir), config, module.RESUME_INERT)
    launch._checking_input = True  # a launcher run again starts in its input phase
    again = module.get_config(preset)
    again.run_dir = str(run_dir)
    return (run_dir / "config.json").read_text(), again


def _flat(config, key):
    return launch.flat_config(config)[key]


# What is learned or how it is scored, per launcher: refused on resume.
REFUSED = [
    (rl, "model_dir", "runs/other_sft/hf"),  # the model
    (rl, "sft.model.num_layers", 3),
    (rl, "data.seed", 2),  # the data
    (rl, "data.num_eval", 100),  # how it is scored
    (rl, "seed", 1),
    (rl, "num_samples", 4),  # G
    (rl, "prompts_per_step", 8),
    (rl, "rollout.max_tokens", 64),  # lengths
    (rl, "rollout.temperature", 0.7),  # sampling
    (rl, "learner.optimizer.learning_rate", 1e-2),
    (rl, "grpo.clip_eps", 0.1),  # the loss
    (rl, "advantage", "rloo"),
    (rl, "reward", "other"),
    (rl, "reward_timeout_s", 5.0),
    (rl, "mesh.fsdp", 2),
    (rl, "tlt.drafter.num_layers", 2),  # TLT's drafter architecture
    (rl, "tlt.drafter.feature_layers", (0, 1)),
    (rl, "brand_new_field", 1),  # a field added later is protected by default
    (sft, "model.num_layers", 2),
    (sft, "data.num_train", 100),
    (sft, "seed", 3),
    (sft, "optimizer.learning_rate", 1e-3),
    (sft, "mesh.data", 2),
    (distill, "teacher_dir", "runs/other/hf"),
    (distill, "student.hidden_size", 32),
    (distill, "top_k", 4),
    (distill, "tail", False),  # the default is True
    (distill, "data.seq_len", 64),
    (drafter, "target_dir", "runs/other/hf"),
    (drafter, "drafter.num_layers", 2),
    (drafter, "kl_weight", 0.5),
    (drafter, "data.seed", 1),
]

# Neither: accepted on resume.
ACCEPTED = [
    (rl, "steps", 120),  # to extend the run
    (rl, "eval_every", 5),
    (rl, "checkpoint_every", 10),
    (rl, "tlt.drafter.checkpoint_every", 1),
    (rl, "save_hf", False),
    (rl, "reward_workers", 4),
    (rl, "reward_overlap", False),  # the same rewards, scored earlier
    (rl, "tlt.enabled", False),  # speculation is lossless
    (rl, "tlt.tuner.epsilon", 0.5),
    (rl, "tlt.tuner.buckets", [1]),
    (rl, "run_dir", "/elsewhere"),  # a copied run directory
    (sft, "steps", 300),
    (sft, "eval_every", 50),
    (distill, "checkpoint_every", 100),
    (distill, "steps", 900),
    (drafter, "eval_every", 10),
    (drafter, "steps", 900),
]


def _name(p):
    return f"{p[0].__name__.split('.')[-1]}:{p[1]}"


@pytest.mark.parametrize("module, field, value", REFUSED, ids=map(_name, REFUSED))
def test_a_change_of_what_is_learned_is_refused_before_anything_is_written(tmp_path, module, field, value):
    recorded, again = _first_run(tmp_path, module)
    before = launch.flat_config(json.loads(recorded)).get(field, "<absent>")
    _set(again, field, value)
    with pytest.raises(ValueError) as refused:
        launch.prepare_run_dir(str(tmp_path), again, module.RESUME_INERT, resume_step=lambda: pytest.fail("written"))
    message = str(refused.value)
    shown = lambda v: v if v == "<absent>" else json.dumps(v)
    assert f"{field}: {shown(before)} -> {json.dumps(_flat(again, field))}" in message
    assert "new --config.run_dir" in message and f"--config.resume_changes={field}" in message
    assert "\n" not in message and launch._checking_input  # shown as one line by the launcher
    assert (tmp_path / "config.json").read_text() == recorded
    assert os.listdir(tmp_path) == ["config.json"]


@pytest.mark.parametrize("module, field, value", ACCEPTED, ids=map(_name, ACCEPTED))
def test_a_change_of_neither_is_accepted_and_recorded_from_its_step(tmp_path, module, field, value, capsys):
    recorded, again = _first_run(tmp_path, module)
    before = launch.flat_config(json.loads(recorded))[field]
    _set(again, field, value)
    launch.prepare_run_dir(str(tmp_path), again, module.RESUME_INERT, resume_step=lambda: 7)
    assert (tmp_path / "config.json").read_text() == recorded  # the first config stays
    assert [(e["step"], e["changes"]) for e in launch.config_history(str(tmp_path))] == [
        (7, [{"field": field, "old": before, "new": _flat(again, field), "learned": False}])]
    line = capsys.readouterr().err.strip()
    assert line == (f"Config changes from step 7 of {tmp_path}, recorded in config_history.jsonl: "
                    f"{field}: {json.dumps(before)} -> {json.dumps(_flat(again, field))}")
    launch.prepare_run_dir(str(tmp_path), again, module.RESUME_INERT, resume_step=lambda: 9)  # run again
    assert len(launch.config_history(str(tmp_path))) == 1  # nothing changed since


def test_resume_changes_accepts_exactly_the_named_fields(tmp_path):
    recorded, again = _first_run(tmp_path, rl)
    again.learner.optimizer.learning_rate, again.num_samples = 1e-2, 4
    again.resume_changes = "learner.optimizer.learning_rate"
    with pytest.raises(ValueError) as refused:
        launch.prepare_run_dir(str(tmp_path), again, rl.RESUME_INERT)
    message = str(refused.value)
    assert "num_samples: 8 -> 4" in message and "learning_rate: 5e-05" not in message
    assert message.endswith("--config.resume_changes=learner.optimizer.learning_rate,num_samples")

    again.resume_changes = "learner.optimizer.learning_rate,num_samples"
    launch.prepare_run_dir(str(tmp_path), again, rl.RESUME_INERT, resume_step=lambda: 6)
    (entry,) = launch.config_history(str(tmp_path))
    assert entry["step"] == 6 and entry["changes"] == [
        {"field": "learner.optimizer.learning_rate", "old": 5e-05, "new": 1e-2, "learned": True},
        {"field": "num_samples", "old": 8, "new": 4, "learned": True},
        {"field": "resume_changes", "old": "", "new": "learner.optimizer.learning_rate,num_samples",
         "learned": False}]
    assert (tmp_path / "config.json").read_text() == recorded

    # The run now runs with the accepted config: the same command again changes nothing,
    # and going back is a change of its own.
    launch.prepare_run_dir(str(tmp_path), again, rl.RESUME_INERT, resume_step=lambda: 8)
    assert len(launch.config_history(str(tmp_path))) == 1
    back = rl.get_config("tiny")
    back.run_dir = str(tmp_path)
    with pytest.raises(ValueError, match=r"learner.optimizer.learning_rate: 0.01 -> 5e-05; num_samples: 4 -> 8\."):
        launch.check_resume(str(tmp_path), back, rl.RESUME_INERT)

    # A section accepts every field in it; a name that is no field is refused.
    again.learner.micro_batch_size, again.resume_changes = 32, "learner"
    assert [c["field"] for c in launch.check_resume(str(tmp_path), again, rl.RESUME_INERT)] == [
        "learner.micro_batch_size", "resume_changes"]
    again.resume_changes = "learner.optimizer.learnin_rate"
    with pytest.raises(ValueError, match="resume_changes names learner.optimizer.learnin_rate: not a field"):
        launch.check_resume(str(tmp_path), again, rl.RESUME_INERT)


def test_config_history_keeps_every_change_with_its_step_and_the_summary_says_so(tmp_path):
    recorded, again = _first_run(tmp_path, sft)
    again.steps = 300
    launch.prepare_run_dir(str(tmp_path), again, sft.RESUME_INERT, resume_step=lambda: 200)
    again.steps, again.eval_every = 400, 50
    again.added = "x"  # a field a later version of the config has
    del again["checkpoint_every"]  # and one it dropped
    again.resume_changes = "added,checkpoint_every"
    launch.prepare_run_dir(str(tmp_path), again, sft.RESUME_INERT, resume_step=lambda: 300)
    lines = (tmp_path / launch.HISTORY_FILENAME).read_text().splitlines()
    assert len(lines) == 2
    first, second = map(json.loads, lines)
    assert first["step"] == 200 and first["changes"] == [{"field": "steps", "old": 200, "new": 300, "learned": False}]
    assert second["step"] == 300 and second["changes"] == [
        {"field": "added", "new": "x", "learned": True},
        {"field": "checkpoint_every", "old": 200, "learned": False},
        {"field": "eval_every", "old": 200, "new": 50, "learned": False},
        {"field": "resume_changes", "old": "", "new": "added,checkpoint_every", "learned": False},
        {"field": "steps", "old": 300, "new": 400, "learned": False}]
    assert all(set(e) == {"step", "time", "changes"} for e in (first, second))
    assert (tmp_path / "config.json").read_text() == recorded

    summary = launch.with_config_changes(str(tmp_path), {"loss": 1.0})
    assert summary["config_changes"] == [
        {"step": 200, "changes": {"steps": "200 -> 300"}},
        {"step": 300, "changes": {"added": '<absent> -> "x"', "checkpoint_every": "200 -> <absent>",
                                  "eval_every": "200 -> 50", "resume_changes": '"" -> "added,checkpoint_every"',
                                  "steps": "300 -> 400"}}]
    assert launch.describe_config_changes(summary["config_changes"]).startswith(
        "; its config changed midway: from step 200: steps 200 -> 300; from step 300: added <absent> -> ")
    assert launch.with_config_changes(str(tmp_path / "new"), {"loss": 1.0}) == {"loss": 1.0}
    assert launch.describe_config_changes(None) == ""


def test_a_new_run_and_a_run_directory_without_a_checkpoint(tmp_path):
    """A new run records its config; a directory holding a config but no checkpoint yet
    is the same experiment all the same, its changes holding from step 0."""
    config = rl.get_config("tiny")
    assert launch.check_resume(str(tmp_path / "run"), config, rl.RESUME_INERT) == []
    assert not (tmp_path / "run").exists()
    launch.prepare_run_dir(str(tmp_path / "run"), config, rl.RESUME_INERT)
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == json.loads(
        json.dumps(config.to_dict(), default=str))
    config.steps = 5
    launch.prepare_run_dir(str(tmp_path / "run"), config, rl.RESUME_INERT,
                           resume_step=lambda: checkpoint.resume_step(tmp_path / "run" / "checkpoints"))
    assert [e["step"] for e in launch.config_history(str(tmp_path / "run"))] == [0]
    config.seed = 5
    with pytest.raises(ValueError, match="seed: 0 -> 5"):
        launch.check_resume(str(tmp_path / "run"), config, rl.RESUME_INERT)


def test_resume_step_is_the_step_a_resume_restores(tmp_path):
    """The newest step whose manifest verifies: a damaged newer step is passed over, as
    `Checkpointer.resume` passes it over."""
    assert checkpoint.resume_step(tmp_path / "none") == 0
    tree = {"w": np.arange(4.0)}
    with checkpoint.Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        for step in (2, 4):
            ckpt.save(step, tree, {"step": step})
    assert checkpoint.resume_step(tmp_path / "ckpt") == 4
    damaged = max((p for p in (tmp_path / "ckpt" / "4").rglob("*") if p.is_file()
                   and p.name != checkpoint.MANIFEST_NAME), key=lambda p: p.stat().st_size)
    damaged.write_bytes(damaged.read_bytes()[:-1])
    assert checkpoint.resume_step(tmp_path / "ckpt") == 2
    with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.resume(tree)[1]["step"] == 2


def _module_config(module, **fields):
    config = module.get_config("tiny")
    config.update(fields)
    return config


@pytest.mark.parametrize("check, config, flag", [
    (rl_train.check_config, _module_config(rl, model_dir="/nonexistent/sft"), "--config.model_dir='/nonexistent/sft'"),
    (rl_train.check_config, _module_config(rl, model_dir="assets"), "--config.model_dir='assets' has no config.json"),
    (distill_train.check_paths, _module_config(distill, teacher_dir="/nope"), "--config.teacher_dir='/nope'"),
    (distill_train.check_paths, _module_config(distill, teacher_dir=""), "--config.teacher_dir=''"),
    (distill_train.check_paths, _module_config(distill, tokenizer_dir="/nope"), "--config.tokenizer_dir='/nope'"),
    (distill_train.check_paths, _module_config(distill, cache_dir="/nope"), "--config.cache_dir='/nope'"),
    (drafter_trainer.check_paths, _module_config(drafter, target_dir="/nope"), "--config.target_dir='/nope'"),
    (drafter_trainer.check_paths, _module_config(drafter, tokenizer_dir="/nope"), "--config.tokenizer_dir='/nope'"),
], ids=["rl:model_dir", "rl:model_dir-no-checkpoint", "distill:teacher_dir", "distill:teacher_dir-empty",
        "distill:tokenizer_dir", "distill:cache_dir", "drafter:target_dir", "drafter:tokenizer_dir"])
def test_a_given_path_that_does_not_exist_is_an_error_naming_its_flag(check, config, flag):
    with pytest.raises(FileNotFoundError) as missing:
        check(config)
    assert str(missing.value).startswith(flag)


def test_the_sft_launcher_names_a_missing_starting_checkpoint(tmp_path):
    (tmp_path / "config.py").write_text("from configs import sft\n\n\ndef get_config():\n"
                                        "    c = sft.get_config('tiny')\n    c.model_dir = '/nonexistent/model'\n"
                                        "    return c\n")
    out = subprocess.run([sys.executable, "-m", "experiments.sft", f"--config={tmp_path / 'config.py'}",
                          f"--config.run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "Error: --config.model_dir='/nonexistent/model' does not exist" in out.stderr
    assert not (tmp_path / "run").exists()


def test_missing_drafter_and_drafter_of_another_target_name_the_flag():
    config = rl.get_config("tiny")
    config.tlt.drafter.init = "/nonexistent/drafter"
    with pytest.raises(FileNotFoundError, match=r"^--config.tlt.drafter.init='/nonexistent/drafter' is not a dir"):
        rl_train.check_config(config)
    config.tlt.enabled = False  # the drafter is not read then
    rl_train.check_config(config)
    # "" is the documented default of each optional path; the shipped defaults exist.
    for check, module in ((rl_train.check_config, rl), (distill_train.check_paths, distill),
                          (drafter_trainer.check_paths, drafter)):
        check(module.get_config("tiny"))
    distill_train.check_paths(_module_config(distill, mode="online", cache_dir="/nope"))  # not read online

    from tlt_jax.models.hf_io import load_hf
    c = rl.get_config("tiny")
    target_config, target_params = load_hf(c.model_dir)
    with pytest.raises(ValueError, match=r"^--config.tlt.drafter.init='assets/drafter_tiny': .*another target model"):
        rl_train._drafter_warm_start(c.tlt.drafter, target_config.replace(num_layers=2), target_params)


def test_a_tuner_changed_on_resume_starts_fresh(caplog):
    """Tuner knobs are accepted on resume: a saved state of other buckets or arms is
    passed over with a warning, not a failure."""
    saved = tuner_lib.from_config({"buckets": [1], "arms": [["eagle-d3", "plain"]]})
    changed = TLT(tuner_lib.from_config({"buckets": [1], "arms": [["ngram-d2-b1", "plain"]]}), None, None)
    with caplog.at_level("WARNING"):
        changed.load_state_dict({"tuner": saved.state_dict()})
    assert "it starts fresh" in caplog.text


def _rl_launcher(warm_start, run_dir, *args):  # noqa: F811
    # One rollout group: a second compiles every rollout program again in each launch (the
    # CPU's compilation cache keys a program by its devices), and resuming is not about groups.
    overrides = [f"--config.{k}={v}" for k, v in {**OVERRIDES, "steps": 2, "checkpoint_every": 2, "mesh.data": 1,
                                                  "mesh.fsdp": 8}.items()]
    return subprocess.run([sys.executable, "-m", "experiments.train_rl", "--config=configs/rl.py:tiny",
                           f"--config.model_dir={warm_start}", f"--config.run_dir={run_dir}", *overrides, *args],
                          capture_output=True, text=True, timeout=600)


def test_the_rl_launcher_refuses_a_changed_resume_and_records_an_accepted_one(warm_start, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    out = _rl_launcher(warm_start, run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    recorded = (run_dir / "config.json").read_text()
    files = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}

    lr = "--config.learner.optimizer.learning_rate=0.01"
    out = _rl_launcher(warm_start, run_dir, "--config.steps=4", lr)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("Error: ")]
    assert "learner.optimizer.learning_rate: 5e-05 -> 0.01." in line and "steps: 2 -> 4" not in line
    assert line.endswith("--config.resume_changes=learner.optimizer.learning_rate")
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == files  # nothing written

    out = _rl_launcher(warm_start, run_dir, "--config.steps=4", lr,
                       "--config.resume_changes=learner.optimizer.learning_rate")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (run_dir / "config.json").read_text() == recorded
    (entry,) = launch.config_history(str(run_dir))
    assert entry["step"] == 2 and {c["field"] for c in entry["changes"]} == {
        "steps", "learner.optimizer.learning_rate", "resume_changes"}
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["config_changes"] == [{"step": 2, "changes": {
        "learner.optimizer.learning_rate": "5e-05 -> 0.01", "resume_changes": '"" -> "learner.optimizer.learning_rate"',
        "steps": "2 -> 4"}}]
    assert json.loads((run_dir / "result.json").read_text())["config_changes"] == summary["config_changes"]
    assert "its config changed midway: from step 2: " in out.stderr
    assert sorted(r["step"] for r in metrics.read_metrics(str(run_dir / "metrics.jsonl"))) == [0, 1, 2, 3, 4]
    # The finished run, run again under another seed, is refused too, not reported as its.
    out = _rl_launcher(warm_start, run_dir, "--config.steps=4", lr,
                       "--config.resume_changes=learner.optimizer.learning_rate", "--config.seed=1")
    assert out.returncode == 1 and "Error: " in out.stderr and "seed: 0 -> 1" in out.stderr, out.stderr[-3000:]

    # The issue's own case: a mistyped warm start is named, not trained.
    out = subprocess.run([sys.executable, "-m", "experiments.train_rl", "--config=configs/rl.py:tiny",
                          f"--config.run_dir={tmp_path / 'typo'}", "--config.model_dir=/nonexistent"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "Error: --config.model_dir='/nonexistent' does not exist" in out.stderr
    assert not pathlib.Path(tmp_path / "typo").exists()
