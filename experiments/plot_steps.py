r"""Per RL step, TLT against the baseline, from `bench_tlt` ABBA results: the drafter's
acceptance length and the step-time ratio (baseline / TLT on the same prompts), one line
per result file, so that runs that differ in one setting (a drafter warm-started or trained
from nothing) read side by side.

  python -m experiments.plot_steps \
    --runs="warm-started=docs/results/bench_tlt_cpu_long_abba.json,\
from scratch=docs/results/bench_tlt_cpu_long_scratch.json" \
    --out=docs/results/bench_tlt_cpu_long_scratch_steps.png

Each file is `bench_tlt --repeats=N --out=...`'s JSON. Per step, the ratio is the geometric
mean over the file's complete pairs (each pair: its baseline run's step time over its TLT
run's), the acceptance the mean over its TLT runs; steps before the preset's warm-up end
(`steady_steps`) have no ratio (their compiles differ by mode). Prints the table it plots.
"""
import argparse
import json
import math


def per_step(result: dict) -> dict:
    """{step: (acceptance length or None, step ratio or None)} of one ABBA result."""
    runs = {r["run"]: r["result"]["modes"][r["mode"]] for r in result["runs"] if "result" in r}
    acceptance, ratios = {}, {}
    for mode in (r for r in result["runs"] if r["mode"] == "tlt" and r["run"] in runs):
        for step, value in enumerate(runs[mode["run"]]["acceptance_length"], 1):
            acceptance.setdefault(step, []).append(value)
    for pair in result.get("pairs", []):
        if "missing" in pair:
            continue
        base, tlt = runs[pair["baseline_run"]], runs[pair["tlt_run"]]
        if base["steady_steps"] != tlt["steady_steps"]:
            raise ValueError(f"pair {pair['pair']}: the runs timed different steps.")
        for step, b, t in zip(base["steady_steps"], base["steady_times"]["time_step_s"],
                              tlt["steady_times"]["time_step_s"]):
            ratios.setdefault(step, []).append(b / t)
    mean = lambda xs: sum(xs) / len(xs)
    geomean = lambda xs: math.exp(mean([math.log(x) for x in xs]))
    return {s: (mean(acceptance[s]) if s in acceptance else None, geomean(ratios[s]) if s in ratios else None)
            for s in sorted(set(acceptance) | set(ratios))}


def plot(lines: dict, path: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 5), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True)
    for label, steps in lines.items():
        xs = list(steps)
        # A step whose tail chunks all decoded plainly has no acceptance: a gap, not 0.
        top.plot(xs, [a if a else math.nan for a, _ in steps.values()], marker="o", markersize=3, label=label)
        bottom.plot(xs, [r if r else math.nan for _, r in steps.values()], marker="o", markersize=3, label=label)
    bottom.axhline(1.0, color="gray", linewidth=0.8)
    top.set_ylabel("acceptance length")
    bottom.set_ylabel("step time, baseline / TLT")
    bottom.set_xlabel("RL step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    figure.savefig(path, dpi=100)


def main(argv=None):
    # argparse, not absl flags: --runs and --out would clash with the benchmarks' flags of
    # the same names in one process (the tests import several scripts).
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", required=True, help="label=path,...: bench_tlt ABBA JSONs, one line each.")
    parser.add_argument("--out", default="", help="Write the plot here (PNG).")
    args = parser.parse_args(argv)
    lines = {}
    for item in args.runs.split(","):
        label, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"--runs item {item!r}: write label=path.")
        with open(path) as f:
            lines[label] = per_step(json.load(f))
    print("step  " + "  ".join(f"{label:>24}" for label in lines))
    for step in sorted({s for steps in lines.values() for s in steps}):
        cells = []
        for steps in lines.values():
            a, r = steps.get(step, (None, None))
            cells.append(f"{'-' if a is None else f'{a:.2f}':>10} {'-' if r is None else f'{r:.2f}x':>13}")
        print(f"{step:>4}  " + "  ".join(cells))
    if args.out:
        plot(lines, args.out)


if __name__ == "__main__":
    main()
