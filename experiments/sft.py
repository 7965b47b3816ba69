r"""Supervised fine-tuning: from random weights on the synthetic traces (the small model the
main job starts from) or from your checkpoint on your data; evaluates greedily and writes
the model in the Hugging Face format to <run_dir>/hf.

  python -m experiments.sft --config=configs/sft.py:tiny      # assets/sft_tiny is its runs/sft_tiny/hf
  python -m experiments.sft --config=configs/sft.py:long_tail
  python -m experiments.sft --config=configs/sft.py:hf --config.model_dir=DIR --config.data.train=train.parquet \
      --config.data.eval=test.parquet --config.data.prompt_field=question --config.data.answer_field=answer

Presets: tiny, gpu, long_tail, hf, example (configs/sft.py). A rerun with the same run_dir resumes from
its last checkpoint; a change of what it learns is refused unless --config.resume_changes
names it (docs/checkpoints.md). Prints the final metrics (loss, eval_accuracy) as one JSON line.
"""
import json
import os

from ml_collections import config_flags

from configs.sft import RESUME_INERT
from tlt_jax import checkpoint, launch, metrics
from tlt_jax.sft import check_config, train_sft

_CONFIG = config_flags.DEFINE_config_file("config", "configs/sft.py:tiny", "SFT config file:preset; override any "
                                          "field with --config.<field>=<value>.")


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    config = _CONFIG.value
    check_config(config)  # bad input fails before the run directory is written
    launch.prepare_run_dir(config.run_dir, config, RESUME_INERT, resume_step=lambda: checkpoint.resume_step(
        os.path.join(config.run_dir, "checkpoints")))
    result = launch.with_config_changes(config.run_dir, train_sft(config))
    metrics.report(f"SFT: eval accuracy {result.get('eval_accuracy', float('nan')):.3f} after {config.steps} steps"
                   f"{launch.describe_config_changes(result.get('config_changes'))}; the model is in "
                   f"{config.run_dir}/hf")
    print(json.dumps(result))


if __name__ == "__main__":
    launch.run(main)
