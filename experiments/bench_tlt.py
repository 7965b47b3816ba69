r"""TLT end to end: the same RL run with TLT off (the baseline) and on, back to back.

  python -m experiments.bench_tlt --preset=cpu_long --seed=0 --out=docs/results/bench_tlt_cpu_long_s0.json
  python -m experiments.bench_tlt --preset=gpu --target=... --drafter=... --out=...   # device_check.sh

Same config, seed and data in every mode; only `tlt.*` differs. Modes:
  baseline   --config.tlt.enabled=False: plain rollouts, no drafter
  tlt        adaptive speculation (the tuner) and the drafter trained on the spot
  frozen     (with --drafters) TLT with the warm-start drafter never trained: what a
             static drafter accepts as the policy moves
  ngram      (with --drafters) TLT with n-gram arms only: no drafter at all

A CPU preset's target is its SFT model (`cpu`, `cpu_tail`: the shipped one; `cpu_long`, the
default: `configs/sft.py:long_tail`, trained once with its drafter) deepened to `layers`
layers by appending layers with zero output projections (`transformer.append_identity_layers`):
the function (and so the accuracy and the drafter's features) of the trained model, the
decode cost of a deeper one, so that a one-layer drafter step is a small fraction of a
target step, as on a GPU. Built once into `--cache_dir`.

Phase times are medians over the steps after `--warmup_steps`; the first steps' excess over
the median is reported as compile time (TLT compiles its strategies before the first step,
`RolloutEngine.warm_up`; compiled programs persist in `<cache_dir>/xla` across runs). The table gives the phase
split of both modes, so a missed bar shows where the time went. A ratio counts only from a
run that compiled nothing new (`new_compiled_programs` 0 in every mode): on a cold cache,
learner and prefill shapes that first appear in later steps compile inside timed steps, and
the second mode finds the first mode's programs compiled, which flatters it.

The speed-ups pair the same steps of the two modes (the same prompts): `rollout_speedup` and
`step_speedup` are the medians over the timed steps of baseline / TLT per step;
`*_speedup_total` the ratio of the summed times; `*_speedup_of_medians` the ratio of each
mode's median time, which can compare unlike steps (`paired_speedups` says why).
"""
import ast
import os
import shutil
import statistics
import time

import jax
import jax.numpy as jnp
from absl import flags

from configs import rl as rl_configs
from tlt_jax import fingerprint, launch, metrics
from tlt_jax.drafter_training import io as drafter_io
from tlt_jax.models import transformer as tfm
from tlt_jax.models.hf_io import load_hf, save_hf
from tlt_jax.rl.train import train_rl
from tlt_jax.tokenizer import load_tokenizer

_PRESET = flags.DEFINE_enum("preset", "cpu_long", ["cpu", "cpu_long", "cpu_tail", "gpu"], "Run size (see PRESETS).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the RL runs (data, sampling, drafter).")
_OUT = flags.DEFINE_string("out", "", "Write the results as JSON here.")
_STEPS = flags.DEFINE_integer("steps", None, "Override the preset's RL steps per mode.")
_MODES = flags.DEFINE_list("modes", ["baseline", "tlt"], "Modes to run, in order (baseline, tlt, frozen, ngram).")
_CACHE = flags.DEFINE_string("cache_dir", "runs/bench_tlt_cache", "Where the preset's target and drafter are built.")
_RUN_DIR = flags.DEFINE_string("run_dir", "runs/bench_tlt", "Run directories of the modes go here.")
_TARGET = flags.DEFINE_string("target", "", "A target (Hugging Face checkpoint with tokenizer) in place of the "
                              "preset's deepened SFT model; needs --drafter.")
_DRAFTER = flags.DEFINE_string("drafter", "", "A drafter export for --target (experiments.train_drafter).")
_TLT_SET = flags.DEFINE_multi_string("tlt_set", [], "A config override key=value for the TLT modes (not the "
                                     "baseline), e.g. tlt.tuner.max_active=32 (TLT's threshold); repeatable.")

PRESETS = {
    # 16 prompts x 8 samples; traces of up to 8-digit additions (Zipf-distributed digit
    # counts: most short, a few 4x the median), so the batch drains through a long tail.
    "cpu": dict(layers=16, steps=12, warmup_steps=3, prompts_per_step=16, num_samples=8, max_tokens=96,
                num_slots=128, catch_up_steps=2, max_steps_per_rl_step=8),
    # Traces of up to 32-digit additions (configs/sft.py:long_tail; the warm start and its
    # drafter are trained first, once): median answer ~32 tokens, the longest of a step's
    # 64 samples ~200, so most of a rollout's steps run in the tail, as in TLT's traces.
    # The tuner may speculate at any batch size (max_active = num_slots): on this CPU a
    # verify step of 64 sequences still pays, which the bandit measures (it chose
    # speculation for ~95% of tokens); TLT's threshold of 32 left half the tokens plain.
    "cpu_long": dict(layers=16, steps=20, warmup_steps=3, prompts_per_step=8, num_samples=8, max_tokens=288,
                     num_slots=64, catch_up_steps=2, max_steps_per_rl_step=8, warm_start="long_tail",
                     max_prompt_length=64, max_active=64),
    # The tail alone: 4 prompts x 8 samples, so every chunk runs at most 32 sequences (TLT's
    # threshold): the regime speculation is for, without the wide phase before it.
    "cpu_tail": dict(layers=16, steps=12, warmup_steps=3, prompts_per_step=4, num_samples=8, max_tokens=96,
                     num_slots=32, catch_up_steps=2, max_steps_per_rl_step=8),
    "gpu": dict(layers=48, steps=10, warmup_steps=3, prompts_per_step=32, num_samples=8, max_tokens=96,
                num_slots=256, catch_up_steps=4, max_steps_per_rl_step=16),
}
_TIMES = ("time_rollout_s", "time_reward_s", "time_batch_s", "time_old_logp_s", "time_learner_s",
          "time_weight_sync_s", "time_tlt_end_s", "time_step_s")


def build_warm_start(name: str, cache_dir: str) -> tuple[str, str]:
    """(SFT model dir, drafter export dir): the shipped assets, or those of
    configs/sft.py:<name> and configs/drafter.py:<name> trained once into cache_dir."""
    if name == "assets":
        return "assets/sft_tiny", "assets/drafter_tiny"
    from configs import drafter as drafter_configs
    from configs import sft as sft_configs
    from tlt_jax.drafter_training.trainer import train_drafter
    from tlt_jax.sft import train_sft

    sft_config = sft_configs.get_config(name)
    sft_config.run_dir = os.path.join(cache_dir, f"sft_{name}")
    sft_dir = os.path.join(sft_config.run_dir, "hf")
    if not os.path.exists(sft_dir):
        print(f"training the {name} warm start once: {sft_config.steps} SFT steps into {sft_config.run_dir}")
        train_sft(sft_config)
    drafter_config = drafter_configs.get_config(name)
    drafter_config.target_dir = sft_dir
    drafter_config.run_dir = os.path.join(cache_dir, f"drafter_{name}")
    drafter_dir = os.path.join(drafter_config.run_dir, "drafter")
    if not os.path.exists(drafter_dir):
        print(f"training its drafter once: {drafter_config.steps} steps into {drafter_config.run_dir}")
        train_drafter(drafter_config)
    return sft_dir, drafter_dir


def build_target(layers: int, cache_dir: str, warm_start: str = "assets") -> tuple[str, str]:
    """(target HF dir, drafter export dir) of the preset, built once from its warm start."""
    sft_dir, sft_drafter_dir = build_warm_start(warm_start, cache_dir)
    suffix = "" if warm_start == "assets" else f"_{warm_start}"
    target_dir = os.path.join(cache_dir, f"target_l{layers}{suffix}")
    drafter_dir = os.path.join(cache_dir, f"drafter_l{layers}{suffix}")
    if not os.path.exists(os.path.join(drafter_dir)):
        cfg, params = load_hf(sft_dir)
        cfg, params = tfm.append_identity_layers(jax.tree.map(jnp.asarray, params), cfg, layers)
        params = jax.device_get(params)
        save_hf(target_dir, cfg, params, tokenizer=load_tokenizer(sft_dir), overwrite=True)
        # The drafter reads the final hidden state, which the appended layers leave as it
        # was: re-exported for the deeper target.
        dcfg, dparams = drafter_io.load_drafter(sft_drafter_dir)
        drafter_io.save_drafter(drafter_dir, dparams, dcfg, cfg, fingerprint.fingerprint_arrays(params))
    return target_dir, drafter_dir


def mode_config(mode: str, preset: dict, target_dir: str, drafter_dir: str, seed: int, steps: int):
    c = rl_configs.get_config("tiny")
    c.model_dir, c.seed, c.steps = target_dir, seed, steps
    c.prompts_per_step, c.num_samples = preset["prompts_per_step"], preset["num_samples"]
    c.rollout.update(num_slots=preset["num_slots"], max_tokens=preset["max_tokens"])
    if preset.get("warm_start", "assets") != "assets":
        from configs import sft as sft_configs

        c.data.tasks = sft_configs.get_config(preset["warm_start"]).data.tasks
        c.rollout.max_prompt_length = preset["max_prompt_length"]
    c.eval_every, c.checkpoint_every, c.save_hf = steps, steps, False
    c.track_kl = False  # kl_coef is 0: no reference forward, in either mode
    c.run_dir = os.path.join(_RUN_DIR.value, f"{mode}_s{seed}")
    c.tlt.enabled = mode != "baseline"
    c.tlt.drafter.init = drafter_dir
    c.tlt.drafter.checkpoint_every = steps
    c.tlt.spot.update(catch_up_steps=preset["catch_up_steps"], max_steps_per_rl_step=preset["max_steps_per_rl_step"])
    if "max_active" in preset:
        c.tlt.tuner.max_active = preset["max_active"]
    if mode == "frozen":
        c.tlt.spot.update(catch_up_steps=0, max_steps_per_rl_step=0)
    if mode == "ngram":
        c.tlt.tuner.arms = [[a for a in arms if not a.startswith("eagle")] for arms in c.tlt.tuner.arms]
    if mode != "baseline":
        for item in _TLT_SET.value:
            key, _, value = item.partition("=")
            *path, leaf = key.split(".")
            node = c
            for name in path:
                node = node[name]
            node[leaf] = type(node[leaf])(ast.literal_eval(value))
    return c


def summarise(records: list[dict], warmup: int) -> dict:
    steps = [r for r in records if "time_step_s" in r]
    steady = steps[warmup:] or steps
    med = {k: statistics.median(r[k] for r in steady) for k in _TIMES}
    first = sum(r["time_step_s"] for r in steps[:warmup])
    return dict(median=med, compile_s=max(0.0, first - warmup * med["time_step_s"]),
                steady_steps=[r["step"] for r in steady],
                steady_times={k: [r[k] for r in steady] for k in ("time_rollout_s", "time_step_s")},
                acceptance_length=[r["acceptance_length"] for r in steps],
                speculative_token_share=[r["speculative_token_share"] for r in steps],
                drafter_version=[r.get("drafter_version", 0) for r in steps],
                drafter_steps=[r.get("spot/steps", 0) + r.get("spot/catch_up_steps", 0) for r in steps],
                hidden_share=[r.get("spot/hidden_share", 1.0) for r in steps],
                preemption_delay_max_s=[r.get("spot/preemption_delay_max_s", 0.0) for r in steps],
                response_length_mean=[r["response_length_mean"] for r in steps],
                reward_mean=[r["reward_mean"] for r in steps],
                rollout_tokens_per_s=statistics.median(r["rollout_tokens_per_s"] for r in steady))


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    preset = PRESETS[_PRESET.value]
    steps = _STEPS.value or preset["steps"]
    # Repeated runs (and the second mode's learner, the same programs) skip compiles.
    launch.enable_compilation_cache(_xla_cache_dir())
    t0 = time.perf_counter()
    if bool(_TARGET.value) != bool(_DRAFTER.value):
        raise SystemExit("Pass --target and --drafter together (or neither, for the preset's own).")
    target_dir, drafter_dir = ((_TARGET.value, _DRAFTER.value) if _TARGET.value
                               else build_target(preset["layers"], _CACHE.value, preset.get("warm_start", "assets")))
    result = dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  preset=_PRESET.value, seed=_SEED.value, steps=steps, layers=preset["layers"], tlt_set=_TLT_SET.value,
                  build_s=time.perf_counter() - t0, modes={})
    for mode in _MODES.value:
        config = mode_config(mode, preset, target_dir, drafter_dir, _SEED.value, steps)
        if os.path.exists(config.run_dir):  # a benchmark measures fresh runs, never a resumed one
            shutil.rmtree(config.run_dir)
        t_mode = time.perf_counter()
        programs = _cached_programs()
        summary = train_rl(config, progress=True)
        records = metrics.read_metrics(os.path.join(config.run_dir, metrics.METRICS_FILENAME))
        result["modes"][mode] = dict(summarise(records, preset["warmup_steps"]), wall_s=time.perf_counter() - t_mode,
                                     final_eval_accuracy=summary["final_eval_accuracy"],
                                     sft_eval_accuracy=summary["sft_eval_accuracy"], tlt=summary.get("tlt"),
                                     new_compiled_programs=_cached_programs() - programs)
        _write(result)
    modes = result["modes"]
    if "baseline" in modes and "tlt" in modes:
        b, t = modes["baseline"]["median"], modes["tlt"]["median"]
        result.update(
            rollout_time_s={"baseline": b["time_rollout_s"], "tlt": t["time_rollout_s"]},
            step_time_s={"baseline": b["time_step_s"], "tlt": t["time_step_s"]},
            **paired_speedups(modes["baseline"], modes["tlt"]),
            rollout_speedup_of_medians=b["time_rollout_s"] / t["time_rollout_s"],
            step_speedup_of_medians=b["time_step_s"] / t["time_step_s"],
            acceptance_length=modes["tlt"]["acceptance_length"],
            final_eval_accuracy={"baseline": modes["baseline"]["final_eval_accuracy"],
                                 "tlt": modes["tlt"]["final_eval_accuracy"]})
    _write(result)
    if _OUT.value and any(m in modes for m in ("tlt", "frozen", "ngram")):
        plot_acceptance(modes, os.path.splitext(_OUT.value)[0] + "_acceptance.png")
    print(f"\nbackend {result['backend']}, preset {result['preset']} ({preset['layers']}-layer target), seed "
          f"{result['seed']}, {steps} steps per mode; medians over steps {preset['warmup_steps'] + 1}..{steps}")
    print(f"{'mode':9}" + "".join(f"{k[5:-2]:>12}" for k in _TIMES) + f"{'compile':>9}{'acc len':>8}{'eval acc':>9}")
    for mode, m in modes.items():
        acc = [a for a in m["acceptance_length"] if a > 0]
        print(f"{mode:9}" + "".join(f"{m['median'][k]:12.3f}" for k in _TIMES) + f"{m['compile_s']:9.1f}"
              f"{(statistics.mean(acc) if acc else 0.0):8.2f}{m['final_eval_accuracy'] or 0.0:9.3f}")
    if "rollout_speedup" in result:
        print(f"rollout speed-up {result['rollout_speedup']:.2f}x, step speed-up {result['step_speedup']:.2f}x "
              "(medians of the per-step ratios)")
        print(f"whole run: rollout {result['rollout_speedup_total']:.2f}x, step {result['step_speedup_total']:.2f}x "
              f"(ratio of sums); ratio of the medians: rollout {result['rollout_speedup_of_medians']:.2f}x, step "
              f"{result['step_speedup_of_medians']:.2f}x")
    cold = {mode: m["new_compiled_programs"] for mode, m in modes.items() if m["new_compiled_programs"]}
    if cold:
        print(f"Programs compiled during the runs (not found in {_CACHE.value}/xla): {cold}. Shapes that first "
              "appear after the warm-up steps (learner rows, prefill buckets) compile inside timed steps, and a "
              "later mode finds an earlier mode's programs compiled: run the same command again for a fair ratio.")


def paired_speedups(baseline: dict, tlt: dict) -> dict:
    """Speed-ups over the same steps (the same prompts in both modes): `<phase>_speedup`, the
    median of the per-step ratios, and `<phase>_speedup_total`, the ratio of the summed
    times. Sturdier than a ratio of medians: a step's learner time jumps with the packed rows
    its longest answers need, so each mode's median can land on a different side of a jump."""
    if baseline["steady_steps"] != tlt["steady_steps"]:
        raise ValueError("The modes timed different steps; run them with the same --steps.")
    out = {}
    for key, name in (("time_rollout_s", "rollout"), ("time_step_s", "step")):
        b, t = baseline["steady_times"][key], tlt["steady_times"][key]
        out[f"{name}_speedup"] = statistics.median(x / y for x, y in zip(b, t))
        out[f"{name}_speedup_total"] = sum(b) / sum(t)
    return out


def plot_acceptance(modes: dict, path: str) -> None:
    """Acceptance length per RL step of each drafter the modes ran (adaptive, frozen, n-gram)."""
    from matplotlib.figure import Figure

    labels = {"tlt": "adaptive (spot-trained)", "frozen": "frozen at step 0", "ngram": "none (n-gram only)"}
    figure = Figure(figsize=(7, 3.2), layout="constrained")
    ax = figure.subplots()
    for mode, label in labels.items():
        if mode in modes:
            # A step whose tail chunks all decoded plainly has no acceptance: a gap, not 0.
            values = [a if a > 0 else float("nan") for a in modes[mode]["acceptance_length"]]
            ax.plot(range(1, len(values) + 1), values, marker="o", markersize=3, label=label)
    ax.set_xlabel("RL step")
    ax.set_ylabel("acceptance length")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    figure.savefig(path, dpi=100)


def _xla_cache_dir() -> str:
    return os.path.abspath(os.path.join(_CACHE.value, "xla"))


def _cached_programs() -> int:
    """Programs in the benchmark's persistent compilation cache (every compile is kept)."""
    path = _xla_cache_dir()
    return len(os.listdir(path)) if os.path.isdir(path) else 0


def _write(result):
    if _OUT.value:
        metrics.write_json(_OUT.value, result)


if __name__ == "__main__":
    launch.run(main)
