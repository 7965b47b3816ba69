"""One real update of a planned case on the device, its measured peak beside the plan:
`python -m experiments.plan_memory ... --execute` (the distill step only).

  python -m experiments.plan_memory --backend=gpu --presets=llama3.2-3b --steps=distill --seq_lens=32768 \
      --execute --planned=docs/results/plan_distill_llama3.2-3b_32k_h200.json --out=/tmp/distill_32k.json

`plan_memory` plans from XLA's compile-time buffer assignment; this runs the same program once
with real arrays (random student weights, a synthetic top-K cache row) and reads the device's
peak (`memory_stats`), which adds the allocator's slack and the libraries' workspaces, to check
the plan against what the device holds. experiments/device_check.sh's distill32k block runs it
on the GPU.
"""
from __future__ import annotations

import dataclasses
import json
import time

from experiments.plan_memory import GB, Case, _abstract_params, _distill_trainer, _gb, distill_rows


def _concrete(shape, dtype, vocab: int):
    """A real array of a `distill_rows` field: positions 0.., one segment, every target on, K
    distinct ids per position (a top-K's are), the teacher's mass 0.9 spread over them."""
    import jax.numpy as jnp
    import numpy as np

    if dtype == jnp.bool_:
        return np.ones(shape, bool)
    if len(shape) == 3:
        k = shape[-1]
        if dtype == jnp.int32:
            return np.broadcast_to((np.arange(shape[1])[:, None] * 7 + np.arange(k)) % vocab, shape).astype(np.int32)
        return np.full(shape, np.log(0.9 / k), jnp.bfloat16)
    return np.broadcast_to(np.arange(shape[1]) % vocab, shape).astype(np.int32)


def execute_distill(case: Case, model_config, mesh, batch: int) -> dict:
    """One real `distill` update at `batch` rows on the mesh's devices, random student weights:
    the compiled executable's buffer assignment (what `measure` reads) beside the device's
    measured peak (`memory_stats`' peak_bytes_in_use: None on a backend without it, the CPU),
    and the seconds to compile and to run it."""
    import jax

    from tlt_jax.models import transformer as tfm

    if case.step != "distill":
        raise ValueError(f"--execute runs the distill step only, not {case.step!r}; pass --steps=distill.")
    trainer = _distill_trainer(model_config, mesh)
    abstract = _abstract_params(model_config)
    params = jax.jit(lambda: tfm.init_params(model_config, jax.random.PRNGKey(0)),
                     out_shardings=tfm.param_shardings(model_config, abstract, mesh))()
    state = trainer.init_state(params)
    del params
    rows = distill_rows(batch, case.seq_len, trainer.top_k,
                        lambda shape, dtype: _concrete(shape, dtype, model_config.vocab_size))
    rows = jax.device_put(rows, trainer._batch_shardings(rows))
    t0 = time.perf_counter()
    compiled = trainer.step_fn(state.params, rows).lower(state, rows).compile()
    mem, compile_s = compiled.memory_analysis(), time.perf_counter() - t0
    t0 = time.perf_counter()
    state, out = compiled(state, rows)
    loss = float(jax.device_get(out["loss"]))
    run_s = time.perf_counter() - t0
    stats = mesh.devices.flat[0].memory_stats() or {}
    planned = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
               - mem.alias_size_in_bytes)
    peak = stats.get("peak_bytes_in_use")
    return dict(dataclasses.asdict(case), micro_batch=batch, tokens=batch * case.seq_len, loss=loss,
                args_gb=mem.argument_size_in_bytes / GB, out_gb=mem.output_size_in_bytes / GB,
                temp_gb=mem.temp_size_in_bytes / GB, alias_gb=mem.alias_size_in_bytes / GB, total_gb=planned / GB,
                measured_peak_gb=None if peak is None else peak / GB,
                measured_over_planned=None if peak is None else peak / planned, compile_s=compile_s, run_s=run_s,
                device=str(mesh.devices.flat[0].device_kind))


def planned_total(path: str, row: dict) -> float | None:
    """The total at the smallest micro-batch that the plan JSON at `path` gives for `row`'s case
    (None without a path); a plan without that case is refused by name."""
    if not path:
        return None
    with open(path) as f:
        plan = json.load(f)
    key = lambda r: (r["preset"], r["step"], tuple(r["mesh"]), r["seq_len"])
    found = [r for r in plan["results"] if key(r) == key(row)]
    if not found:
        raise ValueError(f"--planned={path} has no row for {key(row)}; plan that case first (--out=).")
    return found[0]["smallest_total_gb"]


def describe(row: dict) -> str:
    """One line for an executed case: the compile-time total beside the measured peak."""
    planned = "" if row.get("planned_total_gb") is None else f", planned {_gb(row['planned_total_gb'])} GB"
    measured = ("n/a (no device memory stats on this backend)" if row["measured_peak_gb"] is None else
                f"{_gb(row['measured_peak_gb'])} GB ({row['measured_over_planned']:.2f}x the compile-time total)")
    return (f"{row['preset']} {row['step']} seq_len={row['seq_len']} micro-batch {row['micro_batch']} on "
            f"{row['device']}: compile-time total {_gb(row['total_gb'])} GB (args {_gb(row['args_gb'])}, temp "
            f"{_gb(row['temp_gb'])}){planned}; measured peak {measured}; loss {row['loss']:.3f}, compile "
            f"{row['compile_s']:.0f} s, step {row['run_s']:.1f} s")


