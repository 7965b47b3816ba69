"""Our GRPO objective against TRL's (`trl.GRPOTrainer`, the version in the test extra).

TRL's loss is the trainer's own `GRPOTrainer._compute_loss`, called on a stand-in that
holds the attributes the method reads (set from a real `trl.GRPOConfig`, as
`GRPOTrainer.__init__` sets them) and whose forward returns the batch's log-probs: a
change in TRL's loss breaks these tests. Two pieces live inside TRL's rollout method
(`_generate_and_score_completions`) and cannot be called alone; they are restated here
line for line: the advantages and the token-truncated importance-sampling ratio.
docs/grpo.md says where the two objectives differ, and why.
"""
import collections
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import trl
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd

from tlt_jax.rl import grpo

P, G, T, MAX_COMPLETION = 3, 4, 13, 16  # prompts, samples per prompt, completion width, TRL's max_completion_length
EPS, EPS_HIGH = 0.2, 0.28
LOSS_TYPE = {"token_mean": "dapo", "seq_mean": "grpo", "seq_sum_const": "dr_grpo"}  # ours -> TRL's
RTOL = 1e-6


def _batch(seed=0):
    """12 completions of lengths 1..13, right-padded to T, one masked whole (TRL's
    mask_truncated_completions); log-probs whose ratios reach past both clip bounds and
    whose rollout ratios past the TIS cap; a group of equal rewards. Off the mask, values
    no loss may read (an improbable padding token, stale log-probs)."""
    rng = np.random.default_rng(seed)
    n = P * G
    lengths = rng.integers(1, T + 1, n)
    lengths[[0, 5]] = T, 0
    mask = np.arange(T) < lengths[:, None]
    logp = -rng.exponential(1.0, (n, T))
    old = logp + 0.3 * rng.standard_normal((n, T))
    ref = logp + 0.5 * rng.standard_normal((n, T))
    rollout = old + 0.4 * rng.standard_normal((n, T))
    f32 = lambda x, pad: np.where(mask, x, pad).astype(np.float32)
    rewards = rng.integers(0, 2, n).astype(np.float32)
    rewards[2 * G:] = 1.0
    return dict(mask=mask, logp=f32(logp, -20.0), old=f32(old, -1.0), ref=f32(ref, -1.0),
                rollout=f32(rollout, -1.0), rewards=rewards,
                adv=np.asarray(grpo.grpo_advantages(jnp.asarray(rewards), G)))


# ----------------------------------------------------------------------------- ours


def _ours(b, aggregation, kl_coef, tis_cap, *, max_len=MAX_COMPLETION, segment_ids=None):
    """(loss, d loss / d logp, metrics) of `grpo.policy_loss`, the aggregation's weights
    from the whole batch (as `Learner.loss_and_grads` computes them per minibatch)."""
    mask = jnp.asarray(b["mask"])
    if segment_ids is None:  # one completion per row
        segment_ids = jnp.ones((mask.shape[0], mask.shape[1] + 1), jnp.int32)
    adv = b["adv_nT"] if "adv_nT" in b else b["adv"]
    (value, metrics), grad = _ours_jit(jnp.asarray(b["logp"]), mask, segment_ids, jnp.asarray(adv), b["old"],
                                       b["rollout"], b["ref"], aggregation=aggregation, kl_coef=kl_coef,
                                       tis_cap=tis_cap, max_len=max_len, per_token_adv="adv_nT" in b)
    return float(value), np.asarray(grad), metrics


# Jitted, as the learner runs it (op by op, each operation compiles a program of its own).
@functools.partial(jax.jit, static_argnames=("aggregation", "kl_coef", "tis_cap", "max_len", "per_token_adv"))
def _ours_jit(logp, mask, segment_ids, adv, old, rollout, ref, *, aggregation, kl_coef, tis_cap, max_len,
              per_token_adv):
    weights = grpo.get_aggregation(aggregation)(mask, *grpo.sequence_stats(mask, segment_ids), max_len=max_len)
    config = grpo.GRPOConfig(clip_eps=EPS, clip_eps_high=EPS_HIGH, kl_coef=kl_coef, tis_cap=tis_cap,
                             aggregation=aggregation)
    if not per_token_adv:
        adv = jnp.where(mask, adv[:, None], 0.0)

    def loss(logp):
        return grpo.policy_loss(logp, old, rollout, adv, weights, grpo.token_mean(mask), config, ref_logp_nT=ref)

    return jax.value_and_grad(loss, has_aux=True)(logp)


# ----------------------------------------------------------------------------- TRL's


def _trl_args(loss_type, beta, tis_cap, *, micro_batches=1, steps_per_generation=None,
              use_bias_correction_kl=False):
    """A TRL config of the same objective: clip range [1 - EPS, 1 + EPS_HIGH], k3 KL
    weighted by beta (TRL's default bias-corrects it: off unless asked), TIS as the
    per-token truncated ratio; micro_batches: TRL's gradient accumulation steps, over
    micro-batches of the batch's rows in order."""
    return trl.GRPOConfig(
        loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH, beta=beta, max_completion_length=MAX_COMPLETION,
        use_bias_correction_kl=use_bias_correction_kl,
        use_vllm=tis_cap > 0, vllm_importance_sampling_correction=tis_cap > 0,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=tis_cap or None,
        num_generations=G, per_device_train_batch_size=P * G // (micro_batches * (steps_per_generation or 1)),
        gradient_accumulation_steps=micro_batches, steps_per_generation=steps_per_generation,
        report_to="none", use_cpu=True)


def _trl_trainer(args, logp_rows):
    """What `GRPOTrainer._compute_loss` reads of its trainer, set from args as
    `GRPOTrainer.__init__` sets it; the policy forward returns logp_rows (a single
    process, so gathers and reductions are the identity)."""
    trainer = types.SimpleNamespace(
        args=args, loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        max_completion_length=args.max_completion_length, importance_sampling_level=args.importance_sampling_level,
        top_entropy_quantile=args.top_entropy_quantile, off_policy_mask_threshold=args.off_policy_mask_threshold,
        use_vllm=args.use_vllm, vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy, aux_loss_enabled=False,
        current_gradient_accumulation_steps=args.gradient_accumulation_steps,
        model=types.SimpleNamespace(training=True),
        accelerator=types.SimpleNamespace(num_processes=1, sync_gradients=True, gather=lambda x: x,
                                          reduce=lambda x, reduction: x),
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)))
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp_rows, torch.zeros_like(logp_rows), None)
    return trainer


def _trl(b, args):
    """TRL's loss of each micro-batch (b's rows are one generation batch, split in order
    into micro-batches of per_device_train_batch_size), the gradient of their sum w.r.t.
    the log-probs, and each micro-batch's logged metrics."""
    t = lambda k: torch.tensor(np.asarray(b[k]))
    logp = torch.tensor(b["logp"], requires_grad=True)
    mask = t("mask").to(torch.int64)
    old, ref, adv = t("old"), t("ref"), t("adv")
    ratio = None  # read only with the correction on
    if args.vllm_importance_sampling_correction:  # _generate_and_score_completions, mode "token_truncate":
        ratio = torch.clamp(torch.exp((old - t("rollout")) * mask), min=args.vllm_importance_sampling_clip_min,
                            max=args.vllm_importance_sampling_clip_max)
    num_items_in_batch = mask.sum()  # ibid.: the loss tokens of the whole generation batch
    losses, metrics = [], []
    for rows in np.array_split(np.arange(mask.shape[0]), mask.shape[0] // args.per_device_train_batch_size):
        rows = torch.from_numpy(rows)
        inputs = dict(prompt_ids=torch.zeros((len(rows), 1), dtype=torch.int64),
                      prompt_mask=torch.ones((len(rows), 1), dtype=torch.int64),
                      completion_ids=torch.zeros_like(mask[rows]), completion_mask=mask[rows], advantages=adv[rows],
                      old_per_token_logps=old[rows], ref_per_token_logps=ref[rows],
                      importance_sampling_ratio=None if ratio is None else ratio[rows],
                      num_items_in_batch=num_items_in_batch)
        trainer = _trl_trainer(args, logp[rows])
        losses.append(GRPOTrainer._compute_loss(trainer, None, inputs))
        metrics.append(trainer._metrics["train"])
    sum(losses).backward()
    return [float(x.detach()) for x in losses], logp.grad.numpy(), metrics


def _assert_close(ours, theirs, what, scale=None):
    """Equal to float32 rounding: RTOL relative to `scale`, by default the largest |theirs|
    (a loss sums terms of both signs; its scale is that of the terms, not of the sum)."""
    scale = np.max(np.abs(theirs)) if scale is None else scale
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=RTOL * scale, err_msg=what)


def _scale(b):
    """The size of a loss's terms: the token mean of |advantage|."""
    return float(np.sum(np.abs(b["adv"][:, None]) * b["mask"]) / b["mask"].sum())


# ----------------------------------------------------------------------------- the loss


def test_the_batch_reaches_every_branch():
    b = _batch()
    ratio, live = np.exp(b["logp"] - b["old"]), b["mask"]
    adv = b["adv"][:, None]
    assert np.any(live & (ratio > 1 + EPS_HIGH) & (adv > 0)) and np.any(live & (ratio < 1 - EPS) & (adv < 0))
    assert np.any(live & (ratio > 1 + EPS_HIGH) & (adv < 0)) and np.any(live & (ratio < 1 - EPS) & (adv > 0))
    assert np.any(live & (ratio > 1 + EPS) & (ratio < 1 + EPS_HIGH))  # clipped only without clip-higher
    assert np.any(live & (np.exp(b["old"] - b["rollout"]) > 1.5)) and np.any(b["adv"] == 0)


@pytest.mark.parametrize("aggregation", sorted(LOSS_TYPE))
@pytest.mark.parametrize("kl_coef", [0.0, 0.04])
@pytest.mark.parametrize("tis_cap", [0.0, 1.5])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_loss_and_gradient_equal_trls(aggregation, kl_coef, tis_cap, micro_batches):
    """Each aggregation equals the TRL loss_type it names, clip-higher, KL and TIS
    included, also under TRL's gradient accumulation (our weights come from the whole
    minibatch, so micro-batching cannot change ours)."""
    b = _batch()
    loss, grad, metrics = _ours(b, aggregation, kl_coef, tis_cap)
    trl_losses, trl_grad, trl_metrics = _trl(b, _trl_args(LOSS_TYPE[aggregation], kl_coef, tis_cap,
                                                          micro_batches=micro_batches))
    _assert_close(loss, sum(trl_losses), "loss", _scale(b))
    _assert_close(grad, trl_grad, "gradient")
    assert np.all(grad[~b["mask"]] == 0) and np.count_nonzero(grad) == np.count_nonzero(trl_grad) > 0
    if micro_batches == 1:
        m = trl_metrics[0]
        if kl_coef:  # both the token mean of the k3 KL
            _assert_close(float(metrics["kl"]), m["kl"][0], "kl")
        # TRL counts a clipped ratio only where the clip binds (the advantage's side); ours counts every one.
        assert m["clip_ratio/region_mean"][0] < float(metrics["clip_fraction"])


def _packed(b, width=40, seed=1):
    """b's samples as the learner sees them (`loop.build_batch`'s layout): prompt (2..5
    tokens) then completion, packed greedily into rows of `width` tokens, segment ids
    1, 2, ... per row, then an empty padding row. Returns (packed batch, index of
    completion token j of sample i among the packed [R, width - 1] positions)."""
    rng = np.random.default_rng(seed)
    lengths = b["mask"].sum(1)
    prompts = rng.integers(2, 6, len(lengths))
    rows, offset, place = 0, 0, []
    for total in prompts + lengths:
        if offset + total > width:
            rows, offset = rows + 1, 0
        place.append((rows, offset))
        offset += total
    num_rows = rows + 2
    segment_ids = np.zeros((num_rows, width), np.int32)
    flat = np.full((len(lengths), T), -1)
    for i, (row, off) in enumerate(place):
        segment_ids[row, off:off + prompts[i] + lengths[i]] = 1 + sum(r == row for r, _ in place[:i])
        flat[i, :lengths[i]] = row * (width - 1) + off + prompts[i] - 1 + np.arange(lengths[i])
    live = flat >= 0

    def scatter(x, pad):
        out = np.full(num_rows * (width - 1), pad, x.dtype)
        out[flat[live]] = x[live]
        return out.reshape(num_rows, width - 1)

    packed = dict(mask=scatter(b["mask"], False), logp=scatter(b["logp"], -20.0), old=scatter(b["old"], -1.0),
                  ref=scatter(b["ref"], -1.0), rollout=scatter(b["rollout"], -1.0),
                  adv_nT=scatter(np.broadcast_to(b["adv"][:, None], b["mask"].shape).astype(np.float32), 0.0))
    return packed, jnp.asarray(segment_ids), flat


@pytest.mark.parametrize("aggregation", sorted(LOSS_TYPE))
def test_packed_rows_equal_trls_one_completion_per_row(aggregation):
    """The learner packs several samples to a row behind their prompts; the loss and the
    gradient of each completion token stay TRL's. Without max_len, Dr. GRPO's constant is
    the row width the learner sees: TRL's loss with max_completion_length = that width."""
    b = _batch()
    packed, segment_ids, flat = _packed(b)
    assert packed["mask"].shape[0] < b["mask"].shape[0] and segment_ids.max() > 1
    kw = dict(kl_coef=0.04, tis_cap=1.5, segment_ids=segment_ids)
    loss, grad, _ = _ours(packed, aggregation, max_len=MAX_COMPLETION, **kw)
    trl_losses, trl_grad, _ = _trl(b, _trl_args(LOSS_TYPE[aggregation], 0.04, 1.5))
    _assert_close(loss, sum(trl_losses), "loss", _scale(b))
    _assert_close(np.where(flat >= 0, grad.reshape(-1)[flat], 0.0), trl_grad, "gradient")
    assert np.count_nonzero(grad) == np.count_nonzero(trl_grad)
    if aggregation == "seq_sum_const":
        width = packed["mask"].shape[1]
        default, _, _ = _ours(packed, aggregation, max_len=None, **kw)
        args = _trl_args("dr_grpo", 0.04, 1.5)
        args.max_completion_length = width
        _assert_close(default, sum(_trl(b, args)[0]), "dr_grpo constant = row width", _scale(b))


def test_several_optimizer_steps_per_generation():
    """One generation, two optimizer steps (our num_minibatches=2; TRL's
    steps_per_generation=2). "grpo" and "dr_grpo" normalise each step alone, as we do.
    "dapo" divides each step's token sum by the generation's mean tokens per step; we
    divide by the minibatch's own tokens, so each of our updates is a token mean."""
    b = _batch()
    tokens = b["mask"].sum()
    for aggregation, loss_type in LOSS_TYPE.items():
        trl_losses, _, _ = _trl(b, _trl_args(loss_type, 0.04, 1.5, steps_per_generation=2))
        for half, trl_loss in zip(np.split(np.arange(P * G), 2), trl_losses):
            part = {k: v[half] for k, v in b.items()}
            loss, _, _ = _ours(part, aggregation, 0.04, 1.5)
            if loss_type == "dapo":
                assert part["mask"].sum() != tokens / 2
                loss = loss * part["mask"].sum() / (tokens / 2)
            _assert_close(loss, trl_loss, loss_type, _scale(b))


def test_bnpo_is_token_mean_only_without_micro_batches():
    """TRL's "bnpo" normalises each micro-batch by its own tokens: our token_mean with one
    micro-batch, not with several (our weights, like "dapo"'s, span the minibatch)."""
    b = _batch()
    loss, grad, _ = _ours(b, "token_mean", 0.04, 1.5)
    trl_losses, trl_grad, _ = _trl(b, _trl_args("bnpo", 0.04, 1.5))
    _assert_close(loss, sum(trl_losses), "loss", _scale(b))
    _assert_close(grad, trl_grad, "gradient")
    trl_losses, _, _ = _trl(b, _trl_args("bnpo", 0.04, 1.5, micro_batches=3))
    assert abs(loss - sum(trl_losses)) > 100 * RTOL * _scale(b)


def test_trls_default_kl_is_bias_corrected():
    """TRL multiplies the k3 term by the ratio pi / pi_old by default (DeepSeek-V3.2); we
    keep GRPO's k3. On-policy the two losses are equal and their gradients differ by
    beta * w * k3 (the ratio's own gradient); off-policy the losses differ too."""
    b = _batch()
    on_policy = dict(b, old=b["logp"], rollout=b["logp"])
    loss, grad, _ = _ours(on_policy, "token_mean", 0.04, 0.0)
    trl_losses, trl_grad, _ = _trl(on_policy, _trl_args("dapo", 0.04, 0.0, use_bias_correction_kl=True))
    _assert_close(loss, sum(trl_losses), "on-policy loss", _scale(b))
    mask = b["mask"]
    k3 = np.where(mask, np.asarray(grpo.k3_kl(b["logp"], b["ref"])), 0.0)
    _assert_close(grad + 0.04 * k3 / mask.sum(), trl_grad, "on-policy gradient")
    assert not np.allclose(grad, trl_grad, rtol=1e-3)
    off, _, _ = _ours(b, "token_mean", 0.04, 0.0)
    trl_off = sum(_trl(b, _trl_args("dapo", 0.04, 0.0, use_bias_correction_kl=True))[0])
    assert abs(off - trl_off) > 100 * RTOL * _scale(b)


def test_values_off_the_mask_cannot_reach_our_loss():
    """An improbable padding token (log-prob -200, so exp(ref - logp) overflows float32)
    leaves our loss and gradient TRL's on the same batch with harmless padding. TRL
    multiplies by the mask after the fact (inf * 0: NaN, with TRL 1.16 here)."""
    b = _batch()
    loss, grad, _ = _ours(b, "token_mean", 0.04, 1.5)
    bad = dict(b, logp=np.where(b["mask"], b["logp"], -200.0).astype(np.float32),
               ref=np.where(b["mask"], b["ref"], 0.0).astype(np.float32))
    bad_loss, bad_grad, _ = _ours(bad, "token_mean", 0.04, 1.5)
    trl_losses, trl_grad, _ = _trl(b, _trl_args("dapo", 0.04, 1.5))
    _assert_close(bad_loss, sum(trl_losses), "loss", _scale(b))
    _assert_close(bad_grad, trl_grad, "gradient")
    assert bad_loss == loss and np.array_equal(bad_grad, grad)


# ----------------------------------------------------------------------------- advantages


def test_advantages_against_trls():
    """TRL's GRPOTrainer (`_generate_and_score_completions`, sum_then_normalize) and
    RLOOTrainer compute advantages inline; restated here with TRL's `nanstd`.
    dr_grpo is scale_rewards="none" and rloo RLOOTrainer's baseline (without
    normalize_advantages), exactly. grpo is scale_rewards="group" but with the population
    std where TRL takes the sample std (Bessel), and eps 1e-6 where TRL adds 1e-4."""
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 3, P * G).astype(np.float32) / 2
    rewards[-G:] = 0.5  # one group without signal
    r = torch.from_numpy(rewards)
    grouped = r.view(-1, G)
    mean = grouped.mean(dim=1).repeat_interleave(G)
    std = nanstd(grouped, dim=1).repeat_interleave(G)
    trl_none = (r - mean).numpy()
    trl_group = ((r - mean) / (std + 1e-4)).numpy()
    baseline = ((grouped.sum(dim=1, keepdim=True) - grouped) / (G - 1)).view(-1)
    trl_rloo = (r - baseline).numpy()
    ours = lambda name: np.asarray(grpo.get_advantage_estimator(name)(jnp.asarray(rewards), G))
    np.testing.assert_allclose(ours("dr_grpo"), trl_none, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(ours("rloo"), trl_rloo, rtol=RTOL, atol=1e-7)
    population = (std * np.sqrt((G - 1) / G)).numpy()
    np.testing.assert_allclose(ours("grpo"), trl_none / (population + 1e-6), rtol=RTOL, atol=1e-7)
    # The net effect: a factor sqrt(G / (G - 1)) on groups of distinct rewards, zero on equal ones.
    signal = population > 0
    np.testing.assert_allclose(ours("grpo")[signal], trl_group[signal] * np.sqrt(G / (G - 1)), rtol=1e-3)
    assert np.all(ours("grpo")[~signal] == 0) and np.all(trl_group[~signal] == 0)
