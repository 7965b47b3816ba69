"""The machine a CPU benchmark runs on, and whether its decode is bound by reading weights.

On a GPU a decode step at small batch reads every weight from HBM once, so its time hardly
moves from batch 1 to 4; speculation's verify of a few tokens then costs about one step.
On a CPU that only holds while the weights outgrow the last-level cache: a model that
fits in a 480 MiB L3 decodes at cache speed, where a verify of k tokens costs nearly k
steps, and speculation's gains shrink to what they would be on no real device. The wide
presets of `bench_tlt` therefore pad decode's MLP (`transformer.pad_mlp`: zero units, the
same tokens) to `REGIME_CACHE_FACTOR` times this machine's cache, and `regime_check` times
the padded decode step at batch 1, 2 and 4 to show the regime holds.
"""
from __future__ import annotations

import datetime
import functools
import math
import os
import shlex
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax import metrics

REGIME_CACHE_FACTOR = 3  # decode's weights at least this many times the last-level cache
REGIME_BATCHES = (1, 2, 4)
REGIME_TOLERANCE = 0.15  # the slowest of those steps at most this much above the fastest
# Padded decode weights beyond this share of the memory available are refused: the engine
# holds them beside the learner's model, the drafter and the runs' caches.
MAX_MEMORY_SHARE = 0.25
_MLP_UNIT = 256  # the padded width is a multiple of this


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


@functools.cache
def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of the last-level (highest) data or unified cache that cpu0 sees, from
    Linux's sysfs; None where it cannot be read."""
    best = None
    try:
        entries = [e for e in os.listdir(root) if e.startswith("index")]
    except OSError:
        return None
    for entry in entries:
        try:
            with open(os.path.join(root, entry, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(root, entry, "level")) as f:
                level = int(f.read())
            with open(os.path.join(root, entry, "size")) as f:
                size = _parse_size(f.read().strip())
        except (OSError, ValueError):
            continue
        if kind != "Instruction" and (best is None or level > best[0]):
            best = (level, size)
    return None if best is None else best[1]


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def memory_available_bytes(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def machine_record() -> dict:
    """What a CPU figure must be recorded with: the CPU model, its last-level cache, cores."""
    return dict(cpu=cpu_model(), last_level_cache_bytes=last_level_cache_bytes(), cpus=os.cpu_count())


def command_line() -> str:
    """The command that started this process, as typed: `python -m module args` for a module run."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


@functools.cache
def provenance() -> dict:
    """Where a benchmark's figures come from: the commit (and whether the tree differed
    from it), the command, the date, the machine, jax and its backend."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=30,
                                  cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return dict(commit=git("rev-parse", "--short", "HEAD"), uncommitted_changes=bool(git("status", "--porcelain")),
                command=command_line(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=machine_record(), jax=jax.__version__, backend=jax.default_backend())


def write_result(path: str, result: dict, indent: int = 2) -> None:
    """A benchmark's JSON, with its `provenance` first."""
    metrics.write_json(path, {"provenance": provenance(), **result}, indent=indent)


def weight_bytes(params) -> int:
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


def mlp_size_for_cache(config, params, cache_bytes: int | None = None, factor: int = REGIME_CACHE_FACTOR) -> int:
    """The narrowest MLP width (a multiple of 256, at least the model's own) at which the
    model's weights, every MLP padded with zero units to it, are `factor` times the
    last-level cache. Raises ValueError, with the reason in one line, where the cache
    cannot be read or the padded weights would not fit this machine's memory."""
    cache_bytes = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    if not cache_bytes:
        raise ValueError("This machine's last-level cache size cannot be read (Linux sysfs "
                         "/sys/devices/system/cpu/cpu0/cache): pass --decode_mlp_size=N explicitly.")
    itemsize = np.dtype(jax.tree.leaves(params)[0].dtype).itemsize
    per_unit = 3 * config.hidden_size * config.num_layers * itemsize  # gate, up and down of every layer
    need = factor * cache_bytes - weight_bytes(params)
    width = config.intermediate_size + max(0, math.ceil(need / per_unit))
    width = _MLP_UNIT * math.ceil(width / _MLP_UNIT)
    padded = weight_bytes(params) + (width - config.intermediate_size) * per_unit
    available = memory_available_bytes()
    if available is not None and padded > MAX_MEMORY_SHARE * available:
        raise ValueError(f"Decode weights of {factor}x this machine's {cache_bytes / 2**20:.0f} MiB last-level cache "
                         f"({padded / 2**30:.2f} GiB at MLP width {width}) exceed {MAX_MEMORY_SHARE:.0%} of its "
                         f"{available / 2**30:.1f} GiB of free memory: run a preset without decode padding, or "
                         "pass a smaller --decode_mlp_size.")
    return width


def decode_step_seconds(config, params, decode_mlp_size: int, prompt: list[int],
                        batches=REGIME_BATCHES, min_seconds: float = 1.0) -> dict[int, float]:
    """Seconds per plain decode step of the rollout engine at each batch (every slot decoding
    `prompt`'s continuation, MLPs padded to decode_mlp_size): the fastest of repeated chunks
    of 16 steps, at least min_seconds of them per batch."""
    from tlt_jax import sampling, sharding
    from tlt_jax.rollout import profile
    from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine

    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    sp = sampling.SamplingParams(temperature=1.0, max_tokens=64)
    key = jax.random.PRNGKey(0)
    out = {}
    for b in batches:
        rc = RolloutConfig(num_slots=b, max_prompt_length=len(prompt), max_length=len(prompt) + sp.max_tokens + 1,
                           steps_per_sync=16, eos_token_id=None, decode_mlp_size=decode_mlp_size)
        group = RolloutEngine(config, params, mesh, rc).local_groups[0]
        out[b] = _fastest_step(group, profile.filled_state(group, [prompt] * b, key, sp, speculative=False), key,
                               sp, min_seconds)
    return out


def _fastest_step(group, state, key, sp, min_seconds: float) -> float:
    """Seconds per step of the fastest of repeated plain chunks from `state` (not consumed)."""
    lengths, active = jax.device_get((state.cache.lengths, state.active))
    attended = group.kv_bucket_for(lengths, active, None, False)

    def chunk():
        s = jax.tree.map(jnp.copy, state)
        jax.block_until_ready(s)
        t0 = time.perf_counter()
        steps = int(jax.device_get(group.run_chunk(s, key, False, None, sp, 0, attended)[1]))
        return (time.perf_counter() - t0) / max(steps, 1)

    chunk()  # compiles
    first = chunk()
    return min([first] + [chunk() for _ in range(max(2, math.ceil(min_seconds / (16 * first))))])


def regime_check(step_seconds: dict[int, float], tolerance: float = REGIME_TOLERANCE) -> dict:
    """Whether decode steps at the batches timed are within `tolerance` of each other: the
    mark of a step bound by reading the weights, as on a GPU at small batch."""
    spread = max(step_seconds.values()) / min(step_seconds.values()) - 1
    return dict(step_s={str(b): s for b, s in step_seconds.items()}, spread=spread, tolerance=tolerance,
                passed=bool(spread <= tolerance))
