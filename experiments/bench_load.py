r"""Memory under load: the rollout engine over many `generate` calls, and the drafter
buffer and metrics writer over a long run.

  python -m experiments.bench_load --out=docs/results/bench_load_cpu.json
  python -m experiments.bench_load --calls=1000 --steps=5000   # longer

Engine: `calls` generate calls of `requests` requests each (prompts of 1 to
max_prompt_length tokens, answers that stop at a sampled EOS or at max_tokens, so every
call mixes lengths), on one rollout group of a tiny random model. After each call: host
RSS, the Python heap (tracemalloc's traced bytes), and the device memory held: the bytes
and number of live jax arrays (on a GPU also the allocator's bytes in use). After the
warm-up calls (compilation, allocator pools) all must stay flat. RSS drifts by a few
MiB from native allocator noise, so the Python heap is the sharp test of a host leak:
keeping each call's answers grows it by ~17 KiB a call, where it otherwise grows by the
~1 KiB a call this benchmark itself records.

Long run: `steps` RL steps' worth of the drafter buffer and the metrics writer at the
tiny RL shape (configs/rl.py:tiny: 16 prompts x 8 samples a step, answers of up to 96
tokens, the drafter's rows of 128 tokens, top-8): each step adds a learner batch's
outputs to the buffer, draws a drafter batch, and writes a metrics record of the size
the RL loop writes (JSONL and TensorBoard). The buffer must stay within its bounds
(keep_steps RL steps, max_bytes) and RSS flat.

Prints a table and writes JSON (`--out`).
"""
from __future__ import annotations

import os
import tempfile
import time
import tracemalloc

import jax
import numpy as np
from absl import flags

from experiments import machine
from tlt_jax import launch, metrics, sampling, sharding
from tlt_jax.drafter_training.buffer import DrafterBuffer
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine

_CALLS = flags.DEFINE_integer("calls", 200, "generate calls.")
_REQUESTS = flags.DEFINE_integer("requests", 100, "Requests per call (prompts x samples).")
_STEPS = flags.DEFINE_integer("steps", 1000, "RL steps of the drafter buffer and metrics writer.")
_OUT = flags.DEFINE_string("out", "", "Write the results as JSON here.",
                           allow_override=True)  # tests import several launchers into one process

MiB = 1 << 20


def rss_bytes() -> int:
    """This process's resident set size (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def device_bytes() -> dict:
    """Device memory held: live jax arrays (any backend) and, where the backend reports
    it, the allocator's bytes in use."""
    arrays = jax.live_arrays()
    out = {"live_arrays": len(arrays), "live_array_bytes": sum(x.nbytes for x in arrays)}
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_in_use" in stats:
        out["bytes_in_use"] = stats["bytes_in_use"]
    return out


def growth(samples: list[dict], key: str, warmup: int) -> dict:
    """How `key` moved after the warm-up samples: first and last (medians of up to ten
    samples, so that allocator noise does not count), the maximum, and the least-squares
    slope per sample."""
    values = np.asarray([s[key] for s in samples[warmup:]], np.float64)
    k = max(1, min(10, len(values) // 4))
    slope = float(np.polyfit(np.arange(len(values)), values, 1)[0]) if len(values) > 1 else 0.0
    return {"after_warmup": float(np.median(values[:k])), "end": float(np.median(values[-k:])),
            "max": float(values.max()), "growth": float(np.median(values[-k:]) - np.median(values[:k])),
            "slope_per_sample": slope}


def tiny_engine(num_slots: int = 64, max_prompt_length: int = 16, max_tokens: int = 16, steps_per_sync: int = 16,
                seed: int = 0):
    """A tiny random Llama on one device and its engine; EOS is a likely token, so that
    answers end at every length."""
    cfg = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=16, eos_token_id=2)
    params = tfm.init_params(cfg, jax.random.PRNGKey(seed), init_std=0.3)
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    engine = RolloutEngine(cfg, params, mesh, RolloutConfig(
        num_slots=num_slots, max_prompt_length=max_prompt_length, max_length=max_prompt_length + max_tokens,
        steps_per_sync=steps_per_sync, eos_token_id=cfg.eos_token_id))
    return engine, sampling.SamplingParams(temperature=1.0, max_tokens=max_tokens)


def serve(calls: int, requests: int, num_samples: int = 4, warmup: int = 20, seed: int = 0,
          engine=None, sampling_params=None) -> dict:
    """`calls` generate calls of `requests` requests (requests / num_samples prompts of
    mixed lengths); memory after every call, and its growth after `warmup` calls."""
    if engine is None:
        engine, sampling_params = tiny_engine(seed=seed)
    rc, vocab = engine.rollout_config, engine.model_config.vocab_size
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    samples, lengths = [], []
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    t0 = time.perf_counter()
    for call in range(calls):
        prompts = [rng.integers(3, vocab, rng.integers(1, rc.max_prompt_length + 1)).tolist()
                   for _ in range(requests // num_samples)]
        rollouts = engine.generate(prompts, num_samples, sampling_params, jax.random.fold_in(key, call))
        lengths.extend(rollouts.lengths.tolist())
        del rollouts
        samples.append({"call": call, "seconds": time.perf_counter() - t0, "rss": rss_bytes(),
                        "python_heap": tracemalloc.get_traced_memory()[0], **device_bytes()})
    seconds = time.perf_counter() - t0
    if not tracing:
        tracemalloc.stop()
    warm_s = samples[min(warmup, calls) - 1]["seconds"] if calls else 0.0
    lengths = np.asarray(lengths)
    return {"calls": calls, "requests": len(lengths), "seconds": seconds,
            "seconds_per_call_after_warmup": (seconds - warm_s) / max(calls - warmup, 1),
            "answer_length": {"min": int(lengths.min()), "p50": float(np.median(lengths)), "max": int(lengths.max()),
                              "distinct": int(len(np.unique(lengths)))},
            "warmup_calls": warmup, "rss": growth(samples, "rss", warmup),
            "python_heap": growth(samples, "python_heap", warmup),
            "live_arrays": growth(samples, "live_arrays", warmup),
            "live_array_bytes": growth(samples, "live_array_bytes", warmup),
            **({"bytes_in_use": growth(samples, "bytes_in_use", warmup)} if "bytes_in_use" in samples[0] else {}),
            "samples": samples}


def long_run(steps: int, run_dir: str, warmup: int = 20, seed: int = 0, prompts: int = 16, num_samples: int = 8,
             prompt_length: int = 24, max_tokens: int = 96, hidden_size: int = 128, seq_len: int = 128,
             top_k: int = 8, keep_steps: int = 2, batch_size: int = 16, max_bytes: int = 256 * MiB) -> dict:
    """The drafter buffer and the metrics writer over `steps` RL steps (defaults: the tiny
    RL job's shape); buffer rows and bytes, metrics file size and RSS after every step."""
    rng = np.random.default_rng(seed)
    buffer = DrafterBuffer(seq_len, hidden_size, top_k, max_bytes=max_bytes, keep_steps=keep_steps, seed=seed)
    n, t = prompts * num_samples, prompt_length + max_tokens
    record_keys = [f"metric_{i}" for i in range(60)]  # about what an RL step records
    # The learner's outputs of one batch, reused every step (their values do not matter here).
    outputs = (rng.integers(0, 64, (n, t), dtype=np.int32), rng.standard_normal((n, t, hidden_size), np.float32),
               rng.integers(0, 64, (n, t, top_k), dtype=np.int32), rng.standard_normal((n, t, top_k), np.float32))
    samples = []
    t0 = time.perf_counter()
    with metrics.MetricsWriter(run_dir) as writer:
        for step in range(steps):
            prompt_n = rng.integers(4, prompt_length + 1, n)
            response_n = np.minimum(rng.geometric(1 / 24, n), max_tokens)  # long-tailed answer lengths
            tokens, hidden, ids, logp = outputs
            buffer.add(step, tokens, prompt_n, response_n, hidden, ids, logp)
            buffer.sample(batch_size)
            writer.write(step + 1, {**dict(zip(record_keys, rng.random(len(record_keys)).tolist())),
                                    "response_lengths": response_n})
            samples.append({"step": step, "seconds": time.perf_counter() - t0, "rss": rss_bytes(),
                            "buffer_rows": buffer.num_rows, "buffer_bytes": buffer.nbytes,
                            "metrics_file_bytes": os.path.getsize(writer.path)})
    return {"steps": steps, "seconds": time.perf_counter() - t0, "warmup_steps": warmup,
            "buffer_max_bytes": max_bytes, "buffer_keep_steps": keep_steps,
            "buffer_rows": growth(samples, "buffer_rows", warmup),
            "buffer_bytes": growth(samples, "buffer_bytes", warmup),
            "rss": growth(samples, "rss", warmup),
            "metrics_file_bytes_per_step": samples[-1]["metrics_file_bytes"] / steps if steps else 0.0,
            "samples": samples}


def _table(engine: dict, run: dict) -> str:
    mib = lambda x: f"{x / MiB:8.1f}"
    lines = [f"rollout engine: {engine['requests']} requests in {engine['calls']} generate calls, "
             f"{engine['seconds']:.1f} s ({engine['seconds_per_call_after_warmup'] * 1e3:.0f} ms a call after "
             f"{engine['warmup_calls']} warm-up calls); "
             f"answer lengths {engine['answer_length']['min']}..{engine['answer_length']['max']} "
             f"(median {engine['answer_length']['p50']:.0f})",
             f"{'':28s}{'after warm-up':>14s}{'end':>10s}{'max':>10s}{'growth':>10s}",
             f"{'host RSS (MiB)':28s}{mib(engine['rss']['after_warmup']):>14s}{mib(engine['rss']['end']):>10s}"
             f"{mib(engine['rss']['max']):>10s}{mib(engine['rss']['growth']):>10s}",
             f"{'host Python heap (MiB)':28s}{mib(engine['python_heap']['after_warmup']):>14s}"
             f"{mib(engine['python_heap']['end']):>10s}{mib(engine['python_heap']['max']):>10s}"
             f"{mib(engine['python_heap']['growth']):>10s}",
             f"{'live device arrays':28s}{engine['live_arrays']['after_warmup']:14.0f}"
             f"{engine['live_arrays']['end']:10.0f}{engine['live_arrays']['max']:10.0f}{engine['live_arrays']['growth']:10.0f}",
             f"{'live device bytes (MiB)':28s}{mib(engine['live_array_bytes']['after_warmup']):>14s}"
             f"{mib(engine['live_array_bytes']['end']):>10s}{mib(engine['live_array_bytes']['max']):>10s}"
             f"{mib(engine['live_array_bytes']['growth']):>10s}",
             "",
             f"drafter buffer + metrics writer: {run['steps']} RL steps, {run['seconds']:.1f} s",
             f"{'':28s}{'after warm-up':>14s}{'end':>10s}{'max':>10s}{'growth':>10s}",
             f"{'buffer rows':28s}{run['buffer_rows']['after_warmup']:14.0f}{run['buffer_rows']['end']:10.0f}"
             f"{run['buffer_rows']['max']:10.0f}{run['buffer_rows']['growth']:10.0f}",
             f"{'buffer (MiB)':28s}{mib(run['buffer_bytes']['after_warmup']):>14s}"
             f"{mib(run['buffer_bytes']['end']):>10s}{mib(run['buffer_bytes']['max']):>10s}{mib(run['buffer_bytes']['growth']):>10s}",
             f"{'host RSS (MiB)':28s}{mib(run['rss']['after_warmup']):>14s}{mib(run['rss']['end']):>10s}"
             f"{mib(run['rss']['max']):>10s}{mib(run['rss']['growth']):>10s}",
             f"metrics.jsonl: {run['metrics_file_bytes_per_step']:.0f} bytes a step (on disk, by design)"]
    return "\n".join(lines)


def main(argv):
    del argv
    engine = serve(_CALLS.value, _REQUESTS.value)
    with tempfile.TemporaryDirectory() as run_dir:
        run = long_run(_STEPS.value, run_dir)
    print(_table(engine, run))
    if _OUT.value:
        machine.write_result(_OUT.value, {"backend": jax.default_backend(), "device": str(jax.devices()[0]),
                                        "engine": engine, "long_run": run})


if __name__ == "__main__":
    launch.run(main)
