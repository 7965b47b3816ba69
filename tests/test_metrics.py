"""Tests of tlt_jax/metrics.py: JSONL round trip, truncation on resume, TensorBoard, plots."""

import glob
import importlib.machinery
import importlib.util
import io
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from tlt_jax import metrics


def _tensorboard_events(run_dir):
    """(tag, step, scalar or None for a histogram) of every summary in the run's event files."""
    events = []
    for path in sorted(glob.glob(os.path.join(run_dir, metrics.TENSORBOARD_SUBDIR, "events.*"))):
        data = open(path, "rb").read()
        offset = 0
        while offset < len(data):  # TFRecord framing: length, crc, payload, crc
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalar = value.simple_value if value.WhichOneof("value") == "simple_value" else None
                events.append((value.tag, event.step, scalar))
    return events


def _write_steps(writer, steps):
    for step in steps:
        writer.write(step, {"reward/mean": 0.1 * step, "reward/std": 0.01 * step,
                            "loss": np.float32(1.0 / step), "tokens": jnp.int32(100 * step),
                            "truncated": step % 2 == 0,
                            "lengths": np.arange(step, step + 8)})


def test_jsonl_round_trip_and_tensorboard(tmp_path):
    with metrics.MetricsWriter(tmp_path) as writer:
        _write_steps(writer, [1, 2, 3])
        # Flushed per write: readable while the writer is still open.
        assert [r["step"] for r in metrics.read_metrics(writer.path)] == [1, 2, 3]
    records = metrics.read_metrics(tmp_path / metrics.METRICS_FILENAME)
    assert [set(r) for r in records] == [
        {"step", "wall_time", "reward/mean", "reward/std", "loss", "tokens", "truncated"}] * 3
    assert records[1]["reward/mean"] == 0.1 * 2 and records[1]["tokens"] == 200
    assert records[1]["loss"] == float(np.float32(0.5)) and records[1]["truncated"] is True

    events = _tensorboard_events(tmp_path)
    assert ("reward/mean", 3, pytest.approx(0.3)) in events
    assert ("lengths", 2, None) in events  # the array went in as a histogram


def test_truncate_after_on_resume(tmp_path):
    with metrics.MetricsWriter(tmp_path) as writer:
        _write_steps(writer, range(1, 6))
    with open(tmp_path / metrics.METRICS_FILENAME, "a") as f:
        f.write('{"step": 6, "loss"')  # the line a SIGKILL cut short
    assert [r["step"] for r in metrics.read_metrics(tmp_path / metrics.METRICS_FILENAME)] == [
        1, 2, 3, 4, 5]

    with metrics.MetricsWriter(tmp_path, resume_step=3) as writer:
        assert [r["step"] for r in metrics.read_metrics(writer.path)] == [1, 2, 3]
        _write_steps(writer, [4, 5])
        writer.truncate_after(4)
        _write_steps(writer, [5])
    records = metrics.read_metrics(tmp_path / metrics.METRICS_FILENAME)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]


def test_invalid_line_in_the_middle_raises(tmp_path):
    path = tmp_path / metrics.METRICS_FILENAME
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=":2 is not a JSON record"):
        metrics.read_metrics(path)


def test_rejects_bad_metrics(tmp_path):
    with metrics.MetricsWriter(tmp_path, use_tensorboard=False) as writer:
        with pytest.raises(ValueError, match="reserved"):
            writer.write(1, {"step": 3})
        with pytest.raises(TypeError, match="not numeric"):
            writer.write(1, {"phase": "rollout"})
    assert not os.path.exists(tmp_path / metrics.TENSORBOARD_SUBDIR)


def test_only_process_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with metrics.MetricsWriter(tmp_path / "run") as writer:
        _write_steps(writer, [1])
        writer.truncate_after(0)
    assert not os.path.exists(tmp_path / "run")


def _assert_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 1000


def test_plots_write_pngs(tmp_path):
    rng = np.random.default_rng(0)
    records = [{"step": s, "reward/mean": np.tanh(s / 20), "reward/std": 0.1,
                "time/rollout": 5 + rng.exponential(2), "time/learner": 2.0,
                "time/weight_sync": 0.3, "time/idle": rng.exponential(1)} for s in range(1, 61)]
    for record in records[::10]:
        record["eval/accuracy"] = record["reward/mean"] * 0.9

    metrics.plot_curves(records, ["reward/mean", "eval/accuracy", "never/recorded"],
                        tmp_path / "curves.png", title="toy run")
    metrics.plot_length_histogram(rng.lognormal(6, 0.8, size=512).astype(int),
                                  tmp_path / "lengths.png")
    metrics.plot_time_split(records, ["time/rollout", "time/reward", "time/learner",
                                      "time/weight_sync", "time/idle"], tmp_path / "split.png")
    for name in ("curves.png", "lengths.png", "split.png"):
        _assert_png(tmp_path / name)
    with pytest.raises(ValueError):
        metrics.plot_length_histogram([], tmp_path / "empty.png")


def test_plots_read_like_a_report(tmp_path):
    """Readable labels, a std band inside the reward's range, a compile-heavy first step
    that does not flatten the other bars, the rollout shown named and its speculation shaded."""
    records = [{"step": s, "reward_mean": 0.9, "reward_std": 0.3, "time_rollout_s": 5.0, "time_learner_s": 2.0}
               for s in range(1, 11)]
    records[0]["time_learner_s"] = 120.0  # the first step compiles
    figure = metrics.plot_curves(records, ["reward_mean"], tmp_path / "reward.png", title="GRPO",
                                 bounds={"reward_mean": (0.0, 1.0)})
    ax = figure.axes[0]
    band = ax.collections[0].get_paths()[0].vertices
    assert band[:, 1].max() <= 1.0 and band[:, 1].min() == pytest.approx(0.6)
    assert ax.get_ylabel() == metrics.label("reward_mean") != "reward_mean"

    figure = metrics.plot_time_split(records, ["time_rollout_s", "time_learner_s"], tmp_path / "split.png")
    ax = figure.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["rollout", "learner update"]
    assert ax.get_title() and ax.get_ylim()[1] < 20  # the 125 s bar is cut, not the scale
    assert any(t.get_text() == "125 s" for t in ax.texts)

    from tlt_jax.rollout.timeline import Chunk, GroupTimeline, RolloutTimeline, SpecChunk
    timeline = RolloutTimeline([GroupTimeline(0, 4, start=0.0, end=3.0, chunks=[
        Chunk(0.0, 2.0, [4, 4, 2, 1], [4, 4, 2, 1]),
        SpecChunk(2.0, 3.0, [1], [3], committed_per_sequence=[3])])], origin=0.0)
    figure = metrics.plot_rollout_timeline(timeline, tmp_path / "timeline.png", title="Rollout of RL step 7")
    ax = figure.axes[0]
    assert ax.get_title().startswith("Rollout of RL step 7: 14 tokens")
    assert "speculative decoding" in [t.get_text() for t in ax.get_legend().get_texts()]
    figure = metrics.plot_length_histogram([3, 5, 40], tmp_path / "lengths.png", title="RL step 7")
    assert figure.axes[0].get_title() == "RL step 7"
    for name in ("reward.png", "split.png", "timeline.png", "lengths.png"):
        _assert_png(tmp_path / name)


def test_label_names_metrics_for_people():
    assert metrics.label("time_weight_sync_s") == "weight sync"
    assert metrics.label("time/idle") == "idle"
    assert metrics.label("eval/accuracy") == "eval accuracy"


def test_progress_bar_shows_chosen_metrics():
    out = io.StringIO()
    with metrics.ProgressBar(total=3, keys=["reward/mean", "loss"], file=out, mininterval=0) as bar:
        for step in range(1, 4):
            bar.update({"reward/mean": 0.123456 * step, "loss": 2.0, "ignored": 7})
    text = out.getvalue()
    assert "3/3" in text and "reward/mean=0.3704" in text and "loss=2" in text
    assert "ignored" not in text


def test_wandb_logs_the_records_of_one_run_per_directory(tmp_path, monkeypatch):
    """With wandb.project set, every record also goes to W&B, offline by default, as one W&B
    run per run directory that a resumed run continues (a stand-in module records the calls)."""
    import sys
    import types

    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or Run()
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = metrics.WandbConfig(project="tlt")
    for resume in (None, 1):
        with metrics.MetricsWriter(tmp_path / "run", resume_step=resume, wandb=config) as writer:
            writer.write(2 if resume else 1, {"reward_mean": 0.5, "lengths": np.arange(3)})
    inits = [c[1] for c in calls if c[0] == "init"]
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"] and inits[0]["mode"] == "offline"
    assert inits[0]["project"] == "tlt" and inits[0]["resume"] == "allow" and inits[0]["name"] == "run"
    assert [c for c in calls if c[0] == "log"] == [("log", 1, {"reward_mean": 0.5}), ("log", 2, {"reward_mean": 0.5})]
    assert calls.count(("finish",)) == 2
    with pytest.raises(ValueError, match="wandb.mode='sometimes'"):
        metrics.WandbConfig(project="tlt", mode="sometimes").check()
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install wandb"):
        metrics.WandbConfig(project="tlt").check()
