r"""GRPO training on verifiable reasoning tasks: the main job (TLT on; --config.tlt.enabled=False
is the baseline).

  python -m experiments.train_rl --config=configs/rl.py:tiny
  python -m experiments.train_rl --config=configs/rl.py:qwen2.5-1.5b --config.mesh.tensor=2 \
      --coordinator_address=host0:1234 --num_processes=2 --process_id=0
"""
import json

from ml_collections import config_flags

from tlt_jax import launch
from tlt_jax.rl.train import check_config, train_rl

_CONFIG = config_flags.DEFINE_config_file("config", "configs/rl.py:tiny", "RL config.")


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    config = _CONFIG.value
    check_config(config)  # a bad flag must not rewrite the run directory's config.json
    launch.prepare_run_dir(config.run_dir, config)
    print(json.dumps(train_rl(config)))


if __name__ == "__main__":
    launch.run(main)
