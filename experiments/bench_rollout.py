r"""Decode throughput of the rollout engine against the HBM roofline and transformers.

  python -m experiments.bench_rollout --preset=gpu --out=bench_rollout.json
  python -m experiments.bench_rollout --preset=cpu
  python -m experiments.bench_rollout --model_dir=runs/bench_tlt_cache/target_l16_long_tail --batches=64 \
      --cache_slots=352 --attend=all,bucket --layouts=fused --nohf    # what attention buckets buy

--prefill_samples times the prefill of one prompt for G samples (GRPO's group), the
engine's way (the prompt prefilled once, its cache copied to the G slots) against one
prefill per sample, calls of the two alternating in one process:

  python -m experiments.bench_rollout --model_dir=runs/bench_tlt_cache/target_l16_long_tail \
      --prefill_samples=2,8 --prefill_length=64 --out=bench_prefill.json

With --cache_slots the cache holds more slots than the sequences reach (a rollout's cache
holds max_length, its sequences mostly far fewer); --attend=all times decode with attention
reading every slot, bucket (the engine's default) reading the engine's bucket of them
(`RolloutConfig.kv_bucket`).

For each model shape and batch size: every slot is filled with a prompt, then one device
loop of `new_tokens` decode steps is timed (median over repeats). The roofline of a step
is the bytes it must read — all weights once plus the KV entries actually in use, not
the preallocated cache — over the copy bandwidth measured in the same run. transformers'
torch `generate` runs on the same random checkpoint (written with save_hf), greedy, same
batch and lengths, with its dynamic and its static cache.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from configs import models
from experiments import machine
from tlt_jax import launch, sampling, sharding
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import from_config_dict
from tlt_jax.models.hf_io import load_hf, save_hf
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine

_PRESET = flags.DEFINE_enum("preset", "cpu", ["cpu", "gpu"], "Shapes to run.")
_OUT = flags.DEFINE_string("out", "", "Write the results as JSON here.")
_MODELS = flags.DEFINE_list("models", None, "Override the preset's model list.")
_BATCHES = flags.DEFINE_list("batches", None, "Override the preset's batch sizes.")
_HF = flags.DEFINE_bool("hf", True, "Also time transformers' generate.")
_HF_BATCHES = flags.DEFINE_list("hf_batches", None, "Batch sizes at which transformers runs (default: all).")
# Decode weight layouts (RolloutConfig fields): "fused" is the default, per-layer weights
# with fused q/k/v and gate/up projections; "per_layer" without the fusion; "stacked"
# the training layout in a scanned layer loop.
LAYOUTS = {"fused": dict(per_layer_weights=True, fused_projections=True),
           "per_layer": dict(per_layer_weights=True, fused_projections=False),
           "stacked": dict(per_layer_weights=False, fused_projections=False)}
_LAYOUTS = flags.DEFINE_list("layouts", ["fused", "per_layer", "stacked"],
                             f"Decode weight layouts to time: {list(LAYOUTS)}.")
_MODEL_DIR = flags.DEFINE_string("model_dir", "", "A Hugging Face checkpoint to time in place of --models.")
_CACHE_SLOTS = flags.DEFINE_integer("cache_slots", 0, "KV-cache slots per sequence (0: the prompt and new tokens "
                                    "exactly).")
_PREFILL_SAMPLES = flags.DEFINE_list("prefill_samples", [], "Time the prefill of one prompt for each of these "
                                     "sample counts, shared against one prefill per sample, instead of decode.")
_PREFILL_LENGTH = flags.DEFINE_integer("prefill_length", 64, "Prompt tokens of --prefill_samples.")
ATTEND = ("bucket", "all")
_ATTEND = flags.DEFINE_list("attend", ["bucket"], "Slots decode's attention reads: bucket (the engine's bucket "
                            "over the live sequences), all (every cache slot); several: a row each.")

PRESETS = {
    "cpu": dict(models=["tiny"], batches=[1, 4, 16], prompt=16, new_tokens=32, repeats=3),
    "gpu": dict(models=["qwen2.5-1.5b", "qwen2.5-0.5b"], batches=[1, 4, 16, 64, 256], prompt=64,
                new_tokens=128, repeats=3),
}


def measure_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth (bytes read + written), GB/s."""
    n = (1 << 30) if jax.default_backend() == "gpu" else (1 << 25)
    x = jnp.ones((n // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(copy(x))
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(copy(x))
        times.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(times) / 1e9


def param_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def kv_bytes_per_token(cfg) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * cfg.jnp_dtype.dtype.itemsize


def bench_ours(cfg, params, batch, prompt_len, new_tokens, repeats, layout, cache_slots=0, attend="bucket"):
    """(seconds of one chunk of new_tokens decode steps, compile seconds, slots attention read,
    slots the cache holds)."""
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    rc = RolloutConfig(num_slots=batch, max_prompt_length=prompt_len,
                       max_length=max(cache_slots, prompt_len + new_tokens + 1), steps_per_sync=new_tokens,
                       **LAYOUTS[layout])
    engine = RolloutEngine(cfg, params, mesh, rc)
    group = engine.groups[0]
    attended = rc.max_length
    if attend == "bucket":
        attended = group.kv_bucket_for(np.full((batch,), prompt_len), np.ones((batch,), bool), None, False)
    sp = sampling.SamplingParams(temperature=1.0, max_tokens=new_tokens + 1)
    prompts = np.random.RandomState(0).randint(1, cfg.vocab_size, (batch, prompt_len)).astype(np.int32)
    key = jax.random.PRNGKey(0)

    def filled():
        state = group.empty_state(sp)
        rows = np.arange(batch, dtype=np.int32)
        return group.insert(state, prompts, np.full((batch,), prompt_len, np.int32), rows, rows, rows, key, sp)

    t0 = time.perf_counter()
    jax.block_until_ready(group.run_chunk(filled(), key, False, None, sp, 0, attended))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        state = jax.block_until_ready(filled())
        t0 = time.perf_counter()
        state, steps, _, _ = group.run_chunk(state, key, False, None, sp, 0, attended)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
        assert int(steps) == new_tokens
    return statistics.median(times), compile_s, attended, rc.max_length


def bench_prefill(cfg, params, samples: int, prompt_len: int, min_seconds: float = 1.0) -> dict:
    """Seconds of one insert of `samples` requests of one prompt into an empty slot state:
    the prompt prefilled once and shared (the engine's way), and prefilled once per sample
    (the same prompt as `samples` rows). Calls alternate; each side's median."""
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    rc = RolloutConfig(num_slots=samples, max_prompt_length=prompt_len, max_length=prompt_len + 8)
    group = RolloutEngine(cfg, params, mesh, rc).groups[0]
    sp = sampling.SamplingParams(temperature=1.0, max_tokens=8)
    prompt = np.random.RandomState(0).randint(1, cfg.vocab_size, (1, prompt_len)).astype(np.int32)
    rows = np.arange(samples, dtype=np.int32)
    lengths, key = np.full((samples,), prompt_len, np.int32), jax.random.PRNGKey(0)
    sides = {"shared": (prompt, np.zeros((samples,), np.int32)), "per_sample": (np.repeat(prompt, samples, 0), None)}

    def call(side, out=None):
        prompts, sources = sides[side]
        t0 = time.perf_counter()
        state = group.insert(group.empty_state(sp), prompts, lengths, rows, rows, rows, key, sp, sources_R=sources)
        jax.block_until_ready(state)
        if out is not None:
            out[side] = jax.device_get((state.cache.k, state.cache.v, state.last_token, state.out_logp))
        return time.perf_counter() - t0

    filled = {}
    for side in sides:
        call(side, filled)  # compiles
    # Both sides fill the same slots: the same cache entries, first tokens and their log-probs.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), *filled.values())
    times = {side: [] for side in sides}
    while min(sum(t) for t in times.values()) < min_seconds or min(map(len, times.values())) < 5:
        for side in sides:
            times[side].append(call(side))
    shared, per_sample = (statistics.median(times[side]) for side in sides)
    return dict(samples=samples, prompt=prompt_len, shared_ms=shared * 1e3, per_sample_ms=per_sample * 1e3,
                speedup=per_sample / shared, calls=len(times["shared"]))


def bench_hf(hf_dir, batch, prompt_len, new_tokens, repeats):
    """transformers' generate, with its dynamic and then its static cache, in one subprocess
    (torch and JAX would share the GPU; one import of torch serves both): {"hf": ..., "hf_static":
    ...}, each the median seconds of a generate call after a warm-up call, or its error."""
    code = f"""
import json, statistics, time, torch, transformers
dev = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = torch.bfloat16 if dev == 'cuda' else torch.float32
model = transformers.AutoModelForCausalLM.from_pretrained({hf_dir!r}, dtype=dtype).to(dev).eval()
ids = torch.randint(1, model.config.vocab_size, ({batch}, {prompt_len}), device=dev)
sync = torch.cuda.synchronize if dev == 'cuda' else (lambda: None)
out = {{}}
for label, extra in (('hf', {{}}), ('hf_static', dict(cache_implementation='static'))):
    kw = dict(max_new_tokens={new_tokens}, min_new_tokens={new_tokens}, do_sample=False, pad_token_id=0, **extra)
    try:
        with torch.inference_mode():
            model.generate(ids, **kw); sync()
            times = []
            for _ in range({repeats}):
                t0 = time.perf_counter(); model.generate(ids, **kw); sync(); times.append(time.perf_counter() - t0)
        out[label] = dict(seconds=statistics.median(times))
    except Exception as e:
        out[label] = dict(error=f"{{type(e).__name__}}: {{e}}"[:200])
print(json.dumps(out))
"""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        if done.returncode == 0:
            return json.loads(done.stdout.strip().splitlines()[-1])
        error = done.stderr.strip().splitlines()[-1][:200]
    except Exception as e:  # a failed baseline is recorded, not fatal
        error = f"{type(e).__name__}: {e}"[:200]
    return {label: dict(error=error) for label in ("hf", "hf_static")}


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    unknown = set(_LAYOUTS.value) - set(LAYOUTS)
    if unknown:
        raise SystemExit(f"Unknown --layouts {sorted(unknown)}; choose from {list(LAYOUTS)}.")
    if set(_ATTEND.value) - set(ATTEND):
        raise SystemExit(f"Unknown --attend {sorted(set(_ATTEND.value) - set(ATTEND))}; choose from {list(ATTEND)}.")
    preset = PRESETS[_PRESET.value]
    model_names = _MODELS.value or preset["models"]
    batches = [int(b) for b in (_BATCHES.value or preset["batches"])]
    p, n, repeats = preset["prompt"], preset["new_tokens"], preset["repeats"]
    bandwidth = measure_bandwidth_gbs()
    rows = []
    result = dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                  bandwidth_gbs=bandwidth, jax=jax.__version__, rows=rows)
    for name in ([_MODEL_DIR.value] if _MODEL_DIR.value else model_names):
        hf_dir = None
        if _MODEL_DIR.value:
            cfg, params = load_hf(name)
            params = jax.tree.map(jnp.asarray, params)
            name, hf_dir = os.path.basename(os.path.normpath(name)), name
        else:
            cfg = from_config_dict(models.model_config(name))
            params = tfm.init_params(cfg, jax.random.PRNGKey(0))
        if _PREFILL_SAMPLES.value:
            for g in map(int, _PREFILL_SAMPLES.value):
                row = dict(model=name, **bench_prefill(cfg, params, g, _PREFILL_LENGTH.value))
                rows.append(row)
                print(json.dumps(row), flush=True)
                _write(result)
            continue
        if _HF.value and hf_dir is None:
            hf_dir = os.path.join(tempfile.mkdtemp(prefix="bench_rollout_"), name)
            save_hf(hf_dir, cfg, jax.device_get(params))
        for b, layout, attend in [(b, lay, a) for b in batches for lay in _LAYOUTS.value for a in _ATTEND.value]:
            seconds, compile_s, attended, cache_slots = bench_ours(cfg, params, b, p, n, repeats, layout,
                                                                   _CACHE_SLOTS.value, attend)
            step_s = seconds / n
            # Mean KV entries read per step: the prompt plus, on average, half the answer.
            kv = b * (p + (n - 1) / 2) * kv_bytes_per_token(cfg)
            roofline_s = (param_bytes(params) + kv) / (bandwidth * 1e9)
            row = dict(model=name, batch=b, layout=layout, prompt=p, new_tokens=n, attend=attend,
                       cache_slots=cache_slots, attended_slots=attended, step_ms=step_s * 1e3,
                       tokens_per_s=b * n / seconds, roofline_step_ms=roofline_s * 1e3,
                       roofline_fraction=roofline_s / step_s, compile_s=compile_s)
            first_variant = layout == _LAYOUTS.value[0] and attend == _ATTEND.value[0]  # transformers once
            if _HF.value and hf_dir and first_variant and (_HF_BATCHES.value is None or str(b) in _HF_BATCHES.value):
                for label, hf in bench_hf(hf_dir, b, p, n, repeats).items():
                    if "seconds" in hf:
                        row[f"{label}_tokens_per_s"] = b * n / hf["seconds"]
                        row[f"speedup_vs_{label}"] = row["tokens_per_s"] / row[f"{label}_tokens_per_s"]
                    else:
                        row[f"{label}_error"] = hf["error"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            _write(result)
    if _PREFILL_SAMPLES.value:
        print(f"\nbackend {result['backend']} ({result['device']}): one prompt's prefill for G samples, ms (median)")
        print(f"{'model':14} {'G':>3} {'prompt':>6} {'shared':>8} {'per sample':>10} {'x':>5}")
        for r in rows:
            print(f"{r['model'][:14]:14} {r['samples']:3d} {r['prompt']:6d} {r['shared_ms']:8.2f} "
                  f"{r['per_sample_ms']:10.2f} {r['speedup']:5.2f}")
        return
    header = (f"{'model':14} {'batch':>5} {'layout':>9} {'read':>9} {'step ms':>8} {'tok/s':>9} {'roof ms':>8} "
              f"{'roof %':>6} {'hf tok/s':>9} {'x hf':>5} {'x hfst':>6}")
    print(f"\nbackend {result['backend']} ({result['device']}), copy bandwidth {bandwidth:.0f} GB/s\n{header}")
    for r in rows:
        read = f"{r['attended_slots']}/{r['cache_slots']}"
        print(f"{r['model'][:14]:14} {r['batch']:5d} {r['layout']:>9} {read:>9} {r['step_ms']:8.2f} "
              f"{r['tokens_per_s']:9.0f} "
              f"{r['roofline_step_ms']:8.3f} "
              f"{100 * r['roofline_fraction']:6.1f} {r.get('hf_tokens_per_s', float('nan')):9.0f} "
              f"{r.get('speedup_vs_hf', float('nan')):5.2f} {r.get('speedup_vs_hf_static', float('nan')):6.2f}")


def _write(result):
    """Rewritten after every row, so a run cut short keeps what it measured."""
    if _OUT.value:
        machine.write_result(_OUT.value, result)


if __name__ == "__main__":
    launch.run(main)
