r"""Attention at reasoning lengths: XLA's memory for forward + backward, per implementation.

  python -m experiments.bench_attention --out=/tmp/bench_attention.json
  python -m experiments.bench_attention --model=qwen2.5-1.5b --lengths=8192,16384,32768 --segments
  python -m experiments.bench_attention --time --check     # on a GPU: also run each case

Each case is compiled from `jax.ShapeDtypeStruct` arguments, nothing allocated, and
reports XLA's buffer assignment (`compiled.memory_analysis()`: temp, argument and output
bytes), so the table holds for the model's real shapes on any backend, CPU included.
Scopes, at the preset's shapes and dtype, batch `--batch`, causal (with `--segments`,
packed into 4 segments):
  attention  `attention.attention(q, k, v)` and its gradients wrt q, k, v;
  layer      one decoder layer (`transformer.forward` with num_layers=1, input vectors in
             place of embeddings, final norm included) and its gradients wrt the layer's
             parameters and its input.
Implementations: dense (the [B, H, T, T] float32 scores), blockwise (online softmax in
XLA), cudnn (GPU only, not with --segments). --time runs each compiled case on random
inputs (median ms of 3 after a warm-up; out of memory is reported as such); --check
compares each implementation's output and gradients with dense at T=2048.
"""
import json
import statistics
import time

import jax
import jax.numpy as jnp
from absl import flags

from configs import models
from experiments import machine
from tlt_jax import launch
from tlt_jax.models import attention as attn
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import from_config_dict

_MODEL = flags.DEFINE_string("model", "qwen2.5-1.5b", "Model preset (configs/models.py) whose shapes are used.")
_LENGTHS = flags.DEFINE_list("lengths", ["8192", "16384", "32768"], "Sequence lengths T.")
_IMPLS = flags.DEFINE_list("impls", None, "Implementations (default: dense, blockwise, and cudnn on a GPU).")
_SCOPES = flags.DEFINE_list("scopes", ["attention", "layer"], "What is compiled: attention, layer.")
_BATCH = flags.DEFINE_integer("batch", 1, "Sequences per batch.")
_SEGMENTS = flags.DEFINE_bool("segments", False, "Packed sequences (4 segments per row): the training layout.")
_TIME = flags.DEFINE_bool("time", False, "Also run each case and time it (meant for a GPU).")
_CHECK = flags.DEFINE_bool("check", False, "Compare each implementation with dense at T=2048 on this backend.")
_OUT = flags.DEFINE_string("out", "", "Write the results as JSON here.")

GIB = 2**30


def _mask(b, t, segments):
    if not segments:
        return attn.CausalMask()
    return attn.CausalMask(segment_ids_BT=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) * 4 // t, (b, t)))


def attention_case(cfg, b, t, impl, segments):
    """(fn, argument structs): out and gradients of <attention(q, k, v), d_out>."""
    dt = cfg.jnp_dtype
    q = jax.ShapeDtypeStruct((b, t, cfg.num_heads, cfg.head_dim), dt)
    kv = jax.ShapeDtypeStruct((b, t, cfg.num_kv_heads, cfg.head_dim), dt)

    def fn(q, k, v, d_out):
        out, vjp = jax.vjp(lambda q, k, v: attn.attention(q, k, v, _mask(b, t, segments), impl=impl), q, k, v)
        return out, vjp(d_out)

    return fn, (q, kv, kv, q)


def layer_case(cfg, b, t, impl, segments):
    """(fn, argument structs): h and gradients of <forward(layer, x), d_h>."""
    cfg1 = cfg.replace(num_layers=1)
    shapes = jax.eval_shape(lambda: tfm.init_params(cfg1, jax.random.PRNGKey(0)))
    params = {"layers": shapes["layers"], "final_norm": shapes["final_norm"]}
    x = jax.ShapeDtypeStruct((b, t, cfg.hidden_size), cfg.jnp_dtype)
    seg = None if not segments else _mask(b, t, segments).segment_ids_BT

    def fn(params, x, d_h):
        def run(params, x):
            return tfm.forward(params, cfg1, None, inputs_BTD=x, segment_ids_BT=seg, attention_impl=impl)

        h, vjp = jax.vjp(run, params, x)
        return h, vjp(d_h)

    return fn, (params, x, x)


CASES = {"attention": attention_case, "layer": layer_case}


def _random(structs, seed=0, scale=0.02):
    leaves, tree = jax.tree.flatten(structs)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    arrays = [(jax.random.normal(k, s.shape, jnp.float32) * scale).astype(s.dtype) for k, s in zip(keys, leaves)]
    return jax.tree.unflatten(tree, arrays)


def measure(scope, cfg, b, t, impl, segments, run):
    fn, structs = CASES[scope](cfg, b, t, impl, segments)
    row = dict(scope=scope, model=_MODEL.value, batch=b, T=t, impl=impl, segments=segments,
               dense_scores_gib=b * cfg.num_heads * t * t * 4 / GIB)
    start = time.perf_counter()
    try:
        compiled = jax.jit(fn).lower(*structs).compile()
    except Exception as e:  # noqa: BLE001 - a case that cannot compile is a result
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return row
    row["compile_s"] = time.perf_counter() - start
    mem = compiled.memory_analysis()
    row.update(temp_gib=mem.temp_size_in_bytes / GIB, argument_gib=mem.argument_size_in_bytes / GIB,
               output_gib=mem.output_size_in_bytes / GIB)
    if run:
        try:
            args = _random(structs)
            jax.block_until_ready(compiled(*args))
            times = []
            for _ in range(3):
                start = time.perf_counter()
                jax.block_until_ready(compiled(*args))
                times.append(time.perf_counter() - start)
            row["ms"] = 1e3 * statistics.median(times)
            del args
        except Exception as e:  # noqa: BLE001 - out of memory is a result
            row["run_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row


def check(cfg, impls, segments, t=2048):
    """Relative L2 error of out, dq, dk, dv against dense, per implementation."""
    fn_structs = {impl: attention_case(cfg, 1, t, impl, segments) for impl in impls}
    args = _random(next(iter(fn_structs.values()))[1], seed=1, scale=1.0)
    want = jax.tree.leaves(jax.jit(attention_case(cfg, 1, t, "dense", segments)[0])(*args))
    errors = {}
    for impl, (fn, _) in fn_structs.items():
        got = jax.tree.leaves(jax.jit(fn)(*args))
        errors[impl] = [float(jnp.linalg.norm((g.astype(jnp.float32) - w.astype(jnp.float32)))
                              / jnp.linalg.norm(w.astype(jnp.float32))) for g, w in zip(got, want)]
    return errors


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    cfg = from_config_dict(models.model_config(_MODEL.value))
    backend = jax.default_backend()
    impls = _IMPLS.value or (["dense", "blockwise"] + (["cudnn"] if backend == "gpu" else []))
    unknown = set(impls) - set(attn.IMPLS) | set(_SCOPES.value) - set(CASES)
    if unknown:
        raise SystemExit(f"Unknown --impls/--scopes {sorted(unknown)}; impls {attn.IMPLS[1:]}, scopes {list(CASES)}.")
    rows = []
    result = dict(backend=backend, device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  model=_MODEL.value, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  dtype=cfg.dtype, rows=rows)
    if _CHECK.value:
        result["check_rel_err_vs_dense"] = check(cfg, [i for i in impls if i != "dense"], _SEGMENTS.value)
        print("relative error vs dense (out, dq, dk, dv):", json.dumps(result["check_rel_err_vs_dense"]), flush=True)
    for scope in _SCOPES.value:
        for t in [int(x) for x in _LENGTHS.value]:
            for impl in impls:
                row = measure(scope, cfg, _BATCH.value, t, impl, _SEGMENTS.value, _TIME.value)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if _OUT.value:  # rewritten after every case: a run cut short keeps what it measured
                    machine.write_result(_OUT.value, result)
    print(f"\n{_MODEL.value}: H={cfg.num_heads}, K={cfg.num_kv_heads}, Dh={cfg.head_dim}, {cfg.dtype}, "
          f"batch {_BATCH.value}{', 4 packed segments' if _SEGMENTS.value else ''}; backend {backend} "
          f"({result['device']}), XLA temp GiB of forward + backward")
    header = f"{'scope':9} {'T':>6} " + " ".join(f"{impl:>10}" for impl in impls) + f" {'ratio':>7} {'scores':>7}"
    print(header)
    for scope in _SCOPES.value:
        for t in [int(x) for x in _LENGTHS.value]:
            by_impl = {r["impl"]: r for r in rows if r["scope"] == scope and r["T"] == t}
            cells = [f"{by_impl[i]['temp_gib']:10.3f}" if "temp_gib" in by_impl[i] else f"{'error':>10}" for i in impls]
            temps = [by_impl[i].get("temp_gib") for i in impls]
            ratio = temps[0] / min(temps[1:]) if len(temps) > 1 and all(temps) else float("nan")
            scores = by_impl[impls[0]]["dense_scores_gib"]
            print(f"{scope:9} {t:6d} " + " ".join(cells) + f" {ratio:7.1f} {scores:7.2f}")
    print("ratio: first implementation over the smallest other; scores: one [B, H, T, T] float32 tensor, GiB")
    if _TIME.value:
        for r in rows:
            print(f"{r['scope']:9} {r['T']:6d} {r['impl']:>10} ms {r.get('ms', float('nan')):9.2f} "
                  f"{r.get('run_error', '')}")


if __name__ == "__main__":
    launch.run(main)
