"""The GRPO learner: per-token log-probs through the fused projection, AdamW updates.

One RL step's batch is split into `num_minibatches` optimizer updates, each accumulating
gradients over micro-batches of `micro_batch_size` rows (a `lax.scan`, so one compiled
body whatever the batch). Every jitted function takes explicit shardings on the mesh:
parameters by the logical axis rules, rows over (data, fsdp). Rows come from the host,
the same on every process, and are placed on the mesh first, each process its shards.

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
    remat: bool = True
    logprob_impl: str = "auto"
    attention_impl: str = "auto"  # `attention.attention`'s impl: "dense" forms [n, heads, T, T] scores
    grpo: grpo.GRPOConfig = grpo.GRPOConfig()


def old_policy_outputs(params, model_config: ModelConfig, tokens_nT, positions_nT, segment_ids_nT, *,
                       temperature=1.0, top_k: int, feature_layers=(), attention_impl="auto"):
    """One target forward for the GRPO old-policy pass and the drafter's data:
    (logp [n, T-1], entropy [n, T-1], DrafterData), of rows packed as `token_logprobs`'.
    The log-probs, the entropy and the top-K come out of the same blockwise projection
    (`losses.linear_logprob_topk`), so no [n, T, V] logits exist and the log-probs equal
    `token_logprobs`'."""
    out = tfm.forward(params, model_config, tokens_nT[:, :-1], positions_BT=positions_nT[:, :-1],
                      segment_ids_BT=segment_ids_nT[:, :-1], layer_ids=tuple(feature_layers),
                      attention_impl=attention_impl)
    h, layers = out if feature_layers else (out, None)
    n, t, d = h.shape
    logp, entropy, ids, top_logp = losses.linear_logprob_topk(
        h.reshape(n * t, d), tfm.lm_head_weight(params, model_config), tokens_nT[:, 1:].reshape(-1), top_k,
        temperature=temperature)
    data = DrafterData(h, ids.reshape(n, t, top_k), top_logp.reshape(n, t, top_k),
                       None if layers is None else jnp.moveaxis(layers, 0, 2))
    return logp.reshape(n, t), entropy.reshape(n, t), data


def padded_rows(rows: int, micro_batch_size: int, granule: int) -> int:
    """The rows a minibatch of `rows` packed rows is padded to (its compiled shape). Below
    one micro-batch: at least ceil(micro_batch_size / 8) rows (the few rows of a small RL
    step share one shape), rounded up to a multiple of lcm(granule, 2^(floor(log2 rows) - 2)):
    padding under a quarter of the rows, at most four shapes per doubling. From one
    micro-batch on, a multiple of lcm(micro_batch_size, granule). granule is the
    data-parallel size, so rows shard evenly."""
    if rows < micro_batch_size:
        rows = max(rows, -(-micro_batch_size // 8))
        step = math.lcm(granule, 1 << max(0, rows.bit_length() - 3))
        small = -(-rows // step) * step
        if small < micro_batch_size:
            return small
    unit = math.lcm(micro_batch_size, granule)
    return -(-rows // unit) * unit


class Learner:
    """Holds the compiled steps for one model, optimizer and mesh."""

    def __init__(self, model_config: ModelConfig, config: LearnerConfig, mesh):
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
        return padded_rows(rows, self.config.micro_batch_size, self.mesh.shape["data"] * self.mesh.shape["fsdp"])

    # -- log-probs of the policy at the start of the step, and of the reference ----------------

    def logprobs(self, params, tokens_nT, positions_nT, segment_ids_nT, with_entropy=False):
        """`token_logprobs` of packed rows: [n, T-1] float32 (and the entropy, with_entropy)."""
        key = ("logprobs", with_entropy, tokens_nT.shape)
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
        return self._steps[key](params, *self._rows(tokens_nT, positions_nT, segment_ids_nT))

    def _rows(self, *rows_nT):
        """Host rows (the same on every process) as arrays over (data, fsdp)."""
        return [jax.device_put(x, sharding.batch_sharding(self.mesh, np.ndim(x))) for x in rows_nT]

    def logprobs_and_drafter_data(self, params, tokens_nT, positions_nT, segment_ids_nT, *, top_k: int,
                                  feature_layers=()):
        """`logprobs(..., with_entropy=True)` and, from the same forward, the DrafterData."""
        step = self.drafter_data_step(params, tokens_nT, top_k=top_k, feature_layers=feature_layers)
        return step(params, *self._rows(tokens_nT, positions_nT, segment_ids_nT))

    def drafter_data_step(self, params, tokens_nT, *, top_k: int, feature_layers=()):
        """The jitted old-policy pass of `logprobs_and_drafter_data` for rows shaped like
        tokens_nT: (params, tokens, positions, segment_ids) -> its outputs. params and
        tokens_nT may be jax.ShapeDtypeStructs (`.lower` then compiles it abstractly)."""
        key = ("drafter_data", top_k, tuple(feature_layers), tokens_nT.shape)
        if key not in self._steps:
            fn = lambda p, t, pos, seg: old_policy_outputs(
                p, self.model_config, t, pos, seg, temperature=self.config.temperature, top_k=top_k,
                feature_layers=feature_layers, attention_impl=self.config.attention_impl)
            rows = jax.ShapeDtypeStruct(tokens_nT.shape, jnp.int32)
            out_shapes = jax.eval_shape(fn, params, rows, rows, rows)
            out_sh = jax.tree.map(lambda x: sharding.batch_sharding(self.mesh, x.ndim), out_shapes)
            row_sh = sharding.batch_sharding(self.mesh, 2)
            self._steps[key] = sharding.jit_sharded(
                fn, in_shardings=(self.param_shardings(params), row_sh, row_sh, row_sh), out_shardings=out_sh)
        return self._steps[key]

    # -- the update ------------------------------------------------------------------------------

    def _loss(self, params, mb):
        cfg = self.config
        logp = token_logprobs(params, self.model_config, mb["tokens"], temperature=cfg.temperature,
                              impl=cfg.logprob_impl, remat=cfg.remat, positions_nT=mb["positions"],
                              segment_ids_nT=mb["segment_ids"], attention_impl=cfg.attention_impl)
        return grpo.policy_loss(logp, mb["old_logp"], mb["rollout_logp"], mb["advantages"], mb["loss_weights"],
                                mb["token_weights"], cfg.grpo, ref_logp_nT=mb.get("ref_logp"))

    def loss_and_grads(self, params, minibatch):
        """(loss, metrics, float32 grads) of one minibatch, accumulated over its
        micro-batches. The aggregation's weights come from the whole minibatch (its real
        tokens and sequences), so the sum over micro-batches is the minibatch's loss and
        an all-padding micro-batch adds exactly zero."""
        n = minibatch["tokens"].shape[0]
        micro = min(self.config.micro_batch_size, n)
        if n % micro:
            raise ValueError(f"Minibatch of {n} rows does not split into micro-batches of {micro}.")
        mask = minibatch["loss_mask"]
        stats = grpo.sequence_stats(mask, minibatch["segment_ids"])
        minibatch = dict(minibatch, loss_weights=grpo.get_aggregation(self.config.grpo.aggregation)(mask, *stats),
                         token_weights=grpo.token_mean(mask))
        stacked = jax.tree.map(lambda x: x.reshape((n // micro, micro) + x.shape[1:]), minibatch)
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)

        def body(acc, mb):
            (loss, metrics), grads = grad_fn(params, mb)
            acc_grads, acc_loss, acc_metrics = acc
            acc_grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc_grads, grads)
            acc_metrics = jax.tree.map(jnp.add, acc_metrics, metrics)
            return (acc_grads, acc_loss + loss, acc_metrics), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        first = jax.tree.map(lambda x: x[0], stacked)
        metric_zeros = jax.tree.map(lambda x: jnp.zeros((), jnp.float32),
                                    jax.eval_shape(lambda: self._loss(params, first)[1]))
        (grads, loss, metrics), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32), metric_zeros), stacked)
        return loss, metrics, grads

    def _update_fn(self, state: TrainState, minibatch):
        """One optimizer update from a minibatch."""
        loss, metrics, grads = self.loss_and_grads(state.params, minibatch)
        state, guard = apply_gradients(self.optimizer, state, grads, loss)
        return state, dict(metrics, loss=loss, **guard)

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
            minibatch = {name: v[i * size:(i + 1) * size] for name, v in batch.items()}
            step = self.update_step(state.params, minibatch)
            # Host rows (the same on every process) as arrays over (data, fsdp).
            state, metrics = step(state, jax.device_put(minibatch, self._batch_shardings(minibatch)))
            results.append(metrics)
        return state, [jax.device_get(m) for m in results]

    def update_step(self, params, minibatch: dict):
        """The jitted update of `update` for minibatches shaped like this one: (state,
        minibatch) -> (state, metrics), the state donated. params and minibatch may be
        jax.ShapeDtypeStructs (`.lower` then compiles it abstractly)."""
        key = ("update", tuple(sorted((name, np.shape(v)) for name, v in minibatch.items())))
        if key not in self._steps:
            st_sh = self.state_shardings(params)
            self._steps[key] = sharding.jit_sharded(
                self._update_fn, in_shardings=(st_sh, self._batch_shardings(minibatch)),
                out_shardings=(st_sh, sharding.replicated(self.mesh)), donate_argnums=(0,))
        return self._steps[key]
