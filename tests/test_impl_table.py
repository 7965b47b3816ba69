"""tlt_jax.impl_table: impl="auto" of the losses and of spec_verify reads the measured table
(package data), falls back to today's choice on a device never measured, and the benchmarks
write the fastest candidate per shape class."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_kl
from pallas_kernels import fused_linear_kl
from pallas_kernels import spec_verify as sv
from tests.support.child import printed_json
from tlt_jax import impl_table, losses


def _row(op="losses", backend="cpu", device_kind="cpu", dtype="float32", shape_class="small", impl="chunked_xla"):
    return dict(op=op, backend=backend, device_kind=device_kind, dtype=dtype, shape_class=shape_class, impl=impl)


def test_lookup_takes_the_nearest_measured_row_of_the_device():
    table = [_row(shape_class="small", impl="pallas"), _row(shape_class="large", impl="chunked_xla"),
             _row(dtype="bfloat16", shape_class="medium", impl="pallas")]
    look = lambda **kw: impl_table.lookup("losses", "cpu", "cpu", table=table, **kw)
    assert look(dtype="float32", shape="small") == "pallas"
    assert look(dtype="float32", shape="large") == "chunked_xla"
    assert look(dtype="float32", shape="medium") == "pallas"  # equidistant: the smaller class
    assert look(dtype="bfloat16", shape="large") == "pallas"  # the dtype before the class
    assert impl_table.lookup("losses", "gpu", "NVIDIA H200", table=table) is None  # never measured
    assert impl_table.lookup("verify", "cpu", "cpu", table=table) is None
    assert [impl_table.shape_class("losses", n * 128256) for n in (256, 8192, 32768)] == ["small", "medium", "large"]


def test_auto_reads_the_table_and_falls_back_where_the_device_was_never_measured(monkeypatch):
    monkeypatch.setattr(impl_table, "rows", lambda path=None: (_row(impl="pallas"),))
    assert losses.resolve_impl("auto", "cpu", dtype=jnp.float32, elements=100) == "pallas"
    assert losses.resolve_impl("auto", "gpu") == "chunked_xla"  # no GPU here: never measured
    calls = []
    stats = fused_linear_kl._pallas_row_stats
    monkeypatch.setattr(fused_linear_kl, "_pallas_row_stats", lambda *a, **k: calls.append(1) or stats(*a, **k))
    rng = np.random.default_rng(0)
    h, w = jnp.asarray(rng.normal(size=(5, 8)), jnp.float32), jnp.asarray(rng.normal(size=(8, 13)), jnp.float32)
    losses.linear_logprob(h, w, jnp.arange(5))  # impl="auto" at the call sites too
    assert calls
    monkeypatch.setattr(impl_table, "rows", lambda path=None: (_row(impl="dense"),))
    assert losses.resolve_impl("auto", "cpu") == "chunked_xla"  # never a path that forms [N, V] logits

    # spec_verify: the kernel is an interpreter on the CPU, so no table row makes it auto's choice there.
    monkeypatch.setattr(impl_table, "rows", lambda path=None: (_row(op="verify", impl="pallas"),))
    assert sv.resolve_impl("auto", "cpu", elements=10) == "reference"
    monkeypatch.setattr(sv, "impls_on", lambda backend: ("reference", "pallas"))
    assert sv.resolve_impl("auto", "cpu", elements=10) == "pallas"


def test_a_pallas_verify_on_a_backend_without_a_lowering_names_the_impls_it_has():
    with pytest.raises(ValueError, match="impl='pallas' has no lowering on the tpu backend; pass one of auto, "
                                         "reference."):
        sv.resolve_impl("pallas", "tpu")
    assert sv.resolve_impl("pallas", "cpu") == "pallas"  # the interpreter, for tests


def test_the_shipped_table_has_dated_cpu_rows_for_the_losses_and_verification():
    with open(impl_table.TABLE_PATH) as f:
        rows = json.load(f)["rows"]
    for op in impl_table.OPS:
        cpu = [r for r in rows if r["op"] == op and r["backend"] == "cpu"]
        assert cpu, op
        for r in cpu:
            assert r["date"] and "L3" in r["machine"] and r["impl"] in ("chunked_xla", "reference"), r
    assert impl_table.markdown(rows).count("\n") == len(rows) + 1


_VERIFY_ROWS = r"""
import json
from experiments import bench_verify

verify = [dict(mode="sampled", batch=1, nodes=9, vocab=1000, reference_ms=2.0, pallas_ms=1.0, pallas_equal=True)]
gpu = dict(backend="gpu", device="NVIDIA H200", jax="0.11.2", vocab=1000)
rows = bench_verify.table_rows(verify, gpu, "cmd")
verify[0]["pallas_equal"] = False
print(json.dumps([rows, bench_verify.table_rows(verify, gpu, "cmd")]))
"""


def test_the_benchmarks_write_the_fastest_candidate_per_shape_class(tmp_path):
    def case(impl, kind, n, ms, mode="mean"):
        return dict(kind=kind, impl=impl, mode=mode, n=n, v=8192, status="ok", ms=ms, device="cpu")

    results = [case("chunked_xla", "kl", 1024, 10.0), case("chunked_xla", "logprob", 1024, 4.0, "token"),
               case("pallas", "kl", 1024, 1.0), case("dense", "kl", 1024, 5.0),
               case("chunked_xla[tokens=512]", "kl", 1024, 0.5)]
    path = str(tmp_path / "table.json")
    bench_kl.write_table(path, results, "python -m experiments.bench_kl")
    (row,) = impl_table.rows(path)
    # On a CPU the kernel is an interpreter and dense forms the logits: chunked_xla is the only candidate.
    assert (row["impl"], row["shape_class"], row["dtype"]) == ("chunked_xla", "small", "bfloat16")
    assert list(row["ms"]) == ["chunked_xla"] and row["ms"]["chunked_xla"] == pytest.approx(np.sqrt(40.0))
    assert row["reference_ms"]["dense"] == pytest.approx(5.0)

    # bench_verify's flags share names with other launchers a test process may hold: its rows
    # come from a process of their own.
    rows, disagreeing = printed_json(_VERIFY_ROWS)
    faster = "pallas" if sv._pltriton is not None else "reference"  # a GPU's kernel, where this jax lowers it
    assert [(r["impl"], r["shape_class"], r["device_kind"]) for r in rows] == [(faster, "small", "NVIDIA H200")]
    assert disagreeing[0]["impl"] == "reference"  # a kernel that disagrees with the reference is never chosen
    impl_table.merge(path, rows)
    assert {r["op"] for r in impl_table.rows(path)} == {"losses", "verify"}
