r"""Speculative against plain rollout decoding: tokens/s and acceptance lengths.

  python -m experiments.bench_spec --preset=cpu --out=docs/results/bench_spec_cpu.json
  python -m experiments.bench_spec --preset=gpu --target=... --drafter=... --out=...

A target trained on the synthetic tasks (default: the shipped SFT checkpoint) and its
drafter (`experiments.train_drafter`) generate answers to held-out task prompts, G per
prompt as in RL, with every slot filled: plain decode against each strategy, run on
every step, at each batch size and temperature, over `waves` slot-fulls of requests.
Each configuration is generated once to compile and once timed. The table reports
tokens/s over the whole generate (prefill and host bookkeeping included, the same for
both sides), the speed-up, the speed-up of the decode chunks alone, the acceptance
length (mean tokens committed per sequence per verify step, bonus included) and the
acceptance per draft position (`RolloutTimeline.acceptance_by_depth`);
`breakeven_batch` is, per strategy and temperature, the largest batch at which
speculation still pays end to end: the input to the adaptive tuner.

`--breakdown` adds where the seconds go (`tlt_jax/rollout/profile.py`): per chunk, the parts
of a plain and a speculative chunk at each batch (sync, draft, verify, accept, bookkeeping;
their sum beside the chunk's wall time), summed per timed rollout from its timeline (with the
policy's host time and the host's time between chunks), and the ideal speed-up (acceptance
length x plain forward / (draft + verify forwards)) beside the measured one: their ratio is
the speculation efficiency. `--regime` times the target alone: a decode step against batch
size, and a verify forward over k tokens against one decode step's forward.

  python -m experiments.bench_spec --preset=cpu --breakdown --strategies=eagle-d4 --temperatures=1 \
      --batches=1,2,4,8,32,64 --min_requests=256 --out=docs/results/bench_spec_cpu_breakdown.json
  python -m experiments.bench_spec --regime --target=runs/bench_tlt_cache/target_l16_f4096 \
      --drafter=runs/bench_tlt_cache/drafter_l16_f4096 --out=docs/results/bench_spec_regime_wide.json

`--decode_mlp_size` decodes the target with every MLP padded by zero units
(`RolloutConfig.decode_mlp_size`): the target's own tokens from wider weight reads, with the
drafter as it is (`bench_tlt --preset=cpu_wide_decode`'s regime).
"""
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax import lax

from configs.common import tasks_tiny
from experiments import machine
from tlt_jax import evaluation, launch, sampling, sharding
from tlt_jax.data import tasks
from tlt_jax.drafter_training.io import load_drafter
from tlt_jax.models import transformer as tfm
from tlt_jax.models.hf_io import load_hf
from tlt_jax.rollout import profile
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.rollout.speculative import DraftTree, FixedSpeculation, Strategy
from tlt_jax.tokenizer import load_tokenizer

_PRESET = flags.DEFINE_enum("preset", "cpu", ["cpu", "gpu"], "Batch sizes and lengths to run.")
_TARGET = flags.DEFINE_string("target", "assets/sft_tiny", "Target: a Hugging Face checkpoint with its tokenizer.")
_DRAFTER = flags.DEFINE_string("drafter", "assets/drafter_tiny", "Drafter trained for the target.")
_OUT = flags.DEFINE_string("out", "", "Write the results as JSON here.")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Parameter and compute dtype of the target "
                           "(default: the checkpoint's).")
_BATCHES = flags.DEFINE_list("batches", None, "Override the preset's batch sizes.")
_STRATEGIES = flags.DEFINE_list("strategies", ["eagle-d4", "eagle-d6", "eagle-d5-k3-t12", "ngram-d4-b2"],
                                "Strategies by name (Strategy.from_name).")
_TEMPERATURES = flags.DEFINE_list("temperatures", None, "Override the preset's temperatures.")
_TIME_BUDGET_S = flags.DEFINE_float("time_budget_s", 0.0, "Start no new batch size after this many seconds (0: none); "
                                    "the JSON lists the batch sizes skipped.")
_MIN_REQUESTS = flags.DEFINE_integer("min_requests", 0, "At least this many requests per configuration (more "
                                     "waves at small batch sizes: a second or more of work per cell).")
_BREAKDOWN = flags.DEFINE_bool("breakdown", False, "Also measure where the seconds go and the speculation "
                                "efficiency (measured / ideal speed-up) of every row.")
_REGIME = flags.DEFINE_bool("regime", False, "Time the target alone instead: decode step against batch size, and a "
                            "verify forward over k tokens against one decode step's forward.")
_DECODE_MLP_SIZE = flags.DEFINE_integer("decode_mlp_size", 0, "Decode the target with every MLP padded to this many "
                                        "zero units (RolloutConfig.decode_mlp_size: the same tokens, wider weight "
                                        "reads); 0: the model's own width.")
_SPEC_STEPS_PER_SYNC = flags.DEFINE_integer("spec_steps_per_sync", RolloutConfig.spec_steps_per_sync,
                                           "Speculative steps per device loop (RolloutConfig.spec_steps_per_sync).")
_COUPLED = flags.DEFINE_bool("coupled", False, "Verify coupled (rollout.spec_coupled): every speculative rollout "
                             "returns plain decode's samples; `same_tokens` records whether it did.")
_REGIME_TOKENS = flags.DEFINE_list("regime_tokens", ["1", "2", "4", "5", "8"], "Tokens per sequence of the verify "
                                   "forwards --regime times.")

PRESETS = {
    "cpu": dict(batches=[1, 4, 8, 16, 32, 64], temperatures=[0.0, 1.0], max_tokens=96, samples_per_prompt=4, waves=4),
    "gpu": dict(batches=[1, 4, 8, 16, 32, 64], temperatures=[0.0, 1.0], max_tokens=256, samples_per_prompt=4,
                waves=4),
}


def run_once(engine, prompts, g, sp, speculation, key):
    engine.generate(prompts, g, sp, key, speculation=speculation)  # compiles every shape it meets
    timed = profile.TimedSpeculation(speculation) if speculation is not None else None
    t0 = time.perf_counter()
    out = engine.generate(prompts, g, sp, key, speculation=timed)
    wall = time.perf_counter() - t0
    s = out.timeline.summary()
    decode_s = sum(c.end - c.start for g in out.timeline.groups for c in g.chunks)
    tokens = int(out.lengths.sum())
    return dict(tokens=tokens, seconds=wall, tokens_per_s=tokens / wall, decode_tokens_per_s=tokens / decode_s,
                acceptance_length=s["acceptance_length"], timeline=out.timeline.groups[0],
                acceptance_by_depth=out.timeline.acceptance_by_depth(), answers=out.tokens,
                tuner_s=timed.seconds if timed is not None else 0.0)


def breakdown_row(engine, prompts, sp, key, strategy, plain, spec, plain_chunk):
    """The row's parts per chunk and per rollout, and its ideal speed-up and efficiency
    (plain_chunk: the plain baseline's chunk breakdown, measured once per batch and T)."""
    group = engine.local_groups[0]
    state = profile.filled_state(group, prompts, key, sp)
    spec_chunk = profile.chunk_breakdown(group, state, key, strategy, sp)
    # The same forwards timed as programs of their own (as --regime does): a prefix program
    # can fuse differently from the chunk it is cut from (at batch 2 on the EPYC the plain
    # forward's ran slower than the whole plain chunk), so the ideal is also given from these.
    forward_s = forward_seconds(group, state, 1)
    verify_s = forward_seconds(group, state, strategy.num_tree_nodes, as_tree=True)
    rollouts = {
        "plain": profile.rollout_breakdown(plain["timeline"], {"": plain_chunk.per_step},
                                           {"": plain_chunk.parts["sync"]}),
        "spec": profile.rollout_breakdown(spec["timeline"], {strategy.name: spec_chunk.per_step},
                                          {strategy.name: spec_chunk.parts["sync"]}, spec["tuner_s"]),
    }
    ideal = profile.ideal_speedup(spec["acceptance_length"], plain_chunk.per_step["forward"],
                                  spec_chunk.per_step["draft"], spec_chunk.per_step["verify"])
    ideal_standalone = profile.ideal_speedup(spec["acceptance_length"], forward_s, spec_chunk.per_step["draft"],
                                             verify_s)
    speedup = spec["tokens_per_s"] / plain["tokens_per_s"]
    decode_speedup = spec["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
    chunk = lambda c: dict(steps=c.steps, parts=c.parts, sum_s=c.sum_s, wall_s=c.wall_s, calls=c.reps,
                           after_another_s=c.after_another_s, wall_median_s=c.wall_median_s)
    return dict(plain_chunk=chunk(plain_chunk), spec_chunk=chunk(spec_chunk), rollout=rollouts, ideal_speedup=ideal,
                efficiency=speedup / ideal, decode_efficiency=decode_speedup / ideal,
                standalone=dict(forward_s=forward_s, verify_s=verify_s, ideal_speedup=ideal_standalone,
                                efficiency=speedup / ideal_standalone,
                                decode_efficiency=decode_speedup / ideal_standalone))


def plain_chunk_breakdown(engine, prompts, sp, key):
    group = engine.local_groups[0]
    return profile.chunk_breakdown(group, profile.filled_state(group, prompts, key, sp, speculative=False), key, None,
                                   sp)


def forward_seconds(group, state, num_tokens: int, min_seconds: float = 1.0, as_tree: bool = False) -> float:
    """Seconds per target forward over num_tokens tokens per sequence (a chain, as a verify
    step runs them; as_tree: through the engine's verify forward, `_tree_forward`, the chain
    as a draft tree) on `state`'s cache: the fastest of repeated device loops of 16 forwards,
    at least min_seconds of them."""
    cfg, steps = group.engine.model_config, 16

    def fn(params, cache, tokens_BT):
        b, t = tokens_BT.shape
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        chain = DraftTree(tokens_BT, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) - 1, (b, t)), None)

        def body(i, carry):
            cache, acc = carry
            if as_tree:
                logits, h, new, *_ = group._tree_forward(params, dataclasses.replace(state, cache=cache), chain)
            else:
                logits, h, new = tfm.decode(params, cfg, cache, tokens_BT, positions, mask_BTW=mask,
                                            return_logits=True)
            return new.with_lengths(cache.lengths), acc + jnp.sum(logits) + jnp.sum(h)

        return lax.fori_loop(0, steps, body, (cache, jnp.float32(0)))

    program = jax.jit(fn, donate_argnums=(1,))
    tokens = jnp.broadcast_to(state.last_token[:, None], (state.last_token.shape[0], num_tokens))

    def call():
        cache = jax.tree.map(jnp.copy, state.cache)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        jax.device_get(program(group.params, cache, tokens)[1])
        return time.perf_counter() - t0

    call()  # compiles
    first = call()
    times = [call() for _ in range(max(3, int(min_seconds / first)))]
    return min(times) / steps


def run_regime(model_cfg, params, prompts, batches, mesh):
    """Decode step time against batch (the engine's plain chunk, per step) and the target's
    forward over k tokens against its forward over one, at each batch."""
    sp = sampling.SamplingParams(temperature=1.0, max_tokens=96)
    key = jax.random.PRNGKey(0)
    ks = [int(k) for k in _REGIME_TOKENS.value]
    rows = []
    for b in batches:
        rc = RolloutConfig(num_slots=b, max_prompt_length=max(map(len, prompts)),
                           max_length=max(map(len, prompts)) + sp.max_tokens + 1, steps_per_sync=16,
                           eos_token_id=None, decode_mlp_size=_DECODE_MLP_SIZE.value)
        engine = RolloutEngine(model_cfg, params, mesh, rc)
        group = engine.local_groups[0]
        state = profile.filled_state(group, prompts, key, sp, speculative=False)
        chunk = profile.chunk_breakdown(group, state, key, None, sp)
        forwards = {k: forward_seconds(group, state, k) for k in ks}
        # The engine's verify forward (explicit tree mask, positions by depth) over the widest chain.
        tree = forward_seconds(group, state, max(ks), as_tree=True)
        row = dict(batch=b, step_s=chunk.wall_s / chunk.steps, forward_s=chunk.per_step["forward"],
                   forward_tokens_s={str(k): v for k, v in forwards.items()},
                   forward_vs_one={str(k): forwards[k] / forwards[1] for k in ks},
                   tree_forward_vs_one={str(max(ks)): tree / forwards[1]})
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    preset = PRESETS[_PRESET.value]
    batches = [int(b) for b in (_BATCHES.value or preset["batches"])]
    strategies = [Strategy.from_name(name) for name in _STRATEGIES.value]
    temperatures = [float(t) for t in (_TEMPERATURES.value or preset["temperatures"])]
    model_cfg, params = load_hf(_TARGET.value, dtype=_DTYPE.value)
    tokenizer = load_tokenizer(_TARGET.value)
    if not os.path.exists(_DRAFTER.value):
        raise SystemExit(f"No drafter at {_DRAFTER.value!r}; train one with `python -m experiments.train_drafter "
                         "--config=configs/drafter.py:tiny` or pass --drafter.")
    drafter_cfg, drafter_params = load_drafter(_DRAFTER.value, model_cfg)
    examples = tasks.make_split(tasks.from_spec(tasks_tiny().to_dict()), "eval",
                                max(preset["waves"] * max(batches), _MIN_REQUESTS.value), seed=2, unique=True)
    all_prompts = evaluation.encode_prompts(tokenizer, examples)
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    g = preset["samples_per_prompt"]
    key = jax.random.PRNGKey(0)
    rows = []
    result = dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  target=_TARGET.value, drafter=_DRAFTER.value, target_params=model_cfg.num_params(),
                  target_weight_bytes=_weight_bytes(params), decode_mlp_size=_DECODE_MLP_SIZE.value,
                  decode_weight_bytes=_decode_weight_bytes(params, model_cfg),
                  spec_steps_per_sync=_SPEC_STEPS_PER_SYNC.value, coupled=_COUPLED.value, rows=rows)
    if _REGIME.value:
        result["regime"] = run_regime(model_cfg, params, all_prompts, batches, mesh)
        _write(result)
        print(f"\ntarget {model_cfg.num_params() / 1e6:.1f}M params, {result['target_weight_bytes'] / 1e6:.0f} MB; "
              f"decode reads {result['decode_weight_bytes'] / 1e6:.0f} MB of weights a step")
        print(f"{'batch':>5} {'step ms':>8} {'fwd ms':>7} "
              + " ".join(f"{'fwd ' + k + '/1':>8}" for k in _REGIME_TOKENS.value)
              + f" {'tree ' + str(max(int(k) for k in _REGIME_TOKENS.value)) + '/1':>9}")
        for r in result["regime"]:
            print(f"{r['batch']:5d} {r['step_s'] * 1e3:8.2f} {r['forward_s'] * 1e3:7.2f} "
                  + " ".join(f"{v:8.2f}" for v in r["forward_vs_one"].values())
                  + "".join(f" {v:9.2f}" for v in r["tree_forward_vs_one"].values()))
        return
    t_start = time.perf_counter()
    for i, b in enumerate(batches):
        if _TIME_BUDGET_S.value and time.perf_counter() - t_start > _TIME_BUDGET_S.value:
            result["skipped_batches"] = batches[i:]
            print(f"time budget spent: batches {batches[i:]} skipped", flush=True)
            break
        samples = min(g, b)
        prompts = all_prompts[:max(preset["waves"] * b, _MIN_REQUESTS.value) // samples]
        rc = RolloutConfig(num_slots=b, max_prompt_length=max(map(len, prompts)),
                           max_length=max(map(len, prompts)) + preset["max_tokens"] + 1, steps_per_sync=16,
                           eos_token_id=model_cfg.eos_token_id,
                           max_draft_depth=max(s.depth for s in strategies),
                           spec_steps_per_sync=_SPEC_STEPS_PER_SYNC.value, decode_mlp_size=_DECODE_MLP_SIZE.value,
                           spec_coupled=_COUPLED.value)
        engine = RolloutEngine(model_cfg, params, mesh, rc, drafter_cfg, drafter_params)
        for temperature in temperatures:
            sp = sampling.SamplingParams(temperature=temperature, max_tokens=preset["max_tokens"])
            plain = run_once(engine, prompts, samples, sp, None, key)
            plain_chunk = plain_chunk_breakdown(engine, all_prompts, sp, key) if _BREAKDOWN.value else None
            for strategy in strategies:
                spec = run_once(engine, prompts, samples, sp, FixedSpeculation(strategy, max_active=b), key)
                row = dict(batch=b, temperature=temperature, strategy=strategy.name, requests=len(prompts) * samples,
                           plain_tokens_per_s=plain["tokens_per_s"], spec_tokens_per_s=spec["tokens_per_s"],
                           speedup=spec["tokens_per_s"] / plain["tokens_per_s"],
                           plain_decode_tokens_per_s=plain["decode_tokens_per_s"],
                           spec_decode_tokens_per_s=spec["decode_tokens_per_s"],
                           decode_speedup=spec["decode_tokens_per_s"] / plain["decode_tokens_per_s"],
                           acceptance_length=spec["acceptance_length"],
                           acceptance_by_depth=spec["acceptance_by_depth"], plain_tokens=plain["tokens"],
                           spec_tokens=spec["tokens"],
                           # Token for token plain decode's answers (so at temperature 0 and coupled, up to rounding).
                           same_tokens=all(np.array_equal(a, b) for a, b in zip(plain["answers"], spec["answers"])))
                if _BREAKDOWN.value:
                    row.update(breakdown_row(engine, all_prompts, sp, key, strategy, plain, spec, plain_chunk))
                rows.append(row)
                print(json.dumps(row), flush=True)
                _write(result)
    result["breakeven_batch"] = {
        f"{s.name}@T{t}": max([r["batch"] for r in rows if r["strategy"] == s.name and r["temperature"] == t
                               and r["speedup"] > 1.0], default=0)
        for s in strategies for t in temperatures}
    _write(result)
    print(f"\nbackend {result['backend']} ({result['device']}), target {model_cfg.num_params() / 1e6:.1f}M params")
    print(f"{'batch':>5} {'T':>3} {'strategy':20} {'plain tok/s':>11} {'spec tok/s':>10} {'x':>5} "
          f"{'decode x':>8} {'acc len':>7}  accepted at depth 1, 2, ... (given the drafts before it)")
    for r in rows:
        by_depth = " ".join("  - " if a is None else f"{a:.2f}" for a in r["acceptance_by_depth"])
        print(f"{r['batch']:5d} {r['temperature']:3.1f} {r['strategy']:20} {r['plain_tokens_per_s']:11.0f} "
              f"{r['spec_tokens_per_s']:10.0f} {r['speedup']:5.2f} {r['decode_speedup']:8.2f} "
              f"{r['acceptance_length']:7.2f}  {by_depth}")
    print(("coupled: " if _COUPLED.value else "") + "speculative answers token for token plain decode's in "
          f"{sum(r['same_tokens'] for r in rows)} of {len(rows)} rows")
    print("largest batch where speculation pays:", json.dumps(result["breakeven_batch"]))
    if _BREAKDOWN.value:
        print_breakdown(rows)


def print_breakdown(rows):
    print(f"\nper chunk, ms (spec: {', '.join(profile.SPEC_PARTS)}; plain: {', '.join(profile.PLAIN_PARTS)}); "
          "sum / wall")
    for r in rows:
        sc, pc = r["spec_chunk"], r["plain_chunk"]
        print(f"{r['batch']:5d} {r['temperature']:3.1f} {r['strategy']:16} spec {sc['steps']} steps: "
              + " ".join(f"{v * 1e3:7.2f}" for v in sc["parts"].values())
              + f" = {sc['sum_s'] * 1e3:7.2f} / {sc['wall_s'] * 1e3:7.2f}; plain {pc['steps']} steps: "
              + " ".join(f"{v * 1e3:7.2f}" for v in pc["parts"].values())
              + f" = {pc['sum_s'] * 1e3:7.2f} / {pc['wall_s'] * 1e3:7.2f}; after another program: spec "
              f"{sc['after_another_s'] * 1e3:.2f}, plain {pc['after_another_s'] * 1e3:.2f}; median wall: spec "
              f"{sc['wall_median_s'] * 1e3:.2f}, plain {pc['wall_median_s'] * 1e3:.2f}")
    print("\nper rollout, s: parts summed / the timeline's wall")
    for r in rows:
        for kind, ro in r["rollout"].items():
            print(f"{r['batch']:5d} {r['temperature']:3.1f} {r['strategy']:16} {kind:5} "
                  + ", ".join(f"{k} {v:.3f}" for k, v in ro["parts"].items())
                  + f" = {ro['sum_s']:.3f} / {ro['wall_s']:.3f} ({ro['chunks']} chunks)")
    print(f"\n{'batch':>5} {'T':>3} {'strategy':16} {'acc len':>7} {'ideal x':>7} {'x':>5} {'eff':>5} "
          f"{'decode x':>8} {'eff':>5}   standalone forwards: {'fwd ms':>6} {'verify ms':>9} {'ideal x':>7} "
          f"{'eff':>5} {'decode eff':>10}")
    for r in rows:
        a = r["standalone"]
        print(f"{r['batch']:5d} {r['temperature']:3.1f} {r['strategy']:16} {r['acceptance_length']:7.2f} "
              f"{r['ideal_speedup']:7.2f} {r['speedup']:5.2f} {r['efficiency']:5.2f} {r['decode_speedup']:8.2f} "
              f"{r['decode_efficiency']:5.2f}   {'':21}{a['forward_s'] * 1e3:6.2f} {a['verify_s'] * 1e3:9.2f} "
              f"{a['ideal_speedup']:7.2f} {a['efficiency']:5.2f} {a['decode_efficiency']:10.2f}")


def _weight_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def _decode_weight_bytes(params, model_cfg) -> int:
    """The bytes of the weights a decode step reads: with --decode_mlp_size, the padded
    layout's (shapes only, nothing allocated)."""
    if not _DECODE_MLP_SIZE.value:
        return _weight_bytes(params)
    return _weight_bytes(jax.eval_shape(lambda p: tfm.pad_mlp(p, model_cfg, _DECODE_MLP_SIZE.value)[1], params))


def _write(result):
    """Rewritten after every row, so a run cut short keeps what it measured."""
    if _OUT.value:
        machine.write_result(_OUT.value, result)


if __name__ == "__main__":
    launch.run(main)
