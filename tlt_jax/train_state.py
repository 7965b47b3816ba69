"""What every trainer shares: AdamW with clipping and a schedule, the train state, its
shardings, and the guarded update that skips a step whose loss or gradient is not finite.
Used by SFT, the GRPO learner, drafter training and distillation alike; the offline
trainers also share their step loop (`run_steps`)."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

from tlt_jax import sharding


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 1e-5
    warmup_steps: int = 0
    schedule: str = "constant"  # or "cosine": decays to 10% at decay_steps
    decay_steps: int = 1000
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    max_grad_norm: float = 1.0


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """The learning rate of each optimizer update (what `make_optimizer` applies)."""
    warmup = max(cfg.warmup_steps, 1)
    if cfg.schedule == "constant":
        if cfg.warmup_steps == 0:
            return optax.constant_schedule(cfg.learning_rate)
        return optax.join_schedules([optax.linear_schedule(0.0, cfg.learning_rate, warmup),
                                     optax.constant_schedule(cfg.learning_rate)], [warmup])
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, warmup, max(cfg.decay_steps, warmup + 1),
                                                  cfg.learning_rate * 0.1)
    raise ValueError(f"Unknown schedule {cfg.schedule!r}; choose 'constant' or 'cosine'.")


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    lr = learning_rate_schedule(cfg)
    if cfg.warmup_steps == 0 and cfg.schedule == "constant":
        lr = cfg.learning_rate  # a float keeps a schedule's step counter out of the optimizer state
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                       optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array  # optimizer updates applied (skipped ones do not count)


def optimizer_shardings(optimizer, params, param_shardings, mesh):
    """Optimizer moments shard like the parameters; counters are replicated."""
    p_def = jax.tree.structure(params)
    rep = sharding.replicated(mesh)
    return jax.tree.map(lambda node: param_shardings if jax.tree.structure(node) == p_def else rep,
                        jax.eval_shape(optimizer.init, params), is_leaf=lambda node: jax.tree.structure(node) == p_def)


def state_shardings(optimizer, params, param_shardings, mesh) -> TrainState:
    return TrainState(param_shardings, optimizer_shardings(optimizer, params, param_shardings, mesh),
                      sharding.replicated(mesh))


def init_train_state(optimizer, params, param_shardings, mesh) -> TrainState:
    """Places a copy of params (the state is donated to updates) and fresh moments."""
    params = jax.device_put(params, param_shardings, may_alias=False)
    opt_state = jax.jit(optimizer.init, out_shardings=optimizer_shardings(optimizer, params, param_shardings,
                                                                          mesh))(params)
    return TrainState(params, opt_state, jax.device_put(jnp.zeros((), jnp.int32), sharding.replicated(mesh)))


def apply_gradients(optimizer, state: TrainState, grads, loss):
    """One AdamW step, unless loss or gradient norm is not finite: then the state stays.
    Returns (state, {"grad_norm", "skipped"})."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda old, new: jnp.where(finite, new.astype(old.dtype), old)
    state = TrainState(jax.tree.map(keep, state.params, params), jax.tree.map(keep, state.opt_state, opt_state),
                       state.step + finite.astype(jnp.int32))
    return state, {"grad_norm": grad_norm, "skipped": (~finite).astype(jnp.float32)}


def jit_train_step(loss_fn, optimizer, state_sharding: TrainState, batch_sharding, mesh, has_aux: bool = False):
    """(state, batch) -> (state, {"loss", "grad_norm", "skipped"}): one guarded update of
    loss_fn(params, batch), jitted with explicit shardings, the state donated. With
    `has_aux`, loss_fn returns (loss, dict of scalar metrics) and those join the output."""

    with_aux = loss_fn if has_aux else lambda params, batch: (loss_fn(params, batch), {})

    def step(state, batch):
        (loss, aux), grads = jax.value_and_grad(with_aux, has_aux=True)(state.params, batch)
        state, guard = apply_gradients(optimizer, state, grads, loss)
        return state, dict(aux, loss=loss, **guard)

    return sharding.jit_sharded(step, in_shardings=(state_sharding, batch_sharding),
                                out_shardings=(state_sharding, sharding.replicated(mesh)), donate_argnums=(0,))


def run_steps(state, *, start: int, steps: int, step_fn, eval_fn, eval_every: int, checkpoint_every: int,
              ckpt, writer, bar):
    """The step loop of the offline trainers (SFT, distillation, drafter training).

    step_fn(state, step) -> (state, record) runs update `step` (0-based); eval_fn(state,
    step) -> record runs at every eval_every-th and at the last step (or once, when a
    resumed run is already done); the state is checkpointed at every checkpoint_every-th
    and at the last step; each record goes to the metrics writer and the progress bar.
    Waits for pending checkpoints and closes ckpt, writer and bar. Returns (state, the
    last record, seconds spent in the loop).
    """
    record, t0 = {}, time.time()
    for step in range(start, steps):
        state, record = step_fn(state, step)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            record.update(eval_fn(state, step + 1))
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps:
            ckpt.save(step + 1, state, {"step": step + 1})
        writer.write(step + 1, record)
        bar.update(record)
    bar.close()
    seconds = time.time() - t0
    if start >= steps:
        record = eval_fn(state, steps)
    ckpt.wait()
    ckpt.close()
    writer.close()
    return state, record, seconds
