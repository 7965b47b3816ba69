r"""Distillation of a smaller student from a teacher's top-K distribution, through the fused
blockwise KL (no [tokens, vocab] logits).

  python -m experiments.distill --config=configs/distill.py:tiny [--config.run_dir=runs/distill]
      [--config.mode=online] [--config.tail=True] [--config.teacher_dir=/path/to/hf_checkpoint]

Offline (default) caches the teacher's top-K under <run_dir>/teacher_cache first (tensorstore)
and reuses it when run again; online runs the teacher in the loop instead. A rerun resumes; a
change of what it learns is refused unless --config.resume_changes names it (docs/checkpoints.md).
Prints the final metrics (eval_kl, eval_top1_agree, timings) as one JSON line.
"""
import json
import os

from ml_collections import config_flags

from configs.distill import RESUME_INERT
from tlt_jax import checkpoint, launch, metrics
from tlt_jax.distill.train import check_paths, train_distill

_CONFIG = config_flags.DEFINE_config_file("config", "configs/distill.py:tiny", "Distillation config file:preset; "
                                          "override any field with --config.<field>=<value>.")


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    config = _CONFIG.value
    check_paths(config)
    launch.prepare_run_dir(config.run_dir, config, RESUME_INERT, resume_step=lambda: checkpoint.resume_step(
        os.path.join(config.run_dir, "checkpoints")))
    result = launch.with_config_changes(config.run_dir, train_distill(config))
    metrics.report(f"Student after {result['steps']} steps: eval KL {result['eval_kl']:.3f} nats, top-1 agreement "
                   f"with the teacher {result['eval_top1_agree']:.3f}"
                   f"{launch.describe_config_changes(result.get('config_changes'))}; curves and checkpoints in "
                   f"{config.run_dir}")
    print(json.dumps(result))


if __name__ == "__main__":
    launch.run(main)
