r"""pass@k of a checkpoint on each task of a synthetic mix, sampled at temperature 1.

  python -m experiments.pass_at_k --model_dir=runs/bench_tlt_cache/sft_drift_shift/hf --tasks=drift_shift

Whether GRPO has signal on a task: with G samples a prompt, a task whose pass@G is 0 gives
every sample the same reward and so no advantage. bench_tlt's cpu_drift_shift wants its
warm start's countdowns at pass@4 of about 5-15%. Held-out prompts (the eval split) of each
task alone; pass@k by the unbiased estimator over n >= k samples (Chen et al. 2021).

With two answer formats (additions with `trace_share`, the drift_learn mix), each format's
share of the samples and its accuracy (the share of its samples that are right) too:
cpu_drift_learn wants the worked trace rare and reliable, the bare answer common and not.

  python -m experiments.pass_at_k --model_dir=assets/sft_drift_learn --tasks=drift_learn --max_tokens=96
"""
import json
import math

import jax
import numpy as np
from absl import flags

from configs import common
from tlt_jax import evaluation, launch, sampling, sharding
from tlt_jax.data import tasks
from tlt_jax.models.hf_io import load_hf
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.tokenizer import load_tokenizer

_MODEL_DIR = flags.DEFINE_string("model_dir", None, "A Hugging Face checkpoint with its tokenizer.", required=True)
_TASKS = flags.DEFINE_enum("tasks", "drift_shift", ["drift_shift", "drift_learn", "long_tail", "tiny"],
                           "The task mix of configs/common.py whose tasks are scored, each alone.")
_ONLY = flags.DEFINE_list("only", [], "Score only these tasks of the mix (default: every task).")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 64, "Held-out prompts per task.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 4, "Samples per prompt (n).")
_K = flags.DEFINE_list("k", ["1", "4"], "The k of pass@k (each <= num_samples).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 224, "New tokens per sample.")
_SEED = flags.DEFINE_integer("seed", 1, "Seed of the eval split (bench_tlt's RL data uses 1) and of sampling.")


def pass_at_k(correct_per_prompt: np.ndarray, n: int, k: int) -> float:
    """Mean over prompts of 1 - C(n - c, k) / C(n, k), c the prompt's correct samples of n."""
    if not 1 <= k <= n:
        raise ValueError(f"--k={k} must be between 1 and --num_samples={n}.")
    return float(np.mean([1.0 - math.comb(n - int(c), k) / math.comb(n, k) for c in correct_per_prompt]))


def by_format(samples: list[dict]) -> dict:
    """{"<format>_share": its share of the samples, "<format>_accuracy": the share of its
    samples that are right (None where it has none)} for the formats of
    `tasks.solution_format`."""
    formats = [tasks.solution_format(s["completion"]) for s in samples]
    out = {}
    for name in ("trace", "bare"):
        rewards = [s["reward"] >= 1.0 for s, f in zip(samples, formats) if f == name]
        out[f"{name}_share"] = len(rewards) / len(samples)
        out[f"{name}_accuracy"] = float(np.mean(rewards)) if rewards else None
    return out


def main(argv):
    del argv
    cfg, params = load_hf(_MODEL_DIR.value)
    tokenizer = load_tokenizer(_MODEL_DIR.value)
    mix = {"drift_shift": common.tasks_drift_shift, "drift_learn": common.tasks_drift_learn,
           "long_tail": common.tasks_long_tail, "tiny": common.tasks_tiny}[_TASKS.value]()
    unknown = sorted(set(_ONLY.value) - set(mix))
    if unknown:
        raise ValueError(f"--only={','.join(unknown)}: not a task of the {_TASKS.value} mix "
                         f"({', '.join(sorted(mix))}).")
    mix = {name: spec for name, spec in mix.items() if name in (_ONLY.value or mix)}
    n, ks = _NUM_SAMPLES.value, [int(k) for k in _K.value]
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    out = {}
    for name in sorted(mix):
        examples = tasks.make_split(tasks.from_spec({name: mix[name]}), "eval", _NUM_PROMPTS.value, seed=_SEED.value,
                                    unique=True)
        prompt_length = max(len(tokenizer(e.prompt)["input_ids"]) for e in examples)
        engine = RolloutEngine(cfg, params, mesh, RolloutConfig(
            num_slots=min(64, len(examples) * n), max_prompt_length=prompt_length,
            max_length=prompt_length + _MAX_TOKENS.value + 1, eos_token_id=tokenizer.eos_token_id))
        sp = sampling.SamplingParams(temperature=1.0, max_tokens=_MAX_TOKENS.value)
        _, samples = evaluation.evaluate_samples(engine, tokenizer, examples, sp, jax.random.PRNGKey(_SEED.value),
                                                 num_samples=n)
        correct = (np.asarray([s["reward"] for s in samples]) >= 1.0).reshape(len(examples), n).sum(axis=1)
        out[name] = {f"pass@{k}": pass_at_k(correct, n, k) for k in ks}
        if mix[name].get("trace_share", 1.0) < 1.0:
            out[name].update(by_format(samples))
        print(f"{name}: " + ", ".join(f"{key} {v:.3f}" for key, v in out[name].items() if v is not None), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    launch.run(main)
