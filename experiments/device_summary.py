r"""The bars of DESIGN.md section 5 against what `experiments/device_check.sh` measured: one table.

  python -m experiments.device_summary --out_dir=$OUT [--dry]

Reads the blocks' JSON under --out_dir (bench_spec.json, bench_tlt.json, bench_rollout.json,
bench_attention.json, bench_verify.json, bench_kl.json), prints one row per bar (measured,
target, status, where it was measured) and writes the rows to <out_dir>/summary.json. Status:
  pass / FAIL  the measured value against the target;
  n/a          the fields are there but hold nothing to compare here (no device peak on a
               CPU, no case at the bar's size);
  missing      the block did not run, or its JSON lacks a field this table reads (a broken
               block: `tests/experiments/test_device_check.py` fails on it in the dry run).
Standard library only: it runs wherever the script does, even where jax cannot start.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from dataclasses import dataclass
from typing import Callable


class Missing(Exception):
    """A file or field the bar reads is absent."""


class NotHere(Exception):
    """The fields are there, with nothing to compare on this run (status n/a)."""


@dataclass(frozen=True)
class Bar:
    name: str
    block: str
    file: str
    op: str  # ">=" or "<="
    target: float
    measure: Callable[[dict], tuple[float, str]]  # the file's JSON -> (value, where)
    source: str  # where the bar comes from


def _get(d, *path):
    for key in path:
        try:
            d = d[key]
        except (KeyError, IndexError, TypeError):
            raise Missing(f"no field {'.'.join(map(str, path))}") from None
    return d


def _rows(data, key="rows"):
    rows = _get(data, key)
    if not isinstance(rows, list):
        raise Missing(f"{key} is not a list")
    return rows


def _spec(field):
    """Per strategy, the worst of the batch sizes <= 8 at temperature 1; the best strategy."""

    def measure(data):
        per = {}
        for r in _rows(data):
            b, t, s, v = (_get(r, k) for k in ("batch", "temperature", "strategy", field))
            if b <= 8 and t == 1.0:
                per.setdefault(s, []).append((v, b))
        if not per:
            raise NotHere("no row at temperature 1 and batch <= 8")
        strategy, worst = max(((s, min(vs)) for s, vs in per.items()), key=lambda x: x[1][0])
        batches = ",".join(str(b) for _, b in sorted(per[strategy], key=lambda x: x[1]))
        return worst[0], f"{strategy}, T=1, worst of batches {batches} (at {worst[1]})"

    return measure


def _spec_efficiency(low, high):
    """Speculation efficiency (measured / ideal speed-up, bench_spec --breakdown) at temperature
    1 and batch sizes in [low, high]: the worst row of the best strategy."""

    def measure(data):
        per = {}
        for r in _rows(data):
            b, t, s = (_get(r, k) for k in ("batch", "temperature", "strategy"))
            if low <= b <= high and t == 1.0 and "efficiency" in r:
                per.setdefault(s, []).append((r["efficiency"], b))
        if not per:
            raise NotHere(f"no --breakdown row at temperature 1 and batch {low}-{high} (SPEC_ARGS with --breakdown)")
        strategy, worst = max(((s, min(vs)) for s, vs in per.items()), key=lambda x: x[1][0])
        return worst[0], f"{strategy}, T=1, worst of batches {sorted(b for _, b in per[strategy])} (at {worst[1]})"

    return measure


def _tlt_step(data):
    v = _get(data, "step_speedup")
    return v, f"{_get(data, 'preset')} preset, {data.get('pairs_complete', '?')} pair(s), {_get(data, 'steps')} steps"


def _tlt_rollout_share(data):
    rollout, step = _get(data, "rollout_time_s", "baseline"), _get(data, "step_time_s", "baseline")
    return rollout / step, f"baseline median rollout {rollout:.3f} s of step {step:.3f} s"


def _tlt_acceptance(data):
    values = [a for a in _get(data, "acceptance_length") if a > 0]
    if not values:
        raise NotHere("no speculative step")
    return statistics.fmean(values), f"mean over {len(values)} RL steps with speculation"


def _tlt_accuracy(data):
    acc = _get(data, "final_eval_accuracy")
    b, t = _get(acc, "baseline"), _get(acc, "tlt")
    if b is None or t is None:
        raise NotHere("no final eval")
    return abs(t - b), f"baseline {b:.3f}, tlt {t:.3f}"


def _roofline(data):
    rows = _rows(data)
    if not rows:
        raise NotHere("no rows")
    model, layout = _get(rows[0], "model"), _get(rows[0], "layout")
    mine = [(_get(r, "roofline_fraction"), _get(r, "batch")) for r in rows
            if r.get("model") == model and r.get("layout") == layout and _get(r, "batch") <= 16]
    if not mine:
        raise NotHere(f"no {model} {layout} row at batch <= 16")
    worst = min(mine)
    return worst[0], f"{model}, {layout} layout, worst of batches {sorted(b for _, b in mine)} (at {worst[1]})"


def _check_err(data):
    errors = _get(data, "check_rel_err_vs_dense")
    worst = [(max(e), impl) for impl, e in errors.items() if e]
    if not worst:
        raise NotHere("no implementation besides dense")
    value, impl = max(worst)
    return value, f"worst of out/dq/dk/dv, {', '.join(sorted(errors))} vs dense at T=2048 ({impl} worst)"


def _verify_speedup(data):
    rows = [r for r in _rows(data) if "speedup" in r]
    if not rows:
        raise NotHere("no row timed both implementations")
    best = max(rows, key=lambda r: r["speedup"])
    return best["speedup"], (f"V={_get(data, 'vocab')}, best of {len(rows)} cases ({best['mode']} B={best['batch']} "
                             f"T={best['nodes']})")


def _verify_equal(data):
    rows = [r for r in _rows(data) if "pallas_equal" in r]
    if not rows:
        raise NotHere("no row compared the kernel")
    return float(all(r["pallas_equal"] for r in rows)), f"{sum(r['pallas_equal'] for r in rows)} of {len(rows)} cases"


def _ours(data, kind="kl"):
    rows = []
    for r in _rows(data, "results"):
        if _get(r, "kind") == kind and _get(r, "status") == "ok":
            impl = _get(r, "impl")
            if impl.startswith(("chunked_xla", "pallas")):
                rows.append(r)
    if not rows:
        raise NotHere("no fused case finished")
    return rows


def _kl_peak(data, n=262144):
    rows = _ours(data)
    for r in rows:
        _get(r, "peak_gib")
    at = [r for r in rows if r["n"] >= n and r["peak_gib"] is not None]
    if not at:
        largest = max(rows, key=lambda r: r["n"])
        raise NotHere(f"no device peak at N >= {n} (largest N {largest['n']}, peak {largest['peak_gib']}; "
                      f"backend {data.get('backend')})")
    best = min(at, key=lambda r: r["peak_gib"])
    return best["peak_gib"], f"{best['impl']} {best['mode']} N={best['n']}"


def _kl_temp(data):
    rows = _ours(data)
    worst = max(rows, key=lambda r: -math.inf if _get(r, "xla_temp_gib") is None else r["xla_temp_gib"])
    if worst["xla_temp_gib"] is None:
        raise NotHere("no XLA temp size")
    return worst["xla_temp_gib"], f"worst of {len(rows)} fused cases: {worst['impl']} {worst['mode']} N={worst['n']}"


def _kl_throughput(data):
    """anchor_dense's time over a fused case's at the same N (scalar loss), from each case's own
    row: bench_kl adds its x_dense only at the end, which a run cut short never reaches."""
    dense = {_get(r, "n"): _get(r, "ms") for r in _rows(data, "results")
             if r.get("kind") == "kl" and r.get("impl") == "anchor_dense" and r.get("status") == "ok"}
    ratios = [(dense[r["n"]] / _get(r, "ms"), r) for r in _ours(data) if r["mode"] == "mean" and r["n"] in dense]
    if not ratios:
        raise NotHere("no fused case at an N where the dense anchor ran")
    best, r = max(ratios, key=lambda x: x[0])
    return best, f"best of {len(ratios)}: {r['impl']} N={r['n']}"


def _distill_peak(data):
    """The executed distill step's measured device peak (plan_memory --execute), with its plan."""
    row = _rows(data, "results")[0]
    peak, total = _get(row, "measured_peak_gb"), _get(row, "total_gb")
    planned = row.get("planned_total_gb")
    where = (f"{row.get('preset')} seq_len={row.get('seq_len')} micro-batch {row.get('micro_batch')}: compile-time "
             f"{total:.1f} GB here" + ("" if planned is None else f", {planned:.1f} GB planned on the CPU"))
    if peak is None:
        raise NotHere(f"no device memory stats (backend {data.get('backend')}); {where}")
    return peak, where


S5 = "DESIGN.md 5"
BARS = (
    Bar("spec acceptance length", "spec", "bench_spec.json", ">=", 4.0, _spec("acceptance_length"), S5),
    Bar("spec speed-up (tokens/s)", "spec", "bench_spec.json", ">=", 2.5, _spec("speedup"), S5),
    Bar("spec efficiency, batch 1-8", "spec", "bench_spec.json", ">=", 0.85, _spec_efficiency(1, 8),
        S5 + ": measured / ideal speed-up"),
    Bar("spec efficiency, batch 32-64", "spec", "bench_spec.json", ">=", 0.75, _spec_efficiency(32, 64),
        S5 + ": measured / ideal speed-up"),
    Bar("tlt step speed-up", "tlt", "bench_tlt.json", ">=", 2.5, _tlt_step, S5),
    Bar("tlt baseline rollout share", "tlt", "bench_tlt.json", ">=", 0.9, _tlt_rollout_share,
        "the preset of the 2.5x bar (FastGRPO's traces 91-98%)"),
    Bar("tlt acceptance length", "tlt", "bench_tlt.json", ">=", 4.0, _tlt_acceptance, S5),
    Bar("tlt eval accuracy gap", "tlt", "bench_tlt.json", "<=", 0.05, _tlt_accuracy,
        "seed noise: ~3x the std 0.018 of docs/results/tlt_seeds.json"),
    Bar("decode roofline share", "rollout", "bench_rollout.json", ">=", 0.60, _roofline, S5),
    Bar("attention rel err vs dense", "attention", "bench_attention.json", "<=", 1e-2, _check_err,
        "bf16 operands (METHOD.md)"),
    Bar("verify speed-up (pallas/ref)", "verify", "bench_verify.json", ">=", 1.0, _verify_speedup,
        "spec_verify impl=auto takes the kernel only where faster"),
    Bar("verify kernel equals reference", "verify", "bench_verify.json", ">=", 1.0, _verify_equal,
        "1 = every case equal"),
    Bar("KL peak at 256k tokens (GiB)", "losses", "bench_kl.json", "<=", 7.0, _kl_peak, S5),
    Bar("KL XLA temp, bf16 (GiB)", "losses", "bench_kl.json", "<=", 2.0, _kl_temp, S5),
    Bar("KL throughput vs dense", "losses", "bench_kl.json", ">=", 0.95, _kl_throughput, S5 + ": scalar loss"),
    Bar("distill 3.2B at 32k, peak (GB)", "distill32k", "plan_distill_32k.json", "<=", 141.0, _distill_peak,
        "one H200 (docs/results/plan_distill_llama3.2-3b_32k_h200.json)"),
)


def evaluate(out_dir: str) -> list[dict]:
    """One dict per bar: name, block, file, target ("<op> <value>"), measured (or None),
    status (pass, FAIL, n/a, missing), where (or why not)."""
    cache = {}
    rows = []
    for bar in BARS:
        row = dict(name=bar.name, block=bar.block, file=bar.file, target=f"{bar.op} {bar.target:g}", measured=None,
                   source=bar.source)
        path = os.path.join(out_dir, bar.file)
        try:
            if path not in cache:
                try:
                    with open(path) as f:
                        cache[path] = json.load(f)
                except OSError:
                    raise Missing(f"no {bar.file} (block {bar.block} not run?)") from None
                except ValueError as e:
                    raise Missing(f"{bar.file} is not JSON: {e}") from None
            value, where = bar.measure(cache[path])
            ok = value >= bar.target if bar.op == ">=" else value <= bar.target
            row.update(measured=value, status="pass" if ok else "FAIL", where=where)
        except Missing as e:
            row.update(status="missing", where=str(e))
        except NotHere as e:
            row.update(status="n/a", where=str(e))
        rows.append(row)
    return rows


def print_table(rows: list[dict], dry: bool = False) -> None:
    name_w = max(len(r["name"]) for r in rows)
    print(f"\n{'bar':{name_w}}  {'block':9} {'measured':>10} {'target':>8}  {'status':7} where")
    for r in rows:
        value = "-" if r["measured"] is None else f"{r['measured']:.4g}"
        print(f"{r['name']:{name_w}}  {r['block']:9} {value:>10} {r['target']:>8}  {r['status']:7} {r['where']}")
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "FAIL", "n/a", "missing")}
    print("bars: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    if dry:
        print("DRY: tiny models at a few steps on the CPU: the values check the plumbing, not the bars")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out_dir", required=True, help="device_check.sh's $OUT")
    ap.add_argument("--dry", action="store_true", help="say that the values come from a dry run")
    args = ap.parse_args(argv)
    rows = evaluate(args.out_dir)
    print_table(rows, args.dry)
    tmp = os.path.join(args.out_dir, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(dict(dry=args.dry, bars=rows), f, indent=1)
    os.replace(tmp, os.path.join(args.out_dir, "summary.json"))


if __name__ == "__main__":
    main()
