r"""Speculative against plain rollout decoding: tokens/s and acceptance lengths.

  python -m experiments.bench_spec --preset=cpu --out=docs/results/bench_spec_cpu.json
  python -m experiments.bench_spec --preset=gpu --target=... --drafter=... --out=...

A target trained on the synthetic tasks (default: the shipped SFT checkpoint) and its
drafter (`experiments.train_drafter`) generate answers to held-out task prompts, G per
prompt as in RL, with every slot filled: plain decode against each strategy, run on
every step, at each batch size and temperature, over `waves` slot-fulls of requests.
Each configuration is generated once to compile and once timed. The table reports
tokens/s over the whole generate (prefill and host bookkeeping included, the same for
both sides), the speed-up, the speed-up of the decode chunks alone, and the acceptance
length (mean tokens committed per sequence per verify step, bonus included);
`breakeven_batch` is, per strategy and temperature, the largest batch at which
speculation still pays end to end: the input to the adaptive tuner.
"""
import json
import os
import time

import jax
from absl import flags

from configs import sft as sft_configs
from tlt_jax import evaluation, launch, metrics, sampling, sharding
from tlt_jax.data import tasks
from tlt_jax.drafter_training.io import load_drafter
from tlt_jax.models.hf_io import load_hf
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.rollout.speculative import FixedSpeculation, Strategy
from tlt_jax.tokenizer import load_tokenizer

_PRESET = flags.DEFINE_enum("preset", "cpu", ["cpu", "gpu"], "Batch sizes and lengths to run.")
_TARGET = flags.DEFINE_string("target", "assets/sft_tiny", "Target: a Hugging Face checkpoint with its tokenizer.")
_DRAFTER = flags.DEFINE_string("drafter", "assets/drafter_tiny", "Drafter trained for the target.")
_OUT = flags.DEFINE_string("out", "", "Write the results as JSON here.")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Parameter and compute dtype of the target "
                           "(default: the checkpoint's).")
_BATCHES = flags.DEFINE_list("batches", None, "Override the preset's batch sizes.")
_STRATEGIES = flags.DEFINE_list("strategies", ["eagle-d4", "eagle-d6", "eagle-d5-k3-t12", "ngram-d4-b2"],
                                "Strategies by name (Strategy.from_name).")
_TEMPERATURES = flags.DEFINE_list("temperatures", None, "Override the preset's temperatures.")
_TIME_BUDGET_S = flags.DEFINE_float("time_budget_s", 0.0, "Start no new batch size after this many seconds (0: none); "
                                    "the JSON lists the batch sizes skipped.")

PRESETS = {
    "cpu": dict(batches=[1, 4, 8, 16, 32, 64], temperatures=[0.0, 1.0], max_tokens=96, samples_per_prompt=4, waves=4),
    "gpu": dict(batches=[1, 4, 8, 16, 32, 64], temperatures=[0.0, 1.0], max_tokens=256, samples_per_prompt=4,
                waves=4),
}


def run_once(engine, prompts, g, sp, speculation, key):
    engine.generate(prompts, g, sp, key, speculation=speculation)  # compiles every shape it meets
    t0 = time.perf_counter()
    out = engine.generate(prompts, g, sp, key, speculation=speculation)
    wall = time.perf_counter() - t0
    s = out.timeline.summary()
    decode_s = sum(c.end - c.start for g in out.timeline.groups for c in g.chunks)
    tokens = int(out.lengths.sum())
    return dict(tokens=tokens, seconds=wall, tokens_per_s=tokens / wall, decode_tokens_per_s=tokens / decode_s,
                acceptance_length=s["acceptance_length"])


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    preset = PRESETS[_PRESET.value]
    batches = [int(b) for b in (_BATCHES.value or preset["batches"])]
    strategies = [Strategy.from_name(name) for name in _STRATEGIES.value]
    temperatures = [float(t) for t in (_TEMPERATURES.value or preset["temperatures"])]
    model_cfg, params = load_hf(_TARGET.value, dtype=_DTYPE.value)
    tokenizer = load_tokenizer(_TARGET.value)
    if not os.path.exists(_DRAFTER.value):
        raise SystemExit(f"No drafter at {_DRAFTER.value!r}; train one with `python -m experiments.train_drafter "
                         "--config=configs/drafter.py:tiny` or pass --drafter.")
    drafter_cfg, drafter_params = load_drafter(_DRAFTER.value, model_cfg)
    examples = tasks.make_split(tasks.from_spec(sft_configs.tasks_tiny().to_dict()), "eval",
                                preset["waves"] * max(batches), seed=2, unique=True)
    all_prompts = evaluation.encode_prompts(tokenizer, examples)
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    g = preset["samples_per_prompt"]
    key = jax.random.PRNGKey(0)
    rows = []
    result = dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  target=_TARGET.value, drafter=_DRAFTER.value, target_params=model_cfg.num_params(), rows=rows)
    t_start = time.perf_counter()
    for i, b in enumerate(batches):
        if _TIME_BUDGET_S.value and time.perf_counter() - t_start > _TIME_BUDGET_S.value:
            result["skipped_batches"] = batches[i:]
            print(f"time budget spent: batches {batches[i:]} skipped", flush=True)
            break
        samples = min(g, b)
        prompts = all_prompts[:preset["waves"] * b // samples]
        rc = RolloutConfig(num_slots=b, max_prompt_length=max(map(len, prompts)),
                           max_length=max(map(len, prompts)) + preset["max_tokens"] + 1, steps_per_sync=16,
                           eos_token_id=model_cfg.eos_token_id,
                           max_draft_depth=max(s.depth for s in strategies))
        engine = RolloutEngine(model_cfg, params, mesh, rc, drafter_cfg, drafter_params)
        for temperature in temperatures:
            sp = sampling.SamplingParams(temperature=temperature, max_tokens=preset["max_tokens"])
            plain = run_once(engine, prompts, samples, sp, None, key)
            for strategy in strategies:
                spec = run_once(engine, prompts, samples, sp, FixedSpeculation(strategy, max_active=b), key)
                row = dict(batch=b, temperature=temperature, strategy=strategy.name, requests=len(prompts) * samples,
                           plain_tokens_per_s=plain["tokens_per_s"], spec_tokens_per_s=spec["tokens_per_s"],
                           speedup=spec["tokens_per_s"] / plain["tokens_per_s"],
                           plain_decode_tokens_per_s=plain["decode_tokens_per_s"],
                           spec_decode_tokens_per_s=spec["decode_tokens_per_s"],
                           decode_speedup=spec["decode_tokens_per_s"] / plain["decode_tokens_per_s"],
                           acceptance_length=spec["acceptance_length"], plain_tokens=plain["tokens"],
                           spec_tokens=spec["tokens"])
                rows.append(row)
                print(json.dumps(row), flush=True)
                _write(result)
    result["breakeven_batch"] = {
        f"{s.name}@T{t}": max([r["batch"] for r in rows if r["strategy"] == s.name and r["temperature"] == t
                               and r["speedup"] > 1.0], default=0)
        for s in strategies for t in temperatures}
    _write(result)
    print(f"\nbackend {result['backend']} ({result['device']}), target {model_cfg.num_params() / 1e6:.1f}M params")
    print(f"{'batch':>5} {'T':>3} {'strategy':20} {'plain tok/s':>11} {'spec tok/s':>10} {'x':>5} "
          f"{'decode x':>8} {'acc len':>7}")
    for r in rows:
        print(f"{r['batch']:5d} {r['temperature']:3.1f} {r['strategy']:20} {r['plain_tokens_per_s']:11.0f} "
              f"{r['spec_tokens_per_s']:10.0f} {r['speedup']:5.2f} {r['decode_speedup']:8.2f} "
              f"{r['acceptance_length']:7.2f}")
    print("largest batch where speculation pays:", json.dumps(result["breakeven_batch"]))


def _write(result):
    """Rewritten after every row, so a run cut short keeps what it measured."""
    if _OUT.value:
        metrics.write_json(_OUT.value, result)


if __name__ == "__main__":
    launch.run(main)
