r"""Distillation of a smaller student from a teacher's top-K distribution, through the fused
blockwise KL (no [tokens, vocab] logits).

  python -m experiments.distill --config=configs/distill.py:tiny [--config.run_dir=runs/distill]
      [--config.mode=online] [--config.tail=True] [--config.teacher_dir=/path/to/hf_checkpoint]

Offline (default) caches the teacher's top-K under <run_dir>/teacher_cache first (tensorstore)
and reuses it when run again; online runs the teacher in the loop instead. A rerun resumes.
Prints the final metrics (eval_kl, eval_top1_agree, timings) as one JSON line.
"""
import json

from ml_collections import config_flags

from tlt_jax import launch, metrics
from tlt_jax.distill.train import train_distill

_CONFIG = config_flags.DEFINE_config_file("config", "configs/distill.py:tiny", "Distillation config file:preset; "
                                          "override any field with --config.<field>=<value>.")


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    config = _CONFIG.value
    launch.check_checkpoint_dir(config.teacher_dir, "--config.teacher_dir")
    launch.prepare_run_dir(config.run_dir, config)
    result = train_distill(config)
    metrics.report(f"Student after {result['steps']} steps: eval KL {result['eval_kl']:.3f} nats, top-1 agreement "
                   f"with the teacher {result['eval_top1_agree']:.3f}; curves and checkpoints in {config.run_dir}")
    print(json.dumps(result))


if __name__ == "__main__":
    launch.run(main)
