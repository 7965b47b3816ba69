"""Distillation of a student from a teacher's top-K distribution: the job of `configs/distill.py`.

Offline (the default): the teacher runs once over the token dataset and its draws (or its
top-K ids and log-probs: `cache_kind` below) go to a teacher cache on disk (`teacher_cache`,
resumable, checked against what it was made from); the student then trains from the cache with the fused top-K KL
(`losses.linear_topk_kl`). Online: the same teacher function runs in the loop on each batch.
Both modes feed the student the same rows in the same order with the same teacher values (the
online path rounds log-probs to the cache's dtype), so with one seed their loss curves agree;
the cache only saves the teacher's compute.

Student: `student_dir`, a checkpoint with the teacher's vocabulary (a pruned or smaller
model of its family: what the method is for), or, with student_dir "", `config.student`
from random weights.

Data: the `data` section through `tlt_jax.data.sources` (the synthetic tasks, files from
disk, reasoning-gym), each prompt in the teacher's format (its chat template or
`data.prompt_template`) followed by the response and the tokenizer's end token, packed
into rows of `data.seq_len` tokens (`packing.pack_examples`). The distillation targets are
the positions that predict response tokens and the end token (the pack mask): that is
where an SFT teacher was trained; its distribution over prompt tokens was never fitted and
is not worth copying. The teacher attends with the rows' own layout (positions, segment
ids), which the cache records beside the tokens.

Cache (`config.cache_kind`): "topk", the teacher's top_k most likely ids with their log-probs
(the paper's; biased: the student is never pushed towards the mass outside them), or
"sampled", `cache_samples` draws from the teacher per position stored as distinct ids with
counts (Random-Sampling KD; unbiased: the loss against the draws' empirical distribution has
the full-vocabulary KL's expected gradient). A sampled cache with cache_samples = top_k
takes the bytes of a top-K cache. The held-out targets are a top-K cache either way (the
exact full vocabulary in the tiny config), so both kinds are evaluated against the teacher.

Loss (`config.tail`): False is the paper's top-K loss sum_S p (log p - log q); True adds the
bucket of the mass outside the top-K, a true KL of the two distributions coarsened to K + 1
outcomes (see `tlt_jax/losses.py`).

Evaluation on held-out rows, at the same positions: `eval_loss` (the training objective),
`eval_kl` (KL of teacher and student coarsened to the teacher's top `eval_top_k` ids plus a
rest bucket: the full-vocabulary KL when eval_top_k is the vocabulary size, as in the tiny
config), `eval_top1_agree` (student argmax == teacher argmax), `eval_teacher_tail_mass`
(teacher mass outside its top-K: how much the tail bucket has to carry), `eval_ece` (the
student's expected calibration error against the data's next tokens: 15 equal bins of its
top-1 probability) and `eval_token_accuracy` (student argmax == the data's next token). With
`config.eval_accuracy`, the final student also answers the held-out prompts greedily and is
scored by the source's verifier: `eval_accuracy` in the summary.

Run directory: teacher_cache/{train,eval} (unless `config.cache_dir` points elsewhere),
checkpoints/ (orbax; a rerun resumes), metrics.jsonl + tensorboard/, distill_curves.png, and
hf/ (the final student with the teacher's tokenizer, Hugging Face format).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from tlt_jax import checkpoint, evaluation, fingerprint, launch, logprobs, losses, metrics, sampling, sharding
from tlt_jax.data import sources
from tlt_jax.data.packing import batch_indices, pack_examples, padded_batches
from tlt_jax.distill import teacher_cache as tc
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig, from_config_dict
from tlt_jax.models.hf_io import load_hf, load_hf_config, save_hf
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.tokenizer import end_token_ids, load_tokenizer
from tlt_jax.train_state import (
    OptimizerConfig,
    TrainState,
    init_train_state,
    jit_train_step,
    make_optimizer,
    run_steps,
    state_shardings,
)

MODES = ("offline", "online")
# Files that define a Hugging Face tokenizer; a checkpoint directory's weights are not hashed.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "tokenizer.model")

# (tokens_BT, positions_BT, segment_ids_BT) -> (ids_BTK, logp_BTK): the teacher's top-K.
TeacherTopK = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[jax.Array, jax.Array]]
LAYOUT = ("positions", "segment_ids")  # what the teacher attends with, beside the tokens
# Equal-width bins of the student's top-1 probability for eval_ece (the usual 15).
ECE_BINS = 15


# ----------------------------------------------------------------------------- data


def tokenizer_fingerprint(path: str) -> str:
    """Fingerprint of the tokenizer files in `path` (a checkpoint or tokenizer directory)."""
    files = [name for name in _TOKENIZER_FILES if os.path.isfile(os.path.join(path, name))]
    if not files:
        raise FileNotFoundError(f"No tokenizer files ({', '.join(_TOKENIZER_FILES[:2])}, ...) in {path!r}.")
    parts = "\n".join(f"{name}={fingerprint.fingerprint_path(os.path.join(path, name))}" for name in files)
    return "sha256:" + hashlib.sha256(parts.encode()).hexdigest()


# ----------------------------------------------------------------------------- teacher


def make_teacher_topk(model_cfg: ModelConfig, params, mesh, *, k: int, temperature: float,
                      logp_dtype: str, impl: str = "chunked_xla") -> TeacherTopK:
    """(tokens_BT, positions_BT, segment_ids_BT) -> (ids_BTK int32, logp_BTK in `logp_dtype`):
    the teacher's top-k at `temperature`, attending within each packed segment.

    One function for both modes: the cache writer calls it offline, the loop online. Log-probs
    leave it already rounded to the cache's dtype, so the student sees the same values either way.
    The top-k comes from the blockwise projection (`logprobs.topk_of_hidden`): beyond the forward,
    the teacher's temporary memory is one token block's logits, never [B, T, V] (16.8 GB in
    float32 for one row of 32,768 tokens at Llama-3's vocabulary). impl: that projection's
    (`logprobs.topk_of_hidden`).
    """
    jitted = teacher_topk_step(model_cfg, params, mesh, k=k, temperature=temperature, logp_dtype=logp_dtype,
                               impl=impl)
    return lambda tokens_BT, positions_BT, segment_ids_BT: jitted(params, tokens_BT, positions_BT, segment_ids_BT)


def teacher_topk_step(model_cfg: ModelConfig, params, mesh, *, k: int, temperature: float, logp_dtype: str,
                      impl: str = "chunked_xla"):
    """The jitted teacher of `make_teacher_topk`: (params, tokens_BT, positions_BT,
    segment_ids_BT) -> (ids_BTK, logp_BTK). params may be jax.ShapeDtypeStructs (`.lower`
    then compiles it abstractly, as plan_memory's teacher step does)."""
    def fn(params, tokens_BT, positions_BT, segment_ids_BT):
        h_BTD = tfm.forward(params, model_cfg, tokens_BT, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT)
        ids_BTK, logp_BTK = logprobs.topk_of_hidden(params, model_cfg, h_BTD, k, temperature=temperature, impl=impl)
        return ids_BTK, logp_BTK.astype(jnp.dtype(logp_dtype))

    rows_sh, out_sh = sharding.batch_sharding(mesh, 2), sharding.batch_sharding(mesh, 3)
    return sharding.jit_sharded(
        fn, in_shardings=(tfm.param_shardings(model_cfg, params, mesh), rows_sh, rows_sh, rows_sh),
        out_shardings=(out_sh, out_sh))


def make_teacher_samples(model_cfg: ModelConfig, params, mesh, *, samples: int, width: int, temperature: float,
                         seed: int):
    """(tokens_BT, positions_BT, segment_ids_BT, rows_B) -> (ids_BTK int32, counts_BTK int32):
    `samples` draws from the teacher at `temperature` at each position, as distinct ids with
    counts (`logprobs.samples_of_hidden`, K = width), row r's with key fold_in(key(seed), r)
    whatever batch it comes in. A sampled cache's teacher; beyond the forward it holds one token
    block's logits, as the top-K teacher does."""
    def fn(params, tokens_BT, positions_BT, segment_ids_BT, rows_B):
        h_BTD = tfm.forward(params, model_cfg, tokens_BT, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT)
        keys_B = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(seed), r))(rows_B)
        return logprobs.samples_of_hidden(params, model_cfg, h_BTD, samples, keys_B, width=width,
                                          temperature=temperature)

    rows_sh, out_sh = sharding.batch_sharding(mesh, 2), sharding.batch_sharding(mesh, 3)
    jitted = sharding.jit_sharded(
        fn, in_shardings=(tfm.param_shardings(model_cfg, params, mesh), rows_sh, rows_sh, rows_sh,
                          sharding.batch_sharding(mesh, 1)), out_shardings=(out_sh, out_sh))
    return lambda tokens_BT, positions_BT, segment_ids_BT, rows_B: jitted(
        params, tokens_BT, positions_BT, segment_ids_BT, np.asarray(rows_B, np.int32))


def cache_meta(rows: dict, *, teacher_fingerprint: str, tokenizer_fingerprint: str, top_k: int, temperature: float,
               logp_dtype: str, cache_kind: str = "topk", samples: int = 0, sample_seed: int = 0) -> tc.CacheMeta:
    """What the cache of `rows` (`pack_examples`) is made from: its tokens and their layout."""
    return tc.CacheMeta(teacher_fingerprint=teacher_fingerprint, tokenizer_fingerprint=tokenizer_fingerprint,
                        dataset_fingerprint=fingerprint.fingerprint_tokens(rows["tokens"]),
                        layout_fingerprint=tc.layout_fingerprint(*(rows[name] for name in LAYOUT)),
                        top_k=top_k, temperature=temperature, logp_dtype=logp_dtype, cache_kind=cache_kind,
                        samples=samples, sample_seed=sample_seed)


def open_or_build_cache(path: str, rows: dict, teacher: TeacherTopK, meta: tc.CacheMeta, *,
                        batch_size: int, rows_per_shard: int | None, progress: bool):
    """(reader, rows the teacher ran on): a complete matching cache of `rows` (`pack_examples`)
    is read as is; a missing or partial one is (re)built; one made differently raises
    MetadataMismatchError naming the fields."""
    computed = [0]

    def counted(*inputs_BT):
        computed[0] += len(inputs_BT[0])
        return teacher(*inputs_BT)

    try:
        try:
            return tc.TeacherCacheReader(path, meta), 0
        except (tc.NotAStoreError, tc.IncompleteStoreError):
            reader = tc.write_teacher_cache(path, rows["tokens"], counted, meta, batch_size=batch_size,
                                            layout=tuple(rows[name] for name in LAYOUT),
                                            rows_per_shard=rows_per_shard, progress=progress)
            return reader, computed[0]
    except tc.MetadataMismatchError as e:
        raise tc.MetadataMismatchError(f"{e} (point --config.cache_dir elsewhere, or delete {path} to rebuild "
                                       "it)") from e


# ----------------------------------------------------------------------------- student


class DistillTrainer:
    """Compiled student steps: guarded AdamW on the top-K KL, and held-out sums for evaluation.

    Batches are dicts of [B, T] tokens / positions / segment_ids, the [B, T-1] target mask, and
    the teacher's [B, T, K] ids / logp at every position (position t predicts token t + 1).
    """

    def __init__(self, model_config: ModelConfig, optimizer_config: OptimizerConfig, mesh, *, temperature: float,
                 tail: bool, top_k: int, loss_impl: str = "auto", remat: bool = False):
        self.model_config, self.mesh = model_config, mesh
        self.optimizer = make_optimizer(optimizer_config)
        self.temperature, self.tail, self.top_k = temperature, tail, top_k
        self.loss_impl, self.remat = loss_impl, remat
        self._step = self._eval = None

    def init_state(self, params) -> TrainState:
        return init_train_state(self.optimizer, params, self._param_shardings(params), self.mesh)

    def _param_shardings(self, params):
        return tfm.param_shardings(self.model_config, params, self.mesh)

    def _batch_shardings(self, batch):
        return {k: sharding.batch_sharding(self.mesh, np.ndim(v)) for k, v in batch.items()}

    def _rows(self, params, batch):
        """Student hidden states h_ND and LM head at the N = B (T-1) predicting positions, with
        the teacher's ids / logp there and the target mask."""
        cut = lambda x: x[:, :-1]
        h_BTD = tfm.forward(params, self.model_config, cut(batch["tokens"]), positions_BT=cut(batch["positions"]),
                            segment_ids_BT=cut(batch["segment_ids"]), remat=self.remat)
        b, t, d = h_BTD.shape
        k = batch["ids"].shape[-1]
        w_DV = tfm.lm_head_weight(params, self.model_config, h_BTD.dtype)
        return (h_BTD.reshape(b * t, d), w_DV, cut(batch["ids"]).reshape(b * t, k),
                cut(batch["logp"]).reshape(b * t, k), batch["mask"].reshape(b * t))

    def loss(self, params, batch):
        """Mean top-K KL over the target positions of a batch (nats per token)."""
        h_ND, w_DV, ids_NK, logp_NK, mask_N = self._rows(params, batch)
        return losses.linear_topk_kl(h_ND, w_DV, ids_NK, logp_NK, mask_N=mask_N, temperature=self.temperature,
                                     tail=self.tail, reduction="mean", impl=self.loss_impl)

    def step(self, state: TrainState, batch: dict):
        """One guarded update; returns (state, {"loss", "grad_norm", "skipped"})."""
        return self.step_fn(state.params, batch)(state, batch)

    def step_fn(self, params, batch: dict):
        """The jitted update of `step`: (state, batch) -> (state, metrics), the state
        donated. Its arguments may be jax.ShapeDtypeStructs (`.lower` then compiles it
        abstractly)."""
        if self._step is None:
            st_sh = state_shardings(self.optimizer, params, self._param_shardings(params), self.mesh)
            self._step = jit_train_step(self.loss, self.optimizer, st_sh, self._batch_shardings(batch), self.mesh)
        return self._step

    def eval_sums(self, params, batch) -> dict:
        """`eval_sums_of`, jitted with the trainer's shardings."""
        if self._eval is None:
            self._eval = sharding.jit_sharded(self.eval_sums_of, in_shardings=(self._param_shardings(params),
                                                                               self._batch_shardings(batch)),
                                              out_shardings=sharding.replicated(self.mesh))
        return self._eval(params, batch)

    def eval_sums_of(self, params, batch) -> dict:
        """Sums over the batch's target positions (its ids may hold more than top_k columns):
        "loss" (training objective at top_k), "kl" (tail KL at all columns: the full-vocabulary
        KL where the ids hold the whole vocabulary), "top1_agree" (student argmax == teacher
        argmax), "teacher_tail_mass" (outside its top_k), "token_accuracy" (student argmax ==
        the data's next token), "count", and per bin of the student's top-1 probability
        "ece_count", "ece_confidence", "ece_correct" [ECE_BINS]. A pure function (`eval_metrics`
        turns the sums into means)."""
        h_ND, w_DV, ids_NK, logp_NK, mask_N = self._rows(params, batch)
        kl = lambda ids, logp, tail: losses.linear_topk_kl(
            h_ND, w_DV, ids, logp, mask_N=mask_N, temperature=self.temperature, tail=tail,
            reduction="sum", impl=self.loss_impl)
        k = self.top_k
        # One eval batch of logits at a time: the argmax needs the whole row.
        logits_NV = tfm.logits_from_hidden(params, self.model_config, h_ND).astype(jnp.float32)
        argmax_N = jnp.argmax(logits_NV, axis=-1)
        confidence_N = jnp.exp(jnp.max(logits_NV, -1) / self.temperature
                               - jax.nn.logsumexp(logits_NV / self.temperature, -1))
        correct_N = (argmax_N == batch["tokens"][:, 1:].reshape(-1)) & mask_N
        bin_N = jnp.minimum((confidence_N * ECE_BINS).astype(jnp.int32), ECE_BINS - 1)
        per_bin = lambda x_N: jnp.zeros((ECE_BINS,), jnp.float32).at[bin_N].add(jnp.where(mask_N, x_N, 0.0))
        logp_top = logp_NK[:, :k].astype(jnp.float32)
        tail_mass_N = -jnp.expm1(jax.nn.logsumexp(logp_top, axis=-1))
        return {"loss": kl(ids_NK[:, :k], logp_NK[:, :k], self.tail), "kl": kl(ids_NK, logp_NK, True),
                "top1_agree": jnp.sum((argmax_N == ids_NK[:, 0]) & mask_N),
                "teacher_tail_mass": jnp.sum(jnp.where(mask_N, tail_mass_N, 0.0)),
                "token_accuracy": jnp.sum(correct_N), "count": jnp.sum(mask_N),
                "ece_count": per_bin(jnp.ones_like(confidence_N)), "ece_confidence": per_bin(confidence_N),
                "ece_correct": per_bin(correct_N.astype(jnp.float32))}


def eval_metrics(totals: dict) -> dict:
    """`DistillTrainer.eval_sums_of` summed over the held-out batches -> the eval_* means
    (per target position) and eval_ece."""
    totals = dict(totals)
    count = max(float(totals.pop("count")), 1.0)
    bins = {name: np.asarray(totals.pop(name), np.float64) for name in ("ece_count", "ece_confidence", "ece_correct")}
    ece = float(np.sum(np.abs(bins["ece_confidence"] - bins["ece_correct"]))) / count
    return {"eval_ece": ece, **{f"eval_{k}": float(v) / count for k, v in totals.items()}}


# ----------------------------------------------------------------------------- job


def check_paths(config) -> None:
    """Raises, naming the flag, before anything is written: a teacher, student, tokenizer or
    (offline) cache path that does not exist (a mistyped cache_dir is never taken for a new
    cache), a model type we do not support, a student whose vocabulary is not the teacher's,
    a bad mode or top-K, bad data (missing files or fields)."""
    launch.check_path(config, "teacher_dir", required=True, tokenizer=not config.tokenizer_dir)
    launch.check_path(config, "student_dir", tokenizer=False, hint="or '' for config.student from random weights.")
    launch.check_path(config, "tokenizer_dir", kind="directory", hint="or '' for the teacher's.")
    if config.mode == "offline":
        launch.check_path(config, "cache_dir", kind="directory",
                          hint="point it at another run's teacher cache (<run_dir>/teacher_cache), or leave it '' "
                               "to build one in <run_dir>/teacher_cache.")
    teacher_cfg = _hf_config(config, "teacher_dir")
    _check_config(config, teacher_cfg.vocab_size)
    tokenizer_dir = config.tokenizer_dir or config.teacher_dir
    if config.get("student_dir"):
        _check_student(config, teacher_cfg, _hf_config(config, "student_dir"), tokenizer_dir)
    sources.problems_for(tokenizer_dir, config.data)


def _hf_config(config, field: str) -> ModelConfig:
    try:
        return load_hf_config(config[field])
    except ValueError as e:  # an architecture we do not support
        raise ValueError(f"--config.{field}={config[field]!r}: {e}") from e


def _check_student(config, teacher_cfg: ModelConfig, student_cfg: ModelConfig, tokenizer_dir: str) -> None:
    """The student learns the teacher's distribution token by token: same vocabulary size and,
    when the student's checkpoint holds a tokenizer, the same tokens with the same ids."""
    flags = f"--config.student_dir={config.student_dir!r} and --config.teacher_dir={config.teacher_dir!r}"
    fix = ("distil into a student with the teacher's vocabulary (a pruned or smaller model of its family), or "
           "set --config.student_dir='' to start config.student from random weights.")
    if student_cfg.vocab_size != teacher_cfg.vocab_size:
        raise ValueError(f"{flags} have different vocabularies (the student's embedding has {student_cfg.vocab_size} "
                         f"rows, the teacher's {teacher_cfg.vocab_size}); {fix}")
    if any(os.path.isfile(os.path.join(config.student_dir, name)) for name in ("tokenizer.json",
                                                                               "tokenizer_config.json")):
        student_vocab = load_tokenizer(config.student_dir).get_vocab()
        teacher_vocab = load_tokenizer(tokenizer_dir).get_vocab()
        if student_vocab != teacher_vocab:
            differ = sorted(set(student_vocab.items()) ^ set(teacher_vocab.items()), key=lambda kv: kv[1])
            raise ValueError(f"{flags} have different vocabularies: their tokenizers differ in "
                             f"{len(differ)} (token, id) pairs, e.g. {differ[:3]}; {fix}")


def _check_config(config, vocab_size: int) -> tuple[int, int]:
    """(K, eval_top_k): K the width of the training targets, top_k for a top-K cache and
    min(cache_samples, vocabulary) for a sampled one (no more distinct ids can be drawn)."""
    if config.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {config.mode!r}")
    kind = config.get("cache_kind", "topk")
    if kind not in tc.CACHE_KINDS:
        raise ValueError(f"cache_kind={kind!r} is not a cache kind; set --config.cache_kind to one of "
                         f"{', '.join(tc.CACHE_KINDS)}")
    if kind == "sampled" and not config.cache_samples >= 1:
        raise ValueError(f"cache_samples={config.cache_samples} must be >= 1 (the teacher's draws per position of a "
                         "sampled cache); set --config.cache_samples to 1 or more")
    eval_top_k = config.eval_top_k or vocab_size
    for name, k in (("top_k", config.top_k), ("eval_top_k", eval_top_k)):
        if not 1 <= k <= vocab_size:
            raise ValueError(f"{name}={k} must lie in [1, {vocab_size}] (the teacher's vocabulary); set "
                             f"--config.{name} to at most {vocab_size}")
    width = config.top_k if kind == "topk" else min(config.cache_samples, vocab_size)
    if eval_top_k < width:
        what = "top_k" if kind == "topk" else "the sampled cache's width min(cache_samples, vocabulary)"
        raise ValueError(f"eval_top_k={eval_top_k} must be >= {what}={width} (evaluation reads that many columns "
                         "of the eval targets)")
    return width, eval_top_k


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a distillation job reads before it trains: the teacher, its tokenizer, the data
    packed into rows of both splits, and the cache widths (`_check_config`)."""
    mesh: Any
    teacher_cfg: ModelConfig
    teacher_params: Any
    tokenizer: Any
    tokenizer_dir: str
    problems: Any
    rows: dict  # split -> `pack_examples` rows
    end_ids: tuple
    top_k: int  # width of the training targets
    eval_top_k: int  # width of the held-out targets

    @property
    def vocab(self) -> int:
        return self.teacher_cfg.vocab_size


def prepare(config) -> Setup:
    """Checks the config (`check_paths`), loads the teacher and its tokenizer and packs both splits."""
    check_paths(config)
    mesh = sharding.make_mesh(config.mesh)
    teacher_cfg, teacher_params = load_hf(config.teacher_dir)
    tokenizer_dir = config.tokenizer_dir or config.teacher_dir
    tokenizer = load_tokenizer(tokenizer_dir)
    if len(tokenizer) > teacher_cfg.vocab_size:
        raise ValueError(f"The tokenizer has {len(tokenizer)} tokens, the teacher's vocabulary only "
                         f"{teacher_cfg.vocab_size}.")
    top_k, eval_top_k = _check_config(config, teacher_cfg.vocab_size)
    problems = sources.problems_for(tokenizer_dir, config.data)
    end_ids = tuple(end_token_ids(tokenizer, teacher_cfg.end_token_ids))
    rows = {split: pack_examples(tokenizer, examples, config.data.seq_len, problems.prompt_format, end_ids[0])
            for split, examples in (("train", problems.train), ("eval", problems.eval))}
    return Setup(mesh, teacher_cfg, teacher_params, tokenizer, tokenizer_dir, problems, rows, end_ids, top_k,
                 eval_top_k)


def init_student(config, setup: Setup, seed: int) -> tuple[ModelConfig, Any]:
    """(config, params) of the student: `student_dir`'s, or `config.student` from random
    weights of `seed` with the teacher's vocabulary and special ids."""
    if config.get("student_dir"):
        return load_hf(config.student_dir)
    cfg = from_config_dict(config.student).replace(vocab_size=setup.vocab, bos_token_id=setup.teacher_cfg.bos_token_id,
                                                   eos_token_id=setup.teacher_cfg.eos_token_id)
    return cfg, tfm.init_params(cfg, jax.random.PRNGKey(seed))


def _teacher_targets(config, setup: Setup, progress: bool):
    """(targets(split, row indices) -> {"ids", "logp"}, rows the teacher ran on, seconds):
    offline from the split's cache (built first where missing), online from the teacher. The
    held-out targets are a top-K cache for either kind of run: both are evaluated against
    the teacher itself (its whole vocabulary, at eval_top_k = 0)."""
    t_cache, mesh, cfg = time.time(), setup.mesh, setup.teacher_cfg
    split_k = {"train": setup.top_k, "eval": setup.eval_top_k}
    kind = {"train": config.get("cache_kind", "topk"), "eval": "topk"}
    sampled = dict(cache_kind="sampled", samples=config.get("cache_samples", 0), sample_seed=config.seed)
    # Placed (once for both splits) and compiled only if it runs: not for a complete cache.
    placed_teacher = functools.cache(lambda: tfm.shard_params(cfg, setup.teacher_params, mesh))

    @functools.cache
    def teacher(split):
        if kind[split] == "sampled":
            return make_teacher_samples(cfg, placed_teacher(), mesh, samples=config.cache_samples,
                                        width=split_k[split], temperature=config.temperature, seed=config.seed)
        return make_teacher_topk(cfg, placed_teacher(), mesh, k=split_k[split], temperature=config.temperature,
                                 logp_dtype=config.cache_dtype)

    if config.mode == "online":
        def targets(split, idx):
            inputs = [setup.rows[split][name][idx] for name in ("tokens", *LAYOUT)]
            if kind[split] == "sampled":  # what a sampled cache's reader gives for these rows
                ids, counts = teacher(split)(*inputs, idx)
                return {"ids": ids, "logp": tc.empirical_logp(jax.device_get(counts), config.cache_samples)}
            ids, logp = teacher(split)(*inputs)
            return {"ids": ids, "logp": logp}
        return targets, 0, time.time() - t_cache

    cache_dir = config.cache_dir or os.path.join(config.run_dir, "teacher_cache")
    tok_fp = tokenizer_fingerprint(setup.tokenizer_dir)
    teacher_fp = fingerprint.fingerprint_arrays(setup.teacher_params)
    readers, cache_rows = {}, 0
    for split, k in split_k.items():
        meta = cache_meta(setup.rows[split], teacher_fingerprint=teacher_fp, tokenizer_fingerprint=tok_fp, top_k=k,
                          temperature=config.temperature, logp_dtype=config.cache_dtype,
                          **(sampled if kind[split] == "sampled" else {}))
        readers[split], computed = open_or_build_cache(
            os.path.join(cache_dir, split), setup.rows[split],
            lambda *inputs_BT, split=split: teacher(split)(*inputs_BT), meta,
            batch_size=config.cache_batch_size, rows_per_shard=config.cache_rows_per_shard or None, progress=progress)
        cache_rows += computed
    teacher.cache_clear()  # the teacher's device memory goes back before the student trains
    placed_teacher.cache_clear()
    logging.info("Teacher cache at %s: teacher ran on %d rows", cache_dir, cache_rows)

    def targets(split, idx):
        ids, logp = readers[split].read(idx)
        return {"ids": ids, "logp": logp}
    return targets, cache_rows, time.time() - t_cache


def evaluate_student(trainer: DistillTrainer, params, rows: dict, targets, batch_size: int) -> dict:
    """The eval_* metrics of `params` over every held-out row (`eval_metrics`)."""
    totals = None
    for idx, batch in padded_batches(rows, batch_size):
        sums = jax.device_get(trainer.eval_sums(params, {**batch, **targets(idx)}))
        totals = sums if totals is None else {k: totals[k] + sums[k] for k in totals}
    return eval_metrics(totals)


def train_distill(config, *, progress: bool = True) -> dict:
    """Runs (or resumes) the distillation job of `configs/distill.py`; returns a summary:
    the last step's metrics, the final evaluation, the cache's origin and timings."""
    t_start = time.time()
    setup = prepare(config)
    run_dir, mesh, rows = config.run_dir, setup.mesh, setup.rows
    os.makedirs(run_dir, exist_ok=True)
    targets, cache_rows, t_cache = _teacher_targets(config, setup, progress)

    student_cfg, student_params = init_student(config, setup, config.seed)
    trainer = DistillTrainer(student_cfg, OptimizerConfig(**config.optimizer), mesh, temperature=config.temperature,
                             tail=config.tail, top_k=setup.top_k, loss_impl=config.loss_impl, remat=config.remat)
    state = trainer.init_state(student_params)
    del student_params  # the train state holds the student now
    ckpt = checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints"), max_to_keep=2)
    state, meta = ckpt.resume(state)
    start = meta["step"] if meta else 0
    writer = metrics.MetricsWriter(run_dir, resume_step=start)

    n, b = len(rows["train"]["tokens"]), config.batch_size
    prefetched = (None, None)  # (step, its targets), read while the device ran the step before

    def step_fn(state, step):
        nonlocal prefetched
        idx = batch_indices(step, b, n, config.seed)
        step_targets = prefetched[1] if prefetched[0] == step else targets("train", idx)
        state, out = trainer.step(state, {**{k: v[idx] for k, v in rows["train"].items()}, **step_targets})
        if step + 1 < config.steps:
            prefetched = (step + 1, targets("train", batch_indices(step + 1, b, n, config.seed)))
        return state, {k: float(v) for k, v in jax.device_get(out).items()}

    run_eval = lambda state, step: evaluate_student(trainer, state.params, rows["eval"],
                                                    functools.partial(targets, "eval"), config.eval_batch_size)
    bar = metrics.ProgressBar(config.steps, ["loss", "eval_kl", "eval_top1_agree"], initial=start, desc="distill",
                              disable=not progress)
    state, record, t_train = run_steps(state, start=start, steps=config.steps, step_fn=step_fn, eval_fn=run_eval,
                                       eval_every=config.eval_every, checkpoint_every=config.checkpoint_every,
                                       ckpt=ckpt, writer=writer, bar=bar)
    save_hf(os.path.join(run_dir, "hf"), student_cfg, jax.device_get(state.params), tokenizer=setup.tokenizer,
            overwrite=True)
    accuracy = {}
    if config.get("eval_accuracy"):
        accuracy = {"eval_accuracy": answer_accuracy(answer_engine(config, setup, student_cfg, state.params), config,
                                                     setup)}
    records = metrics.read_metrics(os.path.join(run_dir, metrics.METRICS_FILENAME))
    metrics.plot_curves(records, ["loss", "grad_norm", "eval_kl", "eval_top1_agree"],
                        os.path.join(run_dir, "distill_curves.png"),
                        title=f"distill {config.mode}, tail={config.tail}, K={setup.top_k}")
    kind = config.get("cache_kind", "topk")
    return {**record, **accuracy, "mode": config.mode, "tail": bool(config.tail), "cache_kind": kind,
            "cache_samples": config.get("cache_samples", 0) if kind == "sampled" else 0, "top_k": setup.top_k,
            "eval_top_k": setup.eval_top_k, "steps": config.steps, "resumed_from": start,
            "teacher_rows_cached": cache_rows, "cache_seconds": t_cache, "train_seconds": t_train,
            "total_seconds": time.time() - t_start}


def answer_engine(config, setup: Setup, model_cfg: ModelConfig, params) -> RolloutEngine:
    """A rollout engine for `answer_accuracy` holding `params` (`update_params` swaps in
    another student of the same shape without compiling again)."""
    prompts = evaluation.encode_prompts(setup.tokenizer, setup.problems.eval, setup.problems.prompt_format)
    return RolloutEngine(model_cfg, params, setup.mesh, RolloutConfig(
        num_slots=min(64, len(setup.problems.eval)), max_prompt_length=max(len(ids) for ids in prompts),
        max_length=config.data.seq_len, steps_per_sync=16, eos_token_id=setup.end_ids))


def answer_accuracy(engine: RolloutEngine, config, setup: Setup) -> float:
    """Share of held-out prompts the engine's model answers right: greedy answers scored by
    the source's verifier (as SFT's eval)."""
    data, problems = config.data, setup.problems
    reward = sources.correctness_reward(data, sources.default_reward(data))
    max_tokens = data.seq_len - engine.rollout_config.max_prompt_length
    result = evaluation.evaluate(engine, setup.tokenizer, problems.eval,
                                 sampling.SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                 jax.random.PRNGKey(config.seed), reward=reward,
                                 prompt_format=problems.prompt_format, end_token_ids=setup.end_ids)
    return result["accuracy"]
