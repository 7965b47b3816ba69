"""GRPO objective: group advantages, clipped policy loss, KL to the reference, aggregation.

Estimators and aggregations are registered by name, so configs pick them with a string
(`advantage="rloo"`, `aggregation="seq_mean"`). All functions are pure and jittable;
shapes: n rewards (one per sequence) and G samples per prompt (consecutive) for the
advantages; n rows of a batch and T token positions for the loss, a row holding one
sequence or several packed ones (then told apart by segment ids).
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
# Its arguments describe the minibatch's sequences whatever their layout (one per row, or
# packed several to a row): mask_nT, True on the loss positions; seq_tokens_nT, at each
# loss position the number of loss positions of its sequence; num_sequences, the number
# of sequences in the minibatch (`sequence_stats` derives both from segment ids).


def sequence_stats(mask_nT, segment_ids_nT):
    """(seq_tokens_nT float32, num_sequences float32 scalar) of a minibatch of rows whose
    sequences are told apart by segment ids (1, 2, ... in order within a row; 0 is
    padding, no sequence). mask_nT [n, T] marks the loss positions; segment_ids_nT
    [n, T + 1] are the rows' tokens' (position t of the mask reads token t and predicts
    token t+1 of the same segment). Rows of one unpadded sequence each: segment ids 1."""
    n, t = mask_nT.shape
    seg_nT = segment_ids_nT[:, :-1].astype(jnp.int32)
    sequence_nT = jnp.arange(n, dtype=jnp.int32)[:, None] * (t + 1) + seg_nT  # unique per (row, segment)
    counts = jax.ops.segment_sum(mask_nT.astype(jnp.int32).reshape(-1), sequence_nT.reshape(-1),
                                 num_segments=n * (t + 1))
    seq_tokens_nT = counts[sequence_nT].astype(jnp.float32)
    num_sequences = jnp.sum(jnp.max(segment_ids_nT, axis=1)).astype(jnp.float32)
    return seq_tokens_nT, num_sequences


def token_mean(mask_nT, seq_tokens_nT=None, num_sequences=None, max_len=None):
    """Every token of the batch weighs the same (DAPO)."""
    del seq_tokens_nT, num_sequences, max_len
    mask = mask_nT.astype(jnp.float32)
    return mask / jnp.maximum(jnp.sum(mask), 1)


def seq_mean(mask_nT, seq_tokens_nT, num_sequences, max_len=None):
    """Mean over sequences of each sequence's token mean (original GRPO)."""
    del max_len
    mask = mask_nT.astype(jnp.float32)
    return mask / (jnp.maximum(seq_tokens_nT, 1) * jnp.maximum(num_sequences, 1))


def seq_sum_const(mask_nT, seq_tokens_nT, num_sequences, max_len=None):
    """Token sums over a constant length (Dr. GRPO; default: the T positions of a row),
    averaged over sequences: no length bias."""
    del seq_tokens_nT
    mask = mask_nT.astype(jnp.float32)
    return mask / (jnp.maximum(num_sequences, 1) * (max_len or mask.shape[1]))


AGGREGATIONS: dict[str, Callable] = {"token_mean": token_mean, "seq_mean": seq_mean, "seq_sum_const": seq_sum_const}


def get_aggregation(name: str) -> Callable:
    """name -> fn(mask_nT, seq_tokens_nT, num_sequences, max_len=None) -> token weights
    [n, T] summing to the loss scale."""
    if name not in AGGREGATIONS:
        raise ValueError(f"Unknown loss aggregation {name!r}; choose from {sorted(AGGREGATIONS)}.")
    return AGGREGATIONS[name]


# ----------------------------------------------------------------------------- loss


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """clip_eps / clip_eps_high: the ratio is clipped to [1 - eps, 1 + eps_high] (DAPO's
    asymmetric clip-higher when eps_high > eps). kl_coef: weight of the k3 KL to the
    reference (0 disables it). tis_cap: truncated importance sampling cap on
    pi_old / pi_rollout (0 disables). pi_old is the policy at the temperature alone (the
    learner's log-probs); pi_rollout the distribution the engine actually sampled from,
    after top-k / top-p / min-p. Without those filters the two differ only by the
    engine's numerics; with them the ratio also corrects for the truncation (pi_rollout
    renormalises the kept tokens, so the ratio is the kept mass, <= 1), which makes the
    update unbiased for the untruncated policy. `rollout_logp_gap` reports the same
    difference.
    The advantage estimator is the RL step's (`loop.RLStepConfig.advantage`): it runs on
    the host, before the learner."""

    clip_eps: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    tis_cap: float = 2.0
    aggregation: str = "token_mean"

    def __post_init__(self):
        # A ratio on the clip's edge gets half its gradient through jnp.minimum's tie, and the
        # first update of a step (ratio exactly 1) sits on an edge of width 0.
        for name in ("clip_eps", "clip_eps_high"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GRPOConfig.{name}={getattr(self, name)} must be > 0 (the ratio is clipped to "
                                 "[1 - clip_eps, 1 + clip_eps_high]; e.g. 0.2 and 0.28).")


def require_importance_weight(tis_cap: float, setting: str) -> None:
    """Raises unless the per-token importance weight is on: `setting` (partial rollouts,
    one-step-off) learns tokens drawn by older policies than the learner's."""
    if tis_cap <= 0:
        raise ValueError(f"{setting} learns tokens drawn by older policies: it needs the per-token importance "
                         "weight, grpo.tis_cap > 0 (e.g. 2.0).")


def k3_kl(logp_nT, ref_logp_nT):
    """Schulman's k3 estimator of KL(pi || pi_ref): unbiased, always >= 0."""
    d = ref_logp_nT - logp_nT
    return jnp.exp(d) - d - 1


def policy_loss(logp_nT, old_logp_nT, rollout_logp_nT, advantages_nT, loss_weights_nT, token_weights_nT,
                config: GRPOConfig, ref_logp_nT=None):
    """Returns (loss, metrics), both weighted sums over tokens, so that micro-batch
    results add up to the minibatch's. logp are per-token log-probs of the sampled
    tokens: current policy, policy at the start of the step, and as the engine reported;
    advantages_nT each token's sequence's advantage. loss_weights come from the
    configured aggregation, token_weights from `token_mean` (metrics are token means;
    positive exactly on the loss positions)."""
    # Positions off the loss (prompts, padding) weigh 0. Their log-ratios are zeroed as
    # well, so that an overflow there (an improbable padding token) cannot make 0 * inf
    # a NaN in the loss or its gradient: such positions contribute exactly nothing.
    live = token_weights_nT > 0
    masked = lambda x: jnp.where(live, x, 0.0)
    adv = masked(advantages_nT)
    ratio = jnp.exp(masked(logp_nT - old_logp_nT))
    clipped = jnp.clip(ratio, 1 - config.clip_eps, 1 + config.clip_eps_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    if config.tis_cap > 0:
        per_token = per_token * jax.lax.stop_gradient(
            jnp.minimum(jnp.exp(masked(old_logp_nT - rollout_logp_nT)), config.tis_cap))
    loss = jnp.sum(per_token * loss_weights_nT)
    mean = lambda x: jnp.sum(x * token_weights_nT)
    metrics = {"clip_fraction": mean((jnp.abs(ratio - clipped) > 0).astype(jnp.float32)),
               "ratio_mean": mean(ratio),
               "rollout_logp_gap": mean(masked(jnp.abs(old_logp_nT - rollout_logp_nT)))}
    if ref_logp_nT is not None:
        kl = k3_kl(masked(logp_nT), masked(ref_logp_nT))
        metrics["kl"] = mean(kl)
        if config.kl_coef:
            loss = loss + config.kl_coef * jnp.sum(kl * loss_weights_nT)
    return loss, metrics
