"""The drafter during RL: trained on the spot from the learner's by-products, published
to the rollout engine between rollouts, checkpointed on its own cadence.

    learner's forward     --DrafterData--> DrafterBuffer (host, last n RL steps)
    SpotTrainer gap  --> OnlineDrafter.train_step(placement): one guarded AdamW step
    end of RL step   --> OnlineDrafter.publish(): engine.update_drafter, version + 1

With `publish_holdout` > 0 a publish is earned: that share of each step's samples stays out
of training until the end of the step, and the engine then gets whichever of the drafter in
training, the served one and the run's starting one drafts them best, teacher-forced (none
of the three trained on them). Where the policy moves, the drafter in training follows it
and wins; where it stays, the starting drafter (trained offline on far more data than a
step brings) wins back the engine from versions that training pulled away from it.

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

import dataclasses
import time
from typing import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from tlt_jax import checkpoint, faults, multihost
from tlt_jax.drafter_training import spot
from tlt_jax.drafter_training.buffer import DrafterBuffer
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
    # scored, teacher-forced (`served_metrics`; 0: never).
    eval_rows: int = 16
    # Share of each RL step's samples kept out of training until the step's publish, which
    # they decide (the module docstring); up to eval_rows of their rows are scored. 0:
    # every changed drafter is published.
    publish_holdout: float = 0.0

    def __post_init__(self):
        if not 0 <= self.publish_holdout < 1:
            raise ValueError(f"tlt.drafter.publish_holdout={self.publish_holdout} must be in [0, 1): the share of "
                             "each step's samples that decides whether the drafter is published (0: always).")
        if self.publish_holdout and not self.eval_rows:
            raise ValueError("tlt.drafter.publish_holdout > 0 scores up to eval_rows rows of the held-out samples; "
                             "set tlt.drafter.eval_rows >= 1, or publish_holdout=0.")
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
        # The run's starting drafter, kept to score beside the served one (`served_metrics`):
        # staleness and recovery on the same rows, whatever arms the tuner chose.
        self._initial = {self._home: _copy(self.state.params)}  # per rollout group: a copy on its devices
        self._rows_by_task: dict[str, dict] = {}  # the latest step's rows of each task, to score apart
        self._noise_key = jax.random.PRNGKey(seed + 1)
        self.version = 0  # drafters published to the engine (0: the warm start)
        self.steps = 0  # drafter optimizer steps run (skipped ones included)
        self.skipped = 0
        self.withheld = 0  # changed drafters that another outscored (publish_holdout)
        self._published_steps = 0
        self._held: tuple | None = None  # (rl_step, buffer.add's arguments) of the held-out samples
        self._serving_initial = False  # the engine holds the run's starting drafter (publish_holdout)
        self.publish_metrics: dict[str, float] = {}  # the last publish's scores on them

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
        DrafterData ([n, T-1] positions; the last position predicts nothing and is padded).
        tasks_n: each sample's task; with two or more, `served_metrics` also scores the
        step's rows of each task on their own. observed_nT: bool [n, T], True at the
        environment's observation tokens (multi-turn): context, never targets
        (`DrafterBuffer.add`); None for single-turn samples."""
        pad = lambda x: None if x is None else np.concatenate(
            [np.asarray(x), np.zeros_like(np.asarray(x[:, :1]))], axis=1)
        host = jax.device_get(data)
        samples = (np.asarray(tokens_nT), np.asarray(prompt_lengths_n), np.asarray(response_lengths_n),
                   pad(host.hidden), pad(host.ids), pad(host.logp), pad(host.layers),
                   None if observed_nT is None else np.asarray(observed_nT))
        n = len(samples[0])
        held = _spread(n, round(self.config.publish_holdout * n)) if self.config.publish_holdout and n > 1 else []
        train = np.setdiff1d(np.arange(n), held)
        pick = lambda idx: tuple(None if x is None else x[idx] for x in samples)
        self.buffer.add(rl_step, *pick(train)[:7], observed_nT=pick(train)[7])
        self._held = (rl_step, pick(np.asarray(held, np.int64))) if len(held) else None
        self._rows_by_task = {}
        if tasks_n is not None and len(set(tasks_n)) > 1 and self.config.eval_rows:
            for task in sorted(set(tasks_n)):
                rows = self._rows_alone(rl_step, pick(np.flatnonzero(np.asarray(tasks_n) == task)))
                if rows is not None:
                    self._rows_by_task[task] = rows

    def _rows_alone(self, rl_step: int, samples: tuple) -> dict | None:
        """Up to eval_rows rows (`eval_batch_rows`) packed from `samples` (`add`'s arguments
        to the buffer) alone, or None when they fill no row."""
        b = self.buffer
        alone = DrafterBuffer(b.seq_len, b.hidden_size, b.top_k, max_bytes=b.max_bytes,
                              num_feature_layers=b.num_feature_layers, feature_dtype=b.feature_dtype,
                              prompt_tail=b.prompt_tail)
        alone.add(rl_step, *samples[:7], observed_nT=samples[7])
        held = alone.num_rows_of_step(rl_step)
        return alone.rows_of_step(rl_step, self.eval_batch_rows(held)) if held else None

    def served_metrics(self, rl_step: int) -> dict[str, float]:
        """How well the drafter the engine holds (the one that drafted RL step `rl_step`'s
        rollouts) predicts that step's own sequences, teacher-forced on up to `eval_rows` of
        its rows (`eval_batch_rows`): "drafter/served_accept_rate" (the chance its first draft is accepted, whatever
        strategies the tuner chose), "drafter/served_top1_agree", "drafter/served_kl", with
        ttt_steps > 1 "drafter/served_accept_rate_pass<i>" (the chance of acceptance at draft
        position i + 1, where the drafter reads its own earlier drafts; a pass with no
        entries is left out), the same of the run's starting drafter on the same rows
        ("drafter/initial_accept_rate", "drafter/initial_top1_agree", "drafter/initial_kl":
        how stale it would be by now), the same two per task where the step's samples came
        from several ("drafter/served_accept_rate/<task>", "drafter/initial_accept_rate/<task>"),
        and the seconds it took ("time_served_eval_s"). Empty with eval_rows 0."""
        held = self.buffer.num_rows_of_step(rl_step)
        if not self.config.eval_rows or not held:
            return {}
        t0 = time.perf_counter()
        rows = self.buffer.rows_of_step(rl_step, self.eval_batch_rows(held))
        out = self._evaluate(self._home, rows)
        if not out["count"]:  # no trained entry among the step's rows: nothing to score
            return {}
        initial = self._evaluate(self._home, rows, self._initial_params(self._home))
        by_pass = {f"drafter/served_{k}": v for k, v in out.items()
                   if k.startswith("accept_rate_pass") and out[f"count_pass{k.rsplit('pass', 1)[1]}"]}
        for task, task_rows in self._rows_by_task.items():
            for name, params in (("served", None), ("initial", self._initial_params(self._home))):
                scored = self._evaluate(self._home, task_rows, params)
                if scored["count"]:
                    by_pass[f"drafter/{name}_accept_rate/{task}"] = scored["accept_rate"]
        return {"drafter/served_accept_rate": out["accept_rate"], "drafter/served_top1_agree": out["top1_agree"],
                "drafter/served_kl": out["kl"], **by_pass,
                **{f"drafter/initial_{k}": initial[k] for k in ("accept_rate", "top1_agree", "kl")},
                "time_served_eval_s": time.perf_counter() - t0}

    def eval_batch_rows(self, held: int) -> int:
        """Rows `served_metrics` scores when the step's buffer holds `held`: all of them, up
        to eval_rows, padded to the home group's fsdp times a power of two (few shapes to
        compile; a row of padding costs as much as a row of data)."""
        return shape_bucket(held, self.config.eval_rows, unit=self._fsdp)

    @property
    def _fsdp(self) -> int:
        """Devices of the home group that a drafter batch is split over."""
        return self.engine.groups[self._home].mesh.shape["fsdp"]

    def _initial_params(self, group: int):
        """The starting drafter on the devices of rollout `group` (copied there once)."""
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

    def warm_up(self, max_rows_per_step: int) -> float:
        """Compiles the drafter step on its home group at each batch it can take (a
        throwaway copy of the state takes the steps) and the served drafter's evaluation at
        each batch it can score for a step of at most `max_rows_per_step` rows (a sample
        fills at most one), so that neither compiles inside an RL step; returns the seconds."""
        t0 = time.perf_counter()
        trainer = self._trainer(self._home)
        copy = jax.tree.map(jnp.copy, self.state)
        target = shared_target_params(self.engine.groups[self._home].params)
        for rows in sorted({self.train_batch_rows(held) for held in range(1, self.config.batch_size + 1)}):
            copy, _ = trainer.step(copy, target, self.buffer.empty_batch(rows), self._noise_key,
                                   anchor=self.engine.groups[self._home].drafter_params)
        jax.block_until_ready(copy)
        if self.config.eval_rows:
            for rows in sorted({self.eval_batch_rows(held) for held in range(1, max_rows_per_step + 1)}):
                self._evaluate(self._home, self.buffer.empty_batch(rows))
        return time.perf_counter() - t0

    def _state_shardings(self, trainer: DrafterTrainer) -> TrainState:
        return state_shardings(trainer.optimizer, self.state.params, trainer.drafter_shardings(self.state.params),
                               trainer.mesh)

    # -- to the engine

    def publish(self) -> bool:
        """Hands the engine the drafter in training if it changed since the last publish and
        every weight is finite (a non-finite drafter never reaches the engine); with
        publish_holdout, whichever of it, the served drafter and the run's starting one
        scores best on the step's held-out samples (ties: the served one), which then join
        the buffer. Returns whether the engine's drafter changed. Collective with several
        processes: process 0 decides."""
        self.publish_metrics = {}
        changed = self.steps != self._published_steps and self._finite()
        choice = "candidate" if changed else "served"
        if self._held is not None:
            rl_step, samples = self._held
            choice = self._best_on(self._rows_alone(rl_step, samples), changed)
            self.withheld += changed and choice != "candidate"
            self.buffer.add(rl_step, *samples[:7], observed_nT=samples[7])
            self._held = None
        choice = multihost.broadcast_object(choice)
        if choice == "served":
            return False
        self._serving_initial = choice == "initial"
        self.to_engine()
        if choice == "candidate":
            self._published_steps = self.steps
        self.version += 1
        return True

    def _best_on(self, rows: dict | None, candidate: bool) -> str:
        """"candidate" (the drafter in training; only if `candidate`), "served" or "initial"
        (the run's starting drafter, unless it is the served one): the one of the highest
        teacher-forced acceptance on `rows`, the served one on ties or when `rows` is None or
        holds no target. Their scores go to `publish_metrics`."""
        if rows is None:
            return "candidate" if candidate else "served"
        scores = {"served": self._evaluate(self._home, rows)}
        if not scores["served"]["count"]:
            return "candidate" if candidate else "served"
        if not self._serving_initial:
            scores["initial"] = self._evaluate(self._home, rows, self._initial_params(self._home))
        if candidate:
            scores["candidate"] = self._evaluate(self._home, rows, self.state.params)
        self.publish_metrics = {f"drafter/holdout_{name}_accept_rate": score["accept_rate"]
                                for name, score in scores.items()}
        return max(scores, key=lambda name: (scores[name]["accept_rate"], name == "served"))

    def _finite(self) -> bool:
        if bool(_all_finite(self.state.params)):
            return True
        logging.warning("Drafter weights are not finite after %d steps; keeping the published version %d.",
                        self.steps, self.version)
        return False

    def to_engine(self) -> None:
        """Hands the engine the drafter in training (after `restore`: the restored one), or
        the run's starting drafter while `publish` serves that one. Collective with several
        processes: every engine gets process 0's drafter, every process its counters."""
        # A copy: the engine must not alias the train state, which each step donates. On the
        # devices with one process (no host round trip of the weights each RL step); through
        # the host with several, where process 0's drafter goes to every process.
        if self._serving_initial:  # every process holds it
            params = _copy(self._initial_params(self._home))
        elif multihost.is_multiprocess():
            params = multihost.broadcast_arrays(jax.device_get(self.state.params))
        else:
            params = _copy(self.state.params)
        self.version, self.steps, self.skipped, self.withheld, self._published_steps = multihost.broadcast_object(
            (self.version, self.steps, self.skipped, self.withheld, self._published_steps))
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
        return ({"train": jax.device_get(self.state), "buffer": buffer},
                {"version": self.version, "steps": self.steps, "skipped": self.skipped, "withheld": self.withheld,
                 "serving_initial": self._serving_initial, "published_steps": self._published_steps,
                 "home": self._home, "buffer_shapes": shapes})

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
        tree, _ = ckpt.restore(step, target={"train": like_train, "buffer": like_buffer})
        self.state = tree["train"]
        self.buffer.load_state_dict(jax.tree.map(np.asarray, tree["buffer"]))
        self.version, self.steps, self.skipped = meta["version"], meta["steps"], meta["skipped"]
        # Absent from checkpoints written before publish_holdout.
        self.withheld, self._serving_initial = meta.get("withheld", 0), meta.get("serving_initial", False)
        self._published_steps = meta["published_steps"]


def _spread(n: int, k: int) -> list[int]:
    """k of the indices 0..n-1 (at least one, never all), spread evenly: every task and
    prompt of a step's samples, laid out in order, is held out alike."""
    k = min(max(k, 1), n - 1)
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64)).tolist()


@jax.jit
def _copy(tree):
    """A copy of every array of `tree` in one program (a `jnp.copy` per leaf is a dispatch each)."""
    return jax.tree.map(jnp.copy, tree)


@jax.jit
def _all_finite(tree) -> jax.Array:
    """Whether every element of every array in `tree` is finite: one program, one sync."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
