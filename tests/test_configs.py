"""The shipped configs and assets do what docs/configs.md and docs/tlt.md say: every preset
builds and passes its launcher's checks, TLT is on in the RL presets with the documented
defaults, the sweeps are the documented ones, and the shipped drafter loads against the
shipped SFT model."""
import configparser
import dataclasses
import json

import pytest

from configs import distill, drafter, generate, models, rl, sft
from experiments import sweep
from tlt_jax import launch
from tlt_jax.models.hf_io import load_hf
from tlt_jax.rl import train as rl_train
from tlt_jax.rl.grpo import GRPOConfig
from tlt_jax.rl.learner import LearnerConfig
from tlt_jax.rollout import tuner as tuner_lib
from tlt_jax.train_state import OptimizerConfig

PRESETS = {rl: ["tiny", "tiny-speculate-always", *rl.HF_PRESETS],
           sft: ["tiny", "gpu", "long_tail", "drift_shift", "drift_learn", "hf", "example"],
           drafter: ["tiny", "fused", "gpu", "long_tail", "drift_shift", "drift_learn"],
           distill: ["tiny", "llama3-8b-to-3b-32k"],
           generate: list(models.PRESET_NAMES)}


@pytest.mark.parametrize("module", list(PRESETS), ids=lambda m: m.__name__)
def test_every_documented_preset_builds(module):
    for preset in PRESETS[module]:
        config = module.get_config(preset)
        if module is rl and preset in rl.HF_PRESETS:  # your model: checked on one in tests/test_your_model.py
            with pytest.raises(ValueError, match="--config.model_dir is required"):
                rl_train.check_config(config)
        elif module is rl:
            rl_train.check_config(config)
        if module is rl:
            assert config.tlt.enabled, preset  # TLT is on in every RL preset
    with pytest.raises(ValueError, match="preset"):
        module.get_config("no-such-preset")


def test_a_config_section_builds_its_dataclass_by_field_name():
    """launch.config_dataclass: each key of a section fills the field of its name, a nested
    section a nested dataclass, the run's values override, defaults fill the rest; an
    unknown key, or a field without a default that nothing fills, is an error naming it in
    full (with the section's fields), before anything runs."""
    c = rl.get_config("tiny")
    learner = launch.config_dataclass(LearnerConfig, c.learner, "learner", temperature=0.5)
    assert learner.optimizer == OptimizerConfig(**c.learner.optimizer) and learner.temperature == 0.5
    assert (learner.remat, learner.micro_batch_size, learner.grpo) == (False, 64, GRPOConfig())  # grpo: a default
    step = rl_train._step_config(c)  # from the config's root: only the step's own fields are read
    assert (step.prompts_per_step, step.num_samples, step.reward_overlap) == (16, 8, True)
    c.rollout.kv_buckets = 32  # a typo of kv_bucket
    with pytest.raises(ValueError, match=r"^rollout\.kv_buckets: unknown config key; rollout takes .*kv_bucket,"):
        rl_train.check_config(c)

    @dataclasses.dataclass(frozen=True)
    class Needs:
        width: int
        depth: int = 1

    assert launch.config_dataclass(Needs, {"width": 3}, "model") == Needs(3, 1)
    with pytest.raises(ValueError, match=r"^model\.width: missing from the config"):
        launch.config_dataclass(Needs, {"depth": 2}, "model")


def test_tlt_defaults_are_the_documented_ones():
    c = rl.get_config("tiny").tlt
    assert (c.tuner.buckets, c.tuner.max_active, c.tuner.epsilon, c.tuner.window, c.tuner.seed) == (
        [1, 2, 5, 21], 32, 0.1, 300, 0)
    assert all(tuner_lib.PLAIN in arms for arms in c.tuner.arms)
    # The tiny job drafts with three strategies over one kv bucket (its cold start compiles
    # each once); the GPU presets keep the reference's eight, over buckets.
    assert len(tuner_lib.from_config(c.tuner).strategies) == 3 and rl.get_config("tiny").rollout.kv_bucket == 0
    hf = rl.get_config("hf")
    assert hf.tlt.tuner.to_dict() == tuner_lib.default_arms_config() and hf.rollout.kv_bucket == 64
    assert (c.spot.max_steps_per_rl_step, c.spot.catch_up_steps, c.spot.skip_short_gaps) == (50, 2, True)
    d = c.drafter
    assert (d.init, d.top_k, d.kl_weight, d.feature_weight, d.batch_size, d.seq_len, d.keep_steps,
            d.checkpoint_every) == ("assets/drafter_tiny", 8, 1.0, 1.0, 16, 0, 2, 5)
    assert (d.optimizer.learning_rate, d.optimizer.b1, d.optimizer.b2, d.publish_scored) == (3e-4, 0.9, 0.95, True)
    hf = rl.get_config("hf").tlt.drafter  # from nothing: its own recipe
    assert (hf.init, hf.optimizer.learning_rate, hf.publish_scored) == ("", 1e-3, False)
    assert rl.get_config("tiny").checkpoint_every == 5


def test_speculate_always_has_no_plain_arm_and_no_threshold():
    c = rl.get_config("tiny-speculate-always")
    tuner = tuner_lib.from_config(c.tlt.tuner)
    reachable = [arms for lower, arms in zip(tuner.buckets, tuner.arms) if lower <= c.rollout.num_slots]
    assert reachable and all(None not in arms for arms in reachable)
    for active in range(1, c.rollout.num_slots + 1):
        assert tuner.strategy_for(active) is not None


def test_sweeps_are_the_documented_ones():
    assert rl.get_sweep() == [{"tlt.enabled": e, "seed": s} for e in (False, True) for s in (0, 1, 2)]
    assert rl.get_sweep("tiny-speculate-always") == [{"seed": s} for s in (0, 1, 2)]
    assert distill.get_sweep() == [{"top_k": k, "tail": t, "cache_kind": "topk"} for k in (8, 2)
                                   for t in (False, True)]
    assert generate.get_sweep() == [{"batch_size": b, "temperature": t} for b in (1, 8) for t in (0.0, 1.0)]
    # compare_runs globs the RL sweep's directories by these names (docs/tlt.md).
    assert [sweep.point_name(p) for p in rl.get_sweep()[:2]] == ["enabled=False,seed=0", "enabled=False,seed=1"]


def test_shipped_drafter_loads_against_the_shipped_sft_model(caplog):
    """The RL job's default drafter export fits its default warm start exactly (no
    warning); weights the RL updates changed only warn; another model is refused."""
    c = rl.get_config("tiny")
    target_config, target_params = load_hf(c.model_dir)
    with caplog.at_level("WARNING"):
        dcfg, params = rl_train._drafter_warm_start(c.tlt.drafter, target_config, target_params)
    assert dcfg.num_layers >= 1 and params and "other weights" not in caplog.text
    moved = {**target_params, "embed": target_params["embed"] * 2}
    with caplog.at_level("WARNING"):
        rl_train._drafter_warm_start(c.tlt.drafter, target_config, moved)
    assert "trained against other weights" in caplog.text
    with pytest.raises(ValueError, match="another target model .*num_layers"):
        rl_train._drafter_warm_start(c.tlt.drafter, target_config.replace(num_layers=2), target_params)


def test_the_resolved_config_is_written_to_the_run_directory(tmp_path):
    config = rl.get_config("tiny")
    launch.prepare_run_dir(str(tmp_path), config)
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(json.dumps(config.to_dict(), default=str))


def test_jax_triton_is_not_a_dependency():  # as README.md says (flax is, for the NNX view only)
    cfg = configparser.ConfigParser()
    cfg.read("setup.cfg")
    requires = cfg["options"]["install_requires"] + cfg["options.extras_require"]["test"]
    assert "jax-triton" not in requires and "jax_triton" not in requires
    assert "flax" in cfg["options"]["install_requires"]


def _configs_imports() -> dict[str, set[str]]:
    """Each file of configs/ and the other files of configs/ it imports, at any depth of its code."""
    import ast
    import os

    root = os.path.dirname(distill.__file__)
    names = {f[:-3] for f in os.listdir(root) if f.endswith(".py") and f != "__init__.py"}
    graph = {}
    for name in names:
        tree = ast.parse(open(os.path.join(root, f"{name}.py")).read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "configs":
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("configs."):
                found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("configs.")}
        graph[name] = found & names
    return graph


def test_no_config_file_imports_one_that_imports_it_back():
    graph = _configs_imports()
    assert graph["sft"] and graph["rl"], graph  # the walk sees imports

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph[start])

    circles = sorted(name for name in graph if reaches(name, name))
    assert not circles, f"configs/ files in an import circle: {circles} ({graph})"


@pytest.mark.parametrize("schedule, field, value",
                         [("cosine", "decay_steps", 5000), ("constant", "warmup_steps", 3001)])
def test_a_drafter_schedule_longer_than_the_run_is_refused_naming_the_field(schedule, field, value):
    """tiny: 60 RL steps of at most 50 drafter steps each, 3000 optimizer steps at most."""
    config = rl.get_config("tiny")
    config.tlt.drafter.optimizer.update(schedule=schedule, **{field: value})
    with pytest.raises(ValueError, match=rf"tlt.drafter.optimizer.{field}={value}: .* more than the 3000 this run "
                                         r"can take \(steps=60 x tlt.spot.max_steps_per_rl_step=50\)"):
        rl_train.check_config(config)
    config.tlt.drafter.optimizer.update(schedule=schedule, warmup_steps=0, decay_steps=1000)
    rl_train.check_config(config)
