"""The measured table behind `impl="auto"`: the fastest implementation per (op, backend,
device kind, dtype, shape class), shipped as package data (impl_table.json beside this file).

Ops: "losses" (the fused projection of `tlt_jax.losses`: top-K KL, log-probs, top-k;
candidates the engines that never form [tokens, vocab] logits and that the backend runs
natively: chunked_xla, and pallas on a GPU with the Triton lowering; on a CPU pallas is an
interpreter, not an implementation, and dense is the reference) and "verify"
(`pallas_kernels.spec_verify`: reference, and pallas on a GPU).

Rows are written by the benchmarks (`experiments/bench_kl.py --table=`, `experiments/
bench_verify.py --table=`; on a GPU day the `losses` and `verify` blocks of
experiments/device_check.sh write $OUT/impl_table.json), and merged into the shipped table
with `python -m tlt_jax.impl_table --merge FILE`. `python -m tlt_jax.impl_table` prints it
(the markdown of docs/losses.md). A lookup on a device the table never measured returns
None: the caller keeps its own default (today's choice).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "impl_table.json")
OPS = ("losses", "verify")
KEY = ("op", "backend", "device_kind", "dtype", "shape_class")
# Shape classes by the size of the array an op would hold whole without its fused path:
# losses: N x V logits; verify: B x T x V target log-probs. Upper bounds (exclusive), in
# elements; the last class is unbounded.
SHAPE_CLASSES = ("small", "medium", "large")
_CLASS_BOUNDS = {"losses": (2**26, 2**31), "verify": (2**22, 2**26)}


def device_kind(backend: str) -> str | None:
    """The kind of `backend`'s first device, as rows name it ("cpu", "NVIDIA H200", ...);
    None where this process has no such backend."""
    import jax  # here: the table's command line needs no JAX

    try:
        return jax.devices(backend)[0].device_kind
    except RuntimeError:
        return None


def shape_class(op: str, elements: int) -> str:
    """"small" / "medium" / "large" for an op's problem of `elements` (losses: N V; verify:
    B T V). losses: small below 2^26 (a 256 MiB float32 [N, V]: the CPU presets), large
    from 2^31 (16k tokens of a 128k vocabulary); verify: small below 2^22, large from 2^26."""
    if op not in _CLASS_BOUNDS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    small, large = _CLASS_BOUNDS[op]
    return "small" if elements < small else "medium" if elements < large else "large"


@functools.cache
def _load(path: str) -> tuple[dict, ...]:
    try:
        with open(path) as f:
            return tuple(json.load(f)["rows"])
    except FileNotFoundError:
        return ()


def rows(path: str = TABLE_PATH) -> tuple[dict, ...]:
    return _load(path)


def lookup(op: str, backend: str, device_kind: str, dtype: str | None = None, shape: str | None = None, *,
           table: Sequence[Mapping[str, Any]] | None = None) -> str | None:
    """The measured fastest impl for the op on this device: the row of the same dtype and
    shape class, else the nearest measured one on the device (dtype first, then class
    distance); None where the device was never measured. dtype / shape None match any."""
    table = rows() if table is None else table
    mine = [r for r in table if (r["op"], r["backend"], r["device_kind"]) == (op, backend, device_kind)]
    if not mine:
        return None

    def distance(r):
        d_dtype = 0 if dtype is None or r["dtype"] == dtype else 1
        d_shape = 0 if shape is None else abs(SHAPE_CLASSES.index(r["shape_class"]) - SHAPE_CLASSES.index(shape))
        return d_dtype, d_shape, SHAPE_CLASSES.index(r["shape_class"]), r["dtype"]

    return min(mine, key=distance)["impl"]


def fastest(times_ms: Mapping[str, Mapping[Any, float]], candidates: Iterable[str]) -> tuple[str | None, dict]:
    """The candidate with the least geometric mean time over the cases every candidate ran
    ({impl: {case: ms}}). Returns (impl or None, {impl: geometric mean ms over those cases})."""
    candidates = [c for c in candidates if times_ms.get(c)]
    if not candidates:
        return None, {}
    common = set.intersection(*(set(times_ms[c]) for c in candidates))
    if not common:
        return None, {}
    means = {c: math.exp(sum(math.log(times_ms[c][k]) for k in common) / len(common)) for c in candidates}
    return min(means, key=means.get), means


def merge(path: str, new_rows: Iterable[Mapping[str, Any]]) -> list[dict]:
    """Writes `new_rows` into the table at `path` (created if absent), replacing rows of the
    same key; returns the table's rows, sorted by key."""
    try:
        with open(path) as f:
            table = json.load(f)
    except FileNotFoundError:
        table = {"rows": []}
    by_key = {tuple(r[k] for k in KEY): dict(r) for r in table["rows"]}
    for r in new_rows:
        missing = [k for k in (*KEY, "impl") if k not in r]
        if missing:
            raise ValueError(f"an impl table row needs {missing}: {r}")
        by_key[tuple(r[k] for k in KEY)] = dict(r)
    table["rows"] = [by_key[k] for k in sorted(by_key, key=lambda k: (k[0], k[1], k[2], k[3],
                                                                      SHAPE_CLASSES.index(k[4])))]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    _load.cache_clear()
    return table["rows"]


def markdown(table: Sequence[Mapping[str, Any]]) -> str:
    """The table as docs/losses.md shows it."""
    lines = ["| op | backend | device | dtype | shape class | auto | measured (ms, geometric mean) | date | machine |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        ms = ", ".join(f"{k} {v:.3g}" for k, v in sorted(r.get("ms", {}).items()))
        lines.append(f"| {r['op']} | {r['backend']} | {r['device_kind']} | {r['dtype']} | {r['shape_class']} | "
                     f"{r['impl']} | {ms} | {r.get('date', '')} | {r.get('machine', '')} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Print the impl table, or merge benchmark rows into it.")
    ap.add_argument("--merge", nargs="*", default=(), help="tables (e.g. device_check's $OUT/impl_table.json) whose "
                                                           "rows replace the shipped table's of the same key")
    ap.add_argument("--table", default=TABLE_PATH, help="the table to print or merge into")
    args = ap.parse_args(argv)
    for path in args.merge:
        with open(path) as f:
            merge(args.table, json.load(f)["rows"])
    print(markdown(rows(args.table)))


if __name__ == "__main__":
    main()
