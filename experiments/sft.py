r"""Supervised warm start on the synthetic reasoning traces.

  python -m experiments.sft --config=configs/sft.py:tiny [--config.run_dir=runs/sft]
"""
import json

from ml_collections import config_flags

from tlt_jax import launch
from tlt_jax.rl.sft import train_sft

_CONFIG = config_flags.DEFINE_config_file("config", "configs/sft.py:tiny", "SFT config.")


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    config = _CONFIG.value
    launch.prepare_run_dir(config.run_dir, config)
    print(json.dumps(train_sft(config)))


if __name__ == "__main__":
    launch.run(main)
