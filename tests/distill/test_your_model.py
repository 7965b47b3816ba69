"""Distillation and the offline drafter on models and data as a user brings them: Qwen2
checkpoints with a byte-level BPE tokenizer (chat template, no <bos>, <pad> =
<|endoftext|>, which is also an end token) and rows from a JSONL or Parquet file, prompts
in the chat template. The teacher must attend with each packed row's own layout: its cached
top-K equals the teacher's over every example on its own."""
import json
import os

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import distill as distill_config
from configs import drafter as drafter_config
from configs.common import data_config
from experiments.make_random_hf import write_random_checkpoint
from tests.support.bpe_model import write_bpe_qwen2
from tlt_jax.distill import teacher_cache as tc
from tlt_jax.distill import train
from tlt_jax.drafter_training import io
from tlt_jax.drafter_training import trainer as drafter_trainer
from tlt_jax.models import transformer as tfm
from tlt_jax.models.hf_io import load_hf
from tlt_jax.tokenizer import build_bpe_tokenizer, load_tokenizer

SEQ_LEN = 160  # two examples (of ~67 tokens, the template's system prompt included) per row
STEPS = 2


def _problems(n, offset=0):
    return [{"prompt": f"What is {a} + {a + 30}?", "answer": f"<answer>{2 * a + 30}</answer>"}
            for a in range(offset, offset + n)]


# One xdist worker runs this module (setup.cfg: --dist loadgroup), so its module fixture
# (the user's files and distilled student) is built once, not once per worker.
pytestmark = pytest.mark.xdist_group("test_distill_your_model")


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A teacher (2 layers), a smaller student of its family (1 layer, same tokenizer) and
    the data files."""
    root = tmp_path_factory.mktemp("your_model")
    paths = {"teacher": write_bpe_qwen2(str(root / "teacher"), num_layers=2, seed=0),
             "student": write_bpe_qwen2(str(root / "student"), num_layers=1, seed=1)}
    for split, rows in (("train", _problems(10)), ("eval", _problems(4, offset=50))):
        with open(root / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        pq.write_table(pa.Table.from_pylist(rows), root / f"{split}.parquet")
        paths.update({f"{split}.{ext}": str(root / f"{split}.{ext}") for ext in ("jsonl", "parquet")})
    return root, paths


def _chat_rows(ext, paths):
    return data_config(source="files", train=paths[f"train.{ext}"], eval=paths[f"eval.{ext}"], num_train=0,
                       num_eval=0, chat_template=True, seq_len=SEQ_LEN)


def _distill_config(paths, run_dir, **overrides):
    c = distill_config.get_config("tiny")
    c.update(teacher_dir=paths["teacher"], student_dir=paths["student"], data=_chat_rows("jsonl", paths),
             cache_kind="topk", top_k=4, eval_top_k=8, cache_batch_size=8, cache_rows_per_shard=2, steps=STEPS,
             batch_size=8, eval_every=STEPS, eval_batch_size=8, checkpoint_every=STEPS, run_dir=str(run_dir))
    c.optimizer.update(warmup_steps=0, schedule="constant", learning_rate=1e-3)
    c.update(**overrides)
    return c


def _spy(monkeypatch, module, name):
    """Records the outputs of module.name (a packing function) in a list."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    return calls


def _check_chat_rows(rows, tokenizer, example):
    """Row 0 opens with the first example as the chat template makes it, then its answer and
    <|im_end|>; a second example starts at position 0 in segment 2."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": example["prompt"]}],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    ids = list(prompt) + tokenizer(example["answer"], add_special_tokens=False)["input_ids"]
    ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    n = len(ids)
    assert tokenizer.bos_token_id is None and tokenizer.pad_token == "<|endoftext|>"
    np.testing.assert_array_equal(rows["tokens"][0, :n], ids)
    np.testing.assert_array_equal(rows["positions"][0, :n], np.arange(n))
    assert (rows["segment_ids"][0, :n] == 1).all() and rows["segment_ids"][0, n] == 2 and rows["positions"][0, n] == 0
    assert not rows["mask"][0, :len(prompt) - 1].any() and rows["mask"][0, len(prompt) - 1:n - 1].all()


@pytest.fixture(scope="module")
def distilled(user):
    root, paths = user
    with pytest.MonkeyPatch.context() as mp:
        packed = _spy(mp, train, "pack_examples")
        summary = train.train_distill(_distill_config(paths, root / "distill"), progress=False)
    return root, paths, summary, dict(zip(("train", "eval"), packed))


def test_distill_a_student_checkpoint_on_a_chat_file(distilled):
    root, paths, summary, rows = distilled
    assert summary["mode"] == "offline" and summary["steps"] == STEPS
    assert summary["teacher_rows_cached"] >= len(rows["train"]["tokens"]) + len(rows["eval"]["tokens"])
    assert np.isfinite(summary["loss"]) and 0 <= summary["eval_top1_agree"] <= 1
    tokenizer = load_tokenizer(paths["teacher"])
    _check_chat_rows(rows["train"], tokenizer, _problems(1)[0])
    # The student started from its checkpoint: two steps at lr 1e-3 move no weight far.
    student_cfg, start = load_hf(paths["student"])
    out_cfg, out = load_hf(os.path.join(root, "distill", "hf"))
    assert (out_cfg.num_layers, out_cfg.vocab_size) == (1, student_cfg.vocab_size)
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), out, start)
    assert 0 < max(jax.tree.leaves(moved)) < 5e-3, moved


def test_the_cache_holds_the_teacher_over_each_example_alone(distilled):
    """Of every packed example, the cached top-K log-probs are the teacher's over that
    example by itself (positions from 0, attending to nothing else): the teacher saw the
    rows' layout. The cache records that layout."""
    root, paths, _, rows = distilled
    cfg, params = load_hf(paths["teacher"])
    rows = rows["train"]
    path = os.path.join(root, "distill", "teacher_cache", "train")
    meta = tc.read_cache_meta(path)
    assert meta.layout_fingerprint == tc.layout_fingerprint(rows["positions"], rows["segment_ids"])
    ids_NTK, logp_NTK = tc.TeacherCacheReader(path, meta).read(np.arange(len(rows["tokens"])))
    forward = jax.jit(lambda params, tokens_T: jax.nn.log_softmax(tfm.logits_from_hidden(
        params, cfg, tfm.forward(params, cfg, tokens_T[None]))[0].astype(np.float32)))
    logp_of = lambda tokens_T: forward(params, tokens_T)
    checked = 0
    for r, seg_T in enumerate(rows["segment_ids"]):
        for s in range(1, seg_T.max() + 1):
            at = np.flatnonzero(seg_T == s)
            ref_TV = np.asarray(logp_of(rows["tokens"][r, at]))
            np.testing.assert_allclose(logp_NTK[r, at], np.sort(ref_TV, -1)[:, ::-1][:, :meta.top_k], atol=2e-5)
            np.testing.assert_allclose(np.take_along_axis(ref_TV, ids_NTK[r, at], -1), logp_NTK[r, at], atol=2e-5)
            checked += 1
    assert checked > len(rows["tokens"])  # several examples per row


def test_a_student_of_another_vocabulary_is_refused(user):
    root, paths = user
    bigger = write_random_checkpoint(str(root / "bigger_vocab"), "qwen2", tokenizer=load_tokenizer(paths["teacher"]),
                                     vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                     num_kv_heads=1)
    other_tok = build_bpe_tokenizer(str(root / "other_tokens"), ["another corpus entirely, 0123456789"] * 20,
                                    vocab_size=300)
    other = write_random_checkpoint(str(root / "other_tokens"), "qwen2", tokenizer=other_tok, vocab_size=416,
                                    hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    for student, what in ((bigger, "embedding has 512 rows, the teacher's 416"), (other, "tokenizers differ")):
        config = _distill_config(paths, root / "refused", student_dir=student)
        with pytest.raises(ValueError, match=rf"^--config.student_dir='{student}' and --config.teacher_dir="
                                             rf"'{paths['teacher']}' have different vocabularies.*{what}"):
            train.check_paths(config)
    assert not (root / "refused").exists()


def test_offline_drafter_on_a_parquet_file(user, monkeypatch):
    root, paths = user
    c = drafter_config.get_config("tiny")
    c.update(target_dir=paths["teacher"], data=_chat_rows("parquet", paths), top_k=4, steps=STEPS, batch_size=8,
             eval_every=STEPS, eval_batch_size=8, checkpoint_every=STEPS, run_dir=str(root / "drafter"))
    c.acceptance.update(num_prompts=2, num_samples=1, depth=2, max_tokens=4, num_slots=2, max_prompt_length=64)
    c.mesh.update(data=1, fsdp=8)  # one acceptance-rollout group: each more compiles its programs again
    packed = _spy(monkeypatch, drafter_trainer, "pack_examples")
    summary = drafter_trainer.train_drafter(c, progress=False)
    _check_chat_rows(packed[0], load_tokenizer(paths["teacher"]), _problems(1)[0])
    assert summary["steps"] == STEPS and np.isfinite(summary["loss"]) and 0 <= summary["eval_top1_agree"] <= 1
    assert summary["acceptance"]["acceptance_length"] >= 1
    target_cfg, _ = load_hf(paths["teacher"])
    io.load_drafter(summary["drafter_dir"], target_cfg)
