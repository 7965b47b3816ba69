"""GRPO learner: log-probs, packed rows == one sample per row, micro-batching, padding,
sharded equality, non-finite guard."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pallas_kernels import fused_linear_kl
from tests.support import tiny
from tlt_jax import sharding
from tlt_jax.drafter_training.buffer import DrafterBuffer
from tlt_jax.drafter_training.online import OnlineDrafter
from tlt_jax.logprobs import token_logprobs
from tlt_jax.models import transformer as tfm
from tlt_jax.rl import grpo, loop
from tlt_jax.rl.learner import Learner, LearnerConfig, padded_rows, small_micro_rows
from tlt_jax.rollout.engine import Rollouts
from tlt_jax.rollout.timeline import RolloutTimeline
from tlt_jax.train_state import OptimizerConfig

CFG = tiny.config(vocab_size=40)
T = 16  # the learner's seq_len: row width, and the width of a one-sample-per-row layout
G = 4


def _samples(prompt_lengths, answer_lengths, seed=0):
    """(prompt_ids, Rollouts, advantages) of G samples per prompt, random tokens and
    engine log-probs; every group mixes rewards 0 and 1."""
    rng = np.random.RandomState(seed)
    prompt_ids = [rng.randint(1, CFG.vocab_size, p).tolist() for p in prompt_lengths]
    answers = [rng.randint(1, CFG.vocab_size, a).astype(np.int32) for a in answer_lengths]
    n = len(answers)
    rollouts = Rollouts(prompt_index=np.arange(n, dtype=np.int32) // G, sample_index=np.arange(n, dtype=np.int32) % G,
                        tokens=answers, logprobs=[-rng.rand(len(a)).astype(np.float32) for a in answers],
                        finish_reason=["eos"] * n, group=np.zeros(n, np.int32), timeline=RolloutTimeline([]))
    rewards = jnp.asarray(np.arange(n) % 3 == 0, jnp.float32)
    return prompt_ids, rollouts, np.asarray(grpo.grpo_advantages(rewards, G))


# Sequences of 10 6 12 5 | 9 7 11 5 tokens (sample 7: an empty answer). In rows of 16 these
# pack as [10 6] [12] [5 9] [7] [11 5], or per minibatch of 4 as [10 6] [12] [5] | [9 7] [11 5]:
# rows filled to the last column included.
PROMPTS, ANSWERS = [4, 5], [6, 2, 8, 1, 4, 2, 6, 0]
SAMPLES = _samples(PROMPTS, ANSWERS)


def _one_per_row(prompt_ids, rollouts, advantages):
    """The reference layout: each sample alone in a row, right-padded to T."""
    n = len(rollouts)
    tokens, mask = np.zeros((n, T), np.int32), np.zeros((n, T - 1), bool)
    rollout_logp, adv = np.zeros((n, T - 1), np.float32), np.zeros((n, T - 1), np.float32)
    for i in range(n):
        prompt, answer = prompt_ids[rollouts.prompt_index[i]], rollouts.tokens[i]
        p, a = len(prompt), len(answer)
        tokens[i, :p], tokens[i, p:p + a] = prompt, answer
        mask[i, p - 1:p - 1 + a] = True
        rollout_logp[i, p - 1:p - 1 + a] = rollouts.logprobs[i]
        adv[i, p - 1:p - 1 + a] = advantages[i]
    return dict(tokens=tokens, positions=np.broadcast_to(np.arange(T, dtype=np.int32), (n, T)),
                segment_ids=np.ones((n, T), np.int32), loss_mask=mask, rollout_logp=rollout_logp, advantages=adv)


def _to_packed(packing, x_nT):
    """Per-position values of the one-per-row layout [n, T-1] at the same sample
    positions of the packed rows [R, T-1] (a sample's positions that predict its tokens)."""
    out = np.zeros((packing.num_rows, T - 1), x_nT.dtype)
    for i, (row, at, length) in enumerate(zip(packing.row_N, packing.offset_N, packing.lengths_N)):
        out[row, at:at + length - 1] = x_nT[i, :length - 1]
    return out


def _mesh(shape):
    return sharding.make_mesh(dict(zip(sharding.MESH_AXES, shape)), jax.devices()[:int(np.prod(shape))])


def _rows(batch):
    return batch["tokens"], batch["positions"], batch["segment_ids"]


def _prepare(learner, state, batch):
    old = np.asarray(learner.logprobs(state.params, *_rows(batch)))
    return dict(batch, old_logp=old, rollout_logp=old)


def test_token_logprobs_match_dense():
    params = tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.2)
    tokens = jnp.asarray(_one_per_row(*SAMPLES)["tokens"])

    @jax.jit  # as the learner runs them (op by op, each operation compiles a program of its own)
    def run(params, tokens):
        logp, ent = token_logprobs(params, CFG, tokens, temperature=0.7, with_entropy=True)
        logits = tfm.logits_from_hidden(params, CFG, tfm.forward(params, CFG, tokens[:, :-1])) / 0.7
        return logp, ent, jax.nn.log_softmax(logits)

    logp, ent, ref = run(params, tokens)
    np.testing.assert_allclose(logp, jnp.take_along_axis(ref, tokens[:, 1:, None], -1)[..., 0], atol=1e-5)
    np.testing.assert_allclose(ent, -(jnp.exp(ref) * ref).sum(-1), atol=1e-4)


def test_packed_logprobs_equal_one_sample_per_row():
    """A sample's log-probs and entropies in a packed row are those of the sample alone."""
    params = tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.2)
    learner = Learner(CFG, LearnerConfig(temperature=0.8), _mesh((1, 1, 1)))
    batch, packing = loop.build_batch(*SAMPLES, seq_len=T, pad_id=0)
    assert packing.num_rows == 5 and batch["segment_ids"].max() == 2
    alone = _one_per_row(*SAMPLES)
    for got, want in zip(learner.logprobs(params, *_rows(batch), with_entropy=True),
                         learner.logprobs(params, *_rows(alone), with_entropy=True)):
        got = loop.unpack_samples(packing, np.asarray(got), T - 1)
        for i, length in enumerate(packing.lengths_N):
            np.testing.assert_allclose(got[i, :length - 1], np.asarray(want)[i, :length - 1], rtol=0, atol=1e-5,
                                       err_msg=f"sample {i}")
    # RoPE is relative: only positions that change within a sample change the log-probs.
    tokens, positions, segment_ids = _rows(batch)
    stretched = learner.logprobs(params, tokens, 2 * positions, segment_ids)
    assert not np.allclose(stretched, learner.logprobs(params, tokens, positions, segment_ids), atol=1e-3)


def test_old_policy_outputs_share_the_forward_with_the_logprobs():
    """The drafter's data comes from the old-policy pass itself: its log-probs and entropy
    are the plain pass's (bit for bit on one device; on a sharded mesh the two programs
    partition the blockwise projection differently, within float32 rounding), hidden
    states and layer outputs the forward's, and the top-K the dense log_softmax's."""
    params = tfm.init_params(CFG, jax.random.PRNGKey(1), init_std=0.2)
    batch, _ = loop.build_batch(*SAMPLES, seq_len=T, pad_id=0, minibatch_rows=lambda r: 8)
    rows = tuple(jnp.asarray(x) for x in _rows(batch))
    for shape, atol in (((1, 1, 1), 0.0), ((2, 4, 1), 1e-5)):
        learner = Learner(CFG, LearnerConfig(temperature=0.9), _mesh(shape))
        logp, ent, data = learner.logprobs_and_drafter_data(params, *rows, top_k=5, feature_layers=(0, 1))
        ref_logp, ref_ent = learner.logprobs(params, *rows, with_entropy=True)
        np.testing.assert_allclose(np.asarray(logp), np.asarray(ref_logp), rtol=0, atol=atol)
        np.testing.assert_allclose(np.asarray(ent), np.asarray(ref_ent), rtol=0, atol=atol)
    tokens, positions, segment_ids = (x[:, :-1] for x in rows)

    @jax.jit  # as the learner runs them (op by op, each operation compiles a program of its own)
    def run(params, tokens, positions, segment_ids):
        h, layers = tfm.forward(params, CFG, tokens, positions_BT=positions, segment_ids_BT=segment_ids,
                                layer_ids=(0, 1))
        return h, layers, jax.lax.top_k(jax.nn.log_softmax(tfm.logits_from_hidden(params, CFG, h) / 0.9), 5)

    h, layers, (top, top_ids) = run(params, tokens, positions, segment_ids)
    np.testing.assert_allclose(data.hidden, h, atol=1e-5)
    np.testing.assert_allclose(data.layers, jnp.moveaxis(layers, 0, 2), atol=1e-5)
    np.testing.assert_array_equal(data.ids, top_ids)
    np.testing.assert_allclose(data.logp, top, atol=1e-5)


def test_the_configured_projection_gives_log_probs_and_drafter_data(monkeypatch):
    """learner.logprob_impl reaches every projection of the old-policy pass, the drafter's
    top-K included: pallas (interpret mode) gives chunked_xla's outputs. An impl the
    backend has no lowering for is refused at construction, naming the field."""
    params = tfm.init_params(CFG, jax.random.PRNGKey(2), init_std=0.2)
    batch, _ = loop.build_batch(*SAMPLES, seq_len=T, pad_id=0, minibatch_rows=lambda r: 8)
    rows = tuple(jnp.asarray(x) for x in _rows(batch))
    pallas_calls = []
    stats = fused_linear_kl._pallas_row_stats
    monkeypatch.setattr(fused_linear_kl, "_pallas_row_stats", lambda *a, **k: pallas_calls.append(1) or stats(*a, **k))
    outs = {}
    for impl in ("chunked_xla", "pallas"):
        learner = Learner(CFG, LearnerConfig(temperature=0.9, logprob_impl=impl), _mesh((1, 1, 1)))
        outs[impl] = learner.logprobs_and_drafter_data(params, *rows, top_k=5)
    assert pallas_calls  # traced once per compiled shape, by the pallas learner alone
    (logp, ent, data), (ref_logp, ref_ent, ref_data) = outs["pallas"], outs["chunked_xla"]
    np.testing.assert_array_equal(data.ids, ref_data.ids)
    for got, want in ((logp, ref_logp), (ent, ref_ent), (data.logp, ref_data.logp)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)

    with pytest.raises(ValueError, match="tlt.drafter.top_k=41 exceeds the policy's vocabulary \\(40\\); set "
                                         "--config.tlt.drafter.top_k to at most 40"):
        learner.logprobs_and_drafter_data(params, *rows, top_k=CFG.vocab_size + 1)
    with pytest.raises(ValueError, match="learner.logprob_impl='cuda': impl must be one of"):
        Learner(CFG, LearnerConfig(logprob_impl="cuda"), _mesh((1, 1, 1)))
    monkeypatch.setattr(fused_linear_kl, "engines_on", lambda backend: ("chunked_xla",))  # no Pallas lowering
    with pytest.raises(ValueError, match="learner.logprob_impl='pallas': impl='pallas' has no lowering on the cpu "
                                         "backend; pass one of auto, dense, chunked_xla"):
        Learner(CFG, LearnerConfig(logprob_impl="pallas"), _mesh((1, 1, 1)))


def test_unpacked_drafter_data_equals_the_pass_over_one_sample_per_row():
    """What `RLLoop.step` hands the drafter (`loop.unpack_drafter_data` of the packed pass)
    is the one-sample-per-row pass's DrafterData at every token of each sample, but a
    last token in a row's last column (drafter training never reads a last token's)."""
    params = tfm.init_params(CFG, jax.random.PRNGKey(2), init_std=0.3)
    learner = Learner(CFG, LearnerConfig(temperature=0.9), _mesh((1, 1, 1)))
    batch, packing = loop.build_batch(*SAMPLES, seq_len=T, pad_id=0, num_minibatches=2)
    kw = dict(top_k=5, feature_layers=(0, 1))
    got = loop.unpack_drafter_data(packing, learner.logprobs_and_drafter_data(params, *_rows(batch), **kw)[2])
    want = jax.device_get(learner.logprobs_and_drafter_data(params, *_rows(_one_per_row(*SAMPLES)), **kw)[2])
    tokens = loop.unpack_samples(packing, batch["tokens"], T, fill=0)
    np.testing.assert_array_equal(tokens, _one_per_row(*SAMPLES)["tokens"])
    ends_a_row = packing.offset_N + packing.lengths_N == T
    assert ends_a_row.sum() == 3
    for i, length in enumerate(packing.lengths_N):
        kept = length - ends_a_row[i]  # a last token in the last column has no position
        for name in ("hidden", "ids", "logp", "layers"):
            a, b = getattr(got, name), getattr(want, name)
            assert isinstance(a, np.ndarray) and a.shape == b.shape, name
            # float32 rounding of two layers at magnitudes up to ~13, the passes' shapes apart
            np.testing.assert_allclose(a[i, :kept], b[i, :kept], rtol=1e-5, atol=2e-5, err_msg=f"{name} of sample {i}")
            assert not a[i, kept:].any(), name
    # Through the drafter's own entry point: the buffer rows built from either pass agree
    # wherever drafter training reads them (every token of a sample but its last).
    prompt_lengths = np.asarray([len(SAMPLES[0][i]) for i in SAMPLES[1].prompt_index])
    held = {}
    for name, (toks, data) in {"packed": (tokens, got), "alone": (_one_per_row(*SAMPLES)["tokens"], want)}.items():
        drafter = types.SimpleNamespace(buffer=DrafterBuffer(T, CFG.hidden_size, 5, max_bytes=10 ** 7,
                                                             num_feature_layers=2, prompt_tail=100),
                                        _score_step=lambda rl_step, rows_by_task: None,  # no drafter to score
                                        _warmed_up=lambda: None)  # nor a warm-up to wait for
        OnlineDrafter.add(drafter, 0, toks, prompt_lengths, SAMPLES[1].lengths, data)
        held[name] = drafter.buffer.state_dict()["rows"]
    seg = held["alone"]["segment_ids"]
    last = (seg > 0) & (seg != np.pad(seg[:, 1:], ((0, 0), (0, 1))))
    assert last.sum() == 7  # every sample with an answer
    for name, x in held["packed"].items():
        read = (seg > 0) & ~last if x.ndim > 2 else slice(None)
        np.testing.assert_allclose(x[read], held["alone"][name][read], rtol=1e-5, atol=2e-5, err_msg=name)


def _perturbed(params, seed, scale=0.05):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(treedef, [p + scale * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])


def _grpo_problem(cfg: grpo.GRPOConfig, temperature: float):
    """(params, reference objective, one-per-row old / ref / rollout log-probs): the GRPO
    objective of SAMPLES written out per sample over one sample per row (clipped ratio,
    truncated importance weight, k3 KL, the aggregation), at params a step away from the
    old policy so that ratios and clipping are live."""
    old_params = tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.2)
    params = _perturbed(old_params, 5)
    ref_params = tfm.init_params(CFG, jax.random.PRNGKey(3), init_std=0.2)
    alone = _one_per_row(*SAMPLES)
    tokens = jnp.asarray(alone["tokens"])
    # Jitted, as the learner runs it (op by op, each operation compiles a program of its own).
    lp = jax.jit(lambda p: token_logprobs(p, CFG, tokens, temperature=temperature))
    old, ref = np.asarray(lp(old_params)), np.asarray(lp(ref_params))
    rollout = old + np.random.RandomState(0).normal(0, 0.3, old.shape).astype(np.float32)
    mask, adv = alone["loss_mask"], alone["advantages"]
    lo, hi = 1 - cfg.clip_eps, 1 + cfg.clip_eps_high

    def objective(p):
        logp = lp(p)
        ratio = jnp.exp(logp - old)
        tis = jnp.minimum(jnp.exp(old - rollout), cfg.tis_cap)
        per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv) * tis
        per_token = per_token + cfg.kl_coef * (jnp.exp(ref - logp) - (ref - logp) - 1)
        per_seq = jnp.sum(per_token * mask, 1)
        lengths = np.maximum(mask.sum(1), 1)  # sample 7 has an empty answer: no tokens, still a sequence
        return {"token_mean": per_seq.sum() / mask.sum(), "seq_mean": jnp.mean(per_seq / lengths),
                "seq_sum_const": per_seq.sum() / (len(mask) * (T - 1))}[cfg.aggregation]

    return params, objective, (old, ref, rollout)


def _packed_batch(logps, **kw):
    """SAMPLES as the learner's packed batch, with the one-per-row log-probs moved in."""
    old, ref, rollout = logps
    batch, packing = loop.build_batch(*SAMPLES, seq_len=T, pad_id=0, **kw)
    batch.update(old_logp=_to_packed(packing, old), ref_logp=_to_packed(packing, ref),
                 rollout_logp=np.where(batch["loss_mask"], _to_packed(packing, rollout), 0))
    return batch


@pytest.mark.parametrize("aggregation", sorted(grpo.AGGREGATIONS))
def test_packed_loss_and_gradient_equal_one_sample_per_row(aggregation):
    """The minibatch loss and its gradient over packed rows (padding rows, an all-padding
    micro-batch) equal the GRPO objective written out per sample over one sample per
    row: clipped ratio, truncated importance weight, k3 KL, and the aggregation."""
    cfg = grpo.GRPOConfig(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.1, tis_cap=1.5, aggregation=aggregation)
    learner = Learner(CFG, LearnerConfig(micro_batch_size=2, temperature=0.9, grpo=cfg), _mesh((1, 1, 1)))
    params, reference, logps = _grpo_problem(cfg, 0.9)
    want_loss, want_grads = jax.jit(jax.value_and_grad(reference))(params)
    batch = _packed_batch(logps, minibatch_rows=lambda r: 10)
    assert not batch["segment_ids"][5:].any()  # 5 rows of padding, the last two micro-batches of 2 rows
    loss, metrics, grads = learner.loss_and_grads(params, batch)
    assert 0 < float(metrics["clip_fraction"]) < 1
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5, atol=1e-6)
    # To 1e-5 of each weight's largest gradient entry (float32 sums of entries up to ~10).
    jax.tree_util.tree_map_with_path(lambda path, g, w: np.testing.assert_allclose(
        g, w, rtol=0, atol=1e-5 * float(np.abs(w).max()), err_msg=str(path)), grads, want_grads)


def test_update_applies_the_full_batch_gradient_whatever_the_split_and_mesh():
    """The gradient an update hands the optimizer is the minibatch's full-batch GRPO
    gradient, scale included (AdamW and clipping would hide a wrong scale in the step
    itself), whatever the micro-batch count and the mesh. It is read back from the
    optimizer: with b1 = 0 and no clipping, AdamW's first moment after one update is
    exactly the gradient it was given."""
    cfg = grpo.GRPOConfig(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.1, tis_cap=1.5)
    params, reference, logps = _grpo_problem(cfg, 0.9)
    want_loss, want = jax.jit(jax.value_and_grad(reference))(params)
    want_norm = float(np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(want))))
    opt = OptimizerConfig(learning_rate=1e-3, b1=0.0, max_grad_norm=1e30)
    # (mesh, micro-batch rows) -> micro-batches of the padded minibatch: 5, 1, 5 (of an
    # eighth of 8 rows) and 2 (of 4 rows, a whole row per device).
    for shape, micro, count in (((1, 1, 1), 1, 5), ((1, 1, 1), 5, 1), ((1, 1, 1), 8, 5), ((2, 2, 2), 2, 2)):
        learner = Learner(CFG, LearnerConfig(optimizer=opt, micro_batch_size=micro, temperature=0.9, grpo=cfg),
                          _mesh(shape))
        batch = _packed_batch(logps, minibatch_rows=learner.minibatch_rows)
        assert len(batch["tokens"]) // learner.micro_rows(len(batch["tokens"])) == count
        state, metrics = learner.update(learner.init_state(params), batch)
        assert int(state.step) == 1 and metrics[0]["skipped"] == 0
        np.testing.assert_allclose(metrics[0]["loss"], float(want_loss), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(metrics[0]["grad_norm"], want_norm, rtol=1e-5)
        got = jax.device_get(optax.tree_utils.tree_get(state.opt_state, "mu"))
        where = f"{shape} x{count}"
        jax.tree_util.tree_map_with_path(lambda path, g, w, where=where: np.testing.assert_allclose(
            g, w, rtol=0, atol=1e-5 * float(np.abs(w).max()), err_msg=f"{where} {path}"), got, want)


@pytest.mark.parametrize("drafter_data", [False, True], ids=["baseline", "tlt"])
def test_on_policy_update_is_the_update_after_an_old_policy_pass(drafter_data):
    """With one update per step, the update's own forward stands for the old-policy pass:
    the gradient handed to the optimizer, the loss, the entropy and the drafter's data are
    those of the separate pass followed by `update`, on one device and sharded, with
    micro-batches, remat and feature layers; the ratio is exactly 1 (nothing is clipped).
    The gradient is read back as AdamW's first moment (b1 = 0), as above."""
    params = _perturbed(tfm.init_params(CFG, jax.random.PRNGKey(4), init_std=0.2), 6)
    opt = OptimizerConfig(learning_rate=1e-3, b1=0.0, max_grad_norm=1e30)
    kw = dict(top_k=5, feature_layers=(0, 1)) if drafter_data else {}
    for shape in ((1, 1, 1), (2, 2, 2)):
        learner = Learner(CFG, LearnerConfig(optimizer=opt, micro_batch_size=2, temperature=0.9, remat=True,
                                             grpo=grpo.GRPOConfig(kl_coef=0.1, tis_cap=1.5)), _mesh(shape))
        assert learner.on_policy
        batch, _ = loop.build_batch(*SAMPLES, seq_len=T, pad_id=0, minibatch_rows=learner.minibatch_rows)
        rows = _rows(batch)
        batch["ref_logp"] = np.asarray(learner.logprobs(_perturbed(params, 7), *rows))
        if drafter_data:
            old_logp, want_entropy, want_data = learner.logprobs_and_drafter_data(params, *rows, **kw)
        else:
            (old_logp, want_entropy), want_data = learner.logprobs(params, *rows, with_entropy=True), None
        want_state, want_metrics = learner.update(learner.init_state(params), dict(batch, old_logp=old_logp))
        state, metrics, entropy, data = learner.update_on_policy(learner.init_state(params), batch, **kw)
        assert int(state.step) == 1 and metrics[0]["skipped"] == 0
        # ratio_mean is a weighted sum of ratios of exactly 1: its weights' float32 sum
        assert abs(float(metrics[0]["ratio_mean"]) - 1) < 1e-6 and float(metrics[0]["clip_fraction"]) == 0.0
        for name in ("loss", "grad_norm", "kl", "rollout_logp_gap"):
            np.testing.assert_allclose(metrics[0][name], want_metrics[0][name], rtol=1e-5, err_msg=name)
        want = jax.device_get(optax.tree_utils.tree_get(want_state.opt_state, "mu"))
        jax.tree_util.tree_map_with_path(lambda path, g, w, shape=shape: np.testing.assert_allclose(
            g, w, rtol=0, atol=1e-5 * float(np.abs(w).max()), err_msg=f"{shape} {path}"),
            jax.device_get(optax.tree_utils.tree_get(state.opt_state, "mu")), want)
        np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=1e-5)
        assert (data is None) == (not drafter_data)
        for name in ("hidden", "ids", "logp", "layers") if drafter_data else ():
            got, ref = getattr(data, name), getattr(want_data, name)
            assert isinstance(got, np.ndarray) and got.shape == ref.shape, name
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-5, err_msg=f"{shape} {name}")


def test_on_policy_update_needs_one_update_per_step():
    state_params = tfm.init_params(CFG, jax.random.PRNGKey(0))
    batch, _ = loop.build_batch(*SAMPLES, seq_len=T, pad_id=0, num_minibatches=2)
    for config in (LearnerConfig(num_minibatches=2), LearnerConfig(old_policy_pass="always")):
        learner = Learner(CFG, config, _mesh((1, 1, 1)))
        assert not learner.on_policy
        with pytest.raises(ValueError, match="An on-policy update needs one update per RL step"):
            learner.update_on_policy(learner.init_state(state_params), batch)
    with pytest.raises(ValueError, match="old_policy_pass='sometimes': choose from"):
        Learner(CFG, LearnerConfig(old_policy_pass="sometimes"), _mesh((1, 1, 1)))


def test_padding_rows_add_exactly_zero():
    """Padding rows change nothing, bit for bit: the aggregation counts the real tokens
    and sequences, and an all-padding micro-batch adds exact zeros."""
    params = tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.2)
    learner = Learner(CFG, LearnerConfig(micro_batch_size=2, grpo=grpo.GRPOConfig(kl_coef=0.1,
                                                                                    aggregation="seq_mean")),
                      _mesh((1, 1, 1)))
    fn = learner.loss_and_grads
    padded, _ = loop.build_batch(*SAMPLES, seq_len=T, pad_id=0, minibatch_rows=lambda r: 10)
    tight, _ = loop.build_batch(*SAMPLES, seq_len=T, pad_id=0, minibatch_rows=lambda r: 6)
    assert not padded["segment_ids"][5:].any()
    jax.tree.map(np.testing.assert_array_equal, tight, {k: v[:6] for k, v in padded.items()})
    padded["old_logp"] = np.asarray(learner.logprobs(params, *_rows(padded))) - 0.1
    padded["ref_logp"] = padded["old_logp"] + 0.2
    tight = {k: v[:6] for k, v in padded.items()}
    jax.tree.map(np.testing.assert_array_equal, fn(params, padded), fn(params, tight))
    only_padding = {k: v[6:] for k, v in padded.items()}
    loss, metrics, grads = fn(params, only_padding)
    assert float(loss) == 0 and all(float(m) == 0 for m in metrics.values())
    for g in jax.tree.leaves(grads):
        np.testing.assert_array_equal(g, 0)


def test_padded_rows_buckets():
    # Below a micro-batch: a multiple of small_micro_rows = lcm(granule, ceil(micro / 8));
    # from there on of lcm(micro, granule).
    cases = {(24, 64, 1): 24, (25, 64, 1): 32, (57, 64, 1): 64, (65, 64, 1): 128, (1, 64, 2): 8, (3, 8, 8): 8,
             (5, 2, 4): 8, (9, 64, 1): 16, (17, 64, 1): 24, (33, 64, 1): 40, (9, 48, 1): 12, (46, 48, 1): 48,
             (49, 48, 1): 96, (7, 8, 1): 7, (5, 16, 4): 8, (9, 64, 4): 16}
    assert {k: padded_rows(*k) for k in cases} == cases
    for granule in (1, 2, 4, 8):
        small = small_micro_rows(64, granule)
        padded = [padded_rows(rows, 64, granule) for rows in range(1, 64)]
        assert all(p % granule == 0 and rows <= p < rows + small for rows, p in zip(range(1, 64), padded))
        # The compiled shapes: two whatever the batch, small_micro_rows and 64, each on the granule.
        learner = Learner(CFG, LearnerConfig(micro_batch_size=64), _mesh((granule, 1, 1)))
        micro = {rows: learner.micro_rows(learner.minibatch_rows(rows)) for rows in range(1, 300)}
        assert all(learner.minibatch_rows(rows) % m == 0 and m % granule == 0 for rows, m in micro.items())
        assert set(micro.values()) == {small, max(64, granule)}
    learner = Learner(CFG, LearnerConfig(micro_batch_size=8), _mesh((2, 2, 2)))
    assert learner.minibatch_rows(3) == 4 and learner.minibatch_rows(9) == 16
    # Rows padded otherwise (a caller's own minibatch_rows) split into micro-batches that divide them.
    assert learner.micro_rows(6) == 2 and learner.micro_rows(4) == 4


def test_update_raises_advantaged_logprobs_and_is_shard_invariant():
    params = tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.2)
    lcfg = LearnerConfig(optimizer=OptimizerConfig(learning_rate=3e-3), micro_batch_size=2, num_minibatches=2,
                         grpo=grpo.GRPOConfig(tis_cap=0.0))
    results = {}
    for shape, micro in (((1, 1, 1), 2), ((1, 1, 1), 1), ((2, 2, 2), 2)):
        learner = Learner(CFG, LearnerConfig(**{**lcfg.__dict__, "micro_batch_size": micro}), _mesh(shape))
        batch, packing = loop.build_batch(*SAMPLES, seq_len=T, pad_id=0, num_minibatches=2,
                                          minibatch_rows=learner.minibatch_rows)
        state = learner.init_state(params)
        full = _prepare(learner, state, batch)
        state, metrics = learner.update(state, full)
        assert len(metrics) == 2 and all(m["skipped"] == 0 for m in metrics)
        assert int(state.step) == 2
        new = np.asarray(learner.logprobs(state.params, *_rows(batch)))
        # Per sample: the change of its answer's log-likelihood.
        results[(shape, micro)] = loop.unpack_samples(packing, (new - full["old_logp"]) * batch["loss_mask"],
                                                      T - 1).sum(1)
    gain = results[((1, 1, 1), 2)]
    adv = SAMPLES[2]
    assert gain[adv > 0].mean() > 0 > gain[adv < 0].mean()
    for key in (((1, 1, 1), 1), ((2, 2, 2), 2)):
        np.testing.assert_allclose(results[key], gain, atol=2e-4)


def test_non_finite_step_is_skipped():
    params = tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.2)
    learner = Learner(CFG, LearnerConfig(micro_batch_size=4), _mesh((1, 1, 1)))
    state = learner.init_state(params)
    batch, _ = loop.build_batch(*SAMPLES, seq_len=T, pad_id=0, minibatch_rows=learner.minibatch_rows)
    batch = _prepare(learner, state, batch)
    batch["advantages"] = np.where(batch["loss_mask"] & (batch["advantages"] != 0), np.nan, batch["advantages"])
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = learner.update(state, batch)
    assert metrics[0]["skipped"] == 1 and int(state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, state.params))


def test_bad_batch_split():
    learner = Learner(CFG, LearnerConfig(num_minibatches=3), _mesh((1, 1, 1)))
    state = learner.init_state(tfm.init_params(CFG, jax.random.PRNGKey(0)))
    batch, _ = loop.build_batch(*SAMPLES, seq_len=T, pad_id=0)
    with pytest.raises(ValueError, match="Batch of 5 rows does not split into 3 minibatches"):
        learner.update(state, _prepare(learner, state, batch))
