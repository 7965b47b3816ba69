r"""Offline drafter training against a frozen target (the drafter's warm start), then its
acceptance in speculative rollouts.

  python -m experiments.train_drafter --config=configs/drafter.py:tiny [--config.run_dir=runs/drafter]
      [--config.target_dir=/path/to/hf_checkpoint] [--config.acceptance.num_prompts=0]

Writes metrics.jsonl, tensorboard/, drafter_curves.png, checkpoints/ (a rerun resumes) and
the drafter export <run_dir>/drafter (for experiments.generate --drafter and the RL config's
tlt.drafter.init); prints the final metrics as one JSON line. A change of what a resumed run
learns is refused unless --config.resume_changes names it (docs/checkpoints.md).
"""
import json
import os

from ml_collections import config_flags

from configs.drafter import RESUME_INERT
from tlt_jax import checkpoint, launch, metrics
from tlt_jax.drafter_training.trainer import check_paths, train_drafter

_CONFIG = config_flags.DEFINE_config_file("config", "configs/drafter.py:tiny", "Drafter config file:preset; "
                                          "override any field with --config.<field>=<value>.")


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    config = _CONFIG.value
    check_paths(config)
    launch.prepare_run_dir(config.run_dir, config, RESUME_INERT, resume_step=lambda: checkpoint.resume_step(
        os.path.join(config.run_dir, "checkpoints")))
    result = launch.with_config_changes(config.run_dir, train_drafter(config))
    line = (f"Drafter after {result['steps']} steps: eval top-1 agreement with the target "
            f"{result['eval_top1_agree']:.3f}")
    if "acceptance" in result:
        line += f", acceptance length {result['acceptance']['acceptance_length']:.2f} in speculative rollouts"
    metrics.report(line + launch.describe_config_changes(result.get("config_changes"))
                   + f"; the export is {config.run_dir}/drafter")
    print(json.dumps(result))


if __name__ == "__main__":
    launch.run(main)
