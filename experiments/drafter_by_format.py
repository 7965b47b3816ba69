r"""A drafter's teacher-forced acceptance on each answer format of the drift_learn mix.

  python -m experiments.drafter_by_format --target_dir=assets/sft_drift_learn --drafter_dir=assets/drafter_drift_learn

bench_tlt's cpu_drift_learn wants its offline drafter to draft the bare answers the warm
start mostly writes well and the worked traces RL moves it toward badly (a gap of 25% or
more), so that a frozen drafter goes stale as the policy learns. Held-out problems of
`configs/common.py: tasks_drift_learn`, each written once in each format (trace_share 1,
then 0), scored teacher-forced as the offline trainer scores its eval split
(`trainer.evaluate_rows`): eval_accept_rate is the chance a first draft passes verification.
"""
import json

import jax
from absl import flags

from configs import common
from configs import drafter as drafter_configs
from tlt_jax import launch, sharding
from tlt_jax.data import sources
from tlt_jax.data.packing import pack_examples
from tlt_jax.drafter_training import io as drafter_io
from tlt_jax.drafter_training.trainer import DrafterTrainer, evaluate_rows
from tlt_jax.models.hf_io import load_hf
from tlt_jax.tokenizer import end_token_ids, load_tokenizer
from tlt_jax.train_state import OptimizerConfig

_TARGET_DIR = flags.DEFINE_string("target_dir", None, "The target: a Hugging Face checkpoint with its tokenizer.",
                                  required=True)
_DRAFTER_DIR = flags.DEFINE_string("drafter_dir", None, "A drafter export for it (experiments.train_drafter).",
                                   required=True)
_NUM_PROBLEMS = flags.DEFINE_integer("num_problems", 256, "Held-out problems, each written in both formats.")


def main(argv):
    del argv
    recipe = drafter_configs.get_config("drift_learn")
    target_cfg, host_target = load_hf(_TARGET_DIR.value)
    tokenizer = load_tokenizer(_TARGET_DIR.value)
    dcfg, drafter_params = drafter_io.load_drafter(_DRAFTER_DIR.value, target_cfg)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    trainer = DrafterTrainer(target_cfg, dcfg, OptimizerConfig(**recipe.optimizer), mesh, top_k=recipe.top_k,
                             feature_weight=recipe.feature_weight, kl_weight=recipe.kl_weight,
                             temperature=recipe.temperature)
    target = trainer.place_target(host_target)
    end_id = end_token_ids(tokenizer, target_cfg.end_token_ids)[0]
    out = {}
    for name, share in (("trace", 1.0), ("bare", 0.0)):
        data = recipe.data.copy_and_resolve_references()
        data.update(tasks=common.tasks_drift_learn(share), num_train=1, num_eval=_NUM_PROBLEMS.value)
        problems = sources.problems_for(_TARGET_DIR.value, data)
        rows = pack_examples(tokenizer, problems.eval, data.seq_len, problems.prompt_format, end_id)
        out[name] = evaluate_rows(trainer, drafter_params, target, rows, recipe.eval_batch_size)
        print(f"{name}: teacher-forced acceptance {out[name]['eval_accept_rate']:.3f}, top-1 agreement "
              f"{out[name]['eval_top1_agree']:.3f}", flush=True)
    out["bare_over_trace"] = out["bare"]["eval_accept_rate"] / out["trace"]["eval_accept_rate"]
    print(json.dumps(out))


if __name__ == "__main__":
    launch.run(main)
