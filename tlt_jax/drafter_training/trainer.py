"""Drafter training: the EAGLE drafter distilled from the target's by-products.

The target runs once over a token batch (`target_outputs`): its final hidden states h, the
layer outputs a fused drafter reads, and its top-K ids and log-probs per position. The
drafter's entry t reads (x_{t+1}, f_t) and its output g_t learns (`drafter_loss`)

  * the target's distribution over x_{t+2}, i.e. its top-K at position t+1, through the
    fused top-K KL on the target's LM head (`losses.linear_topk_kl`: no [tokens, vocab]
    logits), weight `kl_weight`;
  * the feature it reads next, f_{t+1} (smooth L1, beta 1), weight `feature_weight`:
    drafting past the committed text feeds g_t back in its place. Unfused f is the
    target's final hidden state h (EAGLE's regression, which weighs it 1 against 0.1 for
    the distribution); fused, it is the fusion of the target's layers at t+1, held
    fixed (stop-gradient) as the regression target. EAGLE-3 has no regression and
    instead trains on its own fed-back features; without either, a fused drafter's
    drafts beyond the first token are poor.

Entries whose x_{t+2} is not a target token of the same sequence are masked. Batches are
`sft.pack_examples` rows (packed examples kept apart by segment ids) or right-padded rows
(segment 0 is padding), with the target mask [B, T-1] of that module (position t predicts a
target token t+1). The acceptance proxy is top-1 agreement: drafter argmax == target argmax.

Optional EAGLE-style noise: the features the drafter reads in training get uniform noise of
width `feature_noise`, so that it tolerates the error of its own features when it drafts
beyond the first token.

`train_drafter` is the offline job of `configs/drafter.py` (the warm start of the drafter
that the spot trainer keeps aligned during RL): SFT traces of the `data` section (any
source of `tlt_jax.data.sources`, prompts in the target's format: its chat template or
`data.prompt_template`) through the frozen target, AdamW on the drafter alone, held-out
evaluation, orbax checkpoints with resume, metrics and plots, the export
(`io.save_drafter`) to <run_dir>/drafter and, optionally, the acceptance length the export
reaches in the rollout engine.
"""
from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tlt_jax import checkpoint, evaluation, fingerprint, launch, logprobs, losses, metrics, sampling, sharding
from tlt_jax.data import sources
from tlt_jax.data.packing import batch_indices, pack_examples, padded_batches
from tlt_jax.drafter_training import io
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.hf_io import load_hf, load_hf_config
from tlt_jax.rollout import speculative
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.tokenizer import end_token_ids, load_tokenizer
from tlt_jax.train_state import (
    OptimizerConfig,
    TrainState,
    init_train_state,
    jit_train_step,
    learning_rate_schedule,
    make_optimizer,
    run_steps,
    state_shardings,
)

ROW_FIELDS = ("tokens", "positions", "segment_ids", "mask")


# ----------------------------------------------------------------------------- target side


def _by_position_blocks(fn, block: int, *arrays_BT):
    """fn over [B, T, ...] arrays, `block` positions at a time (0: all at once), so that
    the [B, block, V] logits fn makes are all that ever exist; its outputs are [B, T, ...]."""
    if not block or block >= arrays_BT[0].shape[1]:
        return fn(*arrays_BT)
    out_T = jax.lax.map(lambda xs: fn(*xs), tuple(jnp.moveaxis(a, 1, 0) for a in arrays_BT), batch_size=block)
    return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), out_T)


def draft_agreement(params, config: ModelConfig, g_BTD: jax.Array, ids_BTK: jax.Array, logp_BTK: jax.Array,
                    temperature: float = 1.0, block: int = 0):
    """(top1_BT int32, accept_BT float32): the argmax token of the logits of the drafter's
    predicted hidden states g_BTD, and the probability that a draft sampled from them passes
    lossless verification against the target's top-K (ids_BTK, logp_BTK): sum over those
    ids of min(p, q), q the drafter's softmax at `temperature` (a lower bound by the target's
    mass outside its top K; exact when that is zero). `block` positions at a time (0: all
    at once), so that only [B, block, V] logits ever exist."""
    def agree(g_xD, ids_xK, logp_xK):
        logits_xV = tfm.logits_from_hidden(params, config, g_xD) / temperature
        logq_xK = jnp.take_along_axis(logits_xV, ids_xK, -1) - jax.nn.logsumexp(logits_xV, -1, keepdims=True)
        accept = jnp.sum(jnp.minimum(jnp.exp(logp_xK), jnp.exp(logq_xK)), -1)
        return jnp.argmax(logits_xV, -1).astype(jnp.int32), accept

    return _by_position_blocks(agree, block, g_BTD, ids_BTK, logp_BTK)


def target_outputs(target_params, target_config: ModelConfig, drafter_config: drafter_lib.DrafterConfig,
                   rows: dict, *, top_k: int, temperature: float = 1.0, topk_block: int = 0,
                   impl: str = "chunked_xla") -> dict:
    """The target's by-products over `rows` (tokens / positions / segment_ids [B, T]) that
    drafter training reads: "hidden" h_BTD, "ids" / "logp" [B, T, K] (position t's top-K of
    x_{t+1}, projected by `impl`: `logprobs.topk_of_hidden`) and, for a fused drafter,
    "layers" [B, T, n, D] (its feature_layers' outputs)."""
    out = tfm.forward(target_params, target_config, rows["tokens"], positions_BT=rows["positions"],
                      segment_ids_BT=rows["segment_ids"], layer_ids=drafter_config.feature_layers)
    h_BTD, layers_nBTD = out if drafter_config.feature_layers else (out, None)
    # The target's top-K from the blockwise projection: one token block's logits at a time,
    # topk_block positions of every row (0: the backend's default block).
    ids_BTK, logp_BTK = logprobs.topk_of_hidden(target_params, target_config, h_BTD, top_k, temperature=temperature,
                                                block_tokens=topk_block * h_BTD.shape[0], impl=impl)
    outputs = {"hidden": h_BTD, "ids": ids_BTK, "logp": logp_BTK}
    if layers_nBTD is not None:
        outputs["layers"] = jnp.moveaxis(layers_nBTD, 0, 2)  # batch-major, like every batch field
    return outputs


def shared_target_params(target_params):
    """The target weights a drafter step reads: its embedding, final norm and LM head (the
    drafter's own layers replace the target's)."""
    return {k: target_params[k] for k in drafter_lib.SHARED_TARGET_KEYS if k in target_params}


# ----------------------------------------------------------------------------- loss


def entry_mask(batch) -> jax.Array:
    """[B, T-2] bool: entry t (reading x_{t+1}, f_t) is trained, i.e. x_{t+2} is a target
    token and t, t+1 lie in the same non-padding segment."""
    seg_BT = batch["segment_ids"]
    return batch["mask"][:, 1:] & (seg_BT[:, :-2] == seg_BT[:, 1:-1]) & (seg_BT[:, :-2] > 0)


def _masked_mean(x_BT: jax.Array, mask_BT: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask_BT, x_BT, 0.0)) / jnp.maximum(jnp.sum(mask_BT), 1)


def drafter_loss(drafter_params, target_params, target_config: ModelConfig,
                 drafter_config: drafter_lib.DrafterConfig, batch: dict, *, feature_weight: float,
                 kl_weight: float, temperature: float = 1.0, feature_noise: float = 0.0,
                 noise_key: jax.Array | None = None, loss_impl: str = "auto", topk_block: int = 0,
                 remat: bool = False, ttt_steps: int = 1):
    """Teacher-forced drafter loss over a batch of rows with the target's outputs.

    batch: ROW_FIELDS of the rows and `target_outputs` of them. Entries t = 0 .. T-3.
    ttt_steps > 1 adds training-time test (`drafter.forward_unrolled`): passes 1 ..
    ttt_steps - 1 train the drafter on its own earlier predictions, as it drafts past the
    first token; the loss is the mean of the passes' losses.
    Returns (loss, {"kl", "feature_loss", "top1_agree", "accept_rate", "count"}): pass 0's
    means over the trained entries (nats per token; smooth L1 per hidden unit; fractions;
    accept_rate is draft_agreement's, the teacher-forced chance that the first draft is
    accepted) and their number; with ttt_steps > 1 also "accept_rate_pass<i>", that of the
    (i+1)-th draft given the drafts before it were the right tokens, over "count_pass<i>"
    entries.
    """
    cut, nxt = (lambda x: x[:, :-2]), (lambda x: x[:, 1:-1])
    # Features of positions 0 .. T-2, fused here so that the gradient reaches `fuse`. Entry t
    # reads f_t and regresses f_{t+1}, the feature it is fed in place of when drafting.
    layers_nBTD = jnp.moveaxis(batch["layers"][:, :-1], 2, 0) if "layers" in batch else None
    f_all_BTD = drafter_lib.target_features(drafter_params, drafter_config, batch["hidden"][:, :-1], layers_nBTD)
    f_BTD, f_next_BTD = f_all_BTD[:, :-1], jax.lax.stop_gradient(f_all_BTD[:, 1:])
    if feature_noise and noise_key is not None:
        f_BTD = f_BTD + jax.random.uniform(noise_key, f_BTD.shape, f_BTD.dtype, -feature_noise / 2, feature_noise / 2)
    tokens_BT, positions_BT, segments_BT = nxt(batch["tokens"]), cut(batch["positions"]), cut(batch["segment_ids"])
    if ttt_steps > 1:
        passes = drafter_lib.forward_unrolled(drafter_params, target_params, target_config, drafter_config,
                                              tokens_BT, f_BTD, ttt_steps, positions_BT=positions_BT,
                                              segment_ids_BT=segments_BT)
    else:
        passes = [drafter_lib.forward(drafter_params, target_params, target_config, drafter_config, tokens_BT,
                                      f_BTD, positions_BT=positions_BT, segment_ids_BT=segments_BT, remat=remat)]
    entries_BT = entry_mask(batch)
    ids_BTK, logp_BTK = nxt(batch["ids"]), nxt(batch["logp"])
    w_DV = tfm.lm_head_weight(target_params, target_config, passes[0].dtype)
    total, aux = 0.0, {}
    for i, g_BTD in enumerate(passes):
        b, t, d = g_BTD.shape
        # Pass i's entry t continues a chain from entry t - i: all of it in t's segment.
        chain_BT = jnp.concatenate([jnp.zeros((b, i), bool), segments_BT[:, :t - i] == segments_BT[:, i:]], axis=1)
        mask_BT = entries_BT & chain_BT
        count = jnp.sum(mask_BT)
        per_entry = functools.partial(_masked_mean, mask_BT=mask_BT)
        k = ids_BTK.shape[-1]
        kl = losses.linear_topk_kl(g_BTD.reshape(b * t, d), w_DV, ids_BTK.reshape(b * t, k),
                                   logp_BTK.reshape(b * t, k), mask_N=mask_BT.reshape(b * t),
                                   temperature=temperature, reduction="mean", impl=loss_impl)
        feature_loss = per_entry(jnp.mean(optax.losses.huber_loss(g_BTD.astype(jnp.float32),
                                                                  f_next_BTD.astype(jnp.float32), delta=1.0), axis=-1))
        top1_BT, accept_BT = draft_agreement(target_params, target_config, jax.lax.stop_gradient(g_BTD), ids_BTK,
                                             logp_BTK, temperature, topk_block)
        total = total + feature_weight * feature_loss + kl_weight * kl
        if i == 0:
            aux = {"kl": kl, "feature_loss": feature_loss, "count": count,
                   "top1_agree": per_entry((top1_BT == ids_BTK[..., 0]).astype(jnp.float32)),
                   "accept_rate": per_entry(accept_BT)}
        else:
            aux.update({f"accept_rate_pass{i}": per_entry(accept_BT), f"count_pass{i}": count})
    return total / len(passes), aux


# ----------------------------------------------------------------------------- trainer


class DrafterTrainer:
    """Compiled drafter steps against a frozen target on `mesh`: the target's outputs for a
    batch of rows, a guarded AdamW update of the drafter, and evaluation. Only the drafter
    is trained, and only its parameters are in the train state."""

    def __init__(self, target_config: ModelConfig, drafter_config: drafter_lib.DrafterConfig,
                 optimizer_config: OptimizerConfig, mesh, *, top_k: int, feature_weight: float, kl_weight: float,
                 temperature: float = 1.0, feature_noise: float = 0.0, loss_impl: str = "auto",
                 topk_block: int = 0, remat: bool = False, ttt_steps: int = 1, trust_region: float = 0.0):
        """trust_region: weight of (1/2) * sum of squares of the drafter's distance to an
        anchor (`step`'s `anchor`, e.g. the version the engine drafts with); 0: none."""
        if trust_region < 0:
            raise ValueError(f"tlt.drafter.trust_region={trust_region} must be >= 0 (0: none).")
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps={ttt_steps} must be >= 1 (1: no training-time test).")
        if remat and ttt_steps > 1:
            raise ValueError("remat=True recomputes the teacher-forced pass only; set ttt_steps=1 or remat=False.")
        self.target_config, self.drafter_config, self.mesh = target_config, drafter_config, mesh
        self.optimizer = make_optimizer(optimizer_config)
        self.learning_rate = learning_rate_schedule(optimizer_config)
        self.top_k, self.temperature, self.topk_block = top_k, temperature, topk_block
        self._loss_kwargs = dict(feature_weight=feature_weight, kl_weight=kl_weight, temperature=temperature,
                                 loss_impl=loss_impl, topk_block=topk_block, remat=remat, ttt_steps=ttt_steps)
        self.feature_noise = feature_noise
        self.trust_region = trust_region
        self._target_fn = self._step = self._eval = None

    # -- shardings

    def drafter_shardings(self, drafter_params):
        axes = drafter_lib.drafter_logical_axes(self.target_config, self.drafter_config)
        return sharding.tree_shardings(axes, drafter_params, self.mesh)

    def target_shardings(self, target_params):
        """Shardings of the target's parameters, or of the subtree the drafter reads
        (`shared_target_params`), in either weight layout."""
        whole = "layers" in target_params
        axes = tfm.param_logical_axes(self.target_config, per_layer=whole and tfm.has_per_layer_weights(target_params),
                                      fused=whole and tfm.has_fused_projections(target_params))
        return sharding.tree_shardings({k: axes[k] for k in target_params}, target_params, self.mesh)

    def _batch_shardings(self, batch):
        return {k: sharding.batch_sharding(self.mesh, np.ndim(v)) for k, v in batch.items()}

    def place_target(self, target_params):
        return jax.device_put(target_params, self.target_shardings(target_params))

    def init_state(self, drafter_params) -> TrainState:
        return init_train_state(self.optimizer, drafter_params, self.drafter_shardings(drafter_params), self.mesh)

    # -- steps

    def batch(self, target_params, rows: dict) -> dict:
        """`rows` (ROW_FIELDS) with the target's outputs over them added."""
        rows = {k: rows[k] for k in ROW_FIELDS}
        if self._target_fn is None:
            fn = lambda params, rows: target_outputs(params, self.target_config, self.drafter_config, rows,
                                                     top_k=self.top_k, temperature=self.temperature,
                                                     topk_block=self.topk_block)
            out_shapes = jax.eval_shape(fn, target_params, rows)
            self._target_fn = sharding.jit_sharded(
                fn, in_shardings=(self.target_shardings(target_params), self._batch_shardings(rows)),
                out_shardings=self._batch_shardings(out_shapes))
        return {**rows, **self._target_fn(target_params, rows)}

    def _loss(self, drafter_params, inputs, noise: bool):
        loss, aux = drafter_loss(drafter_params, inputs["target"], self.target_config, self.drafter_config,
                                 inputs["batch"], feature_noise=self.feature_noise if noise else 0.0,
                                 noise_key=inputs.get("key"), **self._loss_kwargs)
        if "anchor" in inputs:  # a trust region: pulled toward the version the engine drafts with
            distance = sum(jnp.sum(jnp.square(p.astype(jnp.float32) - a.astype(jnp.float32)))
                           for p, a in zip(jax.tree.leaves(drafter_params), jax.tree.leaves(inputs["anchor"])))
            loss = loss + 0.5 * self.trust_region * distance
            aux = dict(aux, anchor_distance=jnp.sqrt(distance))
        return loss, aux

    def _input_shardings(self, target_params, batch, with_key: bool, anchor=None):
        out = {"target": self.target_shardings(target_params), "batch": self._batch_shardings(batch)}
        if with_key:
            out["key"] = sharding.replicated(self.mesh)
        if anchor is not None:
            out["anchor"] = self.drafter_shardings(anchor)
        return out

    def step(self, state: TrainState, target_params, batch: dict, noise_key: jax.Array, anchor=None):
        """One guarded update on `self.batch` output; returns (state, {"loss", "kl",
        "feature_loss", "top1_agree", "accept_rate", "count", "grad_norm", "skipped"}, and
        with a trust region "anchor_distance"). anchor: the drafter parameters the trust
        region pulls toward (required when trust_region > 0, ignored otherwise)."""
        if self.trust_region and anchor is None:
            raise ValueError("A trust region needs the anchor it pulls toward: pass anchor=.")
        anchor = anchor if self.trust_region else None
        step = self.step_fn(state.params, target_params, batch, anchor)
        # Host rows as arrays on the mesh first: with several processes jit takes no numpy
        # input with a non-trivial sharding, even one this process alone holds.
        batch = jax.device_put(batch, self._batch_shardings(batch))
        inputs = {"target": target_params, "batch": batch, "key": noise_key}
        return step(state, inputs if anchor is None else dict(inputs, anchor=anchor))

    def step_fn(self, drafter_params, target_params, batch: dict, anchor=None):
        """The jitted update of `step`: (state, {"target", "batch", "key"[, "anchor"]}) ->
        (state, metrics), the state donated. Its arguments may be jax.ShapeDtypeStructs
        (`.lower` then compiles it abstractly)."""
        if self._step is None:
            st_sh = state_shardings(self.optimizer, drafter_params, self.drafter_shardings(drafter_params), self.mesh)
            self._step = jit_train_step(lambda p, inputs: self._loss(p, inputs, noise=True), self.optimizer, st_sh,
                                        self._input_shardings(target_params, batch, True, anchor), self.mesh,
                                        has_aux=True)
        return self._step

    def evaluate(self, drafter_params, target_params, batch: dict) -> dict:
        """drafter_loss's (loss and) metrics on a batch (`batch` output, host rows or
        arrays), without noise."""
        if self._eval is None:
            def fn(params, inputs):
                loss, aux = self._loss(params, inputs, noise=False)
                return dict(aux, loss=loss)

            self._eval = sharding.jit_sharded(
                fn, in_shardings=(self.drafter_shardings(drafter_params),
                                  self._input_shardings(target_params, batch, False)),
                out_shardings=sharding.replicated(self.mesh))
        batch = jax.device_put(batch, self._batch_shardings(batch))  # as in `step`
        return self._eval(drafter_params, {"target": target_params, "batch": batch})


# ----------------------------------------------------------------------------- acceptance


def rollout_acceptance(target_config: ModelConfig, target_params, drafter_config, drafter_params, mesh,
                       prompts, *, num_samples: int, depth: int, temperature: float, max_tokens: int,
                       num_slots: int, max_prompt_length: int, seed: int = 0,
                       end_token_ids: tuple[int, ...] | None = None) -> dict:
    """Speculative rollouts of `prompts` with an EAGLE chain of `depth` drafts at every step,
    each ending on any of `end_token_ids` (default the target config's): the timeline's
    summary (acceptance_length: tokens committed per sequence and verify step, the bonus
    token included), its acceptance per draft position and the samples' mean length."""
    engine = RolloutEngine(target_config, target_params, mesh, RolloutConfig(
        num_slots=num_slots, max_prompt_length=max_prompt_length, max_length=max_prompt_length + max_tokens,
        eos_token_id=end_token_ids or target_config.eos_token_id, max_draft_depth=depth), drafter_config,
        drafter_params)
    out = engine.generate(prompts, num_samples, sampling.SamplingParams(temperature=temperature, max_tokens=max_tokens),
                          jax.random.PRNGKey(seed), speculation=speculative.FixedSpeculation(
                              speculative.Strategy("eagle", depth=depth), max_active=num_slots))
    return {**out.timeline.summary(), "acceptance_by_depth": out.timeline.acceptance_by_depth(),
            "length_mean": float(out.lengths.mean())}


# ----------------------------------------------------------------------------- job


def check_paths(config) -> None:
    """Raises, naming the flag, before anything is written: a target or tokenizer path that
    does not exist, a target model type we do not support, a bad top_k, bad data (missing
    files or fields, no held-out prompt the acceptance check can take)."""
    launch.check_path(config, "target_dir", required=True, tokenizer=not config.tokenizer_dir)
    launch.check_path(config, "tokenizer_dir", kind="directory", hint="or '' for the target's.")
    try:
        target_cfg = load_hf_config(config.target_dir)
    except ValueError as e:  # an architecture we do not support
        raise ValueError(f"--config.target_dir={config.target_dir!r}: {e}") from e
    if not 1 <= config.top_k <= target_cfg.vocab_size:
        raise ValueError(f"top_k={config.top_k} must lie in [1, {target_cfg.vocab_size}] (the target's vocabulary); "
                         f"set --config.top_k to at most {target_cfg.vocab_size}.")
    problems = sources.problems_for(config.tokenizer_dir or config.target_dir, config.data)
    a = config.acceptance
    if a.num_prompts:
        acceptance_prompts(load_tokenizer(config.tokenizer_dir or config.target_dir), problems.eval,
                           problems.prompt_format, a.num_prompts, a.max_prompt_length)


def acceptance_prompts(tokenizer, examples, prompt_format, num_prompts: int, max_prompt_length: int) -> list:
    """The token ids of the first `num_prompts` held-out prompts that fit the engine's
    max_prompt_length (longer ones are passed over, never truncated)."""
    prompts = []
    for example in examples:
        if len(prompts) == num_prompts:
            break
        ids = evaluation.encode_prompts(tokenizer, [example], prompt_format)[0]
        if len(ids) <= max_prompt_length:
            prompts.append(ids)
    if not prompts:
        raise ValueError(f"No held-out prompt fits acceptance.max_prompt_length={max_prompt_length} tokens; raise "
                         "it, or set acceptance.num_prompts=0.")
    return prompts


def _entries(metrics_out: dict, key: str) -> float:
    """The entries drafter_loss's metric `key` is a mean over: its own pass's for
    accept_rate_pass<i>, pass 0's for every other."""
    return float(metrics_out[f"count_{key.rsplit('_', 1)[1]}"] if "_pass" in key else metrics_out["count"])


def evaluate_rows(trainer: DrafterTrainer, drafter_params, target_params, rows: dict, batch_size: int) -> dict:
    """{"eval_<metric>": drafter_loss's metric over all `pack_examples` rows}, teacher-forced
    (eval_accept_rate: the chance a first draft passes verification), each metric a mean
    over the entries it counts, in batches of `batch_size` rows."""
    totals, counts = {}, {}
    for _, rows_batch in padded_batches(rows, batch_size):
        out = jax.device_get(trainer.evaluate(drafter_params, target_params, trainer.batch(target_params, rows_batch)))
        for k, v in out.items():
            if not k.startswith("count"):
                n = _entries(out, k)
                totals[k], counts[k] = totals.get(k, 0.0) + float(v) * n, counts.get(k, 0.0) + n
    return {f"eval_{k}": v / max(counts[k], 1.0) for k, v in totals.items()}


def train_drafter(config, *, progress: bool = True) -> dict:
    """Runs (or resumes) the drafter job of `configs/drafter.py`; returns the last step's
    metrics with the final evaluation, timings and, when configured, rollout acceptance
    (also written to <run_dir>/summary.json)."""
    t_start = time.time()
    check_paths(config)
    run_dir = config.run_dir
    os.makedirs(run_dir, exist_ok=True)
    mesh = sharding.make_mesh(config.mesh)
    target_cfg, host_target = load_hf(config.target_dir)
    tokenizer_dir = config.tokenizer_dir or config.target_dir
    tokenizer = load_tokenizer(tokenizer_dir)
    dcfg = drafter_lib.DrafterConfig(num_layers=config.drafter.num_layers,
                                     feature_layers=tuple(config.drafter.feature_layers),
                                     layout=config.drafter.get("layout", "tlt"))

    problems = sources.problems_for(tokenizer_dir, config.data)
    end_ids = end_token_ids(tokenizer, target_cfg.end_token_ids)
    rows = {split: pack_examples(tokenizer, examples, config.data.seq_len, problems.prompt_format, end_ids[0])
            for split, examples in (("train", problems.train), ("eval", problems.eval))}

    trainer = DrafterTrainer(target_cfg, dcfg, OptimizerConfig(**config.optimizer), mesh, top_k=config.top_k,
                             feature_weight=config.feature_weight, kl_weight=config.kl_weight,
                             temperature=config.temperature, feature_noise=config.feature_noise,
                             loss_impl=config.loss_impl, topk_block=config.topk_block, remat=config.remat,
                             ttt_steps=config.ttt_steps)
    target = trainer.place_target(host_target)
    state = trainer.init_state(drafter_lib.init_drafter(target_cfg, dcfg, jax.random.PRNGKey(config.seed)))
    ckpt = checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints"), max_to_keep=2)
    state, meta = ckpt.resume(state)
    start = meta["step"] if meta else 0
    writer = metrics.MetricsWriter(run_dir, resume_step=start)

    def run_eval(state, step) -> dict:
        return evaluate_rows(trainer, state.params, target, rows["eval"], config.eval_batch_size)

    noise_key = jax.random.PRNGKey(config.seed + 1)

    def step_fn(state, step):
        idx = batch_indices(step, config.batch_size, len(rows["train"]["tokens"]), config.seed)
        batch = trainer.batch(target, {k: v[idx] for k, v in rows["train"].items()})
        state, out = trainer.step(state, target, batch, jax.random.fold_in(noise_key, step))
        return state, {**{k: float(v) for k, v in jax.device_get(out).items()},
                       "lr": float(trainer.learning_rate(step))}

    bar = metrics.ProgressBar(config.steps, ["loss", "top1_agree", "eval_top1_agree"], initial=start, desc="drafter",
                              disable=not progress)
    state, record, t_train = run_steps(state, start=start, steps=config.steps, step_fn=step_fn, eval_fn=run_eval,
                                       eval_every=config.eval_every, checkpoint_every=config.checkpoint_every,
                                       ckpt=ckpt, writer=writer, bar=bar)

    drafter_dir = os.path.join(run_dir, "drafter")
    with checkpoint.Checkpointer(drafter_dir) as exports:
        exported = config.steps in exports.all_steps()  # by an earlier run of a finished job
    if not exported:
        io.save_drafter(drafter_dir, state.params, dcfg, target_cfg, fingerprint.fingerprint_arrays(host_target),
                        step=config.steps)
    records = metrics.read_metrics(os.path.join(run_dir, metrics.METRICS_FILENAME))
    metrics.plot_curves(records, ["loss", "kl", "feature_loss", "top1_agree", "eval_top1_agree", "eval_accept_rate",
                                  "grad_norm", "lr"],
                        os.path.join(run_dir, "drafter_curves.png"),
                        title=f"drafter {dcfg.num_layers} layer(s), features {dcfg.feature_layers or 'final'}")
    summary = {**record, "steps": config.steps, "resumed_from": start, "train_seconds": t_train,
               "drafter_dir": drafter_dir}
    a = config.acceptance
    if a.num_prompts:
        prompts = acceptance_prompts(tokenizer, problems.eval, problems.prompt_format, a.num_prompts,
                                     a.max_prompt_length)
        t_accept = time.time()
        summary["acceptance"] = rollout_acceptance(
            target_cfg, host_target, dcfg, jax.device_get(state.params), mesh, prompts,
            num_samples=a.num_samples, depth=a.depth, temperature=a.temperature, max_tokens=a.max_tokens,
            num_slots=a.num_slots, max_prompt_length=a.max_prompt_length, seed=config.seed, end_token_ids=end_ids)
        summary["acceptance_seconds"] = time.time() - t_accept
    summary["total_seconds"] = time.time() - t_start
    metrics.write_json(os.path.join(run_dir, "summary.json"), summary)
    return summary
