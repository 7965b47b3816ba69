"""Cluster plan: mesh, KV-cache budget, spot trainer and time per phase of one RL step for
a model on a cluster of GPUs, from compile-time memory and explicit assumptions.

  python -m experiments.plan_cluster --out=docs/results/plan_cluster_64.json
  python -m experiments.plan_cluster --plans=qwen2.5-7b:64x1x1 --prompts=512

One mesh serves the learner and the rollout engine (tlt_jax/rl/train.py builds one from
`config.mesh`): the learner runs on all of it (rows over data x fsdp, weights over fsdp x
tensor), each rollout group is one slice of its data axis, a (1, fsdp, tensor) sub-mesh
that must lie on one process (one node). A plan is therefore DATAxFSDPxTENSOR per preset.

Memory comes from experiments/plan_memory (its steps compiled from abstract shapes on
simulated CPU devices): the learner update with per-layer rematerialisation, the
old-policy pass and a decode chunk at --max_length. Only one data slice is compiled, a
(1, fsdp, tensor) mesh: the data axis replicates weights and optimizer state and splits
rows, so each device of the full mesh holds what a device of the slice holds at the
slice's share of the rows. On this backend the numbers are upper bounds for bf16 models
(plan_memory's docstring: bf16 arrays a loop slices or updates are also held in float32).

Times are derived, each from a printed assumption: rollout by simulating continuous
batching in every group (response lengths drawn from a capped exponential; each decode
step reads the device's weights and the KV cache in use at the measured decode
efficiency of the HBM roofline; a group with fsdp > 1 would also all-gather its weights
every step, which is not modelled), the learner and old-policy pass from FLOPs at an
assumed MFU, the weight sync as a device-local copy at the measured copy bandwidth, and
host data at an assumed per-node network bandwidth. TLT's speculative tail is the
paper's speed-up applied to decode steps with at most its threshold of sequences
running: a paper number, not ours. docs/scaling.md says which figure is which.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import numpy as np

from experiments import plan_memory as pm

GB = pm.GB
DEFAULT_PLANS = "qwen2.5-7b:16x1x4,qwen2.5-32b:8x1x8,llama3.3-70b:8x1x8"

# TLT paper (arXiv 2511.16665), as DESIGN.md sections 1, 5 and 7 quote it: not ours.
PAPER_SPEC_TAIL_SPEEDUP = 2.61  # speculative vs plain tokens/s in the tail, H100
PAPER_SPEC_THRESHOLD = 32  # speculation switches on at <= 32 running requests
PAPER_ROLLOUT_SHARE = 0.85  # rollout's share of step time in their traces
PAPER_END_TO_END = (1.7, 2.1)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device kind and what moves data between them. Sources: see docs/scaling.md."""

    hbm_bytes_s: float = 3.57e12  # H200 HBM (DESIGN.md section 5 anchor)
    peak_flops: float = 634e12  # H200 dense bf16 matmul (DESIGN.md section 5 anchor)
    memory_gb: float = 141.0  # H200
    memory_fraction: float = 0.9  # assumption: what a plan may fill (allocator slack, workspaces)
    decode_efficiency: float = 0.32  # measured: decode at 31-33% of the HBM roofline (benchmarks.md)
    copy_bytes_s: float = 3414e9  # measured: device copy bandwidth (benchmarks.md, rollout decode)
    mfu: float = 0.40  # assumption: learner and old-policy pass at 40% of peak
    node_bytes_s: float = 50e9  # assumption: host data between nodes, per node (400 Gb/s)
    devices_per_node: int = 8


@dataclasses.dataclass(frozen=True)
class Workload:
    """One RL step's rollouts: an assumption, not TLT's reported configuration."""

    prompts: int = 256
    samples: int = 8
    prompt_length: int = 512
    mean_response: int = 4096  # scale of the exponential the response lengths are drawn from
    max_length: int = 16384  # KV positions per sequence, prompt included (RolloutConfig.max_length)
    drafter_top_k: int = 8  # OnlineDrafterConfig.top_k
    # Optimizer updates per RL step (configs/rl.py learner.num_minibatches); with one, the
    # update's own forward gives the old log-probs and the drafter's data: no old-policy pass.
    minibatches: int = 2
    seed: int = 0


# ------------------------------------------------------------------------------------
# Memory: plan_memory's compiles.
# ------------------------------------------------------------------------------------


def slice_mesh(plan: tuple[int, int, int]) -> tuple[int, int, int]:
    """The one data slice that is compiled: (1, fsdp, tensor)."""
    return (1, plan[1], plan[2])


def kv_bytes_per_token(cfg, plan) -> float:
    """Per device, per token of a group's cache: K and V of every layer; kv heads split over
    tensor when it divides them, else replicated (tlt_jax/sharding.py); slots over fsdp."""
    _, fsdp, tensor = plan
    kv_heads = cfg.num_kv_heads // tensor if cfg.num_kv_heads % tensor == 0 else cfg.num_kv_heads
    return 2 * cfg.num_layers * kv_heads * cfg.head_dim * np.dtype(cfg.jnp_dtype).itemsize / fsdp


def plan_memory(preset, cfg, plan, workload: Workload, hw: Hardware, devices, cache: dict,
                cap: int = pm.MAX_MICRO_BATCH) -> dict:
    """The three steps' per-device memory on the compiled slice, and the decode line: bytes
    fixed and per KV-cache slot."""
    shape, mesh = pm.resolve_mesh(slice_mesh(plan), devices)
    limit = hw.memory_gb * hw.memory_fraction * GB
    rows = {}
    for step in ("learner_remat", "old_logp", "decode"):
        rows[step] = pm.plan_case(pm.Case(preset, step, shape, workload.max_length), cfg, mesh, limit, cache,
                                    cap)
    decode = pm.Case(preset, "decode", shape, workload.max_length)
    unit = pm.granule(decode)
    at = [pm.measure_cached(decode, cfg, mesh, b, cache) for b in (unit, 2 * unit)]
    slot_args = (at[1]["args"] - at[0]["args"]) / unit  # the bf16 KV cache and slot state of one slot
    fixed = at[0]["total"] - unit * (at[1]["total"] - at[0]["total"]) / unit
    # A GPU updates the cache in place (donated): a slot costs its arguments' bytes only.
    gpu_slots = min(cap, max(0, int((limit - fixed) // slot_args)))
    return dict(steps=rows, limit_gb=limit / GB, weights_gb=(at[0]["args"] - unit * slot_args) / GB,
                slot_gb=slot_args / GB, kv_slot_gb=kv_bytes_per_token(cfg, plan) * workload.max_length / GB,
                fixed_gb=fixed / GB, slots_cpu=rows["decode"]["micro_batch"] or 0, slots_gpu=gpu_slots)


# ------------------------------------------------------------------------------------
# Time: derived.
# ------------------------------------------------------------------------------------


def forward_flops_per_token(cfg, context: float) -> float:
    """Matmul FLOPs of one token's forward: 2 per weight (the embedding is a lookup) and
    QK^T, PV over `context` positions."""
    return 2 * (cfg.num_params() - cfg.vocab_size * cfg.hidden_size) + \
        4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context


def response_lengths(workload: Workload, rng) -> np.ndarray:
    """Assumption: a long tail, exponential with scale mean_response, capped at the cache."""
    cap = workload.max_length - workload.prompt_length
    return np.clip(rng.exponential(workload.mean_response, workload.prompts * workload.samples), 1, cap).astype(int)


def simulate_group(lengths, slots: int, prompt_length: int, step_s) -> dict:
    """Continuous batching of one group's sequences on `slots` slots, FIFO refill, event by
    event: `step_s(active, kv_tokens)` is one decode step's seconds. Returns plain seconds,
    the part with <= PAPER_SPEC_THRESHOLD running, and seconds with that part sped up by
    the paper's speculative tail."""
    pending, running = list(lengths), []  # running: [remaining, generated]
    plain = tail = 0.0
    while pending or running:
        while pending and len(running) < slots:
            running.append([pending.pop(0), 0])
        k = min(r[0] for r in running)  # steps until the next sequence finishes
        kv = sum(prompt_length + r[1] for r in running) + len(running) * k / 2
        dt = k * step_s(len(running), kv)
        plain += dt
        if len(running) <= PAPER_SPEC_THRESHOLD:
            tail += dt
        running = [[r[0] - k, r[1] + k] for r in running if r[0] > k]
    return dict(plain_s=plain, tail_s=tail, tlt_s=plain - tail + tail / PAPER_SPEC_TAIL_SPEEDUP)


def plan_times(cfg, plan, memory: dict, workload: Workload, hw: Hardware, drafter_bytes: int) -> dict:
    data, fsdp, tensor = plan
    n_devices = data * fsdp * tensor
    weights = memory["weights_gb"] * GB
    kv_token = kv_bytes_per_token(cfg, plan)
    step_s = lambda active, kv_tokens: (weights + kv_tokens * kv_token) / (hw.hbm_bytes_s * hw.decode_efficiency)
    lengths = response_lengths(workload, np.random.default_rng(workload.seed))
    # The engine hands each group whole prompts (their samples together), in order.
    per_prompt = lengths.reshape(workload.prompts, workload.samples)
    shares = np.array_split(np.arange(workload.prompts), data)
    slots = max(1, memory["slots_gpu"])
    groups = [simulate_group(per_prompt[s].reshape(-1).tolist(), slots, workload.prompt_length, step_s)
              for s in shares]
    plain = [g["plain_s"] for g in groups]
    tlt = [g["tlt_s"] for g in groups]
    tokens = float(lengths.sum() + workload.prompt_length * lengths.size)
    context = float(np.mean((workload.prompt_length + lengths) / 2))  # mean causal context, per sample
    fwd_s = tokens * forward_flops_per_token(cfg, context) / (n_devices * hw.peak_flops * hw.mfu)
    # The learner forward's drafter data (final hidden state, top-K ids and log-probs per
    # position) reaches every process's host (rl/loop.py unpack_drafter_data -> to_host).
    drafter_data = tokens * (cfg.hidden_size * np.dtype(cfg.jnp_dtype).itemsize + workload.drafter_top_k * 8)
    return dict(
        slots=min(slots, max(len(s) for s in shares) * workload.samples),  # those a group fills
        mean_response=float(lengths.mean()), max_response=int(lengths.max()), tokens=tokens,
        rollout_s=max(plain), rollout_tlt_s=max(tlt), tail_share=groups[int(np.argmax(plain))]["tail_s"] / max(plain),
        group0_idle_s=max(plain) - plain[0], mean_idle_s=float(np.mean(max(plain) - np.asarray(plain))),
        old_logp_s=fwd_s if workload.minibatches > 1 else 0.0,
        learner_s=4 * fwd_s,  # forward, backward (2x), and the forward again under remat
        weight_sync_s=2 * weights / hw.copy_bytes_s,  # engine.update_params: each device reads and writes its copy
        drafter_publish_s=drafter_bytes / hw.node_bytes_s,
        drafter_data_gb=drafter_data / GB, drafter_data_s=drafter_data / hw.node_bytes_s,
    )


def step_totals(t: dict) -> dict:
    """Plain and TLT step seconds over the modelled phases (reward scoring left out)."""
    rest = t["old_logp_s"] + t["learner_s"] + t["weight_sync_s"]
    plain = t["rollout_s"] + rest
    tlt = t["rollout_tlt_s"] + rest + t["drafter_data_s"] + t["drafter_publish_s"]
    return dict(step_s=plain, step_tlt_s=tlt, rollout_share=t["rollout_s"] / plain, speedup=plain / tlt)


# ------------------------------------------------------------------------------------
# Driver.
# ------------------------------------------------------------------------------------


def parse_plans(text: str) -> list[tuple[str, tuple[int, int, int]]]:
    """'qwen2.5-7b:16x1x4,...' -> [(preset, (data, fsdp, tensor))], every axis given."""
    plans = []
    for item in filter(None, text.split(",")):
        preset, _, mesh = item.partition(":")
        shape = pm.parse_mesh(mesh) if mesh else ()
        if -1 in shape or not shape:
            raise ValueError(f"--plans item {item!r}: expected PRESET:DATAxFSDPxTENSOR with every size given.")
        plans.append((preset, shape))
    return plans


def check_plan(preset, plan, hw: Hardware) -> None:
    data, fsdp, tensor = plan
    if fsdp * tensor > hw.devices_per_node or hw.devices_per_node % (fsdp * tensor):
        raise ValueError(f"{preset}: a rollout group of fsdp x tensor = {fsdp * tensor} devices must lie on one node "
                         f"of {hw.devices_per_node} (RolloutEngine: one process drives each group).")


def _drafter_bytes(cfg) -> int:
    import jax

    from tlt_jax.models import drafter as drafter_lib

    shapes = jax.eval_shape(lambda: drafter_lib.init_drafter(cfg, drafter_lib.DrafterConfig(), jax.random.PRNGKey(0)))
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))


def run(args, cache: dict | None = None) -> list[dict]:
    """Plans every preset of args.plans; `cache` ((Case, batch) -> measure) may carry
    compiles over from an earlier call. Returns the rows."""
    hw = Hardware(hbm_bytes_s=args.hbm_tb_s * 1e12, peak_flops=args.peak_tflops * 1e12, memory_gb=args.memory_gb,
                  memory_fraction=args.memory_fraction, decode_efficiency=args.decode_efficiency,
                  copy_bytes_s=args.copy_gb_s * 1e9, mfu=args.mfu, node_bytes_s=args.node_gb_s * 1e9,
                  devices_per_node=args.devices_per_node)
    workload = Workload(prompts=args.prompts, samples=args.samples, prompt_length=args.prompt_length,
                        mean_response=args.mean_response, max_length=args.max_length,
                        minibatches=args.minibatches)
    if workload.prompt_length >= workload.max_length:
        raise ValueError(f"--prompt_length={workload.prompt_length} leaves no room in --max_length="
                         f"{workload.max_length}.")
    plans = parse_plans(args.plans)
    configs = pm.configs_of([p for p, _ in plans])
    for preset, plan in plans:
        check_plan(preset, plan, hw)
        if plan[0] > workload.prompts:
            raise ValueError(f"{preset}: {plan[0]} rollout groups but only {workload.prompts} prompts per step.")
    devices = pm.compile_devices(max(math.prod(slice_mesh(p)) for _, p in plans), args.backend)
    cache = {} if cache is None else cache
    rows, t0 = [], time.perf_counter()
    for preset, plan in plans:
        cfg = configs[preset]
        memory = plan_memory(preset, cfg, plan, workload, hw, devices, cache, args.max_micro_batch)
        times = plan_times(cfg, plan, memory, workload, hw, _drafter_bytes(cfg))
        row = dict(preset=preset, plan=plan, devices=math.prod(plan), params=cfg.num_params(), memory=memory,
                   times=times, totals=step_totals(times))
        rows.append(row)
        print(f"[{time.perf_counter() - t0:6.0f}s] {preset} {'x'.join(map(str, plan))} planned", flush=True)
    print_report(rows, hw, workload)
    if args.out:
        import jax

        from experiments import machine  # imports jax: only here, as the rest of this module does

        machine.write_result(args.out, dict(backend=args.backend, jax_version=jax.__version__,
                                          hardware=dataclasses.asdict(hw), workload=dataclasses.asdict(workload),
                                          paper=dict(spec_tail_speedup=PAPER_SPEC_TAIL_SPEEDUP,
                                                     spec_threshold=PAPER_SPEC_THRESHOLD,
                                                     rollout_share=PAPER_ROLLOUT_SHARE,
                                                     end_to_end=PAPER_END_TO_END),
                                          results=rows), indent=1)
        print(f"wrote {args.out}")
    return rows


def _table(cols, lines):
    widths = [max(len(c), *(len(x[i]) for x in lines)) for i, c in enumerate(cols)]
    fmt = lambda vals: "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths)))
    print(fmt(cols))
    for line in lines:
        print(fmt(line))


def _fit(step_row) -> str:
    b = step_row["micro_batch"]
    return "none" if b is None else (">=" if step_row["capped"] else "") + str(b)


def print_report(rows, hw: Hardware, workload: Workload):
    mesh = lambda p: "x".join(map(str, p))
    print(f"\nMemory per device (plan_memory, CPU compile of one data slice; limit "
          f"{hw.memory_gb * hw.memory_fraction:.0f} GB = {hw.memory_fraction:g} x {hw.memory_gb:g} GB)")
    lines = []
    for r in rows:
        m, s = r["memory"], r["memory"]["steps"]
        data, fsdp, tensor = r["plan"]
        lines.append((r["preset"], f"{r['params'] / 1e9:.2f}B", mesh(r["plan"]), f"{data}x({fsdp}x{tensor})",
                      f"{fsdp}x{tensor}", str(data),
                      f"{s['learner_remat']['smallest_total_gb']:.1f}", _fit(s["learner_remat"]),
                      f"{s['old_logp']['smallest_total_gb']:.1f}", _fit(s["old_logp"]),
                      f"{m['weights_gb']:.1f}", f"{m['slot_gb']:.2f}", f"{m['fixed_gb']:.1f}",
                      _fit(s["decode"]), str(m["slots_gpu"]),
                      f"{m['slots_gpu'] * m['slot_gb']:.0f}"))
    _table(("preset", "params", "mesh DxFxT", "learner", "group", "groups", "learner GB@1", "rows fit",
            "old-logp GB@1", "rows fit", "weights GB", "GB/slot", "decode fixed GB", "slots CPU", "slots GPU",
            "KV GB/dev"), lines)
    print(f"learner: data x (fsdp x tensor); GB@1: one row of {workload.max_length} tokens per data slice "
          f"(remat update; old-policy pass); rows fit: rows per slice within the limit on the CPU compile (an "
          f"upper bound of memory for bf16); group: a rollout group's fsdp x tensor; weights, GB/slot: a decode "
          f"device's bytes, from the compiles (GB/slot = KV cache of {workload.max_length} positions + slot state); "
          f"slots GPU: derived, the KV cache updated in place as a GPU holds it; KV GB/dev: its budget")

    print(f"\nTime per RL step, seconds (derived; {workload.prompts} prompts x {workload.samples} samples, responses "
          f"~ capped exponential, scale {workload.mean_response}, cap {workload.max_length - workload.prompt_length})")
    lines = []
    for r in rows:
        t, tot = r["times"], r["totals"]
        lines.append((r["preset"], str(t["slots"]), f"{t['mean_response']:.0f}", f"{t['rollout_s']:.1f}",
                      f"{t['tail_share']:.0%}", f"{t['rollout_tlt_s']:.1f}", f"{t['old_logp_s']:.1f}",
                      f"{t['learner_s']:.1f}", f"{t['weight_sync_s']:.3f}", f"{t['drafter_data_gb']:.0f}",
                      f"{t['drafter_data_s']:.1f}", f"{t['mean_idle_s']:.1f}", f"{tot['step_s']:.1f}",
                      f"{tot['rollout_share']:.0%}", f"{tot['step_tlt_s']:.1f}", f"{tot['speedup']:.2f}"))
    _table(("preset", "slots", "mean len", "rollout", "tail", "rollout TLT", "old-logp", "learner", "sync",
            "drafter data GB", "its s", "drafter window", "step", "rollout %", "step TLT", "x"), lines)
    print(f"rollout: the slowest group (continuous batching; decode step = (weights + KV in use) / "
          f"({hw.hbm_bytes_s / 1e12:g} TB/s x {hw.decode_efficiency:g})); tail: its time with <= "
          f"{PAPER_SPEC_THRESHOLD} running; rollout TLT: that tail {PAPER_SPEC_TAIL_SPEEDUP}x faster (paper); "
          f"old-logp, learner: FLOPs at {hw.mfu:.0%} of {hw.peak_flops / 1e12:g} TFLOP/s (learner 4 forwards: remat); "
          f"sync: device-local copy of the weights at {hw.copy_bytes_s / 1e9:g} GB/s; drafter data: to every host at "
          f"{hw.node_bytes_s / 1e9:g} GB/s per node; drafter window: a group's mean idle time while "
          f"the slowest decodes (the spot trainer's, on process 0's groups); "
          f"step: rollout + old-logp + learner + sync (no reward scoring); x: plain step / TLT step "
          f"(paper: {PAPER_END_TO_END[0]}-{PAPER_END_TO_END[1]}x, rollout ~{PAPER_ROLLOUT_SHARE:.0%} of the step)")


def _arg_parser():
    hw, wl = Hardware(), Workload()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--plans", default=DEFAULT_PLANS, help="comma list of PRESET:DATAxFSDPxTENSOR")
    ap.add_argument("--backend", default="cpu", help="backend that compiles (plan_memory's --backend)")
    ap.add_argument("--devices_per_node", type=int, default=hw.devices_per_node)
    ap.add_argument("--memory_gb", type=float, default=hw.memory_gb, help="memory per device, GB")
    ap.add_argument("--memory_fraction", type=float, default=hw.memory_fraction, help="share a plan may fill")
    ap.add_argument("--hbm_tb_s", type=float, default=hw.hbm_bytes_s / 1e12)
    ap.add_argument("--peak_tflops", type=float, default=hw.peak_flops / 1e12)
    ap.add_argument("--decode_efficiency", type=float, default=hw.decode_efficiency,
                    help="decode step time as a share of the HBM roofline")
    ap.add_argument("--copy_gb_s", type=float, default=hw.copy_bytes_s / 1e9, help="device copy bandwidth")
    ap.add_argument("--mfu", type=float, default=hw.mfu, help="learner and old-policy pass, share of peak")
    ap.add_argument("--node_gb_s", type=float, default=hw.node_bytes_s / 1e9, help="host data between nodes")
    ap.add_argument("--prompts", type=int, default=wl.prompts, help="prompts per RL step")
    ap.add_argument("--samples", type=int, default=wl.samples, help="samples per prompt")
    ap.add_argument("--prompt_length", type=int, default=wl.prompt_length)
    ap.add_argument("--mean_response", type=int, default=wl.mean_response, help="scale of the response lengths")
    ap.add_argument("--max_length", type=int, default=wl.max_length,
                    help="KV positions per sequence, prompt included; also the learner's row length")
    ap.add_argument("--minibatches", type=int, default=wl.minibatches,
                    help="optimizer updates per RL step; 1: no old-policy pass (the update's forward gives it)")
    ap.add_argument("--max_micro_batch", type=int, default=pm.MAX_MICRO_BATCH,
                    help="the memory search's upper end (rows, slots)")
    ap.add_argument("--out", default=None, help="JSON output path")
    return ap


def main(argv=None):
    pm.run_cli(_arg_parser, run, argv)


if __name__ == "__main__":
    main()
