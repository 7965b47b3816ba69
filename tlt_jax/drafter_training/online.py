"""The drafter during RL: trained on the spot from the learner's by-products, published
to the rollout engine between rollouts, checkpointed on its own cadence.

    learner's forward --DrafterData--> OnlineDrafter.add: DrafterBuffer (host, last n RL
                      steps); the step's StepEvaluation (the drafters scored on its rows)
    SpotTrainer gap   --> OnlineDrafter.train_step(placement): one guarded AdamW step
    end of RL step    --> OnlineDrafter.publish(): the publish policy (`publish`) chooses;
                          engine.update_drafter, version + 1

With `publish_scored` a version reaches the engine only after it has been scored on
samples none of its rivals trained on. Each step's end snapshots the drafter in training;
the next step's samples (new prompts) score, teacher-forced, that snapshot, the served
drafter and the run's starting one, and that step's end hands the engine the best. Where
the policy moves, the snapshot follows it and wins; where it stays, the starting drafter
(trained offline on far more data than a step brings) keeps or wins back the engine from
versions that a step's few prompts pulled toward themselves. The price: a trained version
drafts one step later than it would unscored. (Samples held out of the same step do not
score it: they share their prompts with the samples it trained on.)

One drafter, never diverging copies: with several processes it trains on process 0
alone, and every publish hands process 0's weights and counters to every process's
engine (`to_engine`, collective). Its train state lives on the devices of the
rollout group it last trained on (`placement` g; host-phase gaps, placement ALL, train
wherever it is) and moves with it. A step reads the target's embedding, final norm and
LM head from that group's engine copy (the current policy: the drafter follows the
target it will draft for). The loss, batch format and AdamW guard are the offline
trainer's (`trainer.DrafterTrainer`), so online and offline training are one recipe.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from tlt_jax import background as background_lib
from tlt_jax import checkpoint, faults, multihost
from tlt_jax.drafter_training import spot
from tlt_jax.drafter_training.buffer import DrafterBuffer
from tlt_jax.drafter_training.publish import StepEvaluation, evaluation_metrics, publish_policy
from tlt_jax.drafter_training.trainer import DrafterTrainer, shared_target_params
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models.config import ModelConfig
from tlt_jax.rollout.engine import RolloutEngine, shape_bucket
from tlt_jax.train_state import OptimizerConfig, TrainState, state_shardings


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DrafterData:
    """What the target's forward at the start of an RL step (the on-policy update's, or the
    old-policy pass) hands the online drafter, per position t of the batch rows (T' = T-1:
    the positions that predict a next token). In packed rows each sample's outputs are
    those of the sample alone, at each of its tokens but a last one in a row's last column
    (no position of T'); drafter training never reads a sample's last token's outputs."""

    hidden: jax.Array  # [n, T', D] final-normed hidden state at t (the EAGLE feature)
    ids: jax.Array  # [n, T', K] int32 top-K ids of the distribution of token t+1
    logp: jax.Array  # [n, T', K] float32 their log-probs (at the learner's temperature)
    layers: jax.Array | None  # [n, T', L, D] the drafter's feature layers' outputs (EAGLE-3), or None


@dataclasses.dataclass(frozen=True)
class OnlineDrafterConfig:
    """How the drafter is trained during RL (`tlt.drafter` in configs/rl.py)."""

    top_k: int = 8  # target ids per position kept for the KL
    batch_size: int = 16  # buffer rows per drafter step
    seq_len: int = 128  # buffer row length (samples are packed)
    buffer_max_bytes: int = 256 << 20
    keep_steps: int = 2  # RL steps of data the buffer holds
    replay_share: float = 0.0  # of each batch, rows older than keep_steps from a replay reservoir (DrafterBuffer)
    prompt_tail: int = 0  # prompt tokens kept before each response (context, never targets)
    feature_weight: float = 1.0
    kl_weight: float = 1.0
    feature_noise: float = 0.2
    ttt_steps: int = 1  # training-time test passes (DrafterTrainer; 1: none)
    # Weight of a pull toward the version the engine drafts with (DrafterTrainer; 0: none):
    # each RL step's drafter moves from the last published one only as far as its data pays.
    trust_region: float = 0.0
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-3, b1=0.9, b2=0.95, weight_decay=0.01)
    checkpoint_every: int = 5  # RL steps between drafter checkpoints (0: never)
    # Rows of each RL step, at most, on which the drafter that drafted its rollouts is
    # scored, teacher-forced (`StepEvaluation`; 0: never).
    eval_rows: int = 16
    # Publish only the best scored on the next step's samples of the last step's drafter,
    # the served one and the starting one (the module docstring, `publish.ScoredPublish`);
    # False: every changed drafter (`publish.EveryVersion`).
    publish_scored: bool = False

    def __post_init__(self):
        if self.publish_scored and not self.eval_rows:
            raise ValueError("tlt.drafter.publish_scored scores drafters on up to eval_rows rows of each step; set "
                             "tlt.drafter.eval_rows >= 1, or publish_scored=False.")
        for name in ("top_k", "batch_size", "keep_steps", "ttt_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"tlt.drafter.{name}={getattr(self, name)} must be >= 1.")
        if self.seq_len < 3:
            raise ValueError(f"tlt.drafter.seq_len={self.seq_len} must be >= 3 (a drafter entry reads a token and "
                             "predicts the one after the next).")
        if self.prompt_tail < 0 or self.checkpoint_every < 0 or self.eval_rows < 0:
            raise ValueError("tlt.drafter.prompt_tail, tlt.drafter.checkpoint_every and tlt.drafter.eval_rows must "
                             "be >= 0.")


class OnlineDrafter:
    """The drafter's train state, buffer and version during an RL run."""

    def __init__(self, engine: RolloutEngine, target_config: ModelConfig,
                 drafter_config: drafter_lib.DrafterConfig, drafter_params, config: OnlineDrafterConfig, *,
                 temperature: float, seed: int = 0):
        if engine.drafter is None:
            raise ValueError("The rollout engine has no drafter; build it with drafter_config and drafter_params.")
        self.engine, self.target_config, self.drafter_config, self.config = engine, target_config, drafter_config, \
            config
        self.temperature = temperature
        self.buffer = DrafterBuffer(config.seq_len, target_config.hidden_size, config.top_k,
                                    max_bytes=config.buffer_max_bytes,
                                    num_feature_layers=len(drafter_config.feature_layers),
                                    feature_dtype=target_config.jnp_dtype, keep_steps=config.keep_steps,
                                    prompt_tail=config.prompt_tail, seed=seed, replay_share=config.replay_share)
        self._trainers: dict[int, DrafterTrainer] = {}
        self._home = engine.local_groups[0].index  # the rollout group whose devices hold the train state
        self.state = self._trainer(self._home).init_state(drafter_params)
        # The run's starting drafter, kept to score beside the served one (`StepEvaluation`):
        # staleness and recovery on the same rows, whatever arms the tuner chose.
        self._initial = {self._home: _copy(self.state.params)}  # per rollout group: a copy on its devices
        self._noise_key = jax.random.PRNGKey(seed + 1)
        self.version = 0  # drafters published to the engine (0: the warm start)
        self.steps = 0  # drafter optimizer steps run (skipped ones included)
        self.skipped = 0
        self.policy = publish_policy(config.publish_scored)
        self.evaluation: StepEvaluation | None = None  # the latest step's, made as its data arrived (`add`)
        self._warming: concurrent.futures.Future | None = None  # `warm_up(background=True)` under way

    def _trainer(self, group: int) -> DrafterTrainer:
        if group not in self._trainers:
            c = self.config
            self._trainers[group] = DrafterTrainer(
                self.target_config, self.drafter_config, c.optimizer, self.engine.groups[group].mesh, top_k=c.top_k,
                feature_weight=c.feature_weight, kl_weight=c.kl_weight, temperature=self.temperature,
                feature_noise=c.feature_noise, ttt_steps=c.ttt_steps, trust_region=c.trust_region)
        return self._trainers[group]

    # -- data

    def add(self, rl_step: int, tokens_nT: np.ndarray, prompt_lengths_n, response_lengths_n,
            data: DrafterData, tasks_n=None, observed_nT=None) -> None:
        """Stores an RL step's samples: the learner batch's rows and the learner forward's
        DrafterData ([n, T-1] positions; the last position predicts nothing and is padded),
        then scores the drafters on them (`evaluation`; the publish policy reads it).
        tasks_n: each sample's task; with two or more, each task's rows are also scored on
        their own. observed_nT: bool [n, T], True at the environment's observation tokens
        (multi-turn): context, never targets (`DrafterBuffer.add`); None for single-turn
        samples."""
        self._warmed_up()
        pad = lambda x: None if x is None else np.concatenate(
            [np.asarray(x), np.zeros_like(np.asarray(x[:, :1]))], axis=1)
        host = jax.device_get(data)
        fields = (pad(host.hidden), pad(host.ids), pad(host.logp), pad(host.layers))
        self.buffer.add(rl_step, tokens_nT, prompt_lengths_n, response_lengths_n, *fields, observed_nT=observed_nT)
        rows_by_task = {}
        if tasks_n is not None and len(set(tasks_n)) > 1 and self.config.eval_rows:
            rows_by_task = self._rows_by_task(rl_step, tokens_nT, prompt_lengths_n, response_lengths_n, fields,
                                              tasks_n, observed_nT)
        self.evaluation = self._score_step(rl_step, rows_by_task)

    def _rows_by_task(self, rl_step: int, tokens_nT, prompt_lengths_n, response_lengths_n, fields, tasks_n,
                      observed_nT) -> dict[str, dict]:
        """{task: the step's rows of that task's samples alone, as `eval_batch_rows` pads them}."""
        out = {}
        for task in sorted(set(tasks_n)):
            pick = np.flatnonzero(np.asarray(tasks_n) == task)
            alone = DrafterBuffer(self.buffer.seq_len, self.buffer.hidden_size, self.buffer.top_k,
                                  max_bytes=self.buffer.max_bytes, num_feature_layers=self.buffer.num_feature_layers,
                                  feature_dtype=self.buffer.feature_dtype, prompt_tail=self.buffer.prompt_tail)
            alone.add(rl_step, np.asarray(tokens_nT)[pick], np.asarray(prompt_lengths_n)[pick],
                      np.asarray(response_lengths_n)[pick], *(None if x is None else x[pick] for x in fields),
                      observed_nT=None if observed_nT is None else np.asarray(observed_nT)[pick])
            held = alone.num_rows_of_step(rl_step)
            if held:
                out[task] = alone.rows_of_step(rl_step, self.eval_batch_rows(held))
        return out

    def _score_step(self, rl_step: int, rows_by_task: dict[str, dict]) -> StepEvaluation | None:
        """The drafter the engine holds (the one that drafted RL step `rl_step`'s rollouts),
        the run's starting one and the publish policy's contenders, scored teacher-forced on
        up to `eval_rows` of the step's rows (`eval_batch_rows`), and on each task's rows in
        `rows_by_task`. Reads the drafters and the buffer, writes nothing. None with
        eval_rows 0, or where the step's rows hold no trained entry."""
        held = self.buffer.num_rows_of_step(rl_step)
        if not self.config.eval_rows or not held:
            return None
        t0 = time.perf_counter()
        rows = self.buffer.rows_of_step(rl_step, self.eval_batch_rows(held))
        served = self._evaluate(self._home, rows)
        if not served["count"]:
            return None
        initial = self._evaluate(self._home, rows, self.initial_params())
        contenders = {name: self._evaluate(self._home, rows, self._on_home(params))
                      for name, params in self.policy.contenders(self).items()}
        by_task = {task: {name: self._evaluate(self._home, task_rows, params)
                          for name, params in (("served", None), ("initial", self.initial_params()))}
                   for task, task_rows in rows_by_task.items()}
        return StepEvaluation(rl_step, served, initial, contenders, by_task, time.perf_counter() - t0)

    def served_metrics(self, rl_step: int) -> dict[str, float]:
        """How well the drafter the engine held when RL step `rl_step`'s data arrived (the
        one that drafted its rollouts) predicts that step's own sequences (`evaluation`,
        made by `add`; this only reads it): "drafter/served_accept_rate" (the chance its
        first draft is accepted, whatever strategies the tuner chose),
        "drafter/served_top1_agree", "drafter/served_kl", with ttt_steps > 1
        "drafter/served_accept_rate_pass<i>" (the chance of acceptance at draft position
        i + 1, where the drafter reads its own earlier drafts; a pass with no entries is
        left out), the same of the run's starting drafter on the same rows
        ("drafter/initial_accept_rate", "drafter/initial_top1_agree", "drafter/initial_kl":
        how stale it would be by now), with publish_scored the last step's snapshot's
        ("drafter/snapshot_accept_rate"; these scores choose the step's publish), the same
        two per task where the step's samples came from several
        ("drafter/served_accept_rate/<task>", "drafter/initial_accept_rate/<task>"), and the
        seconds the scoring took ("time_served_eval_s"). Empty for a step not scored."""
        evaluation = self.evaluation if self.evaluation is not None and self.evaluation.rl_step == rl_step else None
        return evaluation_metrics(evaluation)

    def eval_batch_rows(self, held: int) -> int:
        """Rows `served_metrics` scores when the step's buffer holds `held`: all of them, up
        to eval_rows, padded to the home group's fsdp times a power of two (few shapes to
        compile; a row of padding costs as much as a row of data)."""
        return shape_bucket(held, self.config.eval_rows, unit=self._fsdp)

    @property
    def _fsdp(self) -> int:
        """Devices of the home group that a drafter batch is split over."""
        return self.engine.groups[self._home].mesh.shape["fsdp"]

    def _on_home(self, params):
        """`params` (a drafter's) on the devices of the home group, where the train state is."""
        return jax.device_put(params, self._trainer(self._home).drafter_shardings(params))

    def initial_params(self, group: int | None = None):
        """The starting drafter on the devices of rollout `group` (default: the home group;
        copied there once)."""
        group = self._home if group is None else group
        if group not in self._initial:
            first = next(iter(self._initial.values()))
            self._initial[group] = jax.device_put(first, self._trainer(group).drafter_shardings(first))
        return self._initial[group]

    def _evaluate(self, group: int, rows: dict, params=None) -> dict[str, float]:
        """The trainer's teacher-forced metrics of `params` (default: the drafter the
        engine's group holds) on `rows`, against the group's copy of the target."""
        trainer = self._trainer(group)
        params = self.engine.groups[group].drafter_params if params is None else params
        target = shared_target_params(self.engine.groups[group].params)
        return {k: float(v) for k, v in jax.device_get(trainer.evaluate(params, target, rows)).items()}

    def has_data(self) -> bool:
        return self.buffer.ready(self.config.batch_size)

    # -- the spot trainer's step

    def train_step(self, placement: Hashable) -> dict:
        """One drafter optimizer step on the devices of rollout group `placement` (`spot.ALL`,
        a host phase: where the state already is), blocking until it is done."""
        self._warmed_up()
        group = self._home if placement == spot.ALL else int(placement)
        trainer = self._trainer(group)
        if group != self._home:  # the state moves with the drafter to the idle group's devices
            self.state = jax.device_put(self.state, self._state_shardings(trainer))
            self._home = group
        target = shared_target_params(self.engine.groups[group].params)
        rows = self.buffer.sample(self.config.batch_size, self.train_batch_rows(self.buffer.num_rows))
        self.state, out = trainer.step(self.state, target, rows, jax.random.fold_in(self._noise_key, self.steps),
                                       anchor=self.engine.groups[group].drafter_params)
        faults.maybe_kill("drafter_step", self.steps)
        out = {k: float(v) for k, v in jax.device_get(out).items()}
        self.steps += 1
        self.skipped += int(out["skipped"])
        return out

    def train_batch_rows(self, held: int) -> int:
        """Rows of a drafter step's batch when the buffer holds `held`: batch_size, or, while
        fewer are held, all of them padded as `eval_batch_rows` pads (a step on 2 rows then
        costs what 2 rows cost, not batch_size)."""
        return shape_bucket(held, self.config.batch_size, unit=self._fsdp)

    def warm_up(self, max_rows_per_step: int, background: bool = False) -> float:
        """Compiles and runs once, on the home group, the drafter step at a full batch (a
        throwaway copy of the state takes it) and the served drafter's evaluation at the
        most rows a step of at most `max_rows_per_step` rows scores (a sample fills at most
        one row): the shapes every step takes once the buffer holds a full batch. A smaller
        batch (a buffer of fewer rows) compiles its shape when a step first takes it.
        background: on a thread of its own, while the caller goes on (plain decode's
        compiles, the first rollouts: a compile releases the GIL); the next `add` or
        `train_step` waits for it. Returns the seconds spent in the caller's thread."""
        t0 = time.perf_counter()
        group = self.engine.groups[self._home]
        compile_run = functools.partial(
            self._compile_run, self._trainer(self._home), jax.tree.map(jnp.copy, self.state),
            shared_target_params(group.params),
            group.drafter_params, self.train_batch_rows(self.config.batch_size),
            self.eval_batch_rows(max_rows_per_step) if self.config.eval_rows else 0)
        if background:
            self._warming = background_lib.start(compile_run, "drafter_warm_up",
                                                 one_device=group.mesh.devices.size == 1)
        else:
            compile_run()
        return time.perf_counter() - t0

    def _compile_run(self, trainer: DrafterTrainer, state: TrainState, target, drafter_params, train_rows: int,
                     eval_rows: int) -> None:
        """One drafter step of `train_rows` empty rows on `state` (donated) and, with
        eval_rows, one evaluation of `drafter_params` on that many: both compiled and run."""
        state, _ = trainer.step(state, target, self.buffer.empty_batch(train_rows), self._noise_key,
                                anchor=drafter_params)
        jax.block_until_ready(state)
        if eval_rows:
            jax.block_until_ready(trainer.evaluate(drafter_params, target, self.buffer.empty_batch(eval_rows)))

    def _warmed_up(self) -> None:
        """Waits for a warm-up running in the background (its error raised here); the RL
        thread and the spot trainer's may both wait."""
        if self._warming is not None:
            self._warming.result()

    def _state_shardings(self, trainer: DrafterTrainer) -> TrainState:
        return state_shardings(trainer.optimizer, self.state.params, trainer.drafter_shardings(self.state.params),
                               trainer.mesh)

    # -- to the engine

    def publish(self) -> bool:
        """Hands the engine the drafter its publish policy chooses (`publish.EveryVersion`:
        the one in training if it changed and is finite; `publish.ScoredPublish`: the best
        scored on this step's samples). Returns whether the engine's drafter changed.
        Collective with several processes: process 0 decides."""
        if self.policy.choose(self, self.evaluation) is None:
            return False
        self.to_engine()
        self.version += 1
        return True

    def finite(self) -> bool:
        """Whether every weight of the drafter in training is finite (warned once where not)."""
        if bool(_all_finite(self.state.params)):
            return True
        logging.warning("Drafter weights are not finite after %d steps; keeping the published version %d.",
                        self.steps, self.version)
        return False

    def copy_params(self):
        """A copy of the drafter in training's parameters (the next step donates the state)."""
        return _copy(self.state.params)

    @property
    def withheld(self) -> int:
        """Scored versions the publish policy did not publish."""
        return self.policy.withheld

    def to_engine(self) -> None:
        """Hands the engine the drafter its publish policy holds there (`engine_params`: the
        one in training, after `restore` the restored one, or with publish_scored the one
        last chosen). Collective with several processes: every engine gets process 0's
        drafter, every process its counters."""
        params = self.policy.engine_params(self)
        # A copy: the engine must not alias the train state, which each step donates. On the
        # devices with one process (no host round trip of the weights each RL step); through
        # the host with several, where process 0's drafter goes to every process.
        if multihost.is_multiprocess():
            params = multihost.broadcast_arrays(jax.device_get(params))
        else:
            params = _copy(params)
        policy = self.policy
        self.version, self.steps, self.skipped, policy.withheld, policy.published_steps = multihost.broadcast_object(
            (self.version, self.steps, self.skipped, policy.withheld, policy.published_steps))
        self.engine.update_drafter(params)

    # -- checkpoints

    def checkpoint(self) -> tuple[dict, dict]:
        """(tree, meta) of a drafter checkpoint. The tree: the trainable parameters and
        optimizer state (never the target's shared weights) and the buffer's contents, as
        host copies (the next drafter step donates the device state, possibly while the
        write goes on). The meta: the counters, and the buffer's array shapes (its size
        varies: restoring needs them)."""
        buffer = self.buffer.state_dict()
        shapes = jax.tree.map(lambda x: [list(np.shape(x)), str(np.asarray(x).dtype)], buffer)
        policy_tree, policy_meta = self.policy.checkpoint()  # publish_scored: the engine's drafter, when chosen
        tree = {"train": jax.device_get(self.state), "buffer": buffer, **jax.device_get(policy_tree)}
        return tree, {"version": self.version, "steps": self.steps, "skipped": self.skipped, **policy_meta,
                      "home": self._home, "buffer_shapes": shapes}

    def restore(self, ckpt: checkpoint.Checkpointer, step: int) -> None:
        """Restores drafter checkpoint `step` (train state on its home group, or on this
        process's first group when that one is not here, buffer and counters); `to_engine`
        then hands the engine its weights."""
        meta = ckpt.read_meta(step)
        groups = self.engine.groups
        home = meta["home"]
        self._home = home if home < len(groups) and groups[home].is_local else self.engine.local_groups[0].index
        like_train = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.state,
                                  self._state_shardings(self._trainer(self._home)))
        like_buffer = jax.tree.map(lambda spec: jax.ShapeDtypeStruct(tuple(spec[0]), np.dtype(spec[1])),
                                   meta["buffer_shapes"], is_leaf=lambda x: isinstance(x, list) and len(x) == 2
                                   and isinstance(x[1], str))
        target = {"train": like_train, "buffer": like_buffer}
        if meta.get("chosen"):
            target["chosen"] = like_train.params
        tree, _ = ckpt.restore(step, target=target)
        self.state = tree["train"]
        self.buffer.load_state_dict(jax.tree.map(np.asarray, tree["buffer"]))
        self.version, self.steps, self.skipped = meta["version"], meta["steps"], meta["skipped"]
        self.policy.restore(self, tree, meta)


@jax.jit
def _copy(tree):
    """A copy of every array of `tree` in one program (a `jnp.copy` per leaf is a dispatch each)."""
    return jax.tree.map(jnp.copy, tree)


@jax.jit
def _all_finite(tree) -> jax.Array:
    """Whether every element of every array in `tree` is finite: one program, one sync."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
