"""Tests of tlt_jax/distill/train.py: offline (cached) and online teachers give the same
student curves, a finished cache is reused without the teacher, and a cache made from
another teacher is refused."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import distill as distill_config
from configs import models
from tlt_jax import metrics, sharding
from tlt_jax.data import tasks
from tlt_jax.distill import teacher_cache as tc
from tlt_jax.distill import train
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import from_config_dict
from tlt_jax.models.hf_io import save_hf

STEPS = 4


def _save_teacher(path, tokenizer, seed):
    cfg = from_config_dict(models.model_config("tiny")).replace(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    save_hf(path, cfg, jax.device_get(tfm.init_params(cfg, jax.random.PRNGKey(seed), init_std=0.2)),
            tokenizer=tokenizer)
    return str(path)


def _config(teacher_dir, run_dir, **overrides):
    c = distill_config.get_config("tiny")
    c.teacher_dir = teacher_dir
    c.student.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    c.data.update(num_train=48, num_eval=16, seq_len=64)
    # The cache writer batches rows differently from training (16 vs 8), as in real runs; the
    # bfloat16 cache checks that the online path rounds like the cache.
    # A top-K cache (the default is a sampled one): what these tests check of a cache is its top-K.
    c.update(cache_kind="topk", top_k=4, eval_top_k=8, cache_dtype="bfloat16", cache_batch_size=16,
             cache_rows_per_shard=4, steps=STEPS, batch_size=8, eval_every=STEPS, eval_batch_size=8,
             checkpoint_every=STEPS, run_dir=str(run_dir))
    c.optimizer.update(warmup_steps=0, schedule="constant", learning_rate=1e-2)
    c.update(**overrides)
    return c


# One xdist worker runs this module (setup.cfg: --dist loadgroup), so its module fixture
# (the offline run) is built once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_distill")


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """A random teacher (with the task tokenizer) and an offline run from it."""
    root = tmp_path_factory.mktemp("distill")
    tokenizer = tasks.build_task_tokenizer(str(root / "tokenizer"))
    teacher_dir = _save_teacher(root / "teacher", tokenizer, seed=1)
    config = _config(teacher_dir, root / "offline")
    summary = train.train_distill(config, progress=False)
    return root, tokenizer, config, summary


def _records(run_dir):
    return {r["step"]: r for r in metrics.read_metrics(os.path.join(run_dir, metrics.METRICS_FILENAME))}


def test_online_and_offline_curves_agree(offline_run):
    root, _, offline, summary = offline_run
    assert summary["teacher_rows_cached"] > 0 and summary["mode"] == "offline"
    online = _config(offline.teacher_dir, root / "online", mode="online")
    assert train.train_distill(online, progress=False)["teacher_rows_cached"] == 0
    a, b = _records(offline.run_dir), _records(online.run_dir)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):  # bit for bit: the cache holds exactly what the online teacher gives
        curve_a, curve_b = [a[s][key] for s in sorted(a)], [b[s][key] for s in sorted(b)]
        np.testing.assert_array_equal(curve_a, curve_b, err_msg=key)
    for key in ("eval_loss", "eval_kl", "eval_top1_agree"):
        np.testing.assert_array_equal(a[STEPS][key], b[STEPS][key], err_msg=key)
    # The student learned something in a few steps, so the agreement is not vacuous.
    assert a[STEPS]["loss"] < a[1]["loss"]
    assert a[STEPS]["eval_kl"] >= 0 and 0 <= a[STEPS]["eval_top1_agree"] <= 1


def test_finished_cache_is_reused_without_the_teacher(offline_run, monkeypatch):
    _, _, offline, first = offline_run
    cache = os.path.join(offline.run_dir, "teacher_cache")
    markers = {os.path.join(done, name): os.stat(os.path.join(done, name)).st_mtime_ns
               for done in (os.path.join(cache, split, "done") for split in ("train", "eval"))
               for name in os.listdir(done)}
    assert len(markers) > 2  # several shards per split

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher ran although the cache is complete")

    monkeypatch.setattr(train, "make_teacher_topk", no_teacher)
    # Run again: the run resumes at its last step and evaluates the restored student on the
    # cached held-out targets, which must give the first run's final evaluation.
    again = train.train_distill(offline, progress=False)
    assert again["teacher_rows_cached"] == 0 and again["resumed_from"] == STEPS
    assert {path: os.stat(path).st_mtime_ns for path in markers} == markers
    for key in ("eval_loss", "eval_kl", "eval_top1_agree"):
        assert again[key] == pytest.approx(first[key], rel=1e-6), key


def test_cache_of_another_teacher_is_refused(offline_run):
    root, tokenizer, offline, _ = offline_run
    other = _config(_save_teacher(root / "other_teacher", tokenizer, seed=2), root / "other",
                    cache_dir=os.path.join(offline.run_dir, "teacher_cache"))
    with pytest.raises(tc.MetadataMismatchError, match="teacher_fingerprint.*point --config.cache_dir elsewhere"):
        train.train_distill(other, progress=False)


def test_bad_settings_are_refused(offline_run):
    root, _, offline, _ = offline_run
    for overrides, message in ((dict(top_k=99), r"top_k=99 must lie in \[1, 37\]"),
                               (dict(eval_top_k=2), "eval_top_k=2 must be >= top_k=4"),
                               (dict(mode="sideways"), "mode must be one of"),
                               (dict(cache_kind="dense"), "cache_kind='dense' is not a cache kind; set "
                                                          "--config.cache_kind to one of topk, sampled"),
                               (dict(cache_kind="sampled", cache_samples=0),
                                "cache_samples=0 must be >= 1 .*; set --config.cache_samples to 1 or more")):
        with pytest.raises(ValueError, match=message):
            train.train_distill(_config(offline.teacher_dir, root / "bad", **overrides), progress=False)


def test_a_sampled_cache_trains_as_the_online_sampler_and_is_refused_where_a_top_k_one_was_made(offline_run):
    """cache_kind="sampled": the cache holds each position's draws as distinct ids with counts,
    and the student's curves equal those of the same draws made online (each row's draws
    depend on its index alone); the held-out targets stay the teacher's top-K, so the final
    student is scored like a top-K run's, its answers included. A sampled run pointed at a
    top-K cache is refused naming cache_kind."""
    root, _, offline, _ = offline_run
    kind = dict(cache_kind="sampled", cache_samples=4)
    cached = train.train_distill(_config(offline.teacher_dir, root / "sampled", eval_accuracy=True, **kind),
                                 progress=False)
    assert (cached["cache_kind"], cached["cache_samples"], cached["top_k"]) == ("sampled", 4, 4)
    meta = tc.read_cache_meta(os.path.join(root, "sampled", "teacher_cache", "train"))
    assert (meta.cache_kind, meta.samples, meta.top_k) == ("sampled", 4, 4)
    assert tc.read_cache_meta(os.path.join(root, "sampled", "teacher_cache", "eval")).cache_kind == "topk"
    assert 0 <= cached["eval_accuracy"] <= 1 and 0 <= cached["eval_ece"] <= 1
    train.train_distill(_config(offline.teacher_dir, root / "sampled_online", mode="online", **kind), progress=False)
    a, b = _records(root / "sampled"), _records(root / "sampled_online")
    for key in ("loss", "grad_norm"):
        np.testing.assert_array_equal([a[s][key] for s in sorted(a)], [b[s][key] for s in sorted(b)], err_msg=key)
    assert a[STEPS]["loss"] != _records(offline.run_dir)[STEPS]["loss"]  # not the top-K run's targets
    with pytest.raises(tc.MetadataMismatchError, match="cache_kind is 'topk' on disk, 'sampled' expected"):
        train.train_distill(_config(offline.teacher_dir, root / "sampled_shared", **kind,
                                    cache_dir=os.path.join(offline.run_dir, "teacher_cache")), progress=False)


def test_a_run_stopped_midway_resumes_exactly_from_a_shared_cache(offline_run, tmp_path, monkeypatch):
    """A second run reads the first run's teacher cache (`cache_dir`; the teacher never
    runs), stops after 2 steps and, run again, ends with the uninterrupted run's losses."""
    _, _, offline, _ = offline_run
    monkeypatch.setattr(train, "make_teacher_topk", lambda *a, **k: pytest.fail("the teacher ran"))
    shared = dict(cache_dir=os.path.join(offline.run_dir, "teacher_cache"), checkpoint_every=2)
    first = train.train_distill(_config(offline.teacher_dir, tmp_path, steps=2, **shared), progress=False)
    assert first["teacher_rows_cached"] == 0
    again = train.train_distill(_config(offline.teacher_dir, tmp_path, **shared), progress=False)
    assert again["resumed_from"] == 2
    a, b = _records(offline.run_dir), _records(tmp_path)
    assert sorted(b) == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        np.testing.assert_array_equal([a[s][key] for s in sorted(a)], [b[s][key] for s in sorted(b)], err_msg=key)


def test_the_32k_preset_is_the_papers_setting_and_names_its_required_teacher():
    c = distill_config.get_config("llama3-8b-to-3b-32k")
    assert (c.top_k, c.eval_top_k, c.cache_dtype, c.data.seq_len, c.data.source, c.remat) == (
        100, 100, "bfloat16", 32768, "files", True)
    # The paper's loss is one flag away (--config.tail=False): the default adds the tail bucket.
    assert (c.tail, c.cache_kind) == (True, "topk")
    student = from_config_dict(c.student)
    assert student == from_config_dict(models.model_config("llama3.2-3b"))
    assert from_config_dict(models.model_config("llama3.1-8b")).vocab_size == student.vocab_size
    with pytest.raises(FileNotFoundError, match="^--config.teacher_dir=''"):
        train.check_paths(c)
    with pytest.raises(ValueError, match="presets: tiny, llama3-8b-to-3b-32k"):
        distill_config.get_config("llama3-70b")


def test_the_teacher_never_forms_a_row_of_logits():
    """XLA's temp bytes (compile time, nothing allocated) of the teacher's top-K at a shape
    where one row's float32 logits are 128 MiB: a token block's worth of them, not the row."""
    t, v = 2048, 16384
    cfg = from_config_dict(models.model_config("tiny")).replace(vocab_size=v)
    params = jax.eval_shape(lambda: tfm.init_params(cfg, jax.random.PRNGKey(0)))
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    step = train.teacher_topk_step(cfg, params, mesh, k=8, temperature=1.0, logp_dtype="float32")
    rows = jax.ShapeDtypeStruct((1, t), jnp.int32)
    temp = step.lower(params, rows, rows, rows).compile().memory_analysis().temp_size_in_bytes
    assert temp < t * v * 4 / 3, temp / (t * v * 4)  # the CPU's block: 256 of the 2048 rows
