r"""Compares drafter recipes trained for one target (a sweep of configs/drafter.py): each
run's teacher-forced acceptance on the held-out rows, per draft position where the recipe
trained with training-time test, and its live acceptance in speculative rollouts, per
draft position, with the seconds its training took.

  python -m experiments.sweep --launcher=experiments.train_drafter --config=configs/drafter.py:long_tail \
      --set=acceptance.depth=8 --sweep_dir=runs/drafter_recipes
  python -m experiments.compare_drafters --runs='runs/drafter_recipes/*' --out=docs/results/drafter_recipes.json

Reads <run_dir>/summary.json (written by `train_drafter`); the plot goes beside --out (.png).
"""
import argparse
import glob
import json
import os

from matplotlib.figure import Figure

from experiments import machine


def read_run(run_dir: str) -> dict:
    """The row of one run: its recipe, training seconds, teacher-forced and live acceptance."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        raise ValueError(f"{run_dir} has no summary.json: the run did not finish (rerun it to resume it).")
    with open(path) as f:
        s = json.load(f)
    passes = sorted((int(k.rsplit("pass", 1)[1]), v) for k, v in s.items() if k.startswith("eval_accept_rate_pass"))
    a = s.get("acceptance", {})
    return dict(run=os.path.basename(os.path.normpath(run_dir)), steps=s["steps"], train_s=s["train_seconds"],
                eval_accept_rate=[s["eval_accept_rate"]] + [v for _, v in passes],
                eval_top1_agree=s["eval_top1_agree"], acceptance_length=a.get("acceptance_length"),
                acceptance_by_depth=a.get("acceptance_by_depth", []))


def main(argv=None):
    # argparse, not absl flags: --runs and --out would clash with compare_runs' flags of the
    # same names in one process (the tests import several scripts).
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", required=True, help="Glob of drafter run directories.")
    parser.add_argument("--out", default="runs/compare_drafters.json", help="JSON result; the plot goes beside it.")
    args = parser.parse_args(argv)
    dirs = sorted(d for d in glob.glob(args.runs) if os.path.isdir(d))  # a sweep's logs lie beside its runs
    if not dirs:
        raise SystemExit(f"--runs={args.runs!r} matches no directory.")
    rows = [read_run(d) for d in dirs]
    machine.write_result(args.out, dict(runs=rows))
    print(f"{'recipe':28} {'steps':>5} {'train s':>8} {'top-1':>6} {'accept (teacher-forced, per pass)':>34} "
          f"{'acc len':>7}  live accepted at depth 1, 2, ...")
    for r in rows:
        forced = " ".join(f"{a:.3f}" for a in r["eval_accept_rate"])
        live = " ".join("  - " if a is None else f"{a:.2f}" for a in r["acceptance_by_depth"])
        length = f"{r['acceptance_length']:7.2f}" if r["acceptance_length"] is not None else f"{'-':>7}"
        print(f"{r['run']:28} {r['steps']:5d} {r['train_s']:8.1f} {r['eval_top1_agree']:6.3f} {forced:>34} "
              f"{length}  {live}")
    figure = Figure(figsize=(7, 3.4), layout="constrained")
    ax = figure.subplots()
    for r in rows:
        if r["acceptance_by_depth"]:
            values = [float("nan") if a is None else a for a in r["acceptance_by_depth"]]
            ax.plot(range(1, len(values) + 1), values, marker="o", label=r["run"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted, given the drafts before it")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    figure.savefig(os.path.splitext(args.out)[0] + ".png", dpi=100)


if __name__ == "__main__":
    main()
