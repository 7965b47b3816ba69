r"""Runs a config's sweep: one launcher process per point, each with its own run directory
and log (<sweep_dir>/<point>.log); writes <sweep_dir>/sweep.json with each point's exit status.

A config file that can be swept defines, beside `get_config(arg)`, a
`get_sweep(arg) -> list[dict]` of override dicts (dotted keys; `configs.common.grid`
builds products). Each point runs as

  python -m <launcher> --config=<file>:<arg> --config.<key>=<value> ... --config.run_dir=<dir>/<name>

  python -m experiments.sweep --launcher=experiments.generate \
      --config=configs/generate.py:tiny --sweep_dir=runs/sweep --parallel=2
  python -m experiments.sweep --launcher=experiments.train_rl --config=configs/rl.py:tiny --dry_run

`--set=key=value` (repeatable) overrides every point, before the point's own overrides.
"""
import importlib.util
import json
import os
import subprocess
import sys
import time

from absl import flags

from tlt_jax import launch

_LAUNCHER = flags.DEFINE_string("launcher", None, "Module of the launcher to run, e.g. experiments.train_rl.")
_CONFIG = flags.DEFINE_string("config", None, "Config file and argument, path.py:arg.")
_SWEEP_DIR = flags.DEFINE_string("sweep_dir", "runs/sweep", "Each point runs in <sweep_dir>/<name>.")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Points run at once.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the commands only.")
_SET = flags.DEFINE_multi_string("set", [], "key=value: an override of every point (before the point's own), e.g. "
                                 "--set=target_dir=runs/sft_long_tail/hf.")
flags.mark_flags_as_required(["launcher", "config"])


def load_sweep(config_spec: str) -> list[dict]:
    path, _, arg = config_spec.partition(":")
    spec = importlib.util.spec_from_file_location("_swept_config", path)
    if spec is None or not os.path.exists(path):
        raise ValueError(f"Config file {path!r} not found.")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_sweep"):
        raise ValueError(f"{path} defines no get_sweep(arg); add one returning a list of override dicts.")
    points = module.get_sweep(arg) if arg else module.get_sweep()
    if not points:
        raise ValueError(f"{path}:get_sweep({arg!r}) returned no points.")
    return points


def point_name(overrides: dict) -> str:
    return ",".join(f"{k.split('.')[-1]}={v}" for k, v in overrides.items()) or "default"


def commands(launcher: str, config_spec: str, points: list[dict], sweep_dir: str,
             common: tuple[str, ...] = ()) -> list[tuple[str, list[str]]]:
    """(point name, command) per point; `common` ("key=value") overrides every point."""
    for item in common:
        if "=" not in item:
            raise ValueError(f"--set={item!r}: write key=value, e.g. --set=steps=100.")
    out = []
    for overrides in points:
        name = point_name(overrides)
        cmd = [sys.executable, "-m", launcher, f"--config={config_spec}"]
        cmd += [f"--config.{item}" for item in common]
        cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
        cmd.append(f"--config.run_dir={os.path.join(sweep_dir, name)}")
        out.append((name, cmd))
    return out


def main(argv):
    del argv
    todo = commands(_LAUNCHER.value, _CONFIG.value, load_sweep(_CONFIG.value), _SWEEP_DIR.value, tuple(_SET.value))
    if _DRY_RUN.value:
        for _, cmd in todo:
            print(" ".join(cmd))
        return
    os.makedirs(_SWEEP_DIR.value, exist_ok=True)
    running, results = [], {}
    pending = list(todo)
    while pending or running:
        while pending and len(running) < _PARALLEL.value:
            name, cmd = pending.pop(0)
            log = open(os.path.join(_SWEEP_DIR.value, f"{name}.log"), "w")
            running.append((name, cmd, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
            print(f"started {name}", file=sys.stderr, flush=True)
        for item in list(running):
            name, cmd, proc, log = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                results[name] = dict(returncode=proc.returncode, command=cmd)
                print(f"finished {name} (exit {proc.returncode}), {len(pending) + len(running)} left", file=sys.stderr,
                      flush=True)
        time.sleep(0.2)
    with open(os.path.join(_SWEEP_DIR.value, "sweep.json"), "w") as f:
        json.dump(results, f, indent=2)
    failed = [n for n, r in results.items() if r["returncode"]]
    print(json.dumps(dict(points=len(results), failed=failed)))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    launch.run(main, shared_help=launch.VERBOSITY_HELP)
