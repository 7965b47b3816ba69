"""GRPO objective: group advantages, clipped policy loss, KL to the reference, aggregation.

Estimators and aggregations are registered by name, so configs pick them with a string
(`advantage="rloo"`, `aggregation="seq_mean"`). All functions are pure and jittable;
shapes: n sequences of a batch, T token positions, G samples per prompt (consecutive).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp


# ----------------------------------------------------------------------------- advantages


def _grouped(rewards_n, group_size):
    if rewards_n.shape[0] % group_size:
        raise ValueError(f"{rewards_n.shape[0]} rewards do not split into groups of {group_size}.")
    return rewards_n.reshape(-1, group_size).astype(jnp.float32)


def grpo_advantages(rewards_n, group_size, eps=1e-6):
    """(r - group mean) / (group std + eps) (Shao et al., DeepSeekMath)."""
    r = _grouped(rewards_n, group_size)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + eps)).reshape(-1)


def dr_grpo_advantages(rewards_n, group_size, eps=1e-6):
    """r - group mean, no std scaling (Liu et al., "Understanding R1-Zero-like training")."""
    del eps
    r = _grouped(rewards_n, group_size)
    return (r - r.mean(1, keepdims=True)).reshape(-1)


def rloo_advantages(rewards_n, group_size, eps=1e-6):
    """r_i - mean of the other G-1 rewards (leave-one-out baseline, Ahmadian et al.)."""
    del eps
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 samples per prompt.")
    r = _grouped(rewards_n, group_size)
    baseline = (r.sum(1, keepdims=True) - r) / (group_size - 1)
    return (r - baseline).reshape(-1)


ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


def get_advantage_estimator(name: str) -> Callable:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"Unknown advantage estimator {name!r}; choose from {sorted(ADVANTAGE_ESTIMATORS)}.")
    return ADVANTAGE_ESTIMATORS[name]


# ----------------------------------------------------------------------------- aggregation
#
# An aggregation is a per-token weighting, computed once for a whole minibatch, so that
# the loss is a plain weighted sum: additive over micro-batches, whatever their split.


def token_mean(mask_nT, max_len=None):
    """Every token of the batch weighs the same (DAPO)."""
    del max_len
    mask = mask_nT.astype(jnp.float32)
    return mask / jnp.maximum(jnp.sum(mask), 1)


def seq_mean(mask_nT, max_len=None):
    """Mean over sequences of each sequence's token mean (original GRPO)."""
    del max_len
    mask = mask_nT.astype(jnp.float32)
    return mask / (jnp.maximum(jnp.sum(mask, 1, keepdims=True), 1) * mask.shape[0])


def seq_sum_const(mask_nT, max_len=None):
    """Token sums over a constant length (Dr. GRPO): no length bias."""
    mask = mask_nT.astype(jnp.float32)
    return mask / (mask.shape[0] * (max_len or mask.shape[1]))


AGGREGATIONS: dict[str, Callable] = {"token_mean": token_mean, "seq_mean": seq_mean, "seq_sum_const": seq_sum_const}


def get_aggregation(name: str) -> Callable:
    """name -> fn(mask_nT, max_len=None) -> token weights [n, T] summing to the loss scale."""
    if name not in AGGREGATIONS:
        raise ValueError(f"Unknown loss aggregation {name!r}; choose from {sorted(AGGREGATIONS)}.")
    return AGGREGATIONS[name]


# ----------------------------------------------------------------------------- loss


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """clip_eps / clip_eps_high: the ratio is clipped to [1 - eps, 1 + eps_high] (DAPO's
    asymmetric clip-higher when eps_high > eps). kl_coef: weight of the k3 KL to the
    reference (0 disables it). tis_cap: truncated importance sampling cap on
    pi_old / pi_rollout, correcting for the rollout engine's own numerics (0 disables)."""

    clip_eps: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    tis_cap: float = 2.0
    aggregation: str = "token_mean"
    advantage: str = "grpo"


def k3_kl(logp_nT, ref_logp_nT):
    """Schulman's k3 estimator of KL(pi || pi_ref): unbiased, always >= 0."""
    d = ref_logp_nT - logp_nT
    return jnp.exp(d) - d - 1


def policy_loss(logp_nT, old_logp_nT, rollout_logp_nT, advantages_n, loss_weights_nT, token_weights_nT,
                config: GRPOConfig, ref_logp_nT=None):
    """Returns (loss, metrics), both weighted sums over tokens, so that micro-batch
    results add up to the minibatch's. logp are per-token log-probs of the sampled
    tokens: current policy, policy at the start of the step, and as the engine reported.
    loss_weights come from the configured aggregation, token_weights from `token_mean`
    (metrics are token means)."""
    adv = advantages_n[:, None]
    ratio = jnp.exp(logp_nT - old_logp_nT)
    clipped = jnp.clip(ratio, 1 - config.clip_eps, 1 + config.clip_eps_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    if config.tis_cap > 0:
        per_token = per_token * jax.lax.stop_gradient(
            jnp.minimum(jnp.exp(old_logp_nT - rollout_logp_nT), config.tis_cap))
    loss = jnp.sum(per_token * loss_weights_nT)
    mean = lambda x: jnp.sum(x * token_weights_nT)
    metrics = {"clip_fraction": mean((jnp.abs(ratio - clipped) > 0).astype(jnp.float32)),
               "ratio_mean": mean(ratio),
               "rollout_logp_gap": mean(jnp.abs(old_logp_nT - rollout_logp_nT))}
    if ref_logp_nT is not None:
        kl = k3_kl(logp_nT, ref_logp_nT)
        metrics["kl"] = mean(kl)
        if config.kl_coef:
            loss = loss + config.kl_coef * jnp.sum(kl * loss_weights_nT)
    return loss, metrics
