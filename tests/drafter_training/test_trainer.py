"""Drafter training: the loss's t -> t+1 -> t+2 alignment against a dense reference, masking,
fused gradients, learning, and the export's round trip and target check."""
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.support import tiny
from tlt_jax import sharding
from tlt_jax.drafter_training import io
from tlt_jax.drafter_training import trainer as dt
from tlt_jax.drafter_training.online import OnlineDrafter
from tlt_jax.drafter_training.publish import EveryVersion, StepEvaluation, evaluation_metrics
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer as tfm
from tlt_jax.train_state import OptimizerConfig

CFG = tiny.config(vocab_size=40, num_layers=3)  # three layers: a fused drafter reads several
PLAIN = drafter_lib.DrafterConfig(num_layers=1)
FUSED = drafter_lib.DrafterConfig(num_layers=1, feature_layers=(0, 2))
B, T, K = 8, 16, 4


@pytest.fixture(scope="module")
def target():
    return tfm.init_params(CFG, jax.random.PRNGKey(0), init_std=0.3)


@pytest.fixture(scope="module")
def rows():
    """Two packed segments per row (lengths 9 and 5, then padding), targets after a
    three-token prompt, as `sft.pack_examples` lays them out."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, CFG.vocab_size, (B, T)).astype(np.int32)
    positions = np.zeros((B, T), np.int32)
    segment_ids = np.zeros((B, T), np.int32)
    target = np.zeros((B, T), bool)  # token t is to be predicted
    for start, length, segment in ((0, 9, 1), (9, 5, 2)):
        positions[:, start:start + length] = np.arange(length)
        segment_ids[:, start:start + length] = segment
        target[:, start + 3:start + length] = True
    return {"tokens": tokens, "positions": positions, "segment_ids": segment_ids, "mask": target[:, 1:]}


def _loss(dcfg, **kwargs):
    kwargs = {"feature_weight": 0.3, "kl_weight": 0.7, **kwargs}
    return jax.jit(lambda dparams, tparams, batch: dt.drafter_loss(dparams, tparams, CFG, dcfg, batch, **kwargs))


def _batch(target, rows, dcfg, topk_block=0):
    fn = functools.partial(dt.target_outputs, target_config=CFG, drafter_config=dcfg, top_k=K, topk_block=topk_block)
    return {**rows, **jax.jit(lambda p, r: fn(p, rows=r))(target, rows)}


def test_loss_matches_a_dense_reference_on_the_shifted_positions(target, rows):
    """Entry t reads (x_{t+1}, h_t) and is scored against the target's distribution at t+1
    (over x_{t+2}) and its hidden state h_{t+1}, only where x_{t+2} is a target token of
    the same segment. The top-K comes blockwise (5 positions at a time, T = 16)."""
    dparams = drafter_lib.init_drafter(CFG, PLAIN, jax.random.PRNGKey(1), init_std=0.3)
    batch = _batch(target, rows, PLAIN, topk_block=5)
    loss, aux = _loss(PLAIN)(dparams, target, batch)

    # x_{t+2} is a target of segment 1 for t = 1..6, of segment 2 for t = 10..11.
    mask = np.zeros((B, T - 2), bool)
    mask[:, 1:7] = mask[:, 10:12] = True

    @jax.jit  # the dense reference in one program, not op by op
    def reference(dparams, target, rows):
        h = tfm.forward(target, CFG, rows["tokens"], positions_BT=rows["positions"],
                        segment_ids_BT=rows["segment_ids"])
        target_logp = jax.nn.log_softmax(tfm.logits_from_hidden(target, CFG, h))  # [B, T, V], t over x_{t+1}
        g = drafter_lib.forward(dparams, target, CFG, PLAIN, rows["tokens"][:, 1:-1], h[:, :-2],
                                positions_BT=rows["positions"][:, :-2], segment_ids_BT=rows["segment_ids"][:, :-2])
        drafter_logp = jax.nn.log_softmax(tfm.logits_from_hidden(target, CFG, g))
        p_next = target_logp[:, 1:-1]
        top_ids = jnp.argsort(-p_next, axis=-1)[..., :K]
        top_p = jnp.take_along_axis(p_next, top_ids, -1)
        kl_BT = jnp.sum(jnp.exp(top_p) * (top_p - jnp.take_along_axis(drafter_logp, top_ids, -1)), -1)
        huber_BT = jnp.mean(optax.losses.huber_loss(g, h[:, 1:-1]), -1)
        agree_BT = jnp.argmax(drafter_logp, -1) == top_ids[..., 0]
        accept_BT = jnp.sum(jnp.minimum(jnp.exp(top_p), jnp.exp(jnp.take_along_axis(drafter_logp, top_ids, -1))),
                            -1)
        ref = {"kl": kl_BT, "feature_loss": huber_BT, "top1_agree": agree_BT, "accept_rate": accept_BT}
        return {k: jnp.sum(jnp.where(mask, v, 0.0)) / mask.sum() for k, v in ref.items()}

    np.testing.assert_array_equal(dt.entry_mask(batch), mask)
    ref = {k: float(v) for k, v in reference(dparams, target, rows).items()}
    assert int(aux["count"]) == mask.sum()
    for name, want in ref.items():
        np.testing.assert_allclose(float(aux[name]), want, rtol=1e-4, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(float(loss), 0.3 * ref["feature_loss"] + 0.7 * ref["kl"], rtol=1e-4)


@pytest.mark.parametrize("block", [0, 3])
def test_draft_agreement_against_a_float64_reference(target, block):
    """accept = sum over the target's top-K of min(p, q), q the drafter's softmax at the
    temperature; with the whole vocabulary as the top-K it is 1 - TV(p, q)."""
    rng = np.random.default_rng(int(block) + 7)
    b, t, v = 3, 7, CFG.vocab_size
    g = rng.normal(size=(b, t, CFG.hidden_size)).astype(np.float32)
    p_logits = rng.normal(size=(b, t, v)) * 2
    p = np.exp(p_logits - p_logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    temperature = 0.7
    w = np.asarray(tfm.lm_head_weight(target, CFG), np.float64)
    z = g.astype(np.float64) @ w / temperature
    q = np.exp(z - z.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    for k in (5, v):
        ids = np.argsort(-p, -1)[..., :k].astype(np.int32)
        logp = np.log(np.take_along_axis(p, ids, -1)).astype(np.float32)
        top1, accept = jax.jit(functools.partial(dt.draft_agreement, config=CFG, temperature=temperature,
                                                 block=block))(target, g_BTD=g, ids_BTK=ids, logp_BTK=logp)
        want = np.minimum(np.take_along_axis(p, ids, -1), np.take_along_axis(q, ids, -1)).sum(-1)
        np.testing.assert_allclose(np.asarray(accept), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(top1), np.argmax(z, -1))
    np.testing.assert_allclose(np.asarray(accept), 1 - 0.5 * np.abs(p - q).sum(-1), rtol=1e-5, atol=1e-6)


def test_training_time_test_passes_are_the_chain_drafts_of_inference(target):
    """Pass i of forward_unrolled at entry t equals the i-th draft of a chain started after
    entry t - i, run as the engine runs it (catch-up over the target's features one entry at
    a time, then each draft reading the previous draft's output), in both packed segments."""
    dcfg = drafter_lib.DrafterConfig(num_layers=1)
    dparams = drafter_lib.init_drafter(CFG, dcfg, jax.random.PRNGKey(3), init_std=0.3)
    rng = np.random.default_rng(11)
    t, steps = 12, 3
    tokens = rng.integers(0, CFG.vocab_size, (1, t)).astype(np.int32)
    features = rng.normal(size=(1, t, CFG.hidden_size)).astype(np.float32)
    segments = [(0, 7), (7, 12)]
    segment_ids = np.concatenate([np.full(b - a, n + 1) for n, (a, b) in enumerate(segments)])[None].astype(np.int32)
    positions = np.concatenate([np.arange(b - a) for a, b in segments])[None].astype(np.int32)
    passes = jax.jit(functools.partial(drafter_lib.forward_unrolled, target_config=CFG, config=dcfg, steps=steps))(
        dparams, target, tokens_BT=tokens, features_BTD=features, positions_BT=positions, segment_ids_BT=segment_ids)
    one = jax.jit(lambda cache, token, feature, position: drafter_lib.decode(
        dparams, target, CFG, dcfg, cache, token, feature, position, return_logits=False))
    for a, b in segments:
        for start in range(a, b):
            cache = drafter_lib.init_cache(CFG, dcfg, 1, 16)
            for e in range(a, start):  # catch-up: committed entries read the target's features
                _, cache = one(cache, tokens[:, e:e + 1], features[:, e:e + 1], positions[:, e:e + 1])
            feature = features[:, start:start + 1]
            for i in range(min(steps, b - start)):
                e = start + i
                g, cache = one(cache, tokens[:, e:e + 1], feature, positions[:, e:e + 1])
                np.testing.assert_allclose(np.asarray(passes[i][0, e]), np.asarray(g[0, 0]), rtol=2e-5, atol=2e-5,
                                           err_msg=f"pass {i} entry {e}")
                feature = g
    # Pass 0 is the teacher-forced forward.
    g0 = jax.jit(lambda dparams, target: drafter_lib.forward(dparams, target, CFG, dcfg, tokens, features,
                                                             positions_BT=positions,
                                                             segment_ids_BT=segment_ids))(dparams, target)
    np.testing.assert_allclose(np.asarray(passes[0]), np.asarray(g0), rtol=2e-5, atol=2e-5)


def test_training_time_test_loss_is_the_mean_of_its_passes(target, rows):
    """ttt_steps=3: pass 0's loss and metrics are those of ttt_steps=1; the loss is the mean
    of the three passes', passes 1 and 2 scored by the same dense reference on their own
    outputs, over the trained entries whose chain (t - i .. t) lies in their segment."""
    dparams = drafter_lib.init_drafter(CFG, PLAIN, jax.random.PRNGKey(1), init_std=0.3)
    batch = _batch(target, rows, PLAIN)
    loss1, aux1 = _loss(PLAIN)(dparams, target, batch)
    loss3, aux3 = _loss(PLAIN, ttt_steps=3)(dparams, target, batch)
    for name in ("kl", "feature_loss", "top1_agree", "accept_rate", "count"):
        np.testing.assert_allclose(float(aux3[name]), float(aux1[name]), rtol=1e-4, atol=1e-6, err_msg=name)
    cut, nxt = (lambda x: x[:, :-2]), (lambda x: x[:, 1:-1])
    masks = {}
    for i in (1, 2):
        # Trained entries are 1..6 and 10..11 (segments of entries 0..8, 9..13): two back
        # from entries 1 and 10 leaves the segment.
        masks[i] = np.array(dt.entry_mask(batch))
        if i == 2:
            masks[i][:, 1] = masks[i][:, 10] = False

    @jax.jit  # the passes' dense reference in one program, not op by op
    def reference(dparams, target, rows, batch):
        h = batch["hidden"]
        passes = drafter_lib.forward_unrolled(dparams, target, CFG, PLAIN, nxt(rows["tokens"]), h[:, :-2], 3,
                                              positions_BT=cut(rows["positions"]),
                                              segment_ids_BT=cut(rows["segment_ids"]))
        ids, logp = nxt(batch["ids"]), nxt(batch["logp"])
        out = {}
        for i in (1, 2):
            drafter_logp = jax.nn.log_softmax(tfm.logits_from_hidden(target, CFG, passes[i]))
            kl_BT = jnp.sum(jnp.exp(logp) * (logp - jnp.take_along_axis(drafter_logp, ids, -1)), -1)
            huber_BT = jnp.mean(optax.losses.huber_loss(passes[i], h[:, 1:-1]), -1)
            accept_BT = jnp.sum(jnp.minimum(jnp.exp(logp), jnp.exp(jnp.take_along_axis(drafter_logp, ids, -1))), -1)
            mean = lambda x, mask=masks[i]: jnp.sum(jnp.where(mask, x, 0.0)) / mask.sum()
            out[i] = (mean(huber_BT), mean(kl_BT), mean(accept_BT))
        return out

    total = float(loss1)
    for i, (huber, kl, accept) in reference(dparams, target, rows, batch).items():
        total += 0.3 * float(huber) + 0.7 * float(kl)
        np.testing.assert_allclose(float(aux3[f"accept_rate_pass{i}"]), float(accept), rtol=1e-4)
    np.testing.assert_allclose(float(loss3), total / 3, rtol=1e-4)
    with pytest.raises(ValueError, match="ttt_steps=0 must be >= 1"):
        dt.DrafterTrainer(CFG, PLAIN, OptimizerConfig(), None, top_k=K, feature_weight=1.0, kl_weight=1.0, ttt_steps=0)


def test_served_metrics_report_each_training_time_test_pass(target, rows):
    """The served drafter's teacher-forced acceptance per draft position: pass i's rate as
    drafter/served_accept_rate_pass<i>, a pass with no entries left out."""
    dparams = drafter_lib.init_drafter(CFG, PLAIN, jax.random.PRNGKey(1), init_std=0.3)
    _, aux = _loss(PLAIN, ttt_steps=3)(dparams, target, _batch(target, rows, PLAIN))
    out = {k: float(v) for k, v in aux.items()}
    served = lambda out: evaluation_metrics(StepEvaluation(1, out, out, {}, {}, 0.0))

    got = served(out)
    assert got["drafter/served_accept_rate"] == out["accept_rate"]
    want = {f"drafter/served_accept_rate_pass{i}": out[f"accept_rate_pass{i}"] for i in (1, 2)}
    assert {k: got[k] for k in got if "_pass" in k} == want
    assert "drafter/served_accept_rate_pass2" not in served({**out, "count_pass2": 0.0})


def test_the_version_moves_only_when_the_drafter_has_stepped():
    """A drafter that took no step since its last publish (bench_tlt's frozen mode: no steps
    at all) is not handed to the engine again, and its version stays; one that stepped is,
    once."""
    handed = []
    drafter = types.SimpleNamespace(steps=0, version=0, finite=lambda: True, policy=EveryVersion(), evaluation=None,
                                    state=types.SimpleNamespace(params={}),
                                    to_engine=lambda: handed.append(drafter.steps))
    for _ in range(3):
        assert not OnlineDrafter.publish(drafter)
    assert (drafter.version, handed) == (0, [])
    drafter.steps = 2
    assert OnlineDrafter.publish(drafter) and not OnlineDrafter.publish(drafter)
    assert (drafter.version, handed) == (1, [2])


def test_masked_entries_contribute_nothing(target, rows):
    """Changing what masked entries are scored against, or a whole row with no targets,
    changes neither the loss nor its gradient."""
    dparams = drafter_lib.init_drafter(CFG, PLAIN, jax.random.PRNGKey(2), init_std=0.3)
    batch = _batch(target, rows, PLAIN)
    batch["mask"] = rows["mask"].copy()
    batch["mask"][0] = False
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: _loss(PLAIN)(p, target, b)[0]))
    loss, grads = grad_fn(dparams, batch)

    other = dict(batch)
    scored = np.zeros((B, T), bool)
    scored[:, 1:-1] = dt.entry_mask(batch)  # entry t is scored against position t+1
    masked = ~scored
    other["ids"] = jnp.where(masked[..., None], (batch["ids"] + 7) % CFG.vocab_size, batch["ids"])
    other["logp"] = jnp.where(masked[..., None], batch["logp"] - 1.0, batch["logp"])
    other["tokens"] = batch["tokens"].copy()
    other["tokens"][0] = 5
    other["hidden"] = batch["hidden"].at[0].multiply(-2.0)
    loss2, grads2 = grad_fn(dparams, other)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads2, grads)


def test_fused_gradients_reach_fuse(target, rows):
    """Through the features the drafter reads (the KL alone: the regression target is
    fixed): the gradient of the fusion weights is the loss's slope along it, by central
    differences (a dropped or mis-scaled path would differ)."""
    dparams = drafter_lib.init_drafter(CFG, FUSED, jax.random.PRNGKey(3), init_std=0.3)
    batch = _batch(target, rows, FUSED)
    assert batch["layers"].shape == (B, T, 2, CFG.hidden_size)
    loss = lambda p: _loss(FUSED, feature_weight=0.0)(p, target, batch)[0]
    g = jax.grad(loss)(dparams)["fuse"]
    norm = float(jnp.linalg.norm(g))
    assert norm > 1e-3
    step = lambda eps: loss({**dparams, "fuse": dparams["fuse"] + eps * g / norm})
    eps = 1e-2
    slope = (float(step(eps)) - float(step(-eps))) / (2 * eps)
    np.testing.assert_allclose(slope, norm, rtol=2e-2)


def test_trainer_learns_a_batch(target, rows):
    mesh = sharding.make_mesh({"data": -1})
    trainer = dt.DrafterTrainer(CFG, PLAIN, OptimizerConfig(learning_rate=1e-2), mesh, top_k=K, feature_weight=1.0,
                                kl_weight=1.0, feature_noise=0.1)
    placed = trainer.place_target(target)
    state = trainer.init_state(drafter_lib.init_drafter(CFG, PLAIN, jax.random.PRNGKey(4)))
    batch = trainer.batch(placed, rows)
    before = trainer.evaluate(state.params, placed, batch)
    for step in range(8):
        state, out = trainer.step(state, placed, batch, jax.random.PRNGKey(step))
        assert float(out["skipped"]) == 0 and set(out) >= {"kl", "feature_loss", "top1_agree", "grad_norm"}
    after = trainer.evaluate(state.params, placed, batch)
    assert float(after["loss"]) < 0.7 * float(before["loss"])
    assert int(state.step) == 8


def test_export_round_trip_and_target_check(tmp_path, target):
    dparams = jax.device_get(drafter_lib.init_drafter(CFG, FUSED, jax.random.PRNGKey(5)))
    path = tmp_path / "drafter"
    io.save_drafter(path, dparams, FUSED, CFG, "sha256:abc", step=3)
    config, loaded = io.load_drafter(path, CFG)
    assert config == FUSED
    jax.tree.map(np.testing.assert_array_equal, loaded, dparams)
    assert io.load_drafter(path)[0] == FUSED  # the target's config is on record
    with pytest.raises(ValueError, match=r"trained for another target model \(hidden_size: trained for 32, "
                                         r"given 64.*train a drafter for this target"):
        io.load_drafter(path, CFG.replace(hidden_size=64))
    io.load_drafter(path, CFG.replace(param_dtype="bfloat16"))  # precision may differ
    with pytest.raises(ValueError, match="do not match the target"):
        io.save_drafter(tmp_path / "other", dparams, PLAIN, CFG, "sha256:abc")
    with pytest.raises(FileNotFoundError, match="experiments.train_drafter"):
        io.load_drafter(tmp_path / "missing")


def test_target_topk_never_forms_a_row_of_logits():
    """XLA's temp bytes (compile time) of the target's outputs at a shape where the
    batch's float32 logits are 128 MiB: the top-K comes from the blockwise projection, a
    token block's logits at a time."""
    b, t, v = 2, 1024, 16384
    cfg = tiny.config(vocab_size=v, num_layers=1)
    params = jax.eval_shape(lambda: tfm.init_params(cfg, jax.random.PRNGKey(0)))
    rows = {name: jax.ShapeDtypeStruct((b, t), jnp.int32) for name in ("tokens", "positions", "segment_ids")}
    fn = jax.jit(lambda p, r: dt.target_outputs(p, cfg, PLAIN, r, top_k=K))
    temp = fn.lower(params, rows).compile().memory_analysis().temp_size_in_bytes
    assert temp < b * t * v * 4 / 3, temp / (b * t * v * 4)
