r"""Compares groups of RL runs that differ in one setting over several seeds: held-out
accuracy curves, reward and response length per step, with their spread across seeds.

Speculation is lossless, so TLT and the baseline must agree within seed noise. After the
seed sweep of configs/rl.py (`python -m experiments.sweep --launcher=experiments.train_rl
--config=configs/rl.py:tiny --sweep_dir=runs/tlt_seeds`):

  python -m experiments.compare_runs --runs='baseline:runs/tlt_seeds/enabled=False,*' \
      --runs='tlt:runs/tlt_seeds/enabled=True,*' --out=runs/tlt_seeds/compare.json

Each `--runs` is label:glob of run directories (one per seed). The first group is the
reference; every other is compared with it: a difference counts as within seed noise
when it is at most twice its standard error (sqrt(s1^2/n1 + s2^2/n2), s the standard
deviation across seeds).
"""
import glob
import os

import numpy as np
from absl import app, flags
from matplotlib.figure import Figure

from experiments import machine
from tlt_jax import launch, metrics

_RUNS = flags.DEFINE_multi_string("runs", None, "label:glob of run directories, one group per flag.")
_OUT = flags.DEFINE_string("out", "runs/compare_runs.json", "JSON result; the plot goes beside it (.png).",
                           allow_override=True)  # tests import several launchers into one process
flags.mark_flag_as_required("runs")

PER_STEP = ("reward_mean", "response_length_mean")


def load_group(pattern: str) -> list[list[dict]]:
    """The metrics records of every finished run matching `pattern`, sorted by directory."""
    dirs = sorted(d for d in glob.glob(pattern) if os.path.isfile(os.path.join(d, "metrics.jsonl")))
    if not dirs:
        raise ValueError(f"No run directory with a metrics.jsonl matches {pattern!r}.")
    return [metrics.read_metrics(os.path.join(d, "metrics.jsonl")) for d in dirs]


def curve(records: list[dict], key: str) -> dict[int, float]:
    """step -> value of `key`, the last record of a step winning (a resumed run repeats none)."""
    return {int(r["step"]): float(r[key]) for r in records if key in r and "step" in r}


def group_stats(runs: list[list[dict]]) -> dict:
    """Across seeds: the eval curve (mean, std, min, max per step), the final accuracy and
    the per-run means of the per-step metrics."""
    evals = [curve(r, "eval_accuracy") for r in runs]
    steps = sorted(set.intersection(*(set(e) for e in evals)))
    if not steps:
        raise ValueError("The runs share no evaluated step.")
    at = np.asarray([[e[s] for s in steps] for e in evals])  # [seeds, eval steps]
    per_step = {}
    for key in PER_STEP:
        curves = [curve(r, key) for r in runs]
        common = sorted(set.intersection(*(set(c) for c in curves)))
        per_step[key] = {"steps": common, "values": np.asarray([[c[s] for s in common] for c in curves])}
    spec = lambda k: [float(np.mean(list(curve(r, k).values()) or [0.0])) for r in runs]
    return {
        "seeds": len(runs), "eval_steps": steps, "eval_accuracy": at, "final_eval_accuracy": at[:, -1],
        "per_step": per_step,
        **{f"mean_{k}": np.asarray([v.mean() for v in per_step[k]["values"]]) for k in PER_STEP},
        "acceptance_length": spec("acceptance_length"), "speculative_token_share": spec("speculative_token_share"),
    }


def difference(a: np.ndarray, b: np.ndarray) -> dict:
    """b's mean minus a's, with its standard error across seeds and whether it is within
    two standard errors."""
    se = float(np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))) if min(len(a), len(b)) > 1 else float("nan")
    diff = float(b.mean() - a.mean())
    return {"difference": diff, "standard_error": se, "within_noise": bool(abs(diff) <= 2 * se)}


def summarise(a: np.ndarray) -> dict:
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
            "min": float(a.min()), "max": float(a.max())}


def compare(groups: dict[str, dict]) -> dict:
    labels = list(groups)
    ref = groups[labels[0]]
    out = {"reference": labels[0], "groups": {}}
    for label, g in groups.items():
        entry = {"seeds": g["seeds"], "eval_steps": g["eval_steps"],
                 "eval_accuracy_mean": g["eval_accuracy"].mean(0).tolist(),
                 "eval_accuracy_std": g["eval_accuracy"].std(0, ddof=1).tolist() if g["seeds"] > 1 else None,
                 "final_eval_accuracy": summarise(g["final_eval_accuracy"]),
                 "acceptance_length": g["acceptance_length"], "speculative_token_share": g["speculative_token_share"],
                 **{f"mean_{k}": summarise(g[f"mean_{k}"]) for k in PER_STEP}}
        if label != labels[0]:
            shared = [i for i, s in enumerate(ref["eval_steps"]) if s in g["eval_steps"]]
            per_eval = [difference(ref["eval_accuracy"][:, i], g["eval_accuracy"][:, g["eval_steps"].index(s)])
                        for i, s in ((i, ref["eval_steps"][i]) for i in shared)]
            entry["versus_reference"] = {
                "final_eval_accuracy": difference(ref["final_eval_accuracy"], g["final_eval_accuracy"]),
                "eval_steps_within_noise": sum(d["within_noise"] for d in per_eval), "eval_steps": len(per_eval),
                **{f"mean_{k}": difference(ref[f"mean_{k}"], g[f"mean_{k}"]) for k in PER_STEP}}
        out["groups"][label] = entry
    return out


def plot(groups: dict[str, dict], path: str) -> Figure:
    fig = Figure(figsize=(15, 4), layout="constrained")
    axes = fig.subplots(1, 3)
    for label, g in groups.items():
        acc = g["eval_accuracy"]
        line, = axes[0].plot(g["eval_steps"], acc.mean(0), marker="o", label=f"{label} ({g['seeds']} seeds)")
        axes[0].fill_between(g["eval_steps"], acc.min(0), acc.max(0), color=line.get_color(), alpha=0.2)
        for ax, key in zip(axes[1:], PER_STEP):
            values = g["per_step"][key]["values"]
            ax.plot(g["per_step"][key]["steps"], values.mean(0), color=line.get_color(), label=label)
            ax.fill_between(g["per_step"][key]["steps"], values.min(0), values.max(0), color=line.get_color(),
                            alpha=0.15)
    titles = ("Held-out accuracy (greedy)", "Reward per step", "Mean response length per step (tokens)")
    for ax, title in zip(axes, titles):
        ax.set_title(title + "\nmean; band: min-max over seeds", fontsize=9)
        ax.set_xlabel("RL step")
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)
    return fig


def main(argv):
    del argv
    groups = {}
    for spec in _RUNS.value:
        label, sep, pattern = spec.partition(":")
        if not sep or not label:
            raise app.UsageError(f"--runs={spec!r}: expected label:glob, e.g. tlt:runs/tlt_seeds/enabled=True,*")
        groups[label] = group_stats(load_group(pattern))
    result = compare(groups)
    print(f"{'group':<12} {'seeds':>5} {'final eval acc':>18} {'reward/step':>16} {'length/step':>16} "
          f"{'accept':>7} {'spec share':>10}")
    for label, e in result["groups"].items():
        f, r, n = e["final_eval_accuracy"], e["mean_reward_mean"], e["mean_response_length_mean"]
        print(f"{label:<12} {e['seeds']:>5} {f['mean']:>10.3f} ± {f['std']:.3f} {r['mean']:>8.3f} ± {r['std']:.3f} "
              f"{n['mean']:>8.2f} ± {n['std']:.2f} {np.mean(e['acceptance_length']):>7.2f} "
              f"{np.mean(e['speculative_token_share']):>10.2f}")
    for label, e in result["groups"].items():
        v = e.get("versus_reference")
        if v is None:
            continue
        print(f"{label} - {result['reference']}: " + ", ".join(
            f"{k} {d['difference']:+.4f} (2 SE {2 * d['standard_error']:.4f}, "
            f"{'within' if d['within_noise'] else 'OUTSIDE'} noise)"
            for k, d in v.items() if isinstance(d, dict))
            + f"; eval steps within noise: {v['eval_steps_within_noise']}/{v['eval_steps']}")
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    machine.write_result(_OUT.value, result)
    plot(groups, os.path.splitext(_OUT.value)[0] + ".png")
    print(f"wrote {_OUT.value} and its plot")


if __name__ == "__main__":
    launch.run(main)
