r"""Draft-tree verification (pallas_kernels/spec_verify.py): the jnp reference against the
V-tiled Pallas kernel, timed at real vocabularies.

  python -m experiments.bench_verify --out=/tmp/bench_verify.json            # Qwen2.5's V, GPU
  python -m experiments.bench_verify --vocab=1000 --nodes=8 --batches=1 --repeats=1   # CPU smoke

Per case (mode, batch B, nodes T): B random trees of T nodes (node i hangs under node
(i - 1) // 4: four children per node, depth 2-3), each drafted token drawn from its
parent's target row, target rows peaked (normal logits x 3), draft rows the target's
plus noise (mode "sampled": verified with them; "deterministic": without). For each
implementation: median ms of `repeats` calls after a warm-up (compile excluded), and
whether its outputs equal the reference's for the same keys. On the CPU the kernel
runs in interpret mode (correctness only). Cases run until --time_budget_s is spent.

--table=PATH: the fastest candidate per B x T x V shape class goes into the impl table at PATH
(`tlt_jax.impl_table`, what spec_verify's impl="auto" reads), beside the candidates'
geometric-mean times over the cases all of them ran: the reference, and the kernel on a GPU
(in interpret mode on a CPU it is not a candidate). The tlt block's trees are chains of 9 and
7 nodes (eagle-d8, eagle-d6):
  python -m experiments.bench_verify --nodes=9,7,16,48 --batches=1,8 --table=$OUT/impl_table.json
"""
import datetime
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from absl import flags

from experiments import machine
from pallas_kernels import spec_verify as sv
from tlt_jax import impl_table, launch

_VOCAB = flags.DEFINE_integer("vocab", 151936, "Vocabulary size V (Qwen2.5: 151936, Llama 3: 128256).")
_NODES = flags.DEFINE_list("nodes", ["8", "16", "48"], "Tree sizes T (nodes, root included).")
_BATCHES = flags.DEFINE_list("batches", ["1", "8"], "Batch sizes B.")
_MODES = flags.DEFINE_list("modes", ["sampled", "deterministic"], "sampled (draft_logp given) or deterministic.")
_IMPLS = flags.DEFINE_list("impls", ["reference", "pallas"], "Implementations to time.")
_BLOCK_V = flags.DEFINE_integer("block_v", sv._BLOCK_V, "The kernel's V block (a power of two).")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed calls per case.")
_TIME_BUDGET_S = flags.DEFINE_float("time_budget_s", 0.0, "No new case starts after this many seconds (0: no limit).")
_OUT = flags.DEFINE_string("out", "", "Write the results as JSON here.")
_TABLE = flags.DEFINE_string("table", "", "Impl table to write the fastest candidate per shape class into.")


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def make_inputs(b, t, v, key):
    k_t, k_d, k_tok = jax.random.split(key, 3)
    target = jax.nn.log_softmax(3.0 * jax.random.normal(k_t, (b, t, v)), axis=-1)
    draft = jax.nn.log_softmax(target + jax.random.normal(k_d, (b, t, v)), axis=-1)
    parents = jnp.broadcast_to(jnp.concatenate([jnp.array([-1]), jnp.arange(t - 1) // 4]), (b, t)).astype(jnp.int32)
    parent_rows = jnp.take_along_axis(target, jnp.maximum(parents, 0)[..., None], axis=1)
    tokens = jax.random.categorical(k_tok, parent_rows, axis=-1).astype(jnp.int32)
    return tokens, parents, target, draft


def _impl_fn(impl):
    if impl == "reference":
        return jax.jit(functools.partial(sv.verify, impl="reference"))

    @jax.jit
    def kernel(tokens, parents, target, draft, key):  # verify's noise, the kernel at --block_v
        (b, t, v), (k_u, k_g) = target.shape, jax.random.split(key)
        noise = jax.random.uniform(k_u, (b, t)), jax.random.gumbel(k_g, (b, v))
        draft = None if draft is None else draft.astype(jnp.float32)
        return sv._pallas(tokens, parents, target.astype(jnp.float32), draft, *noise, block_v=_BLOCK_V.value)

    return kernel


def main(argv):
    del argv
    launch.maybe_initialize_distributed()
    v = _VOCAB.value
    rows = []
    result = dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  vocab=v, block_v=_BLOCK_V.value, rows=rows)
    fns = {impl: _impl_fn(impl) for impl in _IMPLS.value}
    start = time.perf_counter()
    cases = [(m, int(b), int(t)) for m in _MODES.value for b in _BATCHES.value for t in _NODES.value]
    for mode, b, t in cases:
        if _TIME_BUDGET_S.value and time.perf_counter() - start > _TIME_BUDGET_S.value:
            print(f"time budget spent: skipping {mode} B={b} T={t} and after", flush=True)
            break
        tokens, parents, target, draft = make_inputs(b, t, v, jax.random.PRNGKey(t * 100 + b))
        draft = draft if mode == "sampled" else None
        keys = [jax.random.key(i) for i in range(_REPEATS.value + 1)]
        row = dict(mode=mode, batch=b, nodes=t, vocab=v)
        outputs = {}
        for impl, fn in fns.items():
            try:
                compile_start = time.perf_counter()
                outputs[impl] = jax.block_until_ready(fn(tokens, parents, target, draft, keys[0]))
                row[f"{impl}_first_call_s"] = time.perf_counter() - compile_start
                times = []
                for key in keys[1:]:
                    call_start = time.perf_counter()
                    jax.block_until_ready(fn(tokens, parents, target, draft, key))
                    times.append(time.perf_counter() - call_start)
                row[f"{impl}_ms"] = 1e3 * statistics.median(times)
            except Exception as e:  # noqa: BLE001 - a failing implementation is a result
                row[f"{impl}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if "reference" in outputs:
            row["mean_accepted"] = float(jnp.mean(outputs["reference"][1]))
            for impl, out in outputs.items():
                if impl != "reference":
                    row[f"{impl}_equal"] = all(bool(jnp.array_equal(a, w)) for a, w in zip(out, outputs["reference"]))
        if "reference_ms" in row and "pallas_ms" in row:
            row["speedup"] = row["reference_ms"] / row["pallas_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if _OUT.value:  # rewritten after every case: a run cut short keeps what it measured
            machine.write_result(_OUT.value, result)
    print(f"\nV={v}, block_v={_BLOCK_V.value}, backend {result['backend']} ({result['device']})")
    print(f"{'mode':13} {'B':>3} {'T':>3} {'ref ms':>8} {'pallas ms':>9} {'x ref':>6} {'equal':>6} {'accepted':>8}")
    for r in rows:
        print(f"{r['mode']:13} {r['batch']:3d} {r['nodes']:3d} {r.get('reference_ms', float('nan')):8.3f} "
              f"{r.get('pallas_ms', float('nan')):9.3f} {r.get('speedup', float('nan')):6.2f} "
              f"{str(r.get('pallas_equal', '-')):>6} {r.get('mean_accepted', float('nan')):8.2f}")
    if _TABLE.value:
        table = table_rows(rows, result, " ".join(["python -m experiments.bench_verify", *sys.argv[1:]]))
        impl_table.merge(_TABLE.value, table)
        for r in table:
            print(f"impl table {_TABLE.value}: verify {r['device_kind']} {r['shape_class']} -> {r['impl']} "
                  f"({', '.join(f'{k} {v:.3f} ms' for k, v in r['ms'].items())})")


def table_rows(rows, result, command: str) -> list[dict]:
    """Impl-table rows from the timed cases: per B x T x V shape class, the candidate with the
    least geometric-mean time over the cases every candidate ran. A kernel whose outputs
    differ from the reference's in some case is no candidate."""
    backend = result["backend"]
    candidates = [impl for impl in sv.impls_on(backend)
                  if impl == "reference" or all(r.get(f"{impl}_equal", True) for r in rows)]
    groups = {}
    for r in rows:
        shape = impl_table.shape_class("verify", r["batch"] * r["nodes"] * r["vocab"])
        for impl in ("reference", "pallas"):
            if f"{impl}_ms" in r:
                groups.setdefault(shape, {}).setdefault(impl, {})[f"{r['mode']}/B={r['batch']}/T={r['nodes']}"] = (
                    r[f"{impl}_ms"])
    if backend == "cpu":
        m = machine.machine_record()
        where = (f"{m['cpu']}, {m['cpus']} cores, L3 {m['last_level_cache_bytes'] / 2**20:.0f} MiB "
                 "(shared with other jobs)")
    else:
        where = result["device"]
    out = []
    for shape, times in sorted(groups.items()):
        impl, means = impl_table.fastest(times, candidates)
        if impl is not None:
            out.append(dict(op="verify", backend=backend, device_kind=result["device"], dtype="float32",
                            shape_class=shape, impl=impl, ms=means, vocab=result["vocab"],
                            cases=sorted(set.intersection(*(set(times[c]) for c in means))),
                            date=datetime.date.today().isoformat(), machine=where, jax=result["jax"],
                            command=command))
    return out


if __name__ == "__main__":
    launch.run(main)
