"""TLT in the RL run: speculation chosen by the tuner, the drafter trained on the spot and
published (never with non-finite weights), and its state (drafter, optimizer, buffer, version,
tuner) resumed."""
import dataclasses
import functools
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import rl as rl_configs
from tests.rl.test_train import OVERRIDES, _config, warm_start  # noqa: F401 (a fixture)
from tlt_jax import checkpoint, metrics, rewards, sharding
from tlt_jax.drafter_training import spot
from tlt_jax.drafter_training.online import DrafterData, OnlineDrafter, OnlineDrafterConfig
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig
from tlt_jax.rl import train as rl_train
from tlt_jax.rl.train import train_rl
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.train_state import OptimizerConfig

# One update per step: the drafter's data comes from the on-policy update's forward (the
# multi-process test runs TLT with two, so through the old-policy pass).
TLT = {**OVERRIDES, "tlt.enabled": True, "learner.num_minibatches": 1, "steps": 3, "eval_every": 3,
       "checkpoint_every": 1,
       "tlt.drafter.init": "", "tlt.drafter.batch_size": 4, "tlt.drafter.seq_len": 48,
       "tlt.drafter.publish_scored": False,  # from nothing: every version published
       "tlt.drafter.checkpoint_every": 1, "tlt.drafter.optimizer.learning_rate": 3e-3,
       "tlt.spot.catch_up_steps": 2, "tlt.spot.max_steps_per_rl_step": 6,
       # every chunk picks among one EAGLE chain, one n-gram trie and plain decode
       "tlt.tuner.buckets": [1], "tlt.tuner.arms": [["eagle-d3", "ngram-d2-b1", "plain"]],
       "tlt.tuner.max_active": 16,
       # every pick runs its strategy (compiled in turn), so the tuner hears the picks whose
       # state the resume below checks
       "rollout.background_compiles": False}


def _records(run_dir):
    return {r["step"]: r for r in metrics.read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "step" in r}


def _slow_reward(prompts, completions, **fields):
    """The task reward after a pause: a reward gap long enough for drafter steps."""
    time.sleep(1.0)
    return rewards.REWARDS["task"](prompts, completions, **fields)


@pytest.mark.costly
def test_tlt_run_speculates_trains_and_publishes_the_drafter(warm_start, tmp_path, monkeypatch):  # noqa: F811
    """With no catch-up steps, the drafter trains only in the idle gaps of the step."""
    run_dir = str(tmp_path / "tlt")
    monkeypatch.setitem(rewards.REWARDS, "slow", _slow_reward)
    received, published = [], []  # what the engine is handed; the drafter's state at each publish
    update_drafter, publish = RolloutEngine.update_drafter, OnlineDrafter.publish
    monkeypatch.setattr(RolloutEngine, "update_drafter",
                        lambda self, p: (received.append(jax.device_get(p)), update_drafter(self, p))[1])

    def publish_and_record(self):
        if publish(self):
            published.append(jax.device_get(self.state.params))
            return True
        return False

    monkeypatch.setattr(OnlineDrafter, "publish", publish_and_record)
    # Scored after the rollout, one call per batch: with reward_overlap each sample is a call
    # of its own, and the pause would add up to 16 s a step.
    gaps_only = {"tlt.spot.catch_up_steps": 0, "tlt.spot.skip_short_gaps": False, "reward": "slow",
                 "reward_overlap": False}
    summary = train_rl(_config(warm_start, run_dir, **{**TLT, **gaps_only}), progress=False)
    records = _records(run_dir)
    steps = [records[s] for s in (1, 2, 3)]
    # The first data comes after step 1's reward gap, from the learner's forward; from step
    # 2 on the drafter trains in the gaps (the reward's at least) and each RL step publishes
    # a new version.
    assert [r["drafter_version"] for r in steps] == [0, 1, 2]
    assert all(r["buffer_truncated_total"] == 0 for r in steps)  # rows of 48 hold every sample of <= 24 tokens
    assert all(r["spot/catch_up_steps"] == 0 for r in steps) and all(r["spot/steps"] >= 1 for r in steps[1:])
    assert steps[-1]["drafter_steps_total"] == sum(r["spot/steps"] + r["spot/catch_up_steps"] for r in steps)
    # Every arm is pulled (untried arms first) and speculation commits tokens.
    pulls = {arm: sum(r.get(f"tuner/b1/{arm}/pulls", 0) for r in steps) for arm in ("eagle-d3", "ngram-d2-b1",
                                                                                     "plain")}
    assert all(n > 0 for n in pulls.values()), pulls
    assert any(r["acceptance_length"] > 1 for r in steps)
    # The drafter that served each rollout, scored teacher-forced on its own sequences; and
    # live acceptance per draft position (eagle-d3 drafts 3 deep).
    assert all(0 < r["drafter/served_accept_rate"] <= 1 for r in steps)
    # The shadow measure scores the run's starting drafter on the same rows: the served one's
    # figures while the engine still drafts with it (steps 1 and 2, version 0), apart once a
    # trained version serves (step 3).
    shadow = lambda r, who: [r[f"drafter/{who}_{k}"] for k in ("accept_rate", "top1_agree", "kl")]
    assert all(shadow(r, "initial") == shadow(r, "served") for r in steps[:2])
    assert steps[2]["drafter/initial_kl"] != steps[2]["drafter/served_kl"]
    # Which depths a rollout reaches depends on the drafter and the tuner's picks: each step
    # reports a prefix of positions 1..3, every rate a probability, and some step position 1.
    for r in steps:
        depths = sorted(int(k.rsplit("_", 1)[1]) for k in r if k.startswith("accept_depth_"))
        assert depths == list(range(1, len(depths) + 1)) and len(depths) <= 3, depths
        assert all(0 <= r[f"accept_depth_{d}"] <= 1 for d in depths)
    assert any("accept_depth_1" in r for r in steps)
    assert 0 < summary["tlt"]["speculative_token_share"] <= 1
    assert summary["tlt"]["drafter_version"] == 2
    assert set(summary["tlt"]) == {"speculative_token_share", "acceptance_length_mean", "drafter_version",
                                   "rollout_tokens_per_s_median"}
    for name in ("tlt.png", "tuner_arms.png"):
        assert os.path.getsize(os.path.join(run_dir, name)) > 0
    # The trained drafter is exported for inference on its own.
    from tlt_jax.drafter_training.io import load_drafter
    _, exported = load_drafter(os.path.join(run_dir, "drafter"))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(exported))
    # Each version reached the engine after the warm start: the drafter as it was published,
    # a new one each time.
    assert len(received) == 1 + len(published) == 3
    for got, want in zip(received[1:], published):
        jax.tree.map(np.testing.assert_array_equal, got, want)
    changed = lambda a, b: any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert all(changed(a, b) for a, b in zip(received, received[1:]))


# Keyed as this process keys its programs (tests/conftest.py), so that the resume below
# loads the programs the killed run compiled.
_KILLED_RUN = """
import sys
from tlt_jax import launch
launch.cache_programs_for_any_devices()
from tests.rl.test_tlt import TLT, _config
from tlt_jax.rl.train import train_rl
train_rl(_config(sys.argv[1], sys.argv[2], **{**TLT, "steps": 6}), progress=False)
"""


@pytest.mark.costly
def test_tlt_resume_after_sigkill_restores_drafter_tuner_and_buffer(warm_start, tmp_path):  # noqa: F811
    run_dir = str(tmp_path / "resumed")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, warm_start, run_dir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    markers = [os.path.join(run_dir, d, "2", checkpoint.MANIFEST_NAME) for d in ("drafter_checkpoints", "checkpoints")]
    deadline = time.time() + 300
    while not all(map(os.path.exists, markers)) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert all(map(os.path.exists, markers)), "the killed run never reached its step-2 checkpoints"
    before = _records(run_dir)[2]
    ckpt = checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints"))
    saved_tuner = ckpt.read_meta(2)["tlt"]["tuner"]
    ckpt.close()
    dckpt = checkpoint.Checkpointer(os.path.join(run_dir, "drafter_checkpoints"))
    saved_drafter, saved_meta = dckpt.restore(2)
    dckpt.close()
    assert saved_meta["version"] == before["drafter_version"] == 2

    # Resume: the restored state is the saved one, and the run continues from it.
    import tlt_jax.rl.train as train_module
    seen = {}
    original = train_module._restore_drafter

    def spy(drafter, dc, rl_step):
        original(drafter, dc, rl_step)
        seen["params"] = jax.device_get(drafter.state.params)
        seen["rows"] = drafter.buffer.num_rows
        seen["version"] = drafter.version

    train_module._restore_drafter = spy
    try:
        train_rl(_config(warm_start, run_dir, **TLT), progress=False)
    finally:
        train_module._restore_drafter = original
    jax.tree.map(np.testing.assert_array_equal, seen["params"], jax.device_get(saved_drafter["train"].params)
                 if hasattr(saved_drafter["train"], "params") else saved_drafter["train"]["params"])
    assert seen["version"] == 2 and seen["rows"] > 0
    after = _records(run_dir)[3]
    assert after["drafter_version"] == 3
    assert after["drafter_steps_total"] == before["drafter_steps_total"] + after["spot/steps"] + \
        after["spot/catch_up_steps"]
    ckpt = checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints"))
    resumed_tuner = ckpt.read_meta(3)["tlt"]["tuner"]
    ckpt.close()
    # Tuner statistics carry over: every pull counted before the kill is still counted.
    assert all(a >= b for pa, pb in zip(resumed_tuner["pulls"], saved_tuner["pulls"]) for a, b in zip(pa, pb))
    assert sum(map(sum, resumed_tuner["pulls"])) > sum(map(sum, saved_tuner["pulls"]))


@pytest.mark.parametrize("override, message", [
    ({"tlt.tuner.buckets": [1, 1]}, "buckets"),
    ({"tlt.tuner.epsilon": 1.5}, "epsilon"),
    ({"tlt.tuner.arms": [["eagle-d3", "bogus"]], "tlt.tuner.buckets": [1]}, r"arms\[0\]"),
    ({"tlt.spot.catch_up_steps": -1}, "tlt.spot.catch_up_steps"),
    ({"tlt.drafter.batch_size": 0}, "tlt.drafter.batch_size"),
    ({"tlt.drafter.batch_size": 6}, r"tlt.drafter.batch_size=6 must be a multiple of mesh.fsdp=4: .* make it 8"),
    ({"tlt.drafter.eval_rows": 6}, r"tlt.drafter.eval_rows=6 must be a multiple of mesh.fsdp=4: .* make it 8"),
    ({"tlt.drafter.init": "/nonexistent/drafter"}, "--config.tlt.drafter.init='/nonexistent/drafter' is not a"),
])
def test_bad_tlt_config_is_refused_before_anything_runs(tmp_path, override, message):
    from tlt_jax.rl.train import check_config
    config = _config("assets/sft_tiny", str(tmp_path / "run"), **{**TLT, **override})
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        check_config(config)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        train_rl(config, progress=False)
    assert not os.path.exists(tmp_path / "run")  # nothing written


def test_a_drafter_from_nothing_never_publishes_non_finite_weights():
    """A drafter trained from random weights (`tlt.drafter.init=""`) whose weights turn
    non-finite is never handed to the engine: the engine keeps the last finite version."""
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    dcfg = drafter_lib.DrafterConfig(num_layers=1)
    fresh = drafter_lib.init_drafter(cfg, dcfg, jax.random.PRNGKey(1))
    engine = RolloutEngine(cfg, tfm.init_params(cfg, jax.random.PRNGKey(0)),
                           sharding.make_mesh({"data": 1}, jax.devices()[:1]),
                           RolloutConfig(num_slots=2, max_prompt_length=4, max_length=16), dcfg, fresh)
    online = OnlineDrafter(engine, cfg, dcfg, fresh, OnlineDrafterConfig(batch_size=2, seq_len=8), temperature=1.0)
    in_engine = lambda: jax.device_get(engine.groups[0].drafter_params)
    moved = jax.tree.map(lambda x: x + 1.0, online.state.params)
    online.state, online.steps = dataclasses.replace(online.state, params=moved), 1
    assert online.publish() and online.version == 1
    jax.tree.map(np.testing.assert_array_equal, in_engine(), jax.device_get(moved))
    poisoned = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(np.nan), moved)
    online.state, online.steps = dataclasses.replace(online.state, params=poisoned), 2
    assert not online.publish() and online.version == 1
    jax.tree.map(np.testing.assert_array_equal, in_engine(), jax.device_get(moved))
    online.state, online.steps = dataclasses.replace(online.state, params=moved), 3  # finite again: published
    assert online.publish() and online.version == 2


def _tiny_online(config: OnlineDrafterConfig, head_scale: float = 1.0) -> OnlineDrafter:
    """An OnlineDrafter of a 1-layer drafter for a 1-layer, 16-wide target, on one device
    (head_scale: the target's LM head scaled, so that a drafter's logits can be far from flat)."""
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    dcfg = drafter_lib.DrafterConfig(num_layers=1)
    dparams = drafter_lib.init_drafter(cfg, dcfg, jax.random.PRNGKey(1), init_std=0.3)
    params = tfm.init_params(cfg, jax.random.PRNGKey(0))
    params["lm_head"] = params["lm_head"] * head_scale
    engine = RolloutEngine(cfg, params,
                           sharding.make_mesh({"data": 1}, jax.devices()[:1]),
                           RolloutConfig(num_slots=2, max_prompt_length=4, max_length=16), dcfg, dparams)
    return OnlineDrafter(engine, cfg, dcfg, dparams, config, temperature=1.0)


def _add_three_rows(online: OnlineDrafter, rl_step: int) -> None:
    """RL step `rl_step`'s data: three samples of 10-12 tokens (one 12-token buffer row each)."""
    rng = np.random.default_rng(0)
    n, t = 3, 12
    data = DrafterData(hidden=rng.standard_normal((n, t - 1, 16)).astype(np.float32),
                       ids=rng.integers(0, 32, (n, t - 1, 4)).astype(np.int32),
                       logp=np.log(np.full((n, t - 1, 4), 0.2, np.float32)), layers=None)
    online.add(rl_step, rng.integers(1, 32, (n, t)), [2, 3, 2], [8, 9, 10], data)


def test_a_drafter_step_takes_the_rows_held_not_a_batch_of_repeats():
    """With 3 rows held and batch_size 8, a drafter step trains on 4 rows (the 3, each
    once, and 1 that trains nothing). Warm-up compiles the full batch alone (the shape of
    every step once the buffer holds batch_size rows); 4 rows compile at their first step."""
    online = _tiny_online(OnlineDrafterConfig(batch_size=8, seq_len=12, top_k=4, eval_rows=0))
    assert [online.train_batch_rows(n) for n in (1, 2, 3, 5, 8, 40)] == [1, 2, 4, 8, 8, 8]
    online.warm_up(max_rows_per_step=3)
    trainer = online._trainer(online._home)
    assert trainer.step_fn(None, None, None)._cache_size() == 1  # 8 rows
    _add_three_rows(online, 0)
    seen = []
    step = trainer.step
    trainer.step = lambda state, target, batch, key, **kw: seen.append(batch) or step(state, target, batch, key, **kw)
    out = online.train_step(spot.ALL)
    assert [len(b["tokens"]) for b in seen] == [4] and seen[0]["mask"][:3].any(axis=1).all()
    assert not seen[0]["mask"][3].any() and out["count"] > 0
    assert trainer.step_fn(None, None, None)._cache_size() == 2  # and 4 rows


def test_the_served_drafter_is_scored_on_the_rows_its_step_holds():
    """served_metrics scores a step's rows, padded to a power of two (not to eval_rows):
    the same figures as over eval_rows rows, of which the padding ones count nothing."""
    online = _tiny_online(OnlineDrafterConfig(batch_size=2, seq_len=12, top_k=4, eval_rows=16))
    assert [online.eval_batch_rows(n) for n in (1, 2, 3, 4, 5, 16, 40)] == [1, 2, 4, 4, 8, 16, 16]
    scored = []
    evaluate = online._evaluate
    online._evaluate = lambda group, rows, params=None: scored.append(len(rows["tokens"])) or evaluate(group, rows,
                                                                                                    params)
    _add_three_rows(online, 5)  # the step's data arrives: the drafters are scored on it
    assert online.buffer.num_rows_of_step(5) == 3
    assert scored == [4, 4]  # the served drafter, then the starting one beside it
    got = online.served_metrics(5)
    assert scored == [4, 4]  # the metrics read the scores, and score nothing
    want = evaluate(online._home, online.buffer.rows_of_step(5, 16))
    assert want["count"] > 0
    np.testing.assert_allclose([got["drafter/served_accept_rate"], got["drafter/served_top1_agree"],
                                got["drafter/served_kl"]], [want["accept_rate"], want["top1_agree"], want["kl"]],
                               rtol=1e-5)
    assert online.served_metrics(6) == {} and scored == [4, 4]  # a step with no rows is not scored


def test_the_starting_drafter_is_scored_beside_the_served_one():
    """drafter/initial_*: the run's starting drafter on the same rows. While the drafter has
    not changed it equals the served figures; once a trained version is published the
    served figures move and the starting drafter's stay where they were."""
    online = _tiny_online(OnlineDrafterConfig(batch_size=4, seq_len=12, top_k=4, eval_rows=16,
                                              optimizer=OptimizerConfig(learning_rate=3e-2)))
    _add_three_rows(online, 1)
    names = ("accept_rate", "top1_agree", "kl")
    before = online.served_metrics(1)
    for name in names:
        assert before[f"drafter/initial_{name}"] == before[f"drafter/served_{name}"], name
    for _ in range(3):
        online.train_step(spot.ALL)
    assert online.publish()
    _add_three_rows(online, 2)  # the same rows again, drafted by the trained version
    after = online.served_metrics(2)
    assert after["drafter/served_kl"] != before["drafter/served_kl"]
    for name in names:
        np.testing.assert_allclose(after[f"drafter/initial_{name}"], before[f"drafter/initial_{name}"], rtol=1e-6)


def test_the_rows_of_each_task_are_scored_on_their_own():
    """With samples of two tasks, drafter/{served,initial}_accept_rate/<task> score each
    task's samples alone: task b's figure is that of a step holding sample 1 alone."""
    config = OnlineDrafterConfig(batch_size=4, seq_len=12, top_k=4, eval_rows=16)
    rng = np.random.default_rng(0)
    n, t = 3, 12
    data = DrafterData(hidden=rng.standard_normal((n, t - 1, 16)).astype(np.float32),
                       ids=rng.integers(0, 32, (n, t - 1, 4)).astype(np.int32),
                       logp=np.log(np.full((n, t - 1, 4), 0.2, np.float32)), layers=None)
    tokens = rng.integers(1, 32, (n, t))
    mixed, alone = _tiny_online(config), _tiny_online(config)
    mixed.add(1, tokens, [2, 3, 2], [8, 9, 10], data, tasks_n=["a", "b", "a"])
    alone.add(1, tokens[1:2], [3], [9], jax.tree.map(lambda x: x[1:2], data))
    got, want = mixed.served_metrics(1), alone.served_metrics(1)
    assert {k for k in got if k.count("/") > 1} == {
        f"drafter/{name}_accept_rate/{task}" for name in ("served", "initial") for task in "ab"}
    np.testing.assert_allclose(got["drafter/served_accept_rate/b"], want["drafter/served_accept_rate"], rtol=1e-6)
    assert got["drafter/served_accept_rate/a"] != got["drafter/served_accept_rate/b"]
    alone.add(2, tokens, [2, 3, 2], [8, 9, 10], data)  # one task: no per-task figures
    assert not any(k.count("/") > 1 for k in alone.served_metrics(2))


_SCORED = OnlineDrafterConfig(batch_size=4, seq_len=12, top_k=4, eval_rows=16, keep_steps=1, publish_scored=True,
                              optimizer=OptimizerConfig(learning_rate=3e-2))


def _sample_of_one_prompt():
    """(hidden, ids, logp, tokens) of one sample, each position's ids a shuffle of the vocabulary."""
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, 11, 16)).astype(np.float32)
    ids = rng.permuted(np.tile(np.arange(32), (11, 1)), axis=1)[None].astype(np.int32)
    logp = np.log(np.broadcast_to(np.float32([0.7, 0.1, 0.1, 0.05]), (1, 11, 4)))
    return hidden, ids, logp, rng.integers(1, 32, (1, 12))


def _drifting_step(online, sample, rl_step, at, train=False, metrics_calls=1):
    """An RL step of four copies of one sample whose target's top-4 are ids at..at+3 of each
    position's shuffle (a drafter that learns 4-7 unlearns 0-3): its samples, the metrics
    asked `metrics_calls` times, drafter steps, the publish. Returns (published, the last
    metrics)."""
    hidden, ids, logp, tokens = sample
    data = DrafterData(hidden=np.repeat(hidden, 4, 0), ids=np.repeat(ids[..., at:at + 4], 4, 0),
                       logp=np.repeat(logp, 4, 0), layers=None)
    online.add(rl_step, np.repeat(tokens, 4, 0), [2] * 4, [10] * 4, data)
    scored = {}
    for _ in range(metrics_calls):
        scored = online.served_metrics(rl_step)
    for _ in range(4 * train):
        online.train_step(spot.ALL)
    return online.publish(), scored


def test_a_scored_publish_hands_the_engine_the_drafter_that_best_drafts_the_next_step(tmp_path):
    """publish_scored: each step's end snapshots the drafter in training, and the next
    step's samples choose among that snapshot, the served drafter and the starting one. A
    snapshot trained toward the tokens that step samples is published; a served drafter
    that step's samples disown gives the engine back to the starting one; a snapshot they
    disown is withheld, and stays a contender. The engine's drafter survives a checkpoint
    round trip."""
    online = _tiny_online(_SCORED, head_scale=100.0)
    sample = _sample_of_one_prompt()
    step = functools.partial(_drifting_step, online, sample)

    in_engine = lambda: jax.device_get(online.engine.groups[0].drafter_params)
    start = jax.device_get(online.state.params)

    published, scored = step(1, 4, train=True)  # nothing scored the trained drafter yet
    assert not published and online.version == 0 and "drafter/snapshot_accept_rate" not in scored
    trained = [jax.device_get(online.state.params)]
    published, scored = step(2, 4, train=True)
    assert published and online.version == 1
    assert scored["drafter/snapshot_accept_rate"] > scored["drafter/served_accept_rate"]
    jax.tree.map(np.testing.assert_array_equal, in_engine(), trained[0])  # the snapshot scored, not the latest
    trained.append(jax.device_get(online.state.params))

    published, scored = step(3, 0)  # the served drafter and the snapshot learned 4-7; this step samples 0-3
    assert published and online.version == 2 and online.withheld == 1
    assert scored["drafter/initial_accept_rate"] > max(scored["drafter/served_accept_rate"],
                                                       scored["drafter/snapshot_accept_rate"])
    jax.tree.map(np.testing.assert_array_equal, in_engine(), start)
    ckpt = checkpoint.Checkpointer(str(tmp_path / "drafter"))
    ckpt.save(3, *online.checkpoint())
    ckpt.wait()

    published, scored = step(4, 4)  # the withheld snapshot is still a contender
    assert published and online.version == 3 and online.withheld == 1
    jax.tree.map(np.testing.assert_array_equal, in_engine(), trained[1])

    resumed = _tiny_online(_SCORED, head_scale=100.0)
    resumed.restore(ckpt, 3)
    resumed.to_engine()
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.engine.groups[0].drafter_params), start)
    assert resumed.version == 2


def test_a_scored_publish_does_not_wait_for_a_metrics_call():
    """The scores that choose a scored publish are made as the step's data arrives, and the
    metrics only read them: a drafter whose metrics nobody asks for publishes what one
    asked twice a step publishes, version for version, and the scores did choose (the
    starting drafter won the engine back once, and a snapshot was withheld)."""
    sample = _sample_of_one_prompt()
    silent, asked = _tiny_online(_SCORED, head_scale=100.0), _tiny_online(_SCORED, head_scale=100.0)
    for rl_step, at, train in ((1, 4, True), (2, 4, True), (3, 0, False), (4, 4, False)):
        published = _drifting_step(silent, sample, rl_step, at, train, metrics_calls=0)[0]
        assert published == _drifting_step(asked, sample, rl_step, at, train, metrics_calls=2)[0], rl_step
        assert (silent.version, silent.withheld) == (asked.version, asked.withheld), rl_step
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(silent.engine.groups[0].drafter_params),
                     jax.device_get(asked.engine.groups[0].drafter_params))
    assert (silent.version, silent.withheld) == (3, 1)


def test_a_trust_region_holds_the_drafter_near_the_version_the_engine_drafts_with():
    """Four steps at a high learning rate move the drafter; with a trust region toward the
    engine's version they move it far less. The anchor is the version published: each
    step reports its distance from it before updating, 0 right after a publish."""
    def moved(trust_region, publish_after=None):
        online = _tiny_online(OnlineDrafterConfig(batch_size=4, seq_len=12, top_k=4, eval_rows=0,
                                                  trust_region=trust_region,
                                                  optimizer=OptimizerConfig(learning_rate=3e-2)))
        _add_three_rows(online, 1)
        start = jax.device_get(online.state.params)
        outs = []
        for i in range(4):
            outs.append(online.train_step(spot.ALL))
            if i == publish_after:
                assert online.publish()
        now = jax.device_get(online.state.params)
        distance = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(now), jax.tree.leaves(start))))
        return distance, outs

    free, outs_free = moved(0.0)
    held, _ = moved(30.0)
    assert "anchor_distance" not in outs_free[0]
    assert held < 0.5 * free, (held, free)
    distances = [out["anchor_distance"] for out in moved(30.0, publish_after=1)[1]]
    assert distances[0] == distances[2] == 0 and distances[1] > 0 and distances[3] > 0, distances
    with pytest.raises(ValueError, match=r"tlt.drafter.trust_region=-1.0 must be >= 0"):
        _tiny_online(OnlineDrafterConfig(trust_region=-1.0))


def test_online_drafter_rows_hold_a_whole_sample_unless_set():
    """By default a buffer row holds a whole sample: the whole prompt (tlt.drafter.prompt_tail
    =-1), which live drafting attends over, and every response token (seq_len=0): shorter
    rows cut the end of long responses off, the positions the rollout's tail drafts."""
    c = rl_configs.get_config("tiny").tlt.drafter
    assert (c.seq_len, c.prompt_tail) == (0, -1)
    whole = rl_train._online_drafter_config(c, 24, 300)
    assert (whole.prompt_tail, whole.seq_len) == (23, 324)
    c.prompt_tail = 7
    assert rl_train._online_drafter_config(c, 24, 300).seq_len == 308
    c.seq_len = 64
    assert rl_train._online_drafter_config(c, 24, 300).seq_len == 64
    # The two conventions are named where a value is out of range.
    c.prompt_tail = -2
    with pytest.raises(ValueError, match=r"prompt_tail=-2: .* or -1 for the whole prompt"):
        rl_train._online_drafter_config(c, 24, 300)
    c.prompt_tail, c.seq_len = 7, -5
    with pytest.raises(ValueError, match=r"seq_len=-5: .* or 0 for a whole sample"):
        rl_train._online_drafter_config(c, 24, 300)
