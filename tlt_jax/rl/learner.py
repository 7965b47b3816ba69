"""The GRPO learner: per-token log-probs through the fused projection, AdamW updates.

One RL step's batch is split into `num_minibatches` optimizer updates, each accumulating
gradients over micro-batches (`Learner.micro_rows`). With one update per step the update is
on-policy: the policy at the start of the step is the one it differentiates, so its own
forward gives the old log-probs (the ratio is exactly 1, as TRL's GRPOTrainer takes it with
one iteration), the entropy and the drafter's data, and no separate old-policy pass runs
(`Learner.update_on_policy`). The micro-batches run one by one from
the host through one compiled program per micro-batch shape, as do the chunks of the
log-prob passes, and those shapes are two (`micro_batch_size`, and `small_micro_rows`
for minibatches smaller than that), so a batch of a new size compiles nothing: each model
program of a new shape costs seconds to compile here, minutes for a large model on a GPU.
Every jitted function takes explicit shardings on the mesh: parameters by the logical axis
rules, rows over (data, fsdp). Rows come from the host, the same on every process, and are
placed on the mesh first, each process its shards.

A batch is a dict of R packed rows of S tokens (`loop.build_batch`): each row holds
several samples (prompt then answer), kept apart by segment ids, so that attention never
crosses two samples and RoPE sees each sample's own positions; rows of segment 0 only
pad each minibatch to `minibatch_rows`:
    tokens       int32 [R, S]
    positions    int32 [R, S]     the token's position in its sample (0 on padding)
    segment_ids  int32 [R, S]     1, 2, ... per sample within a row; 0 is padding
    loss_mask    bool  [R, S-1]   True where position t predicts an answer token t+1 of its
                                  own sample (never at a sample's last position)
    rollout_logp f32   [R, S-1]   the engine's log-prob of token t+1 (0 off the mask)
    advantages   f32   [R, S-1]   the advantage of token t+1's sample (0 off the mask)
One sample per row, right-padded, is the special case of segment ids 1 and positions
0 .. S-1. The loss aggregations see sequences, not rows (`grpo.sequence_stats`), so a
minibatch's loss is the same in either layout.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax import losses, sharding
from tlt_jax.drafter_training.online import DrafterData
from tlt_jax.logprobs import token_logprobs
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig
from tlt_jax.rl import grpo
from tlt_jax.train_state import (
    OptimizerConfig,
    TrainState,
    apply_gradients,
    init_train_state,
    make_optimizer,
    state_shardings,
)


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    optimizer: OptimizerConfig = OptimizerConfig()
    num_minibatches: int = 1
    micro_batch_size: int = 8
    temperature: float = 1.0  # the rollout sampling temperature: log-probs of that distribution
    # "auto": with one minibatch, the update's own forward is the old-policy pass
    # (`Learner.on_policy`); "always": a separate forward first, as verl does.
    old_policy_pass: str = "auto"
    remat: bool = True
    logprob_impl: str = "auto"  # `losses.IMPLS`: the projection of the log-probs, entropy and drafter's top-K
    attention_impl: str = "auto"  # `attention.attention`'s impl: "dense" forms [n, heads, T, T] scores
    grpo: grpo.GRPOConfig = grpo.GRPOConfig()


OLD_POLICY_PASSES = ("auto", "always")


def policy_outputs(params, model_config: ModelConfig, tokens_nT, positions_nT, segment_ids_nT, *,
                   temperature=1.0, top_k: int = 0, feature_layers=(), remat=False, logprob_impl="auto",
                   attention_impl="auto"):
    """One target forward's per-token outputs, of rows packed as `token_logprobs`':
    (logp [n, T-1], entropy [n, T-1], DrafterData or None). With top_k > 0 the log-probs,
    the entropy and the drafter's top-K come out of the same blockwise projection
    (`losses.linear_logprob_topk`), so no [n, T, V] logits exist; without, no drafter data.
    Either way the projection is `logprob_impl`'s. logp and entropy are differentiable (the
    on-policy update's loss), the drafter data is not."""
    if top_k > model_config.vocab_size:
        raise ValueError(f"tlt.drafter.top_k={top_k} exceeds the policy's vocabulary ({model_config.vocab_size}); set "
                         f"--config.tlt.drafter.top_k to at most {model_config.vocab_size}.")
    out = tfm.forward(params, model_config, tokens_nT[:, :-1], positions_BT=positions_nT[:, :-1],
                      segment_ids_BT=segment_ids_nT[:, :-1], layer_ids=tuple(feature_layers), remat=remat,
                      attention_impl=attention_impl)
    h, layers = out if feature_layers else (out, None)
    n, t, d = h.shape
    w, targets = tfm.lm_head_weight(params, model_config, h.dtype), tokens_nT[:, 1:].reshape(-1)
    if not top_k:
        logp, entropy = losses.linear_logprob(h.reshape(n * t, d), w, targets, temperature=temperature,
                                              with_entropy=True, impl=logprob_impl)
        return logp.reshape(n, t), entropy.reshape(n, t), None
    logp, entropy, ids, top_logp = losses.linear_logprob_topk(h.reshape(n * t, d), w, targets, top_k,
                                                              temperature=temperature, impl=logprob_impl)
    data = DrafterData(jax.lax.stop_gradient(h), ids.reshape(n, t, top_k), top_logp.reshape(n, t, top_k),
                       None if layers is None else jnp.moveaxis(layers, 0, 2))
    return logp.reshape(n, t), entropy.reshape(n, t), data


def small_micro_rows(micro_batch_size: int, granule: int) -> int:
    """The rows of every micro-batch of a minibatch smaller than one micro-batch:
    lcm(granule, ceil(micro_batch_size / 8)). One size whatever the batch, so a run
    compiles its update and log-prob passes at two shapes at most (this and
    micro_batch_size), each costing seconds to compile here and minutes for a large model
    on a GPU, while padding stays under this many rows."""
    return math.lcm(granule, -(-micro_batch_size // 8))


def padded_rows(rows: int, micro_batch_size: int, granule: int) -> int:
    """The rows a minibatch of `rows` packed rows is padded to (its compiled shape is its
    micro-batch's, `Learner.micro_rows`). Below one micro-batch: a multiple of
    `small_micro_rows`; from one micro-batch on, a multiple of lcm(micro_batch_size,
    granule). granule is the data-parallel size, so rows shard evenly."""
    small = small_micro_rows(micro_batch_size, granule)
    padded = -(-rows // small) * small
    if padded < micro_batch_size:
        return padded
    unit = math.lcm(micro_batch_size, granule)
    return -(-rows // unit) * unit


class Learner:
    """Holds the compiled steps for one model, optimizer and mesh."""

    def __init__(self, model_config: ModelConfig, config: LearnerConfig, mesh):
        if config.old_policy_pass not in OLD_POLICY_PASSES:
            raise ValueError(f"LearnerConfig.old_policy_pass={config.old_policy_pass!r}: choose from "
                             f"{OLD_POLICY_PASSES}.")
        try:  # refused here, naming the backend's impls, rather than at the first step's trace
            losses.resolve_impl(config.logprob_impl)
        except ValueError as e:
            raise ValueError(f"learner.logprob_impl={config.logprob_impl!r}: {e}") from e
        self.model_config, self.config, self.mesh = model_config, config, mesh
        self.optimizer = make_optimizer(config.optimizer)
        self._steps: dict = {}

    # -- state ------------------------------------------------------------------------------

    def param_shardings(self, params):
        return tfm.param_shardings(self.model_config, params, self.mesh)

    def init_state(self, params) -> TrainState:
        return init_train_state(self.optimizer, params, self.param_shardings(params), self.mesh)

    def state_shardings(self, params) -> TrainState:
        return state_shardings(self.optimizer, params, self.param_shardings(params), self.mesh)

    def _batch_shardings(self, batch):
        return {k: sharding.batch_sharding(self.mesh, np.ndim(v)) for k, v in batch.items()}

    def minibatch_rows(self, rows: int) -> int:
        """Rows of a minibatch that needs `rows` packed rows, padding included (`padded_rows`
        on this mesh's data-parallel size): `loop.build_batch` pads to it."""
        return padded_rows(rows, self.config.micro_batch_size, self._granule())

    def micro_rows(self, rows: int) -> int:
        """Rows of one micro-batch of a minibatch of `rows` rows (`minibatch_rows`): the
        compiled shape of the update and of the log-prob passes' chunks. From one
        micro-batch on, `micro_batch_size` on the data-parallel granule; below it,
        `small_micro_rows` (a divisor of rows where rows were padded otherwise)."""
        cfg, granule = self.config, self._granule()
        unit = math.lcm(cfg.micro_batch_size, granule)
        if rows >= cfg.micro_batch_size:
            return unit if rows % unit == 0 else rows
        return math.gcd(rows, small_micro_rows(cfg.micro_batch_size, granule))

    @property
    def on_policy(self) -> bool:
        """Whether an RL step's update takes its old log-probs from its own forward
        (`update_on_policy`): one minibatch, so the policy it differentiates is the one at the
        start of the step, and old_policy_pass "auto"."""
        return self.config.num_minibatches == 1 and self.config.old_policy_pass == "auto"

    def _granule(self) -> int:
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    # -- log-probs of the policy at the start of the step, and of the reference ----------------

    def logprobs(self, params, tokens_nT, positions_nT, segment_ids_nT, with_entropy=False):
        """`token_logprobs` of packed rows: [n, T-1] float32 on the host (and the entropy,
        with_entropy)."""
        chunk = self._chunk_rows(tokens_nT.shape[0])
        key = ("logprobs", with_entropy, (chunk, tokens_nT.shape[1]))
        if key not in self._steps:
            cfg = self.config
            fn = lambda p, t, pos, seg: token_logprobs(p, self.model_config, t, temperature=cfg.temperature,
                                                       with_entropy=with_entropy, impl=cfg.logprob_impl,
                                                       positions_nT=pos, segment_ids_nT=seg,
                                                       attention_impl=cfg.attention_impl)
            row_sh = sharding.batch_sharding(self.mesh, 2)
            self._steps[key] = sharding.jit_sharded(
                fn, in_shardings=(self.param_shardings(params), row_sh, row_sh, row_sh),
                out_shardings=(row_sh, row_sh) if with_entropy else row_sh)
        return self._chunked(self._steps[key], chunk, params, tokens_nT, positions_nT, segment_ids_nT)

    def logprobs_and_drafter_data(self, params, tokens_nT, positions_nT, segment_ids_nT, *, top_k: int,
                                  feature_layers=()):
        """`logprobs(..., with_entropy=True)` and, from the same forward, the DrafterData,
        all on the host."""
        chunk = self._chunk_rows(tokens_nT.shape[0])
        step = self.drafter_data_step(params, jax.ShapeDtypeStruct((chunk, tokens_nT.shape[1]), jnp.int32),
                                      top_k=top_k, feature_layers=feature_layers)
        return self._chunked(step, chunk, params, tokens_nT, positions_nT, segment_ids_nT)

    def drafter_data_step(self, params, tokens_nT, *, top_k: int, feature_layers=()):
        """The jitted old-policy pass of `logprobs_and_drafter_data` for rows shaped like
        tokens_nT: (params, tokens, positions, segment_ids) -> its outputs. params and
        tokens_nT may be jax.ShapeDtypeStructs (`.lower` then compiles it abstractly)."""
        key = ("drafter_data", top_k, tuple(feature_layers), tokens_nT.shape)
        if key not in self._steps:
            fn = lambda p, t, pos, seg: policy_outputs(
                p, self.model_config, t, pos, seg, temperature=self.config.temperature, top_k=top_k,
                feature_layers=feature_layers, logprob_impl=self.config.logprob_impl,
                attention_impl=self.config.attention_impl)
            rows = jax.ShapeDtypeStruct(tokens_nT.shape, jnp.int32)
            out_shapes = jax.eval_shape(fn, params, rows, rows, rows)
            out_sh = jax.tree.map(lambda x: sharding.batch_sharding(self.mesh, x.ndim), out_shapes)
            row_sh = sharding.batch_sharding(self.mesh, 2)
            self._steps[key] = sharding.jit_sharded(
                fn, in_shardings=(self.param_shardings(params), row_sh, row_sh, row_sh), out_shardings=out_sh)
        return self._steps[key]

    def _chunk_rows(self, rows: int) -> int:
        """Rows per forward of a log-prob pass over a batch of `rows` rows: a micro-batch of
        its minibatches (the update's shapes), or all rows where they do not split so."""
        k = self.config.num_minibatches
        return self.micro_rows(rows // k if rows % k == 0 else rows)

    def _chunked(self, step, chunk: int, params, *rows_nT):
        """`step(params, *rows)` over consecutive chunks of `chunk` rows, all dispatched
        before the first is read back; the outputs gathered to the host and concatenated."""
        n = rows_nT[0].shape[0]
        return self._gather([step(params, *self._rows(*(x[i:i + chunk] for x in rows_nT)))
                             for i in range(0, n, chunk)])

    def _rows(self, *rows_nT):
        """Host rows (the same on every process) as arrays over (data, fsdp)."""
        return [jax.device_put(x, sharding.batch_sharding(self.mesh, np.ndim(x))) for x in rows_nT]

    # -- the update ------------------------------------------------------------------------------

    def _loss(self, params, mb, outputs=None):
        """(loss, aux) of a micro-batch. outputs None: mb carries old_logp and aux is the
        metrics. outputs (top_k, feature_layers): on-policy, the forward's own log-probs are
        the old ones (without gradient: the ratio is exactly 1, its gradient the log-probs'),
        and aux is (metrics, (entropy, DrafterData or None)) (`policy_outputs`)."""
        cfg = self.config
        if outputs is None:
            logp = token_logprobs(params, self.model_config, mb["tokens"], temperature=cfg.temperature,
                                  impl=cfg.logprob_impl, remat=cfg.remat, positions_nT=mb["positions"],
                                  segment_ids_nT=mb["segment_ids"], attention_impl=cfg.attention_impl)
            old_logp = mb["old_logp"]
        else:
            top_k, feature_layers = outputs
            logp, entropy, data = policy_outputs(
                params, self.model_config, mb["tokens"], mb["positions"], mb["segment_ids"],
                temperature=cfg.temperature, top_k=top_k, feature_layers=feature_layers, remat=cfg.remat,
                logprob_impl=cfg.logprob_impl, attention_impl=cfg.attention_impl)
            old_logp = jax.lax.stop_gradient(logp)
        loss, metrics = grpo.policy_loss(logp, old_logp, mb["rollout_logp"], mb["advantages"], mb["loss_weights"],
                                         mb["token_weights"], cfg.grpo, ref_logp_nT=mb.get("ref_logp"))
        return loss, (metrics if outputs is None else (metrics, (entropy, data)))

    def loss_and_grads(self, params, minibatch: dict, outputs=None):
        """(loss, metrics, float32 grads) of one minibatch of host rows, summed in order over
        its micro-batches (`micro_rows`), each one call of the same compiled program. The
        aggregation's weights come from the whole minibatch (its real tokens and
        sequences), so the sum is the minibatch's loss and an all-padding micro-batch adds
        exactly zero. With outputs (on-policy, `_loss`): (that, (entropy, DrafterData or
        None) of the minibatch's rows on the host)."""
        n = minibatch["tokens"].shape[0]
        micro = self.micro_rows(n)  # divides n by construction
        minibatch = dict(minibatch, **self._weights(minibatch["loss_mask"], minibatch["segment_ids"]))
        micro_batches = [{name: v[i:i + micro] for name, v in minibatch.items()} for i in range(0, n, micro)]
        step, zeros = self.micro_step(params, micro_batches[0], outputs)
        acc, rows, behind = zeros(), [], None
        for mb in micro_batches:
            out = step(params, acc, jax.device_put(mb, self._batch_shardings(mb)))
            if outputs is None:
                acc = out
                continue
            # The previous micro-batch's outputs go to the host while this one runs: the
            # batch's drafter data never piles up on the devices beside the update.
            acc, this = out
            if behind is not None:
                rows.append(jax.tree.map(sharding.to_host, behind))
            behind = this
        if outputs is None:
            return acc
        rows.append(jax.tree.map(sharding.to_host, behind))
        return acc, self._gather(rows)

    @staticmethod
    def _gather(parts):
        """Per-row outputs of consecutive chunks of rows, concatenated on the host."""
        return jax.tree.map(lambda *xs: np.concatenate([sharding.to_host(x) for x in xs]), *parts)

    def _weights(self, mask_nT, segment_ids_nT) -> dict:
        """The minibatch's loss weights (the configured aggregation) and token weights (the
        metrics' token mean), on the host: one small program per minibatch shape."""
        key = ("weights", np.shape(mask_nT), np.shape(segment_ids_nT))
        if key not in self._steps:
            aggregate = grpo.get_aggregation(self.config.grpo.aggregation)

            def fn(mask, segment_ids):
                return dict(loss_weights=aggregate(mask, *grpo.sequence_stats(mask, segment_ids)),
                            token_weights=grpo.token_mean(mask))

            self._steps[key] = sharding.jit_sharded(
                fn, in_shardings=(sharding.batch_sharding(self.mesh, 2),) * 2,
                out_shardings=sharding.batch_sharding(self.mesh, 2))
        return jax.tree.map(sharding.to_host, self._steps[key](*self._rows(mask_nT, segment_ids_nT)))

    def micro_step(self, params, mb: dict, outputs=None):
        """(step, zeros) for micro-batches shaped like mb (the minibatch fields with its
        loss_weights and token_weights): step(params, acc, mb) adds mb's (loss, metrics,
        float32 grads) to acc (donated) and returns it, with outputs (on-policy, `_loss`)
        beside mb's (entropy, DrafterData or None); zeros() is an empty acc. params and mb
        may be jax.ShapeDtypeStructs (`step.lower` then compiles it abstractly)."""
        key = ("micro", outputs, tuple(sorted((name, v.shape) for name, v in mb.items())))
        if key not in self._steps:
            abstract = {name: jax.ShapeDtypeStruct(v.shape, v.dtype) for name, v in mb.items()}
            aux_shapes = jax.eval_shape(lambda p, m: self._loss(p, m, outputs)[1], params, abstract)
            metric_names = aux_shapes if outputs is None else aux_shapes[0]
            grad_fn = jax.value_and_grad(functools.partial(self._loss, outputs=outputs), has_aux=True)

            def step(params, acc, mb):
                (loss, aux), grads = grad_fn(params, mb)
                metrics, rows = (aux, None) if outputs is None else aux
                acc_loss, acc_metrics, acc_grads = acc
                acc = (acc_loss + loss, jax.tree.map(jnp.add, acc_metrics, metrics),
                       jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_grads, grads))
                return acc if outputs is None else (acc, rows)

            def zeros():
                return (jnp.zeros((), jnp.float32), jax.tree.map(lambda _: jnp.zeros((), jnp.float32), metric_names),
                        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

            acc_sh = self._acc_shardings(params)
            out_sh = acc_sh if outputs is None else (acc_sh, jax.tree.map(
                lambda x: sharding.batch_sharding(self.mesh, x.ndim), aux_shapes[1]))
            self._steps[key] = (
                sharding.jit_sharded(step, in_shardings=(self.param_shardings(params), acc_sh,
                                                         self._batch_shardings(mb)),
                                     out_shardings=out_sh, donate_argnums=(1,)),
                sharding.jit_sharded(zeros, in_shardings=(), out_shardings=acc_sh))
        return self._steps[key]

    def _acc_shardings(self, params):
        replicated = sharding.replicated(self.mesh)
        return replicated, replicated, self.param_shardings(params)

    def update(self, state: TrainState, batch: dict) -> tuple[TrainState, list[dict]]:
        """One RL step: `num_minibatches` updates over the batch's rows, in order.

        The batch must carry old_logp (and ref_logp with a KL term) beside the fields above.
        A non-finite loss or gradient leaves the state unchanged (metrics["skipped"] = 1).
        """
        n = batch["tokens"].shape[0]
        k = self.config.num_minibatches
        if n % k:
            raise ValueError(f"Batch of {n} rows does not split into {k} minibatches.")
        size = n // k
        results = []
        for i in range(k):
            acc = self.loss_and_grads(state.params, {name: v[i * size:(i + 1) * size] for name, v in batch.items()})
            state, metrics = self._apply_step(state.params, acc)(state, acc)
            results.append(metrics)
        return state, [jax.device_get(m) for m in results]

    def update_on_policy(self, state: TrainState, batch: dict, *, top_k: int = 0, feature_layers=()):
        """One RL step's single update, on-policy (`on_policy`): the batch carries no old_logp,
        the update's forward gives it. Returns (state, [metrics], entropy [R, S-1],
        DrafterData or None), the last two on the host: with top_k > 0 the drafter's data
        of the batch's rows at the policy before the update, as `logprobs_and_drafter_data`
        gives it."""
        if not self.on_policy:
            raise ValueError(
                f"An on-policy update needs one update per RL step and old_policy_pass 'auto' (here "
                f"num_minibatches={self.config.num_minibatches}, old_policy_pass="
                f"{self.config.old_policy_pass!r}); otherwise compute old_logp (`logprobs`) and call `update`.")
        acc, (entropy, data) = self.loss_and_grads(state.params, batch, (int(top_k), tuple(feature_layers)))
        state, metrics = self._apply_step(state.params, acc)(state, acc)
        return state, [jax.device_get(metrics)], entropy, data

    def _apply_step(self, params, acc):
        """The jitted optimizer update from a minibatch's (loss, metrics, grads): (state,
        acc) -> (state, metrics), the state donated."""
        key = ("apply", tuple(sorted(acc[1])))
        if key not in self._steps:

            def apply(state, acc):
                loss, metrics, grads = acc
                state, guard = apply_gradients(self.optimizer, state, grads, loss)
                return state, dict(metrics, loss=loss, **guard)

            st_sh = self.state_shardings(params)
            self._steps[key] = sharding.jit_sharded(
                apply, in_shardings=(st_sh, self._acc_shardings(params)),
                out_shardings=(st_sh, sharding.replicated(self.mesh)), donate_argnums=(0,))
        return self._steps[key]
