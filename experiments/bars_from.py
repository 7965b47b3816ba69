r"""The adaptive drafter's bars of one seed from its modes run apart, each its own bench_tlt.

  python -m experiments.bars_from docs/results/bench_tlt_cpu_code_{baseline,tlt,frozen}_s0.json

bench_tlt prints the bars (experiments/tlt_bars.py) at the end of a run of several modes;
where the modes of one seed ran as separate commands (side by side, to share a loaded
machine's time), this reads each mode's first run among the results given, as
`bench_tlt --plot_from` does, and prints the same lines, with each trained drafter's
live acceptance over the frozen one's over the last third and the speculative token share
and drafter versions of each mode. Run nothing.
"""
import sys

from experiments.tlt_bars import first_runs, print_verdicts, read_results, thirds


def merged(paths: list[str]) -> dict:
    """A bench_tlt result whose `modes` are each mode's first run among `paths` (the preset,
    seed and decode settings those of the first), refusing results of different presets or seeds."""
    results = read_results(paths)
    out = {}
    for path, result in results:
        for key in ("preset", "seed"):
            if out.setdefault(key, result.get(key)) != result.get(key):
                raise ValueError(f"{path}: {key} {result.get(key)!r}, not {out[key]!r} as the results before it: "
                                 "the bars compare the modes of one preset and seed.")
        for key in ("decode_mlp_size", "regime"):
            out.setdefault(key, result.get(key))
    return dict(out, modes=first_runs(results))


def describe(result: dict) -> list[str]:
    """Per mode: eval accuracy along the run, the speculative token share and live acceptance
    over the first and the last third, the drafter versions it served."""
    lines = []
    fmt = lambda t: "n/a" if not t or t.get("last") is None else f"{t['first']:.3f} -> {t['last']:.3f}"
    for name, m in result["modes"].items():
        accept = (m.get("thirds") or {}).get("acceptance_length")
        steps = m.get("eval_steps") or []
        lines.append(f"{name}: eval accuracy {' / '.join(f'{e:.3f}' for e in m.get('eval_accuracy') or [])}"
                     + (f" (steps {', '.join(str(s) for s in steps)})" if steps else "") + "; speculative token share "
                     f"{fmt(thirds(m.get('speculative_token_share') or []))}; live acceptance {fmt(accept)}; "
                     f"drafter versions {max(m.get('drafter_version') or [0])}")
    frozen = ((result["modes"].get("frozen") or {}).get("thirds") or {}).get("acceptance_length") or {}
    for name in ("tlt", "scratch"):
        mine = ((result["modes"].get(name) or {}).get("thirds") or {}).get("acceptance_length") or {}
        if mine.get("last") and frozen.get("last"):
            ratio = mine["last"] / frozen["last"]
            lines.append(f"{name} over frozen, live acceptance over the last third: {ratio:.3f}x")
    return lines


def main(paths: list[str]) -> None:
    if not paths:
        raise SystemExit("usage: python -m experiments.bars_from RESULT.json ... (bench_tlt --out files of one "
                         "preset and seed)")
    result = merged(paths)
    print("\n".join(describe(result)))
    print_verdicts(result)


if __name__ == "__main__":
    main(sys.argv[1:])
