r"""What infinite loops cost the `code` reward: a batch with loops against its honest
programs alone (the bar: 64 completions, 8 of them infinite loops, score within
about twice the per-test timeout plus the honest programs' time, not 8 times it).

  python -m experiments.bench_code_reward --paths=per_sample --out=docs/results/bench_code_reward.json
  python -m experiments.bench_code_reward --completions=8 --loops=2 --timeouts=1 --parallel=2 --repeats=1   # smoke

The tasks are experiments/make_code_dataset.py's (three asserts each). The honest
completions are their reference solutions; a loop is the same function whose body never
returns, evenly spread through the batch: "spin" (`while True: pass`, a core's worth of
work each until it is killed) or "sleep" (`while True: time.sleep(1)`, what the reward's
own scheduling costs without the CPU the spinning takes). Per case (loop kind, per-test
timeout, sandboxes at once, path): the honest programs alone, then the whole batch,
alternately, `repeats` times;
median wall seconds of each. Paths: "call" scores the batch in one call of the reward (its
threads run `max_parallel` sandboxes); "per_sample" hands every sample to `Scorer.begin` at
once, as the RL loop hands samples over when they finish decoding. extra / timeout is what
the loops added, in per-test timeouts; the bar holds where it is at most 2.
"""
import itertools
import json
import os
import platform
import statistics
import time

from absl import flags

from experiments import machine, make_code_dataset
from tlt_jax import launch, rewards, sandbox

_COMPLETIONS = flags.DEFINE_integer("completions", 64, "Completions per batch.")
_LOOPS = flags.DEFINE_integer("loops", 8, "Of them, infinite loops.")
_TIMEOUTS = flags.DEFINE_list("timeouts", ["1", "2"], "code.timeout_s values (seconds per test).")
_PARALLEL = flags.DEFINE_list("parallel", ["8", "0"], "code.max_parallel values (0: one sandbox per CPU).")
_PATHS = flags.DEFINE_list("paths", ["call", "per_sample"], "call and/or per_sample (see the docstring).")
_LOOP_KINDS = flags.DEFINE_list("loop_kinds", ["spin", "sleep"], "spin and/or sleep (see the docstring).")
_SANDBOX = flags.DEFINE_string("sandbox", "auto", "code.sandbox: auto, bwrap or rlimits.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs of each batch per case.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the tasks.")
_OUT = flags.DEFINE_string("out", "", "Write the results as JSON here.")


_LOOP_BODIES = {"spin": "    while True:\n        pass",
                "sleep": "    import time\n    while True:\n        time.sleep(1)"}


def make_batch(completions: int, loops: int, seed: int, kind: str = "spin"
               ) -> tuple[list[str], list[str], dict, list[int]]:
    """(prompts, completions, fields, which completions loop): loops evenly spread."""
    rows = make_code_dataset.make_rows(completions, seed)
    looping = [round(i * completions / loops) for i in range(loops)] if loops else []
    texts = []
    for i, row in enumerate(rows):
        fence, signature, *_ = row["solution"].split("\n")
        texts.append(f"{fence}\n{signature}\n{_LOOP_BODIES[kind]}\n```" if i in looping else row["solution"])
    fields = {"test_list": [r["test_list"] for r in rows], "test_setup_code": [r["test_setup_code"] for r in rows]}
    return [r["prompt"] for r in rows], texts, fields, looping


def _subset(prompts, completions, fields, keep):
    return ([prompts[i] for i in keep], [completions[i] for i in keep],
            {k: [v[i] for i in keep] for k, v in fields.items()})


def score(reward: rewards.CodeReward, path: str, prompts, completions, fields) -> tuple[float, list[float]]:
    """(wall seconds, scores) of one batch on `path`."""
    start = time.perf_counter()
    if path == "call":
        scores = [float(s) for s in reward(prompts, completions, **fields)]
    else:
        scorer = rewards.Scorer(reward)
        try:
            scoring = scorer.begin()
            for i in range(len(completions)):
                scoring.submit(i, prompts[i], completions[i], {k: v[i] for k, v in fields.items()})
            scores = scoring.result(len(completions)).scores.tolist()
        finally:
            scorer.close()
    return time.perf_counter() - start, scores


def main(argv):
    del argv
    batches = {kind: make_batch(_COMPLETIONS.value, _LOOPS.value, _SEED.value, kind) for kind in _LOOP_KINDS.value}
    prompts, completions, fields, looping = next(iter(batches.values()))
    honest = [i for i in range(len(completions)) if i not in looping]
    mode = sandbox.resolve_mode(_SANDBOX.value, sandbox.default_python())
    rows = []
    cpu = dict(machine.machine_record(), load_average=os.getloadavg())  # the machine may be shared
    result = dict(machine=cpu, python=platform.python_version(), sandbox=mode, completions=len(completions),
                  loops=len(looping), repeats=_REPEATS.value, rows=rows)
    score(rewards.CodeReward(sandbox=_SANDBOX.value, timeout_s=1.0), "call", *_subset(
        prompts, completions, fields, honest[:4]))  # warm: the mode's trial run, the interpreter's files
    for (kind, (prompts, completions, fields, _)), timeout_s in itertools.product(
            batches.items(), map(float, _TIMEOUTS.value)):
        for parallel in map(int, _PARALLEL.value):
            reward = rewards.CodeReward(sandbox=_SANDBOX.value, timeout_s=timeout_s, max_parallel=parallel)
            for path in _PATHS.value:
                times = {"honest": [], "all": []}
                right = True
                for _ in range(_REPEATS.value):
                    seconds, scores = score(reward, path, *_subset(prompts, completions, fields, honest))
                    times["honest"].append(seconds)
                    right &= scores == [1.0] * len(honest)
                    seconds, scores = score(reward, path, prompts, completions, fields)
                    times["all"].append(seconds)
                    right &= scores == [0.0 if i in looping else 1.0 for i in range(len(completions))]
                honest_s, all_s = statistics.median(times["honest"]), statistics.median(times["all"])
                row = dict(loop=kind, timeout_s=timeout_s, max_parallel=parallel, sandboxes_at_once=reward.parallel,
                           path=path,
                           honest_s=honest_s, all_s=all_s, extra_s=all_s - honest_s,
                           extra_timeouts=(all_s - honest_s) / timeout_s,
                           bar_met=all_s <= honest_s + 2 * timeout_s, scores_right=right, times=times)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if _OUT.value:  # rewritten after every case: a run cut short keeps what it measured
                    machine.write_result(_OUT.value, result)
    result["machine"]["load_average_end"] = os.getloadavg()  # the machine may be shared
    if _OUT.value:
        machine.write_result(_OUT.value, result)
    record = result["machine"]
    print(f"\n{len(completions)} completions, {len(looping)} infinite loops, sandbox {mode}, "
          f"{record['cpu']} ({record['cpus']} CPUs, last-level cache "
          f"{(record['last_level_cache_bytes'] or 0) / 2**20:.0f} MiB), "
          f"median of {_REPEATS.value}")
    print(f"{'loop':>5} {'timeout s':>9} {'at once':>7} {'path':>10} {'honest s':>8} {'all s':>7} {'extra s':>7} "
          f"{'x timeout':>9} {'bar':>4} {'scores':>6}")
    for r in rows:
        print(f"{r['loop']:>5} {r['timeout_s']:9g} {r['sandboxes_at_once']:7d} {r['path']:>10} "
              f"{r['honest_s']:8.2f} {r['all_s']:7.2f} "
              f"{r['extra_s']:7.2f} {r['extra_timeouts']:9.2f} {'met' if r['bar_met'] else 'no':>4} "
              f"{'right' if r['scores_right'] else 'WRONG':>6}")


if __name__ == "__main__":
    launch.run(main)
