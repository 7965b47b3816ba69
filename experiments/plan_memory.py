"""Will my run fit? Per-device memory of the project's jitted steps at real model shapes,
from XLA's compile-time buffer assignment: no weights are allocated, any backend serves
(simulated CPU devices stand in for the mesh).

  python -m experiments.plan_memory --presets=qwen2.5-1.5b --mesh=1x1x1 --seq_lens=8192,32768
  python -m experiments.plan_memory --mesh=1x8x1 --device_memory_gb=80 --out=/tmp/plan.json

For each model preset, step, mesh (DATAxFSDPxTENSOR, one of them may be -1) and sequence
length, the step is compiled from jax.ShapeDtypeStructs at a few micro-batch sizes, and
the largest micro-batch whose per-device memory (arguments + outputs + temp - aliased,
i.e. what the executable holds at its peak) fits --device_memory_gb is reported with its
breakdown. The steps, as the code runs them:

  learner        Learner.micro_step: the gradient of one GRPO micro-batch of micro_batch
                 rows added to the update's accumulator (donated), with the optimizer
                 state resident beside it (its other program, applying the sum, holds the
                 same state and accumulator without activations)
  learner_remat  the same with per-layer rematerialisation (LearnerConfig.remat)
  learner_tlt    learner_remat on-policy (one update per RL step, `Learner.on_policy`) with
                 the drafter's data (hidden states, top-K) as outputs beside the gradient:
                 what a TLT step runs in place of learner_remat and old_logp
  old_logp       Learner.drafter_data_step: the old-policy pass with the drafter's data
                 (hidden states, top-K), micro_batch rows per call
  drafter        DrafterTrainer.step_fn: one drafter update on micro_batch buffer rows
  decode         Group.chunk_step: one plain decode chunk of a rollout group, micro_batch
                 KV-cache slots of seq_len tokens each
  distill        DistillTrainer.step_fn: one update of the student from a top-100 teacher
                 cache, micro_batch rows, per-layer rematerialisation
  teacher        the distillation teacher (`distill.train.make_teacher_topk`): its top-100
                 ids and log-probs over micro_batch rows, what the cache writer (and the
                 online teacher) runs per call; the forward pass only
  teacher_topk   the teacher's top-100 from its final hidden states alone
                 (`logprobs.topk_of_hidden`, the blockwise projection), micro_batch rows:
                 the part of `teacher` that once formed [rows, seq_len, V] float32 logits.
                 On XLA:CPU the teacher's forward holds a float32 copy of the scanned
                 bfloat16 layer stack (28 GB for an 8B), which a GPU does not, and that
                 hides this part in `teacher`'s total

Micro-batches are multiples of the data-parallel size (data x fsdp; for decode, the
slots of one rollout group: fsdp). The search compiles the smallest micro-batch and
twice it, extrapolates the line through them and checks the prediction and its
neighbour, bisecting when the line misleads: about four compiles per case, each
(shape, micro-batch) compiled once. Memory is XLA's buffer assignment on the backend
that compiles (by default CPU): allocator slack, cuDNN/cuBLAS workspaces and fragmentation
on a GPU come on top; the GPU run is the check.

On the CPU backend the numbers are an upper bound for 16-bit models: XLA:CPU computes
16-bit floats in float32, so a bf16 array that a loop slices or updates in place (scanned
layer weights, activations stacked for the backward pass, the KV cache of a decode loop)
is held as a float32 copy besides it. A decode chunk's temp there is about twice its bf16
KV cache; a GPU updates the cache in place. `--backend=gpu` on a GPU machine compiles
with the GPU's own buffer assignment (its real devices form the mesh).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

GB = 1e9
STEPS = ("learner", "learner_remat", "learner_tlt", "old_logp", "drafter", "decode", "distill", "teacher",
         "teacher_topk")
ATTENTION_STEPS = ("learner", "learner_remat", "learner_tlt", "old_logp")  # those that take --attention_impl
DISTILL_TOP_K = 100  # the teacher cache's K at real scale (the paper's)
DEFAULT_PRESETS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama3.2-3b")
MAX_MICRO_BATCH = 4096  # the search stops here (reported as "at least")


def parse_mesh(text: str) -> tuple[int, int, int]:
    """'1x8x1' -> (data, fsdp, tensor); one entry may be -1 (the rest of the devices)."""
    try:
        sizes = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        sizes = ()
    if len(sizes) != 3 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"--mesh={text!r}: expected DATAxFSDPxTENSOR, positive sizes or one -1, e.g. 1x8x1.")
    return sizes


def _devices_needed(meshes, devices):
    if devices:
        return devices
    if any(-1 in m for m in meshes):
        raise ValueError("A mesh axis of -1 needs --devices (the number of simulated devices it fills).")
    return max(math.prod(m) for m in meshes)


# ------------------------------------------------------------------------------------
# One compile.
# ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    preset: str
    step: str
    mesh: tuple[int, int, int]  # resolved (data, fsdp, tensor)
    seq_len: int
    attention_impl: str = "auto"  # the learner's and old-logp pass's attention (LearnerConfig.attention_impl)


def granule(case: Case) -> int:
    data, fsdp, _ = case.mesh
    return fsdp if case.step == "decode" else data * fsdp


def _abstract_params(model_config):
    import jax

    from tlt_jax.models import transformer as tfm

    return jax.eval_shape(lambda: tfm.init_params(model_config, jax.random.PRNGKey(0)))


def _abstract_state(optimizer, params):
    import jax
    import jax.numpy as jnp

    from tlt_jax.train_state import TrainState

    return TrainState(params, jax.eval_shape(optimizer.init, params), jax.ShapeDtypeStruct((), jnp.int32))


def _device_bytes(x, sharding) -> int:
    """Bytes of one device's shard of abstract array x under `sharding`."""
    import numpy as np

    return int(np.prod(sharding.shard_shape(x.shape))) * x.dtype.itemsize


def _lowered_learner(case: Case, model_config, mesh, batch: int, params):
    """`_lowered` for the learner's micro-step (plain, remat, or on-policy with the drafter's data)."""
    import jax
    import jax.numpy as jnp

    from tlt_jax.drafter_training.online import OnlineDrafterConfig
    from tlt_jax.rl.learner import Learner, LearnerConfig

    s = case.seq_len
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
    learner = Learner(model_config, LearnerConfig(micro_batch_size=batch, remat=case.step != "learner",
                                                  attention_impl=case.attention_impl), mesh)
    on_policy = case.step == "learner_tlt"
    minibatch = {name: spec((batch, s), jnp.int32) for name in ("tokens", "positions", "segment_ids")}
    minibatch["loss_mask"] = spec((batch, s - 1), jnp.bool_)
    minibatch.update({name: spec((batch, s - 1), jnp.float32)
                      for name in ("rollout_logp", "advantages", "loss_weights", "token_weights")
                      + (() if on_policy else ("old_logp",))})
    outputs = (OnlineDrafterConfig().top_k, ()) if on_policy else None
    step, zeros = learner.micro_step(params, minibatch, outputs)
    opt_state = _abstract_state(learner.optimizer, params).opt_state
    resident = sum(_device_bytes(x, sh) for x, sh in zip(
        jax.tree.leaves(opt_state), jax.tree.leaves(learner.state_shardings(params).opt_state)))
    return step.lower(params, jax.eval_shape(zeros), minibatch), resident


def _lowered(case: Case, model_config, mesh, batch: int):
    """(the step of `case` at `batch` rows (slots) lowered from abstract arguments, the
    per-device bytes that stay on the device across the call without being one of its
    arguments)."""
    import jax
    import jax.numpy as jnp

    s = case.seq_len
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    params = _abstract_params(model_config)
    if case.step in ("learner", "learner_remat", "learner_tlt"):
        return _lowered_learner(case, model_config, mesh, batch, params)
    if case.step == "old_logp":
        from tlt_jax.drafter_training.online import OnlineDrafterConfig
        from tlt_jax.rl.learner import Learner, LearnerConfig

        learner = Learner(model_config, LearnerConfig(attention_impl=case.attention_impl), mesh)
        rows = spec((batch, s), jnp.int32)
        step = learner.drafter_data_step(params, rows, top_k=OnlineDrafterConfig().top_k)
        return step.lower(params, rows, rows, rows), 0
    if case.step == "drafter":
        from tlt_jax.drafter_training.buffer import DrafterBuffer
        from tlt_jax.drafter_training.online import OnlineDrafterConfig
        from tlt_jax.drafter_training.trainer import DrafterTrainer, shared_target_params
        from tlt_jax.models import drafter as drafter_lib

        c = OnlineDrafterConfig()
        dcfg = drafter_lib.DrafterConfig()
        trainer = DrafterTrainer(model_config, dcfg, c.optimizer, mesh, top_k=c.top_k, feature_weight=c.feature_weight,
                                 kl_weight=c.kl_weight, feature_noise=c.feature_noise)
        drafter_params = jax.eval_shape(lambda: drafter_lib.init_drafter(model_config, dcfg, jax.random.PRNGKey(0)))
        fields = DrafterBuffer(s, model_config.hidden_size, c.top_k, max_bytes=1 << 62,
                               feature_dtype=model_config.jnp_dtype).field_specs()
        rows = {name: spec((batch, *shape), dtype) for name, (shape, dtype) in fields.items()}
        target = shared_target_params(params)
        step = trainer.step_fn(drafter_params, target, rows)
        return step.lower(_abstract_state(trainer.optimizer, drafter_params),
                          {"target": target, "batch": rows, "key": key}), 0
    if case.step == "decode":
        from tlt_jax import sampling
        from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine

        prompt = min(1024, s // 2)
        engine = RolloutEngine(model_config, params, mesh,
                               RolloutConfig(num_slots=batch, max_prompt_length=prompt, max_length=s))
        group = engine.groups[0]
        sp = sampling.SamplingParams(max_tokens=s - prompt)
        state = jax.eval_shape(lambda: group.empty_state(sp))
        step = group.chunk_step(None, speculative=False)
        return step.lower(engine._param_shapes, None, state, key, spec((), jnp.bool_), spec((), jnp.int32), sp), 0
    if case.step == "distill":
        trainer = _distill_trainer(model_config, mesh)
        rows = distill_rows(batch, s, trainer.top_k, spec)
        return trainer.step_fn(params, rows).lower(_abstract_state(trainer.optimizer, params), rows), 0
    if case.step == "teacher":
        from tlt_jax.distill.train import teacher_topk_step

        k = min(DISTILL_TOP_K, model_config.vocab_size)
        # bfloat16 log-probs, as the llama3-8b-to-3b-32k preset caches them.
        step = teacher_topk_step(model_config, params, mesh, k=k, temperature=1.0, logp_dtype="bfloat16")
        rows = spec((batch, s), jnp.int32)
        return step.lower(params, rows, rows, rows), 0
    if case.step == "teacher_topk":
        from tlt_jax import logprobs, sharding
        from tlt_jax.models import transformer as tfm

        k = min(DISTILL_TOP_K, model_config.vocab_size)
        heads = ("embed", "lm_head")
        head = {name: params[name] for name in heads if name in params}
        head_sh = {name: sh for name, sh in tfm.param_shardings(model_config, params, mesh).items() if name in heads}
        fn = lambda head, h_BTD: logprobs.topk_of_hidden(head, model_config, h_BTD, k)
        rows_sh = sharding.batch_sharding(mesh, 3)
        step = sharding.jit_sharded(fn, in_shardings=(head_sh, rows_sh), out_shardings=(rows_sh, rows_sh))
        return step.lower(head, spec((batch, s, model_config.hidden_size), model_config.jnp_dtype)), 0
    raise ValueError(f"Unknown step {case.step!r}; steps: {', '.join(STEPS)}.")


def _distill_trainer(model_config, mesh):
    """The student's trainer of the `distill` step: top-100 (at most V), the paper's loss, remat per layer."""
    from tlt_jax.distill.train import DistillTrainer
    from tlt_jax.train_state import OptimizerConfig

    return DistillTrainer(model_config, OptimizerConfig(), mesh, temperature=1.0, tail=False,
                          top_k=min(DISTILL_TOP_K, model_config.vocab_size), remat=True)


def distill_rows(batch: int, seq_len: int, k: int, make) -> dict:
    """The `distill` step's batch, each array made by make(shape, dtype): the rows' tokens and
    layout, the target mask, and the teacher cache's [rows, seq_len, K] ids and log-probs as
    the cache stores them (CacheMeta: int32 ids, bfloat16 logp by default)."""
    import jax.numpy as jnp

    rows = {name: make((batch, seq_len), jnp.int32) for name in ("tokens", "positions", "segment_ids")}
    rows["mask"] = make((batch, seq_len - 1), jnp.bool_)
    rows["ids"] = make((batch, seq_len, k), jnp.int32)
    rows["logp"] = make((batch, seq_len, k), jnp.bfloat16)
    return rows


def measure(case: Case, model_config, mesh, batch: int) -> dict:
    """Per-device bytes of the compiled step: args, out, temp, alias, resident (held across
    the call, not an argument: the learner's optimizer state) and their total."""
    t0 = time.perf_counter()
    lowered, resident = _lowered(case, model_config, mesh, batch)
    mem = lowered.compile().memory_analysis()
    out = dict(
        args=mem.argument_size_in_bytes,
        out=mem.output_size_in_bytes,
        temp=mem.temp_size_in_bytes,
        alias=mem.alias_size_in_bytes,
        resident=resident,
    )
    out["total"] = out["args"] + out["out"] + out["temp"] - out["alias"] + out["resident"]
    out["compile_s"] = time.perf_counter() - t0
    return out


# ------------------------------------------------------------------------------------
# The search.
# ------------------------------------------------------------------------------------


def largest_fitting(measure_at, unit: int, limit: float, cap: int = MAX_MICRO_BATCH) -> dict:
    """The largest multiple b of `unit` (<= cap) with measure_at(b)["total"] <= limit.

    Memory is close to affine in b, so few sizes are compiled: the smallest and twice
    it give a line; its prediction is compiled; when that lands on the line and the line
    puts the next size over the limit by a clear margin, the search stops, otherwise it
    bisects (or doubles) on compiled sizes. Returns {"batch": b or None, "at":
    measure_at(b) (of the smallest b when none fits), "capped": cap itself fits,
    "probes": the sizes compiled}."""
    probes = {}

    def total(b):
        if b not in probes:
            probes[b] = measure_at(b)
        return probes[b]["total"]

    def result(batch, capped=False):
        return dict(batch=batch, at=probes[batch or unit], capped=capped, probes=sorted(probes))

    cap = max(unit, cap // unit * unit)
    if total(unit) > limit:
        return result(None)
    if unit == cap:
        return result(unit, capped=True)
    if total(2 * unit) > limit:
        return result(unit)
    t1, slope = total(unit), (total(2 * unit) - total(unit)) / unit
    line = lambda b: t1 + slope * (b - unit)
    lo, hi = 2 * unit, None  # lo fits; hi (None: not known yet) does not
    guess = cap if slope <= 0 else min(cap, max(lo, int((limit - t1) / slope) // unit * unit + unit))
    if guess > lo:
        if total(guess) <= limit:
            lo = guess
        else:
            hi = guess
    on_line = abs(total(lo) - line(lo)) <= 1e-3 * total(lo)
    if hi is None and lo < cap and on_line and line(lo + unit) > limit * 1.01:
        hi = lo + unit  # over the limit by the line through three compiled sizes
    step = unit
    while hi is None and lo < cap:  # off the line: walk up, doubling
        nxt = min(lo + step, cap)
        if total(nxt) <= limit:
            lo, step = nxt, 2 * step
        else:
            hi = nxt
    while hi is not None and hi - lo > unit:
        mid = min(max((lo + hi) // 2 // unit * unit, lo + unit), hi - unit)
        if total(mid) <= limit:
            lo = mid
        else:
            hi = mid
    return result(lo, capped=hi is None)


def measure_cached(case: Case, model_config, mesh, batch: int, cache: dict) -> dict:
    """`measure`, compiled once per (case, batch) in `cache`."""
    if (case, batch) not in cache:
        cache[(case, batch)] = measure(case, model_config, mesh, batch)
    return cache[(case, batch)]


def plan_case(case: Case, model_config, mesh, limit: float, cache: dict, cap: int = MAX_MICRO_BATCH) -> dict:
    measure_at = lambda b: measure_cached(case, model_config, mesh, b, cache)
    found = largest_fitting(measure_at, granule(case), limit, cap)
    row = dict(dataclasses.asdict(case), unit=granule(case), limit_gb=limit / GB, micro_batch=found["batch"],
               capped=found["capped"], probes=found["probes"], **{f"{k}_gb": v / GB for k, v in found["at"].items()
                                                                   if k != "compile_s"})
    row["tokens"] = None if found["batch"] is None else found["batch"] * case.seq_len
    smallest = measure_at(granule(case))  # one micro-batch of `unit` rows
    row["smallest_total_gb"] = smallest["total"] / GB
    row["smallest_gb"] = {k: v / GB for k, v in smallest.items() if k != "compile_s"}  # its parts
    row["compile_s"] = sum(cache[(case, b)]["compile_s"] for b in found["probes"])
    return row


def describe(row: dict) -> str:
    """One line for a planned case: the fit, or why there is none."""
    mesh = "x".join(map(str, row["mesh"]))
    head = f"{row['preset']} {row['step']} mesh={mesh} seq_len={row['seq_len']} attention={row['attention_impl']}:"
    if row["micro_batch"] is None:
        return (f"{head} does not fit in {row['limit_gb']:g} GB at any micro-batch: the smallest "
                f"({row['unit']}) needs {_gb(row['total_gb'])} GB per device (args {_gb(row['args_gb'])}, temp "
                f"{_gb(row['temp_gb'])})")
    at_least = "at least " if row["capped"] else ""
    return (f"{head} micro-batch {at_least}{row['micro_batch']} ({row['tokens']} tokens): {_gb(row['total_gb'])} GB "
            f"per device (args {_gb(row['args_gb'])}, temp {_gb(row['temp_gb'])}, out {_gb(row['out_gb'])}, aliased "
            f"{_gb(row['alias_gb'])}" + (f", resident {_gb(row['resident_gb'])})" if row["resident_gb"] else ")"))


def _gb(x: float) -> str:
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


def print_table(rows):
    cols = ("preset", "step", "mesh", "seq_len", "attention", "micro-batch", "tokens", "args GB", "temp GB", "out GB",
            "total GB", "GB at unit", "compiles")
    lines = []
    for r in rows:
        none = r["micro_batch"] is None
        lines.append((r["preset"], r["step"], "x".join(map(str, r["mesh"])), str(r["seq_len"]), r["attention_impl"],
                      "none" if none else ((">=" if r["capped"] else "") + str(r["micro_batch"])),
                      "-" if none else str(r["tokens"]), *(_gb(r[f"{k}_gb"]) for k in ("args", "temp", "out", "total")),
                      _gb(r["smallest_total_gb"]), str(len(r["probes"]))))
    widths = [max(len(c), *(len(x[i]) for x in lines)) for i, c in enumerate(cols)]
    fmt = lambda vals: "  ".join(v.ljust(w) if i < 5 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths)))
    print(fmt(cols))
    for line in lines:
        print(fmt(line))
    print("per device; micro-batch: rows per update or pass (decode: KV-cache slots per rollout group), the "
          "largest that fits, and its memory; GB at unit: the total at the smallest micro-batch (the data-parallel "
          "size); none: even that does not fit; GB = 1e9 bytes")


# ------------------------------------------------------------------------------------
# Driver.
# ------------------------------------------------------------------------------------


def configs_of(presets) -> dict:
    """{preset: ModelConfig}; unknown presets fail here, before any compile."""
    from configs.models import model_config as preset_config
    from tlt_jax.models.config import from_config_dict

    return {p: from_config_dict(preset_config(p)) for p in presets}


def compile_devices(n_devices: int, backend: str, execute: bool = False) -> list:
    """At least `n_devices` devices of `backend` to compile for; on CPU they are simulated,
    which must be asked for before jax first starts a backend. execute: the programs will run,
    so the backend optimises them as usual."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags and not execute:  # read when jax first starts a backend
        # Nothing here runs, so LLVM need not optimise: buffer assignment, all that is
        # read, comes before it (the same sizes, a third less compile time).
        flags += (f" --xla_force_host_platform_device_count={n_devices} --xla_backend_optimization_level=0"
                  " --xla_llvm_disable_expensive_passes=true")
        os.environ["XLA_FLAGS"] = flags.strip()
    import jax

    devices = jax.devices(backend)
    if len(devices) < n_devices:
        hint = f"; start it with XLA_FLAGS=--xla_force_host_platform_device_count={n_devices}" \
            if backend == "cpu" else ""
        raise ValueError(f"{n_devices} devices wanted but this process has {len(devices)} {backend} "
                         f"devices{hint}.")
    return devices


def resolve_mesh(mesh: tuple[int, int, int], devices: list):
    """(resolved (data, fsdp, tensor), Mesh): a mesh without -1 takes the first prod(mesh)
    devices; one with -1 fills them all."""
    from tlt_jax import sharding

    n = len(devices)
    count = n if -1 in mesh or math.prod(mesh) > n else math.prod(mesh)
    shape = sharding.mesh_shape_from_config(dict(zip(sharding.MESH_AXES, mesh)), count)
    return shape, sharding.make_mesh(dict(zip(sharding.MESH_AXES, shape)), devices[:count])


def _arg_parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--presets", default=",".join(DEFAULT_PRESETS), help="comma list of configs/models.py presets")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    ap.add_argument("--mesh", action="append", default=None,
                    help="DATAxFSDPxTENSOR (repeatable; default 1x1x1: one device)")
    ap.add_argument("--devices", type=int, default=0, help="devices (default: the largest mesh); on CPU simulated")
    ap.add_argument("--backend", default="cpu", help="backend that compiles (cpu: simulated devices; gpu: real ones)")
    ap.add_argument("--seq_lens", default="4096,32768", help="comma list of sequence lengths (decode: KV length)")
    ap.add_argument("--attention_impl", default="auto",
                    help="comma list of the learner's attention impls (auto, dense, blockwise, cudnn): "
                         "dense,auto shows what blockwise attention buys")
    ap.add_argument("--device_memory_gb", type=float, default=141.0, help="memory per device, GB (H200: 141)")
    ap.add_argument("--max_micro_batch", type=int, default=MAX_MICRO_BATCH, help="the search's upper end")
    ap.add_argument("--execute", action="store_true",
                    help="distill only: instead of the search, run one real update at the smallest micro-batch on "
                         "the backend's devices (random weights) and record its compile-time total beside the "
                         "device's measured peak (a GPU's memory_stats; none on the CPU)")
    ap.add_argument("--planned", default="", help="with --execute: a plan JSON of the same case (this script's "
                    "--out); its total at the smallest micro-batch is recorded beside the measured peak")
    ap.add_argument("--out", default=None, help="JSON output path")
    return ap


def main(argv=None):
    run_cli(_arg_parser, run, argv)


def run_cli(arg_parser, run_args, argv=None) -> None:
    """Parses argv and runs; a bad input (ValueError) is one line on stderr and exit status 1."""
    args = arg_parser().parse_args(argv)
    try:
        run_args(args)
    except ValueError as e:
        sys.stderr.write(f"Error: {' '.join(str(e).split())}\n")
        sys.exit(1)


def run(args, cache: dict | None = None) -> list[dict]:
    """Plans every (preset, mesh, step, seq_len) of args; `cache` ((Case, batch) ->
    measure) may carry compiles over from an earlier call. Returns the rows."""
    presets = [p for p in args.presets.split(",") if p]
    steps = [s for s in args.steps.split(",") if s]
    seq_lens = [int(s) for s in args.seq_lens.split(",") if s]
    impls = [i for i in args.attention_impl.split(",") if i]
    meshes = [parse_mesh(m) for m in (args.mesh or ["1x1x1"])]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        raise ValueError(f"Unknown steps {unknown}; steps: {', '.join(STEPS)}.")
    from tlt_jax.models.attention import IMPLS

    if set(impls) - set(IMPLS):
        raise ValueError(f"--attention_impl={args.attention_impl}: choose from {', '.join(IMPLS)}.")
    if any(s < 4 for s in seq_lens):
        raise ValueError(f"--seq_lens={args.seq_lens}: every sequence length must be >= 4.")
    n_devices = _devices_needed(meshes, args.devices)
    configs = configs_of(presets)
    if args.execute and set(steps) != {"distill"}:
        raise ValueError(f"--execute runs the distill step only; pass --steps=distill, not --steps={args.steps}.")
    devices = compile_devices(n_devices, args.backend, args.execute)
    resolved = [resolve_mesh(m, devices[:n_devices]) for m in meshes]
    limit = args.device_memory_gb * GB
    cache = {} if cache is None else cache
    rows, t0 = [], time.perf_counter()
    for seq_len in seq_lens:  # every preset at the first length first: a cut run is still a table
        for preset in presets:
            for shape, mesh in resolved:
                for step in steps:
                    # Only the learner's steps take the attention impl.
                    for impl in impls if step in ATTENTION_STEPS else ["auto"]:
                        case = Case(preset, step, shape, seq_len, impl)
                        if args.execute:
                            from experiments import plan_memory_check

                            row = plan_memory_check.execute_distill(case, configs[preset], mesh, granule(case))
                            row["planned_total_gb"] = plan_memory_check.planned_total(args.planned, row)
                            print(f"[{time.perf_counter() - t0:6.0f}s] {plan_memory_check.describe(row)}", flush=True)
                        else:
                            row = plan_case(case, configs[preset], mesh, limit, cache, args.max_micro_batch)
                            print(f"[{time.perf_counter() - t0:6.0f}s] {describe(row)}", flush=True)
                        rows.append(row)
                        _write(args, rows, t0, final=False)
    rows.sort(key=lambda r: (presets.index(r["preset"]), r["mesh"], steps.index(r["step"]), r["seq_len"],
                             r["attention_impl"]))
    if not args.execute:
        print_table(rows)
    _write(args, rows, t0, final=True)
    return rows


def _write(args, rows, t0, final):
    if not args.out:
        return
    import jax

    from experiments import machine

    machine.write_result(args.out, dict(backend=jax.default_backend(), jax_version=jax.__version__,
                                      python=sys.version.split()[0], device_memory_gb=args.device_memory_gb,
                                      complete=final, wall_s=time.perf_counter() - t0, results=rows), indent=1)
    if final:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
