r"""The main job: GRPO on verifiable reasoning tasks with TLT (speculative rollouts in the long
tail, the drafter trained on the spot in idle gaps); --config.tlt.enabled=False is the baseline.

Writes metrics.jsonl, tensorboard/, plots (reward.png, time_split.png, tlt.png, ...), checkpoints,
the policy (hf/) and the drafter (drafter/) to --config.run_dir; prints the result as one JSON
line. Run again with the same run_dir, it resumes (a finished run: its recorded result); a
change of what it learns is refused unless --config.resume_changes names it (docs/checkpoints.md).

  python -m experiments.train_rl --config=configs/rl.py:tiny                 # CPU, minutes
  python -m experiments.train_rl --config=configs/rl.py:tiny --config.tlt.enabled=False --config.run_dir=runs/base
  python -m experiments.train_rl --config=configs/rl.py:hf --config.model_dir=DIR \
      --config.data.train=train.parquet --config.data.eval=test.parquet   # your model and data
  python -m experiments.train_rl --config=configs/rl.py:hf --config.model_dir=DIR ... --config.mesh.tensor=2 \
      --coordinator_address=host0:1234 --num_processes=2 --process_id=0

Presets: tiny, tiny-speculate-always, hf, qwen2.5-math-1.5b-gsm8k, qwen2.5-7b-math (configs/rl.py;
docs/your_model.md, docs/tlt.md).
"""
import json
import os

from ml_collections import config_flags

from configs.rl import RESUME_INERT
from tlt_jax import checkpoint, launch
from tlt_jax.rl.train import check_config, recorded_result, train_rl

_CONFIG = config_flags.DEFINE_config_file("config", "configs/rl.py:tiny", "RL config file:preset; override any "
                                          "field with --config.<field>=<value>.")


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    config = _CONFIG.value
    check_config(config)  # a bad flag must not touch the run directory
    if recorded_result(config.run_dir, config.steps) is None:
        launch.prepare_run_dir(config.run_dir, config, RESUME_INERT, resume_step=lambda: checkpoint.resume_step(
            os.path.join(config.run_dir, "checkpoints")))
    else:  # a finished run trains nothing, and is still not reported under another config
        launch.check_resume(config.run_dir, config, RESUME_INERT)
    print(json.dumps(train_rl(config)))


if __name__ == "__main__":
    launch.run(main)
