r"""Distillation of a smaller student from a teacher's top-K distribution.

  python -m experiments.distill --config=configs/distill.py:tiny [--config.run_dir=runs/distill]
      [--config.mode=online] [--config.tail=True] [--config.teacher_dir=/path/to/hf_checkpoint]

Offline (default) caches the teacher's top-K under <run_dir>/teacher_cache first and reuses
it when run again; online runs the teacher in the loop instead.
"""
import json

from ml_collections import config_flags

from tlt_jax import launch
from tlt_jax.distill.train import train_distill

_CONFIG = config_flags.DEFINE_config_file("config", "configs/distill.py:tiny", "Distillation config.")


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    config = _CONFIG.value
    launch.prepare_run_dir(config.run_dir, config)
    print(json.dumps(train_distill(config)))


if __name__ == "__main__":
    launch.run(main)
