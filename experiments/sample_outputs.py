r"""pass@k of a warm start on its files dataset, and its own outputs as a dataset for its drafter.

  python -m experiments.sample_outputs --preset=code --model_dir=runs/sft_code/hf \
      --outputs=runs/sft_code/outputs.parquet

For the warm starts of bench_tlt's cpu_code and cpu_plan (configs/sft.py:code, :plan):
--num_samples samples at temperature 1 of each held-out prompt (the eval split), scored by
the preset's reward, give pass@1 and pass@k (`pass_at_k.pass_at_k`; a sample counts as
passed at reward 1: every test, the whole plan). With --outputs, one sample of each
training prompt too, written as the dataset's rows with `solution` replaced by the sample:
what configs/drafter.py:code and :plan train the offline drafter on, so that it drafts the
warm start's own answers, right or wrong, as a drafter trained before RL would.
"""
import collections
import json

import jax
import numpy as np
from absl import flags

from configs import sft as sft_configs
from experiments.pass_at_k import pass_at_k
from tlt_jax import evaluation, launch, rewards, sampling, sharding
from tlt_jax.data import sources
from tlt_jax.models.hf_io import load_hf
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.tokenizer import load_tokenizer

_PRESET = flags.DEFINE_enum("preset", "code", list(sft_configs.SEED_PRESETS), "The SFT preset whose data and "
                            "reward are used.")
_OUTPUTS = flags.DEFINE_string("outputs", "", "Write one sample of each training prompt here (parquet).")
_NUM_TRAIN = flags.DEFINE_integer("num_train", 1000, "Training prompts sampled for --outputs.")
# --model_dir, --num_samples, --k and --seed are experiments/pass_at_k.py's flags, as there.
FLAGS = flags.FLAGS


def _engine(cfg, params, prompt_length: int, max_tokens: int, eos: int, slots: int) -> RolloutEngine:
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    return RolloutEngine(cfg, params, mesh, RolloutConfig(num_slots=slots, max_prompt_length=prompt_length,
                                                          max_length=prompt_length + max_tokens + 1,
                                                          eos_token_id=eos))


def pass_at_k_by_prompt(samples: list[dict], k: int) -> float:
    """pass@k over the distinct prompts of `samples` (a prompt drawn twice pools its samples)."""
    passed = collections.defaultdict(list)
    for s in samples:
        passed[s["prompt"]].append(s["reward"] >= 1.0)
    return float(np.mean([pass_at_k(np.asarray([sum(v)]), len(v), k) for v in passed.values()]))


def main(argv):
    del argv
    config = sft_configs.get_config(_PRESET.value)
    cfg, params = load_hf(FLAGS.model_dir)
    tokenizer = load_tokenizer(FLAGS.model_dir)
    problems = sources.load_problems(config.data, tokenizer=tokenizer)
    reward = rewards.reward_from_config(config)
    max_tokens = config.data.seq_len - config.eval.max_prompt_length
    engine = _engine(cfg, params, config.eval.max_prompt_length, max_tokens, tokenizer.eos_token_id, 64)
    sp = sampling.SamplingParams(temperature=1.0, max_tokens=max_tokens)
    n, ks = FLAGS.num_samples, [int(k) for k in FLAGS.k]
    examples = list(problems.eval)
    _, samples = evaluation.evaluate_samples(engine, tokenizer, examples, sp, jax.random.PRNGKey(FLAGS.seed),
                                             num_samples=n, reward=reward, prompt_format=problems.prompt_format)
    out = {f"pass@{k}": pass_at_k_by_prompt(samples, k) for k in ks}
    out["reward_mean"] = float(np.mean([s["reward"] for s in samples]))
    if _OUTPUTS.value:
        import datasets

        train = list(problems.train)[:_NUM_TRAIN.value]
        _, own = evaluation.evaluate_samples(engine, tokenizer, train, sp, jax.random.PRNGKey(FLAGS.seed + 1),
                                             num_samples=1, reward=reward, prompt_format=problems.prompt_format)
        rows = [{"prompt": e.prompt, "solution": s["completion"]} for e, s in zip(train, own)]
        datasets.Dataset.from_list(rows).to_parquet(_OUTPUTS.value)
        out["outputs"], out["outputs_reward_mean"] = _OUTPUTS.value, float(np.mean([s["reward"] for s in own]))
    print(json.dumps(out))


if __name__ == "__main__":
    launch.run(main)
