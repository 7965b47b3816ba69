"""Teacher caches compared by their students (experiments/bench_distill_caches.py): the arms,
their bytes, the paired tie rule and the ranking, table and plot it reports. No flags, so
tests and notebooks import it freely."""
from __future__ import annotations

import math

import numpy as np

from tlt_jax.distill import teacher_cache as tc

ARMS = ("exact", "topk", "topk_tail", "sampled")
TIE_SE = 2.0  # a pair within this many standard errors of its paired difference is a tie


def arms_for(ks: list[int], vocab: int, arms: list[str], sampled_at_v: bool = True) -> list[tuple[str, int]]:
    """(arm, K) in table order: at K = V the exact teacher (and a sampled cache if `arms` and
    `sampled_at_v` ask for one), below it `arms`."""
    bad = sorted(set(arms) - set(ARMS[1:]))
    if bad:
        raise ValueError(f"--arms: {bad} are not arms; choose from {', '.join(ARMS[1:])}")
    out = []
    for k in ks:
        k = k or vocab
        if not 1 <= k <= vocab:
            raise ValueError(f"--ks: K={k} must lie in [1, {vocab}] (the teacher's vocabulary), or 0 for all of it")
        if k == vocab:
            out += [("exact", k)] + [("sampled", k)] * ("sampled" in arms and sampled_at_v)
        else:
            out += [(arm, k) for arm in arms]
    return out


def cache_bytes(k: int, logp_dtype: str) -> int:
    """Bytes per position of a K-wide cache of either kind: int32 ids plus log-probs (or counts as wide)."""
    return k * (4 + np.dtype(tc.FieldSpec(logp_dtype, ()).np_dtype).itemsize)


def paired(a: np.ndarray, b: np.ndarray) -> dict:
    """Mean of a - b over paired seeds, its standard error, and whether it is within TIE_SE of them."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    se = float(np.std(d, ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("inf")
    return {"diff": float(np.mean(d)), "se": se, "tie": bool(abs(np.mean(d)) <= TIE_SE * se)}


def rank(arms: list[dict], metric: str = "eval_kl") -> list[dict]:
    """Arms sorted by mean `metric` (lower first), each with its paired comparison against every
    other arm: "beats" (lower beyond noise), "ties", "beaten_by"."""
    order = sorted(arms, key=lambda a: np.mean(a[metric]))
    for a in order:
        a["beats"], a["ties"], a["beaten_by"] = [], [], []
        for b in order:
            if b is not a:
                p = paired(a[metric], b[metric])
                a["ties" if p["tie"] else ("beats" if p["diff"] < 0 else "beaten_by")].append({"arm": b["name"], **p})
    return order


def _mean_se(values) -> str:
    return f"{np.mean(values):.4f} ({np.std(values, ddof=1) / math.sqrt(len(values)):.4f})"


def table(order: list[dict]) -> str:
    """Markdown: the arms by eval KL with their paired verdicts."""
    lines = ["| rank | arm | K | bytes / position | eval KL, mean (SE) | eval accuracy, mean (SE) | top-1 agreement | "
             "teacher mass outside K | beats | ties |", "|---:|---|---:|---:|---|---|---:|---:|---|---|"]
    for i, a in enumerate(order, 1):
        acc = _mean_se(a["eval_accuracy"]) if a.get("eval_accuracy") else "–"
        beats, ties = (", ".join(b["arm"] for b in a[key]) or "–" for key in ("beats", "ties"))
        lines.append(f"| {i} | {a['arm']} | {a['k']} | {a['bytes']} | {_mean_se(a['eval_kl'])} | {acc} | "
                     f"{np.mean(a['eval_top1_agree']):.3f} | {a['tail_mass']:.4f} | {beats} | {ties} |")
    return "\n".join(lines)


def plot(order: list[dict], path: str) -> None:
    """Eval KL (mean, 2 SE bars) against cache bytes per position (log scale), one marker per
    cache kind, the exact teacher as a horizontal band."""
    from tlt_jax import metrics

    fig = metrics.new_figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    styles = {"topk": ("o", "top-K"), "topk_tail": ("s", "top-K + tail"), "sampled": ("^", "sampled"),
              "exact": ("*", "exact (top-V)")}
    for arm, (marker, label) in styles.items():
        points = sorted((a["bytes"], np.mean(a["eval_kl"]), 2 * np.std(a["eval_kl"], ddof=1) / math.sqrt(
            len(a["eval_kl"]))) for a in order if a["arm"] == arm)
        if points:
            x, y, e = zip(*points)
            ax.errorbar(x, y, yerr=e, marker=marker, capsize=3, label=label, linestyle="-" if len(x) > 1 else "none")
    exact = next((a for a in order if a["arm"] == "exact"), None)
    if exact is not None:
        m, se = np.mean(exact["eval_kl"]), np.std(exact["eval_kl"], ddof=1) / math.sqrt(len(exact["eval_kl"]))
        ax.axhspan(m - 2 * se, m + 2 * se, color="grey", alpha=0.2)
    ax.set_xscale("log")
    ax.set_xlabel("cache bytes per position")
    ax.set_ylabel("held-out full-vocabulary KL (nats/token)")
    ax.set_title(f"students over {len(order[0]['eval_kl'])} paired seeds (bars: 2 SE)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
