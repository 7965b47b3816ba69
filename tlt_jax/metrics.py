"""Run metrics: one JSON line per step, TensorBoard, PNG plots, a progress bar, the lines a
person reads.

`<run_dir>/metrics.jsonl` is the record of a run: one JSON object per step,
`{"step": 12, "wall_time": 1712345678.9, "reward/mean": 0.41, ...}`, flushed as it is
written, so a killed run loses at most the line it was writing (which `read_metrics`
then skips). TensorBoard (tensorboardX, `<run_dir>/tensorboard`) gets the same scalars,
and histograms of array-valued metrics. A run resumed from a checkpoint at step k drops
the records after k from both (`truncate_after`), so no step has two values.
`<run_dir>/eval_samples.jsonl` (`write_samples`) holds every evaluated sample, one JSON
object each with its step, and is truncated alike. In a
multi-host run only process 0 writes; the writer is a no-op elsewhere.

The plot helpers draw on a bare `matplotlib.figure.Figure` (Agg canvas, no pyplot
state), so they are safe to call from a training loop or a background thread; each
writes a PNG and returns its figure (a notebook shows it inline). Axes and legends
read `label(key)`, not raw metric names.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import jax
import numpy as np
from absl import logging
from tqdm import auto as tqdm_auto

if TYPE_CHECKING:
    from matplotlib.figure import Figure

METRICS_FILENAME = "metrics.jsonl"
EVAL_SAMPLES_FILENAME = "eval_samples.jsonl"  # every evaluated sample: prompt, completion, reward, ...
TENSORBOARD_SUBDIR = "tensorboard"
_RESERVED_KEYS = ("step", "wall_time")


def write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> None:
    """Writes obj as JSON through a temporary file and a rename, so neither a reader nor
    a run cut short mid-write ever sees half a file (benchmarks rewrite theirs often)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent)
    os.replace(tmp, path)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl, in file order.

    A last line that is not valid JSON (the write a kill interrupted) is skipped with a
    warning; an invalid line anywhere else raises ValueError.
    """
    with open(path) as f:
        lines = f.read().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number < len(lines):
                raise ValueError(f"{path}:{number} is not a JSON record: {e}") from e
            logging.warning("Skipping the torn last line of %s: %r", path, line[:80])
    return records


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases logging beside TensorBoard (`--config.wandb.project=...`; the
    `wandb` package, `pip install wandb`). mode "offline" (the default: no network needed)
    keeps the run under <run_dir>/wandb for a later `wandb sync`; "online" streams it."""

    project: str = ""  # "": no W&B logging
    name: str = ""  # "": the run directory's name
    mode: str = "offline"  # offline | online

    def check(self) -> None:
        if not self.project:
            return
        if self.mode not in ("offline", "online"):
            raise ValueError(f"wandb.mode={self.mode!r}; choose offline or online.")
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ImportError(f"wandb.project={self.project!r} needs the wandb package, which is not installed: "
                              "pip install wandb (or set --config.wandb.project='').")

    def start(self, run_dir: str):
        """The W&B run of this run directory: resumed (the same id) when it is run again."""
        import wandb

        self.check()
        run_dir = os.path.abspath(run_dir)
        run_id = "tlt-" + hashlib.blake2b(run_dir.encode(), digest_size=6).hexdigest()
        return wandb.init(project=self.project, name=self.name or os.path.basename(run_dir), id=run_id,
                          resume="allow", dir=run_dir, mode=self.mode)


def _summary_writer():
    """tensorboardX's SummaryWriter, imported on first use and without torch: tensorboardX
    tries `import torch` only to accept torch tensors, which nothing here passes, and torch
    costs 2-3 s of CPU in every process that writes metrics. A process that has torch
    already keeps it."""
    hide_torch = "torch" not in sys.modules and "tensorboardX" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None  # `import torch` raises ImportError, as where torch is not installed
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide_torch:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Writes per-step metrics to `<run_dir>/metrics.jsonl` and TensorBoard (process 0).

    Usage:
        with MetricsWriter(run_dir, resume_step=meta["step"] if resumed else None) as w:
            w.write(step, {"reward/mean": 0.4, "reward/std": 0.1, "lengths": lengths_B})
    """

    def __init__(self, run_dir: str | os.PathLike, use_tensorboard: bool = True,
                 resume_step: int | None = None, wandb: WandbConfig | None = None):
        """
        Args:
          run_dir: directory of the run (created if missing).
          use_tensorboard: also write TensorBoard event files.
          resume_step: the step a resumed run restarts after; later records are dropped.
          wandb: also log the scalars to Weights & Biases (one W&B run per run directory,
            resumed with it; `WandbConfig`).
        """
        self.path = os.path.join(run_dir, METRICS_FILENAME)
        self.samples_path = os.path.join(run_dir, EVAL_SAMPLES_FILENAME)
        self._tensorboard_dir = os.path.join(run_dir, TENSORBOARD_SUBDIR) if use_tensorboard else None
        self._enabled = jax.process_index() == 0
        self._file = None
        self._tensorboard = None
        self._wandb = None
        if not self._enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if wandb is not None and wandb.project:
            self._wandb = wandb.start(run_dir)
        if resume_step is None:
            self._open(purge_step=None)
        else:
            self.truncate_after(resume_step)

    def _open(self, purge_step: int | None) -> None:
        self._file = open(self.path, "a")
        if self._tensorboard_dir is not None:
            # purge_step hides events at or after it that an earlier (killed) run wrote.
            self._tensorboard = _summary_writer()(self._tensorboard_dir, purge_step=purge_step, flush_secs=30)

    def _close_files(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def truncate_after(self, step: int) -> None:
        """Drops every record with a step greater than `step`, on disk and in TensorBoard.

        The JSONL is rewritten to a side file and renamed over the original, so a kill
        during the rewrite leaves either the old or the new file, never a mix.
        """
        if not self._enabled:
            return
        self._close_files()
        for path in (self.path, self.samples_path):
            if os.path.exists(path):
                kept = [r for r in read_metrics(path) if r["step"] <= step]
                rewritten = path + ".rewrite"
                with open(rewritten, "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in kept)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(rewritten, path)
        self._open(purge_step=step + 1)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records `metrics` for `step`.

        Scalars (Python or numpy numbers, bools, 0-d arrays) go to the JSONL and to
        TensorBoard scalars; arrays with at least one dimension (e.g. response lengths)
        become TensorBoard histograms only, keeping the JSONL one small line per step.
        """
        if not self._enabled:
            return
        record: dict[str, Any] = {"step": int(step), "wall_time": time.time()}
        for name, value in metrics.items():
            if name in _RESERVED_KEYS:
                raise ValueError(f"Metric name {name!r} is reserved for the record itself.")
            array = np.asarray(value)
            if array.dtype.kind not in "biuf":
                raise TypeError(f"Metric {name!r} is not numeric: {value!r}")
            if array.ndim == 0:
                record[name] = array.item()
                if self._tensorboard is not None:
                    self._tensorboard.add_scalar(name, float(array), step)
            elif self._tensorboard is not None and array.size:
                self._tensorboard.add_histogram(name, array.ravel(), step)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k not in _RESERVED_KEYS}, step=int(step))

    def write_samples(self, step: int, samples: Iterable[Mapping[str, Any]]) -> None:
        """Appends one JSON record per sample, `{"step": step, **sample}`, to eval_samples.jsonl."""
        if not self._enabled:
            return
        with open(self.samples_path, "a") as f:
            f.writelines(json.dumps({"step": int(step), **sample}) + "\n" for sample in samples)

    def close(self) -> None:
        self._close_files()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


_LABELS = {
    "reward_mean": "reward (mean ± std)",
    "accuracy": "train accuracy",
    "eval_accuracy": "eval accuracy (greedy)",
    "loss": "loss",
    "kl": "KL (nats)",
    "eval_kl": "eval KL (nats)",
    "top1_agree": "top-1 agreement",
    "eval_top1_agree": "eval top-1 agreement",
    "lr": "learning rate",
    "acceptance_length": "acceptance length",
    "accept_rate": "teacher-forced acceptance",
    "drafter/served_accept_rate": "served drafter's teacher-forced acceptance",
    "speculative_token_share": "speculative token share",
    "rollout_tokens_per_s": "rollout tokens/s",
    "drafter_version": "drafter version",
    "spot/steps": "drafter steps in gaps",
    "spot/hidden_share": "drafter time hidden",
    "time_rollout_s": "rollout",
    "time_reward_s": "reward scoring",
    "time_learner_s": "learner update",
    "time_weight_sync_s": "weight sync",
}


def new_figure(**kwargs) -> Figure:
    """A bare `matplotlib.figure.Figure`. matplotlib is imported here, on the first plot:
    at module level it cost every process a quarter second of its start (launchers that
    fail a flag check, `--help`, the tests' processes)."""
    from matplotlib.figure import Figure
    return Figure(**kwargs)


def label(key: str) -> str:
    """A metric's name as a person reads it on an axis or legend: 'time_rollout_s' ->
    'rollout', 'eval/accuracy' -> 'eval accuracy'."""
    if key in _LABELS:
        return _LABELS[key]
    words = key.replace("/", " ").replace("_", " ").split()
    if words and words[0] == "time":
        words = words[1:]
    if words and words[-1] == "s":
        words = words[:-1]
    return " ".join(words) or key


def report(message: str) -> None:
    """A line for the person running the job (a warm start's accuracy, a resumption, the
    result): on stderr between the progress bars, without log prefixes, process 0 only."""
    if jax.process_index() == 0:
        tqdm_auto.tqdm.write(message, file=sys.stderr)
        sys.stderr.flush()


def _std_key(key: str) -> str | None:
    """'reward/mean' -> 'reward/std', 'loss_mean' -> 'loss_std'; None if not a mean."""
    return key[: -len("mean")] + "std" if key.endswith("mean") else None


def plot_curves(records: Sequence[Mapping[str, Any]], keys: Sequence[str],
                path: str | os.PathLike, title: str | None = None,
                bounds: Mapping[str, tuple[float, float]] | None = None) -> Figure:
    """One panel per key against step, written as a PNG.

    A key ending in "mean" gets a +-1 std band when the matching "std" key is recorded
    (e.g. "reward/mean" with "reward/std"), clipped to `bounds[key]` (the range the
    metric's samples can take: a reward in [0, 1] has no mass outside it). Metrics
    recorded on some steps only (eval accuracy) are plotted at the steps that have them,
    with markers when sparse.
    """
    bounds = bounds or {}
    figure = new_figure(figsize=(7, 2.4 * len(keys)), layout="constrained")
    axes = figure.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, keys):
        rows = [r for r in records if key in r]
        ax.set_ylabel(label(key))
        ax.grid(alpha=0.3)
        if not rows:
            ax.text(0.5, 0.5, "no records", transform=ax.transAxes, ha="center", va="center")
            continue
        steps = np.array([r["step"] for r in rows])
        values = np.array([r[key] for r in rows], dtype=np.float64)
        ax.plot(steps, values, marker="o" if len(rows) <= 50 else None, markersize=3)
        std_key = _std_key(key)
        if std_key is not None and all(std_key in r for r in rows):
            std = np.array([r[std_key] for r in rows], dtype=np.float64)
            low, high = bounds.get(key, (-np.inf, np.inf))
            ax.fill_between(steps, np.clip(values - std, low, high), np.clip(values + std, low, high), alpha=0.25,
                            label="±1 std" + (f", clipped to [{low:g}, {high:g}]" if key in bounds else ""))
            ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("step")
    if title:
        figure.suptitle(title)
    figure.savefig(path, dpi=100)
    return figure


def plot_length_histogram(lengths: Iterable[int], path: str | os.PathLike, bins: int = 50,
                          title: str | None = None) -> Figure:
    """Response-length histogram on a log count axis, so the long tail stays visible.

    p50, p90 and the maximum are marked: the gap between p90 and max is the tail that
    idles the devices that finished early.
    """
    lengths = np.asarray(list(lengths), dtype=np.float64)
    if lengths.size == 0:
        raise ValueError("plot_length_histogram needs at least one length")
    figure = new_figure(figsize=(7, 3.5), layout="constrained")
    ax = figure.subplots()
    ax.hist(lengths, bins=bins, log=True, color="tab:blue", alpha=0.8)
    for label, value, color in (("p50", np.percentile(lengths, 50), "tab:green"),
                                ("p90", np.percentile(lengths, 90), "tab:orange"),
                                ("max", lengths.max(), "tab:red")):
        ax.axvline(value, color=color, linestyle="--", label=f"{label} = {value:.0f}")
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("responses (log)")
    ax.legend(loc="upper right")
    ax.set_title(title or f"response lengths (n={lengths.size})")
    figure.savefig(path, dpi=100)
    return figure


def plot_time_split(records: Sequence[Mapping[str, Any]], keys: Sequence[str],
                    path: str | os.PathLike, title: str | None = None, outlier_factor: float = 3.0) -> Figure:
    """Stacked bars of where each step's time went, e.g. keys = ("time/rollout",
    "time/reward", "time/learner", "time/weight_sync", "time/idle") in seconds.

    Steps that record none of the keys are left out; a key missing from a step counts 0.
    A step taking over `outlier_factor` times the median step (the first, which compiles;
    one slowed by other work on the machine) would flatten the others: the axis stops
    above the rest, and such a bar is cut there with its total written on it.
    """
    rows = [r for r in records if any(k in r for k in keys)]
    if not rows:
        raise ValueError(f"No record has any of {list(keys)}")
    steps = np.array([r["step"] for r in rows], dtype=np.float64)
    width = 0.8 * (np.diff(steps).min() if len(steps) > 1 else 1.0)
    figure = new_figure(figsize=(8, 3.5), layout="constrained")
    ax = figure.subplots()
    bottom = np.zeros(len(rows))
    for key in keys:
        seconds = np.array([r.get(key, 0.0) for r in rows], dtype=np.float64)
        ax.bar(steps, seconds, width=width, bottom=bottom, label=label(key))
        bottom += seconds
    outliers = bottom > outlier_factor * np.median(bottom)
    ax.set_xlabel("step")
    if outliers.any() and not outliers.all():
        top = 1.15 * bottom[~outliers].max()
        ax.set_ylim(0, top)
        for step, total in zip(steps[outliers], bottom[outliers]):
            ax.annotate(f"{total:.3g} s", (step, 0.98 * top), ha="center", va="top", fontsize="x-small", rotation=90,
                        bbox=dict(boxstyle="square,pad=0.1", facecolor="white", alpha=0.8, lw=0))
        ax.set_xlabel(f"step (bars over {top:.3g} s are cut, their totals written on them)")
    ax.set_ylabel("seconds")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or "where each step's time went")
    figure.savefig(path, dpi=100)
    return figure


def plot_rollout_timeline(timeline, path: str | os.PathLike, title: str | None = None) -> Figure:
    """Active sequences over the seconds of one rollout (a `rollout.timeline.RolloutTimeline`),
    one line per data-parallel group, speculative chunks shaded: the long tail, and where
    the tuner switched speculation on. `title` says which rollout (e.g. the RL step)."""
    figure = new_figure(figsize=(8, 3.5), layout="constrained")
    ax = figure.subplots()
    shaded = False
    for g in timeline.groups:
        steps = g.steps()
        if steps:
            ax.step([t - timeline.origin for t, _, _ in steps], [a for _, a, _ in steps], where="mid",
                    label=f"group {g.group}")
        for chunk in g.chunks:
            if chunk.kind == "speculative":
                ax.axvspan(chunk.start - timeline.origin, chunk.end - timeline.origin, color="tab:orange",
                           alpha=0.2, lw=0, label=None if shaded else "speculative decoding")
                shaded = True
        ax.axvline(g.end - timeline.origin, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("seconds since rollout start")
    ax.set_ylabel("active sequences")
    s = timeline.summary()
    ax.set_title(f"{title or 'rollout'}: {s['tokens']} tokens, group idle {s['group_idle_fraction']:.0%}, "
                 f"slot idle {s['slot_idle_fraction']:.0%}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize="small")
    figure.savefig(path, dpi=100)
    return figure


class ProgressBar:
    """A tqdm bar over training steps showing chosen metrics in its postfix.

    Shown on process 0 only. Extra keyword arguments go to tqdm (e.g. `file`, `leave`).
    """

    def __init__(self, total: int, keys: Sequence[str], initial: int = 0, desc: str = "train",
                 **tqdm_kwargs):
        self._keys = tuple(keys)
        tqdm_kwargs.setdefault("disable", jax.process_index() != 0)
        self._bar = tqdm_auto.tqdm(total=total, initial=initial, desc=desc, unit="step",
                                   dynamic_ncols=True, **tqdm_kwargs)

    def update(self, metrics: Mapping[str, Any], steps: int = 1) -> None:
        """Advances by `steps` and shows the latest values of the chosen keys."""
        shown = {k: f"{float(metrics[k]):.4g}" for k in self._keys if k in metrics}
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(steps)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
