"""Benchmark of the fused LM-head losses (tlt_jax.losses) against the project's anchors.

  python -m experiments.bench_kl --preset=cpu --out=/tmp/bench_kl.json
  python -m experiments.bench_kl --preset=gpu --out=$OUT/bench_kl.json --time_budget_s=210
  python -m experiments.bench_kl --memory_only --out=/tmp/bench_kl_memory.json
  python -m experiments.bench_kl --preset=cpu --only=chunked_xla,dense,anchor_dense --table=tlt_jax/impl_table.json

--table=PATH: after the run, the fastest candidate per (dtype, N x V shape class) goes into the
impl table at PATH (`tlt_jax.impl_table`, what impl="auto" reads), beside the candidates'
geometric-mean times over the cases all of them ran. Candidates are the fused engines this
backend runs natively: chunked_xla, and pallas on a GPU (on a CPU it is an interpreter; dense
materialises [N, V] logits, and is recorded as reference_ms, never chosen). --ns=8192,32768
keeps only those token counts (the table's run in device_check.sh: pallas beside chunked_xla
at the same N).

--memory_only: no run and no allocation. Every implementation is compiled at the GPU
shapes from jax.ShapeDtypeStruct arguments on whatever backend runs it (top-K KL at
D=3072, V=128256, K=100 and N = 8k..256k; per-token log-probs at D=1536, V=151936 and
N = 8k..512k; scalar and per-token cotangents; bf16 and f32 h and w), and XLA's
compiled temp / argument / output sizes are printed beside the H200 numbers recorded in
docs/results/bench_kl_h200_*.json (peak, peak above the floor, and that run's own XLA
temp). "chunked_xla" uses this backend's default blocks; "chunked_xla[blocks=gpu]"
compiles the GPU's default blocks here (the same program the H200 rows ran, though
buffer assignment is the backend's own). Bars (DESIGN.md section 5): temp <= 2.0 GiB
with bf16 w (the f32 dW accumulator included), <= 0.75 GiB with f32 w.

Per case (one fresh subprocess each, so peak memory is the case's own): forward +
backward wrt h and w under jit (compiled from abstract shapes before the inputs are
allocated), median time of `repeats` runs after a warm-up, peak
device memory (`memory_stats()['peak_bytes_in_use']`; None on CPU), and XLA's compiled
temp size (`memory_analysis().temp_size_in_bytes`, every backend). "Above floor" is peak
minus the floor (inputs plus gradient outputs). Bars (DESIGN.md section 5): XLA temp
<= 2.0 GiB (bf16), device peak <= 7 GiB at 256k tokens, throughput. Throughput ratios
are t(anchor) / t(case) at the same N: x_dense against anchor_dense (for logprob rows:
dense_log_softmax), x_naive against anchor_naive_chunked; per-token rows are compared
with the anchors' scalar-loss times.

Modes: "mean" = scalar loss (one cotangent; gradients in the loss pass), "token" =
per-token loss contracted with a random cotangent (the backward recomputes).
Implementations: anchor_dense / anchor_naive_chunked (../shared/anchors/kl_anchor.py,
copied below), dense / chunked_xla / pallas (tlt_jax.losses; options in brackets,
e.g. chunked_xla[tokens=2048,dw_accum=param]), dense_log_softmax (logprob baseline).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

GIB = 2**30

# ------------------------------------------------------------------------------------
# The project's anchors, copied verbatim from ../shared/anchors/kl_anchor.py (the
# "before this project" baselines that belong in this table).
# ------------------------------------------------------------------------------------


def dense_kl(h, w, t_idx, t_logp):
    import jax
    import jax.numpy as jnp

    logits = (h @ w).astype(jnp.float32)  # [N, V]
    logz = jax.nn.logsumexp(logits, axis=-1)  # [N]
    s_logp = jnp.take_along_axis(logits, t_idx, axis=-1) - logz[:, None]
    p = jnp.exp(t_logp)
    return jnp.sum(p * (t_logp - s_logp)) / h.shape[0]


def chunked_kl(h, w, t_idx, t_logp, chunk=4096):
    import jax
    import jax.numpy as jnp

    n = h.shape[0]

    @jax.checkpoint
    def one(args):
        hc, ic, lc = args
        return dense_kl(hc, w, ic, lc) * hc.shape[0]

    hs = h.reshape(n // chunk, chunk, -1)
    ids = t_idx.reshape(n // chunk, chunk, -1)
    lps = t_logp.reshape(n // chunk, chunk, -1)
    return jnp.sum(jax.lax.map(one, (hs, ids, lps))) / n


# ------------------------------------------------------------------------------------
# Presets: shapes, case list in priority order (a time budget cuts from the end).
# ------------------------------------------------------------------------------------

PRESETS = {
    "gpu": dict(
        d=3072,
        v=128256,
        k=100,
        ns=(8192, 32768, 65536, 262144),
        naive_chunk=4096,
        repeats=3,
        case_timeout_s=90,
        device_mem_gib=139.0,
        check_n=2048,
        memory_variants=(("chunked_xla[dw_accum=param]", (32768, 262144)),),
        pallas_ns=(8192, 32768),
        logprob_ns=(32768,),
        dense_ns=(8192,),
        speed_variants=(
            ("chunked_xla[tokens=2048]", (32768,)),
            ("chunked_xla[tokens=512,dw_accum=param]", (32768,)),
            ("chunked_xla[vocab=16032]", (32768,)),
        ),
    ),
    "cpu": dict(
        d=256,
        v=8192,
        k=100,
        ns=(1024, 4096),
        naive_chunk=512,
        repeats=3,
        case_timeout_s=120,
        device_mem_gib=64.0,
        check_n=512,
        memory_variants=(("chunked_xla[dw_accum=param]", (4096,)),),
        pallas_ns=(1024,),
        logprob_ns=(1024,),
        dense_ns=(1024,),
        speed_variants=(),
    ),
}
DENSE_LIKE = ("anchor_dense", "dense", "dense_log_softmax")


def _cases(preset: str):
    """Cases in priority order: a --time_budget_s cut drops the tail of this list."""
    p = PRESETS[preset]
    cases = []

    def add(kind, impl, mode, n_values):
        cases.extend(dict(kind=kind, impl=impl, mode=mode, n=n) for n in n_values)

    # Cross-implementation agreement on this backend first: a failing kernel shows early.
    add("check", "dense,chunked_xla,pallas", "both", (p["check_n"],))
    add("kl", "anchor_dense", "mean", p["ns"])
    add("kl", "anchor_naive_chunked", "mean", p["ns"])
    add("kl", "chunked_xla", "mean", p["ns"])
    add("kl", "chunked_xla", "token", p["ns"])
    for impl, ns in p["memory_variants"]:
        add("kl", impl, "mean", ns)
    for mode in ("mean", "token"):
        add("kl", "pallas", mode, p["pallas_ns"])
    for impl in ("dense_log_softmax", "chunked_xla", "pallas"):
        add("logprob", impl, "token", p["logprob_ns"])
    for mode in ("mean", "token"):
        add("kl", "dense", mode, p["dense_ns"])
    for impl, ns in p["speed_variants"]:
        add("kl", impl, "mean", ns)
    for c in cases:
        c.update(
            d=p["d"], v=p["v"], k=p["k"], naive_chunk=p["naive_chunk"], repeats=2 if c["n"] >= 262144 else p["repeats"]
        )
    return cases


def parse_impl(impl: str):
    """'chunked_xla[tokens=2048,dw_accum=param]' -> ('chunked_xla', {'tokens': 2048, ...})."""
    if "[" not in impl:
        return impl, {}
    base, opts = impl[:-1].split("[", 1)
    parsed = {}
    for item in opts.split(","):
        key, val = item.split("=")
        parsed[key] = int(val) if val.isdigit() else val
    return base, parsed


# ------------------------------------------------------------------------------------
# One case, in this process.
# ------------------------------------------------------------------------------------


def _inputs(case):
    """h, w (bf16, as the anchor), ids, teacher logp, cotangent; generated in row chunks
    so that generation temporaries stay far below any case's own peak."""
    import jax
    import jax.numpy as jnp

    n, d, v, k = case["n"], case["d"], case["v"], case["k"]
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.PRNGKey(0), 5)

    def normal(key, shape, scale, chunk):
        rows = math.gcd(shape[0], chunk)
        keys = jax.random.split(key, shape[0] // rows)
        gen = lambda kk: (jax.random.normal(kk, (rows,) + shape[1:], jnp.float32) * scale).astype(jnp.bfloat16)
        return jax.jit(lambda ks: jax.lax.map(gen, ks).reshape(shape))(keys)

    h = normal(k1, (n, d), 1.0, 1024)
    w = normal(k2, (d, v), 1.0 / d**0.5, 64)
    if case["kind"] == "check":  # distinct ids, as a teacher top-K (gradients need it)
        ids = jax.jit(jax.vmap(lambda kk: jax.random.choice(kk, v, (k,), replace=False)))(jax.random.split(k3, n))
    else:  # the anchor's workload (a few rows repeat an id; timing does not care)
        ids = jax.jit(lambda kk: jax.random.randint(kk, (n, k), 0, v))(k3)
    logp = jax.jit(lambda kk: jax.nn.log_softmax(jax.random.normal(kk, (n, k)), -1) - 0.1)(k4)
    cot = jax.random.normal(k5, (n,), jnp.float32)
    return h, w, ids, logp, cot


def _objective(case, blocks=None):
    import jax
    import jax.numpy as jnp

    from tlt_jax import losses

    impl, opts = parse_impl(case["impl"])
    blocks = blocks or opts or None
    if case["kind"] == "logprob":
        if impl == "dense_log_softmax":  # what a JAX user writes today

            def f(h, w, ids, logp, cot):
                logq = jax.nn.log_softmax((h @ w).astype(jnp.float32), axis=-1)
                return jnp.sum(jnp.take_along_axis(logq, ids[:, :1], axis=-1)[:, 0] * cot)

            return f
        return lambda h, w, ids, logp, cot: jnp.sum(
            losses.linear_logprob(h, w, ids[:, 0], impl=impl, block_sizes=blocks) * cot
        )
    if impl == "anchor_dense":
        return lambda h, w, ids, logp, cot: dense_kl(h, w, ids, logp)
    if impl == "anchor_naive_chunked":
        return lambda h, w, ids, logp, cot: chunked_kl(h, w, ids, logp, chunk=case["naive_chunk"])
    if case["mode"] == "mean":
        return lambda h, w, ids, logp, cot: losses.linear_topk_kl(
            h, w, ids, logp, reduction="mean", impl=impl, block_sizes=blocks
        )
    return lambda h, w, ids, logp, cot: jnp.sum(
        losses.linear_topk_kl(h, w, ids, logp, reduction="none", impl=impl, block_sizes=blocks) * cot
    )


def run_check(case):
    """Relative error of each impl's loss, dh, dw against impl="dense" (bf16 inputs,
    tail=True, scalar "mean" and a random per-token cotangent), on this backend."""
    import jax
    import jax.numpy as jnp

    from tlt_jax import losses

    h, w, ids, logp, cot = _inputs(case)
    rel = lambda a, b: float(
        jnp.linalg.norm((a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.linalg.norm(b.astype(jnp.float32))
    )
    errors = {}
    for mode in ("mean", "token"):
        ref = None
        for impl in case["impl"].split(","):

            def objective(h, w, impl=impl, mode=mode):
                loss = losses.linear_topk_kl(
                    h, w, ids, logp, tail=True, impl=impl, reduction="mean" if mode == "mean" else "none"
                )
                return loss if mode == "mean" else jnp.sum(loss * cot)

            try:
                got = jax.jit(jax.value_and_grad(objective, argnums=(0, 1)))(h, w)
                jax.block_until_ready(got)
            except Exception as e:  # noqa: BLE001 -- recorded, the other impls still run
                errors[f"{impl}/{mode}"] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            if ref is None:
                ref = got
                continue
            errors[f"{impl}/{mode}"] = dict(
                loss=abs(float(got[0]) - float(ref[0])) / abs(float(ref[0])),
                dh=rel(got[1][0], ref[1][0]),
                dw=rel(got[1][1], ref[1][1]),
            )
    failed = any(isinstance(e, str) for e in errors.values())
    return dict(
        case,
        status="error" if failed else "ok",
        errors=errors,
        note="; ".join(
            f"{k}: " + (e[:120] if isinstance(e, str) else " ".join(f"{n}={v:.1e}" for n, v in e.items()))
            for k, e in errors.items()
        ),
    )


def run_case(case):
    import jax
    import jax.numpy as jnp
    import numpy as np

    if case["kind"] == "check":
        return run_check(case)
    dev = jax.devices()[0]
    # Compiled before the inputs exist, so that compile-time scratch (e.g. GEMM
    # autotuning buffers) does not stack on top of them in the peak.
    fn = jax.jit(jax.value_and_grad(_objective(case), argnums=(0, 1)))
    t0 = time.perf_counter()
    compiled = fn.lower(*jax.eval_shape(lambda: _inputs(case))).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()

    args = _inputs(case)
    jax.block_until_ready(args)
    floor = sum(a.nbytes for a in args) + args[0].nbytes + args[1].nbytes + 4  # + dh, dw, loss
    stats0 = dev.memory_stats() or {}
    temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None

    out = compiled(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(case["repeats"]):
        t0 = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    stats = dev.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    n, d, v = case["n"], case["d"], case["v"]
    med = float(np.median(times))
    return dict(
        case,
        status="ok",
        device=dev.device_kind,
        ms=med * 1e3,
        times_ms=[t * 1e3 for t in times],
        compile_s=compile_s,
        loss=float(out[0]),
        grad_finite=all(bool(jnp.isfinite(g).all()) for g in out[1]),
        peak_gib=None if peak is None else peak / GIB,
        floor_gib=floor / GIB,
        above_floor_gib=None if peak is None else (peak - floor) / GIB,
        in_use_before_gib=stats0.get("bytes_in_use", 0) / GIB if stats0 else None,
        xla_temp_gib=None if temp is None else temp / GIB,
        tflops_3proj=6 * n * d * v / med / 1e12,
    )


# ------------------------------------------------------------------------------------
# --memory_only: compile-time memory at the GPU shapes, no allocation.
# ------------------------------------------------------------------------------------

MEMORY_SHAPES = {
    "kl": dict(d=3072, v=128256, k=100, ns=(8192, 32768, 65536, 262144)),
    "logprob": dict(d=1536, v=151936, k=1, ns=(8192, 65536, 262144, 524288)),
}
MEMORY_IMPLS = {
    "kl": ("anchor_dense", "anchor_naive_chunked", "dense", "chunked_xla", "chunked_xla[blocks=gpu]", "pallas"),
    "logprob": ("dense_log_softmax", "dense", "chunked_xla", "chunked_xla[blocks=gpu]", "pallas"),
}
# XLA temp bars of DESIGN.md section 5 for the fused engines, by w dtype.
TEMP_BAR_GIB = {"bfloat16": 2.0, "float32": 0.75}
PEAK_BAR_256K_GIB = 7.0  # device peak at 256k tokens, bf16
H200_RESULTS = "docs/results/bench_kl_h200_*.json"


def _memory_cases(only=None):
    cases = []
    for kind, shape in MEMORY_SHAPES.items():
        for impl in MEMORY_IMPLS[kind]:
            if only and impl not in only:
                continue
            anchor = impl.startswith("anchor")
            for mode in ("mean",) if anchor else ("mean", "token") if kind == "kl" else ("token",):
                for dtype in ("bfloat16",) if anchor else ("bfloat16", "float32"):
                    for n in shape["ns"]:
                        cases.append(
                            dict(kind=kind, impl=impl, mode=mode, n=n, dtype=dtype, naive_chunk=4096,
                                 **{k: shape[k] for k in ("d", "v", "k")})
                        )
    return cases


def _resolved_blocks(case):
    """(BlockSizes passed to tlt_jax.losses or None, the blocks the engine resolves)."""
    from pallas_kernels import fused_linear_kl as fk

    impl, opts = parse_impl(case["impl"])
    if impl not in fk.ENGINES:
        return opts or None, None
    if opts.get("blocks") == "gpu":
        blocks = fk.resolve_block_sizes(impl, None, case["n"], case["d"], case["v"], backend="gpu")
    else:
        blocks = fk.BlockSizes(**opts)
    return blocks, fk.resolve_block_sizes(impl, blocks, case["n"], case["d"], case["v"])


def memory_case(case):
    """Compiles forward + backward wrt h and w from abstract arguments; XLA's sizes in GiB."""
    import jax
    import jax.numpy as jnp

    n, d, v, k = case["n"], case["d"], case["v"], case["k"]
    dtype = jnp.dtype(case["dtype"])
    args = (
        jax.ShapeDtypeStruct((n, d), dtype),
        jax.ShapeDtypeStruct((d, v), dtype),
        jax.ShapeDtypeStruct((n, k), jnp.int32),
        jax.ShapeDtypeStruct((n, k), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    )
    blocks, resolved = _resolved_blocks(case)
    t0 = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(_objective(case, blocks), argnums=(0, 1))).lower(*args).compile()
    mem = compiled.memory_analysis()
    gib = lambda name: getattr(mem, name) / GIB
    out = dict(
        case,
        status="ok",
        backend=jax.default_backend(),
        compile_s=time.perf_counter() - t0,
        temp_gib=gib("temp_size_in_bytes"),
        arg_gib=gib("argument_size_in_bytes"),
        out_gib=gib("output_size_in_bytes"),
        alias_gib=gib("alias_size_in_bytes"),
    )
    if resolved is not None:
        out["blocks"] = dict(tokens=resolved.tokens, vocab=resolved.vocab, dw_accum=resolved.dw_accum)
        out["temp_bar_gib"] = TEMP_BAR_GIB[case["dtype"]]
        if parse_impl(case["impl"])[0] == "chunked_xla" and dtype.itemsize == 2 and out["backend"] == "cpu":
            # The CPU slices 16-bit h as its bit pattern: a copy of h, a parameter here (an h
            # computed inside a step is written in that form by its producer: no copy).
            out["cpu_h_copy_gib"] = n * d * 2 / GIB
    return out


def _h200_rows(pattern):
    """Recorded H200 results by (kind, mode, impl, n): the last ok row of the files."""
    import glob

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = {}
    for path in sorted(glob.glob(os.path.join(root, pattern))):
        with open(path) as f:
            for r in json.load(f)["results"]:
                if r.get("status") == "ok" and r["kind"] != "check":
                    rows[(r["kind"], r["mode"], r["impl"], r["n"])] = r
    return rows


def _h200_key(case, backend):
    """The recorded H200 case that ran the same program: bf16, the GPU's default blocks."""
    impl = case["impl"]
    if impl == "chunked_xla[blocks=gpu]":
        impl = "chunked_xla"
    elif impl == "chunked_xla" and backend != "gpu" or case["dtype"] != "bfloat16":
        return None
    return case["kind"], case["mode"], impl, case["n"]


def print_memory_table(results, backend):
    cols = ("kind", "mode", "impl", "w", "N", "blocks", "temp", "h copy", "args", "out", "bar",
            "H200 peak", "H200 >floor", "H200 temp")
    rows = []
    for r in results:
        ok = r["status"] == "ok"
        bar = ""
        if ok and "temp_bar_gib" in r:
            bar = f"<={r['temp_bar_gib']}:{_mark(r['temp_gib'] <= r['temp_bar_gib'])}"
            copy = r.get("cpu_h_copy_gib")
            if copy and r["temp_gib"] > r["temp_bar_gib"] >= r["temp_gib"] - copy:
                bar += " (ok less h copy)"
        blocks = r.get("blocks")
        h = r.get("h200") or {}
        rows.append((
            r["kind"], r["mode"], r["impl"], "bf16" if r["dtype"] == "bfloat16" else "f32", str(r["n"]),
            "" if not blocks else f"{blocks['tokens']}x{blocks['vocab']}",
            _fmt(r.get("temp_gib"), ".2f") if ok else f"{r['status']}: {r.get('note', '')}"[:60],
            _fmt(r.get("cpu_h_copy_gib"), ".2f"), _fmt(r.get("arg_gib"), ".2f"), _fmt(r.get("out_gib"), ".2f"), bar,
            _fmt(h.get("peak_gib"), ".2f"), _fmt(h.get("above_floor_gib"), ".2f"), _fmt(h.get("xla_temp_gib"), ".2f"),
        ))
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(
        v.rjust(wd) if i >= 4 else v.ljust(wd) for i, (v, wd) in enumerate(zip(vals, widths))
    )
    print(line(cols))
    for row in rows:
        print(line(row))
    print(
        f"GiB; temp/args/out: XLA's compiled sizes on this backend ({backend}); blocks: tokens x vocab "
        "columns per dh/dW update; h copy: the part of temp that is the CPU's 16-bit view of h (a parameter "
        "here; none on a GPU); bar: fused-engine temp bar for the w dtype; H200: the recorded "
        "run at the same case (bf16, GPU default blocks), its peak, peak minus inputs and gradients, "
        "and its own XLA temp"
    )


def run_memory(args):
    import jax

    only = set(args.only.split(",")) if args.only else None
    h200 = _h200_rows(H200_RESULTS)
    start, results = time.perf_counter(), []
    for case in _memory_cases(only):
        try:
            r = memory_case(case)
        except Exception as e:  # noqa: BLE001 -- a failed compile is a result here
            r = dict(case, status="error", note=f"{type(e).__name__}: {e}"[:400])
        key = _h200_key(case, jax.default_backend())
        if key in h200:
            r["h200"] = {k: h200[key].get(k) for k in ("peak_gib", "above_floor_gib", "xla_temp_gib", "ms")}
        results.append(r)
        print(
            f"[{time.perf_counter() - start:6.1f}s] {r['kind']}/{r['mode']} {r['impl']} {r['dtype']} N={r['n']}: "
            f"{r['status']} temp {_fmt(r.get('temp_gib'), '.2f')} GiB {r.get('note', '')}"[:200],
            flush=True,
        )
        _write_memory(args, results, start, final=False)
    print_memory_table(results, jax.default_backend())
    _write_memory(args, results, start, final=True)


def _write_memory(args, results, start, final):
    if args.out:
        _write_json(args.out, dict(mode="memory_only", shapes={k: {f: v for f, v in s.items() if f != "ns"}
                                                               for k, s in MEMORY_SHAPES.items()}),
                    results, start, final)


def _write_json(path, head: dict, results, start, final):
    """The results so far, with provenance; partial results survive an outer kill."""
    import jax  # provenance only; the driver never touches a device

    from experiments import machine

    machine.write_result(path, dict(head, backend=jax.default_backend(), jax_version=jax.__version__,
                                  python=sys.version.split()[0], complete=final, wall_s=time.perf_counter() - start,
                                  results=results), indent=1)
    if final:
        print(f"wrote {path}")


# ------------------------------------------------------------------------------------
# Driver.
# ------------------------------------------------------------------------------------


def _spawn(case, timeout_s):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [sys.executable, "-m", "experiments.bench_kl", "--case", json.dumps(case)]
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
    except subprocess.TimeoutExpired:
        return dict(case, status="timeout", note=f"over {timeout_s:.0f}s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return dict(case, status="error", note=f"rc={proc.returncode}: " + " | ".join(tail)[-400:])


def _skip_reason(case, results, preset):
    p = PRESETS[preset]
    if case["impl"] in DENSE_LIKE:
        need_gib = 6.0 * case["n"] * case["v"] / GIB  # ~6 B per logit: the anchor's 188 GiB @256k
        if need_gib > p["device_mem_gib"]:
            return f"skipped: predicted OOM (~{need_gib:.0f} GiB of logits)"
    base = parse_impl(case["impl"])[0]
    for r in results:
        if r["kind"] == "check" and any(
            name.startswith(base + "/") and isinstance(err, str) for name, err in (r.get("errors") or {}).items()
        ):
            return "skipped: failed the agreement check"
        if not all(r[key] == case[key] for key in ("kind", "impl", "mode")) or r["n"] >= case["n"]:
            continue
        if r["status"] in ("error", "timeout", "oom"):  # a failure at a smaller N skips the larger
            return f"skipped: failed at N={r['n']}"
        if r["status"] == "ok":  # linear extrapolation of (warm-up + repeats) runs
            predicted_s = r["ms"] / 1e3 * case["n"] / r["n"] * (case["repeats"] + 1)
            if predicted_s > p["case_timeout_s"] - 15:
                return f"skipped: predicted {predicted_s:.0f}s of runs"
    return None


def _add_ratios(results):
    def ref_ms(r, impl):
        for o in results:
            if (
                o["impl"] == impl
                and o["n"] == r["n"]
                and o["status"] == "ok"
                and (o["kind"] == r["kind"] or impl.startswith("anchor"))
            ):
                return o["ms"]
        return None

    for r in results:
        if r["status"] != "ok":
            continue
        dense = ref_ms(r, "dense_log_softmax" if r["kind"] == "logprob" else "anchor_dense")
        naive = ref_ms(r, "anchor_naive_chunked")
        r["x_dense"] = None if dense is None else dense / r["ms"]
        r["x_naive"] = None if naive is None else naive / r["ms"]
        ours = not (r["impl"] in DENSE_LIKE or r["impl"].startswith("anchor"))
        if ours and r["kind"] == "kl":
            bar = 0.95 if r["mode"] == "mean" else 0.72
            # bf16 inputs: XLA temp <= 2.0 GiB; on a device, peak <= 7 GiB at 256k tokens.
            temp = r["xla_temp_gib"]
            marks = f"temp:{_mark(None if temp is None else temp <= TEMP_BAR_GIB['bfloat16'])}"
            if r["peak_gib"] is not None and r["n"] >= 262144:
                marks += f" peak:{_mark(r['peak_gib'] <= PEAK_BAR_256K_GIB)}"
            thr_ok = None if r["x_dense"] is None else r["x_dense"] >= bar
            r["bars"] = f"{marks} thr>={bar}:{_mark(thr_ok)}"


def _mark(ok):
    return "?" if ok is None else ("ok" if ok else "MISS")


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_table(results):
    cols = ("kind", "mode", "impl", "N", "ms", "x_dense", "x_naive", "peak", ">floor", "xla_tmp", "loss", "bars / note")
    rows, checks = [], []
    for r in results:
        if r["kind"] == "check":
            checks.append(r)
            continue
        ok = r["status"] == "ok"
        rows.append(
            (
                r["kind"],
                r["mode"],
                r["impl"],
                str(r["n"]),
                _fmt(r.get("ms"), ".1f"),
                _fmt(r.get("x_dense"), ".2f"),
                _fmt(r.get("x_naive"), ".2f"),
                _fmt(r.get("peak_gib"), ".2f"),
                _fmt(r.get("above_floor_gib"), ".2f"),
                _fmt(r.get("xla_temp_gib"), ".2f"),
                _fmt(r.get("loss"), ".5f"),
                r.get("bars", "") if ok else f"{r['status']}: {r.get('note', '')}"[:90],
            )
        )
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(
        v.rjust(wd) if i in range(3, 11) else v.ljust(wd) for i, (v, wd) in enumerate(zip(vals, widths))
    )
    for r in checks:
        print(f"check N={r['n']} (relative error vs dense, bf16, tail=True): {r['status']}")
        for name, err in (r.get("errors") or {}).items():
            print(f"  {name}: " + (err if isinstance(err, str) else " ".join(f"{k}={v:.2e}" for k, v in err.items())))
        if not r.get("errors"):
            print(f"  {r.get('note', '')}")
    print(line(cols))
    for row in rows:
        print(line(row))
    print(
        "memory in GiB; peak: device peak; >floor: peak minus inputs and gradient outputs; "
        "xla_tmp: compiled temp buffers; x_*: throughput vs anchor at the same N"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--only", default=None, help="comma list of impls to keep")
    ap.add_argument(
        "--time_budget_s", type=float, default=None, help="stop launching cases after this many seconds (rest: skipped)"
    )
    ap.add_argument(
        "--memory_only", action="store_true", help="compile at the GPU shapes and report XLA's memory sizes; no runs"
    )
    ap.add_argument("--ns", default=None, help="comma list of token counts N to keep (default: the preset's)")
    ap.add_argument("--table", default=None, help="impl table to write the fastest candidates into")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # child mode
    args = ap.parse_args(argv)

    if args.memory_only:
        run_memory(args)
        return

    if args.case:
        case = json.loads(args.case)
        try:
            result = run_case(case)
        except Exception as e:  # noqa: BLE001 -- OOM and lowering failures are results here
            msg = f"{type(e).__name__}: {e}"
            status = "oom" if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower() else "error"
            result = dict(case, status=status, note=msg[:400])
        print("RESULT " + json.dumps(result), flush=True)
        return

    preset = PRESETS[args.preset]
    cases = _cases(args.preset)
    if args.only:
        keep = set(args.only.split(","))
        cases = [c for c in cases if c["impl"] in keep]
    if args.ns:
        ns = {int(n) for n in args.ns.split(",")}
        cases = [c for c in cases if c["n"] in ns]
    start, results = time.perf_counter(), []
    for case in cases:
        elapsed = time.perf_counter() - start
        reason = _skip_reason(case, results, args.preset)
        if reason is None and args.time_budget_s is not None and elapsed > args.time_budget_s:
            reason = "skipped: time budget"
        if reason is not None:
            results.append(dict(case, status="skipped", note=reason))
        else:
            timeout = preset["case_timeout_s"]
            if args.time_budget_s is not None:
                timeout = max(20.0, min(timeout, args.time_budget_s + 30 - elapsed))
            results.append(_spawn(case, timeout))
        r = results[-1]
        print(
            f"[{time.perf_counter() - start:6.1f}s] {r['kind']}/{r['mode']} {r['impl']} "
            f"N={r['n']}: {r['status']} {_fmt(r.get('ms'), '.1f')} ms {r.get('note', '')}"[:200],
            flush=True,
        )
        _write(args, results, start, final=False)  # partial results survive an outer kill
    _add_ratios(results)
    print_table(results)
    _write(args, results, start, final=True)
    if args.table:
        write_table(args.table, results, " ".join(["python -m experiments.bench_kl", *(argv or sys.argv[1:])]))


def table_rows(results, command: str):
    """Impl-table rows (`tlt_jax.impl_table`) from a run's results: per (dtype, shape class)
    of the timed kl and logprob cases, the candidate with the least geometric-mean time over
    the cases every candidate ran."""
    import datetime

    import jax

    from experiments import machine
    from pallas_kernels import fused_linear_kl as fk
    from tlt_jax import impl_table

    backend = jax.default_backend()
    candidates = [e for e in fk.engines_on(backend) if not (e == "pallas" and backend == "cpu")]
    groups = {}
    for r in results:
        if r["status"] != "ok" or r["kind"] not in ("kl", "logprob") or "[" in r["impl"]:
            continue
        key = ("bfloat16", impl_table.shape_class("losses", r["n"] * r["v"]), r["device"])
        groups.setdefault(key, {}).setdefault(r["impl"], {})[f"{r['kind']}/{r['mode']}/N={r['n']}"] = r["ms"]
    if backend == "cpu":
        m = machine.machine_record()
        where = (f"{m['cpu']}, {m['cpus']} cores, L3 {m['last_level_cache_bytes'] / 2**20:.0f} MiB "
                 "(shared with other jobs)")
    rows = []
    for (dtype, shape, device), times in sorted(groups.items()):
        impl, means = impl_table.fastest(times, candidates)
        if impl is None:
            continue
        ref = {name: impl_table.fastest(times, [name])[1].get(name) for name in ("dense", "anchor_dense")
               if name in times}
        rows.append(dict(op="losses", backend=backend, device_kind=device, dtype=dtype, shape_class=shape, impl=impl,
                         ms=means, reference_ms=ref, cases=sorted(set.intersection(*(set(times[c]) for c in means))),
                         date=datetime.date.today().isoformat(), machine=where if backend == "cpu" else device,
                         jax=jax.__version__, command=command))
    return rows


def write_table(path, results, command: str):
    from tlt_jax import impl_table

    rows = table_rows(results, command)
    impl_table.merge(path, rows)
    for r in rows:
        print(f"impl table {path}: losses {r['device_kind']} {r['dtype']} {r['shape_class']} -> {r['impl']} "
              f"({', '.join(f'{k} {v:.2f} ms' for k, v in r['ms'].items())})")
    if not rows:
        print(f"impl table {path}: no rows (no candidate ran every case of a class)")


def _write(args, results, start, final):
    if args.out:
        preset = PRESETS[args.preset]
        _write_json(args.out, dict(preset=args.preset, shapes={k: preset[k] for k in ("d", "v", "k")}), results,
                    start, final)


if __name__ == "__main__":
    main()
