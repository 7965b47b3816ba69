r"""Partial rollouts, or one-step-off training, against synchronous steps: the same RL run of
a bench_tlt preset with TLT off, synchronous and the other mode, each run in a fresh process.

  python -m experiments.bench_partial --preset=cpu_drift_learn --seeds=0 --pairs=2 --steps=30 \
      --set=learner.optimizer.learning_rate=3e-5 --set=eval_every=10 --run_dir=runs/bench_partial \
      --out=docs/results/bench_partial_cpu_drift_learn.json
  python -m experiments.bench_partial --against=off_policy ...  (the same flags)

Every run is `experiments.bench_tlt --single_mode=baseline` with the same flags (--target and
--drafter passed on when given); the partial runs add --set=rollout.partial_share=<share>
--set=rollout.max_carry_steps=<m>, the off_policy runs --set=off_policy_steps=1. Per seed,
`--pairs` pairs of runs in ABBA order (sync, partial, partial, sync, ...; the next seed
starts where the last left off), so that neither mode always runs second. From each run's
metrics.jsonl, over the steps after the preset's warm-up steps: the median step and rollout
times, the rollout's share of the step time, the learner's response tokens per second of
its own time, the samples learned per second of step time (partial steps learn the groups
that completed, synchronous and one-step-off ones all of theirs), the token ages (what was
carried, how stale), and the eval accuracy by step beside the samples learned by then, for
comparing learning at equal samples. Ratios are the other mode's over synchronous within a
pair, with the load average the run saw (the machine may be shared); where one-step-off
overlaps a step's rollout with the learner before it (every program on one device), the
rollout's time is the step's wait for it. --out is written again
after every run, so that a benchmark cut short keeps the runs that finished."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

from experiments import bench_tlt
from tlt_jax import metrics

MODES = ("partial", "off_policy")  # the modes measured against synchronous steps ("sync")

_REFRESH = flags.DEFINE_string("refresh", "", "Summarize the result JSON at this path again from its runs' metrics "
                                "(and plot it) in place of running.")
# bench_tlt's own flags serve here too: --preset, --steps, --set, --run_dir, --cache_dir, --out.
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds; each gets --pairs pairs of runs.")
_PAIRS = flags.DEFINE_integer("pairs", 1, "Pairs of runs per seed (sync and partial), in ABBA order.")
_SHARE = flags.DEFINE_float("share", 0.5, "rollout.partial_share of the partial runs.")
_MAX_CARRY = flags.DEFINE_integer("max_carry_steps", 2, "rollout.max_carry_steps of the partial runs.")
_AGAINST = flags.DEFINE_enum("against", "partial", list(MODES), "The mode run against synchronous steps: partial "
                             "rollouts (--share, --max_carry_steps) or one-step-off training (off_policy_steps=1).")
_PRESET, _STEPS, _SET, _RUN_DIR, _CACHE, _OUT = (bench_tlt._PRESET, bench_tlt.STEPS, bench_tlt._SET, bench_tlt._RUN_DIR,
                                                  bench_tlt.CACHE, bench_tlt.OUT)


def _command(mode: str, seed: int, run_dir: str) -> list[str]:
    settings = {"sync": [], "off_policy": ["--set=off_policy_steps=1"],
                "partial": [f"--set=rollout.partial_share={_SHARE.value}",
                            f"--set=rollout.max_carry_steps={_MAX_CARRY.value}"]}[mode]
    target = [f"--{flag.name}={flag.value}" for flag in (bench_tlt._TARGET, bench_tlt._DRAFTER) if flag.value]
    return [sys.executable, "-m", "experiments.bench_tlt", f"--preset={_PRESET.value}", f"--seed={seed}",
            *([f"--steps={_STEPS.value}"] if _STEPS.value else []), f"--run_dir={run_dir}",
            f"--cache_dir={_CACHE.value}", *target, "--decode_mlp_size=0",
            "--noregime_check", *[f"--set={s}" for s in _SET.value], *settings,
            "--single_mode=baseline", f"--out={os.path.join(run_dir, 'result.json')}"]


def summarize(records: list[dict], warmup: int, samples_per_step: int) -> dict:
    """One run's figures from its metrics records (see the module docstring)."""
    steps = [r for r in records if "time_step_s" in r]
    steady = steps[warmup:]
    # Partial steps learn the groups that completed; synchronous ones every sample they drew.
    learned = [r.get("learned_samples", samples_per_step) for r in steps]
    tail = learned[warmup:]
    step_s = sum(r["time_step_s"] for r in steady)
    response_tokens = sum(n * r["response_length_mean"] for n, r in zip(tail, steady))
    evals = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
    by_step = {r["step"]: int(np.sum(learned[:i + 1])) for i, r in enumerate(steps)}
    seconds = {r["step"]: float(sum(q["time_step_s"] for q in steps[:i + 1])) for i, r in enumerate(steps)}
    out = {"step_s_median": float(np.median([r["time_step_s"] for r in steady])),
           "rollout_s_median": float(np.median([r["time_rollout_s"] for r in steady])),
           "learner_s_median": float(np.median([r["time_learner_s"] for r in steady])),
           "rollout_share": sum(r["time_rollout_s"] for r in steady) / step_s,
           "learner_response_tokens_per_s": response_tokens / sum(r["time_learner_s"] for r in steady),
           "learned_samples_per_s": sum(tail) / step_s,
           # The same from the median step: what a steady step gives, without the steps that
           # compiled a new shape (a resumed prefill's, a learner bucket's).
           "learned_samples_per_median_s": float(np.mean(tail)) / float(np.median([r["time_step_s"] for r in steady])),
           "samples_learned": int(np.sum(learned)),
           "eval_accuracy": {str(s): a for s, a in sorted(evals.items())},
           "samples_learned_at_eval": {str(s): by_step.get(s, 0) for s in sorted(evals)},
           "step_seconds_at_eval": {str(s): seconds.get(s, 0.0) for s in sorted(evals)},
           "wall_s": float(sum(r["time_step_s"] for r in steps))}
    if "token_age_max" in steps[-1]:  # partial rollouts and one-step-off
        for key in ("carried_samples", "token_age_mean", "stale_token_share", "learned_groups"):
            if key in steps[-1]:
                out[f"{key}_mean"] = float(np.mean([r[key] for r in steady]))
        out["token_age_max"] = int(max(r["token_age_max"] for r in steps))
    return out


def _run(mode: str, seed: int, index: int, warmup: int, samples_per_step: int) -> dict:
    run_dir = os.path.join(_RUN_DIR.value, f"run{index}_{mode}_s{seed}")
    command = _command(mode, seed, run_dir)
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    records = metrics.read_metrics(os.path.join(run_dir, f"baseline_s{seed}", metrics.METRICS_FILENAME))
    result = summarize(records, warmup, samples_per_step)
    print(f"run {index} {mode} seed {seed}: step {result['step_s_median']:.3f} s, rollout share "
          f"{result['rollout_share']:.2f}, eval {result['eval_accuracy']}", flush=True)
    return {"mode": mode, "seed": seed, "command": " ".join(command), "load_before": load_before,
            "load_after": os.getloadavg()[0], "process_wall_s": time.perf_counter() - t0, **result}


def _ratios(runs: list[dict]) -> dict:
    """The other mode over sync, per pair (runs 2k and 2k+1 of a seed), and their geometric
    means (named `<key>_<mode>_over_sync`)."""
    keys = ("step_s_median", "rollout_s_median", "learner_response_tokens_per_s", "learned_samples_per_s",
            "learned_samples_per_median_s")
    pairs, mode = [], next((r["mode"] for r in runs if r["mode"] != "sync"), "partial")
    for a, b in zip(runs[::2], runs[1::2]):
        sync, other = (a, b) if a["mode"] == "sync" else (b, a)
        pairs.append({k: other[k] / sync[k] for k in keys} | {"seed": sync["seed"]})
    if not pairs:
        return {"pairs": []}
    return {"pairs": pairs, **{f"{k}_{mode}_over_sync": float(np.exp(np.mean([np.log(p[k]) for p in pairs])))
                               for k in keys}}


def plot_learning(result: dict, path: str) -> None:
    """Eval accuracy against the samples learned by then, one line per run (sync solid,
    the other mode dashed, a colour per seed), and the same against the seconds of steps run."""
    figure = metrics.new_figure(figsize=(10, 3.6), layout="constrained")
    by_samples, by_time = figure.subplots(1, 2)
    for run in result["runs"]:
        steps = sorted(int(s) for s in run["eval_accuracy"])
        accuracy = [run["eval_accuracy"][str(s)] for s in steps]
        style = dict(linestyle="-" if run["mode"] == "sync" else "--", marker="o", color=f"C{run['seed']}",
                     label=f"{run['mode']} seed {run['seed']}")
        by_samples.plot([run["samples_learned_at_eval"][str(s)] for s in steps], accuracy, **style)
        by_time.plot([run["step_seconds_at_eval"][str(s)] for s in steps], accuracy, **style)
    by_samples.set(xlabel="samples learned", ylabel="eval accuracy (greedy)")
    by_time.set(xlabel="seconds of RL steps (shared machine: see the load)", ylabel="eval accuracy (greedy)")
    by_samples.legend(fontsize=7)
    mode = (f"Partial rollouts (share {result['share']})" if result.get("against", "partial") == "partial"
            else "One-step-off training")
    figure.suptitle(f"{mode} against synchronous steps, {result['preset']}")
    figure.savefig(path, dpi=100)


def refresh(path: str) -> dict:
    """A result at `path` summarized again from its runs' metrics (their run directories
    are in each run's command), rewritten with its plot."""
    with open(path) as f:
        result = json.load(f)
    preset = bench_tlt.PRESETS[result["preset"]]
    for run in result["runs"]:
        run_dir = next(a.split("=", 1)[1] for a in run["command"].split() if a.startswith("--run_dir="))
        records = metrics.read_metrics(os.path.join(run_dir, f"baseline_s{run['seed']}", metrics.METRICS_FILENAME))
        run.update(summarize(records, preset["warmup_steps"], preset["prompts_per_step"] * preset["num_samples"]))
    result.update(_ratios(result["runs"]))
    metrics.write_json(path, result)
    plot_learning(result, os.path.splitext(path)[0] + ".png")
    return result


def main(argv):
    del argv
    if _REFRESH.value:
        refresh(_REFRESH.value)
        return
    preset = bench_tlt.PRESETS[_PRESET.value]
    warmup, samples_per_step = preset["warmup_steps"], preset["prompts_per_step"] * preset["num_samples"]
    order, runs = ["sync", _AGAINST.value], []
    result = {"preset": _PRESET.value, "steps": _STEPS.value or preset["steps"], "against": _AGAINST.value,
              "share": _SHARE.value, "max_carry_steps": _MAX_CARRY.value, "set": _SET.value,
              "machine": os.uname().nodename, "cpus": os.cpu_count(), "runs": runs}
    for seed in map(int, _SEEDS.value):
        for _ in range(_PAIRS.value):
            for mode in order:
                runs.append(_run(mode, seed, len(runs), warmup, samples_per_step))
                result.update(_ratios(runs))
                if _OUT.value:  # after every run: a benchmark cut short keeps what finished
                    metrics.write_json(_OUT.value, result)
            order = order[::-1]
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if _OUT.value:
        plot_learning(result, os.path.splitext(_OUT.value)[0] + ".png")


if __name__ == "__main__":
    app.run(main)
