"""Teacher caches compared by their students (experiments/bench_distill_caches.py): the arms,
their bytes, the teacher's targets held at the target positions only, the paired tie rule
and the ranking, table and plot it reports. No flags, so tests and notebooks import it freely."""
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


class TargetPositions:
    """The target positions of packed rows (mask[r, t]: position t predicts a target token) and
    the teacher's per-position values held there alone, [P, K] in row-major order. A
    whole-vocabulary target is V values a position: held at every position of every row it
    would be [rows, T, V] (1.3 GB at 1,000 rows of 160 tokens and V = 1,024), though the loss
    reads the few target positions (the answers) and ignores the others."""

    def __init__(self, mask_RT: np.ndarray):
        mask_RT = np.asarray(mask_RT, bool)
        self.mask_RT = mask_RT
        self.seq_len = mask_RT.shape[1] + 1  # the mask has one column fewer than the rows
        self.row_P, self.col_P = np.nonzero(mask_RT)
        self.start_R = np.searchsorted(self.row_P, np.arange(len(mask_RT) + 1))

    @property
    def count(self) -> int:
        return len(self.row_P)

    def gather(self, idx: np.ndarray, values_BTK: np.ndarray) -> np.ndarray:
        """The [P_idx, K] values at the target positions of rows idx (values_BTK their [B, T, K]);
        concatenated over idx = 0 .. rows - 1 in order, the table `scatter` reads."""
        idx = np.asarray(idx)
        if values_BTK.shape[:2] != (len(idx), self.seq_len):
            raise ValueError(f"values {values_BTK.shape} must be [{len(idx)}, {self.seq_len}, K]: rows idx by seq_len")
        return values_BTK[:, :-1][self.mask_RT[idx]]

    def scatter(self, idx: np.ndarray, values_PK: np.ndarray, fill) -> np.ndarray:
        """[B, T, K] for rows idx (repeats allowed): values_PK (all P positions) at each row's
        target positions, `fill` elsewhere. The loss and the eval mask the other positions out,
        so what fills them never reaches a number."""
        if len(values_PK) != self.count:
            raise ValueError(f"values_PK has {len(values_PK)} positions; the rows have {self.count} target positions")
        idx = np.asarray(idx)
        begin, end = self.start_R[idx], self.start_R[idx + 1]
        counts = end - begin
        pos = np.concatenate([np.arange(b, e) for b, e in zip(begin, end)]) if len(idx) else np.zeros(0, int)
        out = np.full((len(idx), self.seq_len, *values_PK.shape[1:]), fill, values_PK.dtype)
        out[np.repeat(np.arange(len(idx)), counts), self.col_P[pos]] = values_PK[pos]
        return out


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
