r"""Offline drafter training against a frozen target, then its acceptance in speculative rollouts.

  python -m experiments.train_drafter --config=configs/drafter.py:tiny [--config.run_dir=runs/drafter]
      [--config.target_dir=/path/to/hf_checkpoint] [--config.acceptance.num_prompts=0]

Writes metrics.jsonl, tensorboard/, drafter_curves.png, checkpoints/ (a rerun resumes) and
the drafter export <run_dir>/drafter; prints the final metrics as one JSON line.
"""
import json

from ml_collections import config_flags

from tlt_jax import launch
from tlt_jax.drafter_training.trainer import train_drafter

_CONFIG = config_flags.DEFINE_config_file("config", "configs/drafter.py:tiny", "Drafter training config.")


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    config = _CONFIG.value
    launch.prepare_run_dir(config.run_dir, config)
    print(json.dumps(train_drafter(config)))


if __name__ == "__main__":
    launch.run(main)
