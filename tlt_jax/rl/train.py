"""The RL run of `configs/rl.py`: the model of model_dir, GRPO steps on the problems of
`data` in the model's prompt format, checkpoints, metrics, eval samples, plots.

Resuming: the checkpoint holds the train state (policy and optimizer), the reference
policy, the RNG key, the data position, the step, the config and, with partial rollouts,
the groups in flight (`carry.py`); a run killed at any point and started again with the
same run_dir continues exactly where the last good checkpoint left it.

Several processes (`jax.distributed`, the launchers' --coordinator_address, --num_processes
and --process_id): every process runs this same function. Each rollout group lies on one
process's devices (the mesh's data axis a multiple of the number of processes); the
learner and the checkpoints span them all (orbax writes each process's shards). Process 0
writes the metrics, plots, exports and the drafter's own checkpoints (its drafter trains
there). The checkpoint directory must be one filesystem that every process sees.
"""
from __future__ import annotations

import functools
import json
import os
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from tlt_jax import background, checkpoint, envs, fingerprint, launch, metrics, multihost, rewards, sampling, sharding
from tlt_jax.data import reasoning_gym_problems, sources
from tlt_jax.drafter_training import io as drafter_io
from tlt_jax.drafter_training.online import OnlineDrafter, OnlineDrafterConfig
from tlt_jax.drafter_training.spot import SpotConfig
from tlt_jax.models import drafter as drafter_lib
from tlt_jax.models.hf_io import load_hf, load_hf_config, save_hf
from tlt_jax.rl import grpo, off_policy
from tlt_jax.rl.carry import PartialConfig
from tlt_jax.rl.learner import Learner, LearnerConfig
from tlt_jax.rl.loop import RLLoop, RLStepConfig
from tlt_jax.rl.tlt import TLT
from tlt_jax.rollout import tuner as tuner_lib
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.tokenizer import end_token_ids, load_tokenizer
from tlt_jax.train_state import TrainState

_TIMING_KEYS = ("time_", "rollout_tokens_per_s", "rollout_group_idle_fraction", "wall_time", "tuner/", "spot/")
RESULT_FILENAME = "result.json"  # the summary of a finished run, returned again when it is run again
WARM_START_FIELD = "model_dir"  # the config field naming the starting checkpoint ("": train config.sft first)


def _check_warm_start(config, field: str = WARM_START_FIELD) -> None:
    if not config[field] and config.get("sft") is None:
        raise ValueError(f"--config.{field} is required: give a Hugging Face checkpoint directory (config.json, "
                         "*.safetensors and its tokenizer).")
    hint = (f"Or pass --config.{field}='' to train the warm start of --config.sft first."
            if config.get("sft") is not None else "")
    launch.check_path(config, field, hint=hint)


def _warm_start(config, field: str = WARM_START_FIELD):
    """(model config, params, tokenizer, path) of the starting checkpoint `config.<field>`;
    when the field is "" the warm start of `config.sft` is trained first into <run_dir>/sft
    (once)."""
    path = config[field]
    _check_warm_start(config, field)
    if not path:
        from tlt_jax.sft import train_sft
        config.sft.run_dir = os.path.join(config.run_dir, "sft")
        path = os.path.join(config.sft.run_dir, "hf")
        if not os.path.exists(os.path.join(path, "config.json")):
            metrics.report(f"--config.{field}='': training the warm start of --config.sft into {config.sft.run_dir}")
            train_sft(config.sft)
    model_cfg, params = load_hf(path)
    return model_cfg, params, load_tokenizer(path), path


def _drafter_warm_start(c, target_config, target_params):
    """(DrafterConfig, params) of the RL run's drafter: an offline export (`c.init`) or a
    fresh one of the configured architecture."""
    if c.init:
        try:
            return drafter_io.load_drafter(c.init, target_config,
                                           target_fingerprint=fingerprint.fingerprint_arrays(target_params))
        except ValueError as e:  # made for another target model
            raise ValueError(f"--config.tlt.drafter.init={c.init!r}: {e} Or set --config.tlt.drafter.init='' to "
                             "start the drafter from scratch.") from e
    dcfg = launch.config_dataclass(drafter_lib.DrafterConfig, c, "tlt.drafter", others=launch.ALL_OTHERS,
                                   feature_layers=tuple(c.feature_layers))
    dcfg.layer_config(target_config)  # feature layers outside the target fail here
    return dcfg, drafter_lib.init_drafter(target_config, dcfg, jax.random.PRNGKey(0))


_DRAFTER_ARCHITECTURE = ("init", "num_layers", "feature_layers", "layout")  # tlt.drafter keys of the drafter itself


def _online_drafter_config(c, max_prompt_length: int, max_tokens: int) -> OnlineDrafterConfig:
    if c.prompt_tail < -1:
        raise ValueError(f"tlt.drafter.prompt_tail={c.prompt_tail}: give the prompt tokens a drafter row "
                         "keeps, or -1 for the whole prompt (the default).")
    if c.seq_len < 0:
        raise ValueError(f"tlt.drafter.seq_len={c.seq_len}: give a drafter row's length in tokens, or 0 for "
                         "a whole sample (the default).")
    # -1: the whole prompt, which live drafting attends over; rows without it teach the
    # drafter a context it never drafts in (and score it there).
    prompt_tail = max_prompt_length - 1 if c.prompt_tail == -1 else c.prompt_tail
    # 0: rows as long as a whole sample. Shorter rows cut a long response's end off (the
    # buffer keeps a span's true prefix): the drafter never learns the positions the
    # rollout's tail drafts, and drafted worse there live than the one it started from.
    return launch.config_dataclass(OnlineDrafterConfig, c, "tlt.drafter", others=_DRAFTER_ARCHITECTURE,
                                   prompt_tail=prompt_tail, seq_len=c.seq_len or prompt_tail + 1 + max_tokens)


def _due(step: int, every: int, last: int) -> bool:
    return every > 0 and (step % every == 0 or step == last)


def _restore_drafter(drafter: OnlineDrafter, ckpt: checkpoint.Checkpointer, rl_step: int) -> None:
    """The newest drafter checkpoint not after the resumed RL step (a newer one belongs to
    steps that will run again)."""
    for step in reversed([s for s in ckpt.all_steps() if s <= rl_step]):
        try:
            drafter.restore(ckpt, step)
        except (checkpoint.CheckpointIntegrityError, FileNotFoundError) as e:  # a write the kill cut short
            logging.warning("Skipping drafter checkpoint %d: %s", step, e)
            continue
        logging.info("Restored the drafter of RL step %d (version %d)", step, drafter.version)
        return
    logging.warning("No usable drafter checkpoint up to RL step %d: the drafter restarts from its warm start.",
                    rl_step)


def _prefixed(prefix: str, build):
    """build(), with a ValueError's message prefixed by the config section it checks
    ("rollout." before a message that starts with the field's name)."""
    try:
        return build()
    except ValueError as e:
        if str(e).startswith(prefix):  # already named in full (`launch.config_dataclass`)
            raise
        raise ValueError(f"{prefix}{e}") from e


_SAMPLING_KEYS = ("temperature", "top_p", "max_tokens")  # the rollout section's keys of its sampling
_PARTIAL_KEYS = ("partial_share", "max_carry_steps")  # the rollout section's keys of partial rollouts (the RL step's)


def _rollout_config(r, **engine_fields) -> RolloutConfig:
    """The engine's RolloutConfig from the config's `rollout` section; `engine_fields` are
    what the run adds (the model's end tokens, the tuner's deepest strategy)."""
    return launch.config_dataclass(RolloutConfig, r, "rollout", others=_SAMPLING_KEYS + _PARTIAL_KEYS,
                                   max_length=r.max_prompt_length + r.max_tokens, **engine_fields)


def _sampling_params(r) -> sampling.SamplingParams:
    """The rollouts' sampling, from the config's `rollout` section."""
    return launch.config_dataclass(sampling.SamplingParams, r, "rollout", others=launch.ALL_OTHERS)


def _partial_config(config) -> PartialConfig:
    """Partial rollouts, from the rollout section's partial_share and max_carry_steps."""
    r = config.rollout
    return _prefixed("rollout.", lambda: PartialConfig(r.get("partial_share", 0.0), r.get("max_carry_steps", 2)))


def _check_partial(config) -> None:
    """What partial rollouts need of the rest of the config."""
    if not _partial_config(config).enabled:
        return
    share = f"rollout.partial_share={config.rollout.partial_share}"
    grpo.require_importance_weight(config.grpo.tis_cap, share)
    if envs.EnvConfig.from_config(config).name:
        raise ValueError(f"{share} takes single-turn rollouts; set rollout.partial_share=0 with env.name.")
    k = config.learner.num_minibatches
    if config.num_samples % k:
        raise ValueError(f"{share}: a step learns a varying number of whole groups, so learner.num_minibatches={k} "
                         f"must divide num_samples={config.num_samples}.")


def _learner_config(config) -> LearnerConfig:
    """The learner's config from the `learner` and `grpo` sections; its log-probs are those
    of the rollouts' temperature."""
    return launch.config_dataclass(LearnerConfig, config.learner, "learner", temperature=config.rollout.temperature,
                                   grpo=launch.config_dataclass(grpo.GRPOConfig, config.grpo, "grpo"))


def _step_config(config) -> RLStepConfig:
    """The RL step's config from the config's top-level fields."""
    return launch.config_dataclass(RLStepConfig, config, "", others=launch.ALL_OTHERS, reward=_step_reward(config),
                                   partial=_partial_config(config))


def _check_mesh(mesh_config) -> jax.sharding.Mesh:
    """The mesh fills every process's devices, and each rollout group (a slice of its data
    axis) lies on one process; returns it."""
    given = " ".join(f"mesh.{k}={v}" for k, v in mesh_config.items())
    processes = jax.process_count()
    where = f" ({processes} processes with {jax.local_device_count()} each)" if processes > 1 else ""
    try:
        mesh = sharding.make_mesh(mesh_config)
    except ValueError as e:
        raise ValueError(f"{given}: {str(e).rstrip('.')}{where}.") from e
    if processes > 1 and mesh.shape["data"] % processes:
        raise ValueError(f"{given}: the {mesh.shape['data']} rollout group(s) of the data axis must each lie on "
                         f"one process's devices{where}; make mesh.data a multiple of {processes}.")
    return mesh


def _wandb_config(config) -> metrics.WandbConfig:
    return launch.config_dataclass(metrics.WandbConfig, config.get("wandb"), "wandb")


def _spot_config(config) -> SpotConfig:
    return launch.config_dataclass(SpotConfig, config.tlt.spot, "tlt.spot")


def _step_reward(config):
    """The reward on each whole completion: config.reward, or none with an environment and reward=""."""
    if envs.EnvConfig.from_config(config).name and not config.reward:
        return envs.no_reward
    return rewards.reward_from_config(config)


def check_config(config) -> None:
    """Raises ValueError naming the field for settings that cannot run, and
    FileNotFoundError naming the flag for a given path that does not exist, before
    anything is loaded or written (the launcher calls it before touching the run directory)."""
    for name in ("steps", "eval_every", "checkpoint_every", "prompts_per_step", "num_samples"):
        if config[name] < 1:
            raise ValueError(f"{name}={config[name]} must be >= 1.")
    r = config.rollout
    _prefixed("rollout.", lambda: _sampling_params(r))
    _prefixed("rollout.", lambda: _rollout_config(r))
    _learner_config(config)
    _check_partial(config)
    off_policy.check_config(config)
    samples, k = config.prompts_per_step * config.num_samples, config.learner.num_minibatches
    if k < 1 or samples % k:
        raise ValueError(f"learner.num_minibatches={k} must divide the step's prompts_per_step x num_samples = "
                         f"{samples} samples.")
    if config.advantage not in grpo.ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage={config.advantage!r}; choose from {sorted(grpo.ADVANTAGE_ESTIMATORS)}.")
    env = envs.EnvConfig.from_config(config)
    env.check(r.max_tokens)
    if not (env.name and not config.reward):
        rewards.reward_from_config(config)  # a registered name or an importable module.path:function
        sources.check_reward(config.data, config.reward)
    if sources.kind(config.data) == "reasoning_gym":
        reasoning_gym_problems.parse_source(config.data.source)
    mesh = _check_mesh(config.mesh)
    _wandb_config(config).check()
    _check_warm_start(config)
    if config[WARM_START_FIELD]:  # the model and the data, read now so bad input fails before anything is written
        model_cfg = _prefixed(f"--config.{WARM_START_FIELD}={config[WARM_START_FIELD]!r}: ",
                              lambda: load_hf_config(config[WARM_START_FIELD]))
        seq_len = r.max_prompt_length + r.max_tokens
        if seq_len > model_cfg.max_position_embeddings:
            raise ValueError(f"rollout.max_prompt_length + rollout.max_tokens = {seq_len} is beyond the "
                             f"{model_cfg.max_position_embeddings} positions of --config.{WARM_START_FIELD}'s "
                             "model (max_position_embeddings); lower them.")
        sources.problems_for(config[WARM_START_FIELD], config.data, config.rollout.max_prompt_length)
    if not config.tlt.enabled:
        return
    tuner = tuner_lib.from_config(config.tlt.tuner)
    _spot_config(config)
    _online_drafter_config(config.tlt.drafter, config.rollout.max_prompt_length, config.rollout.max_tokens)
    c = config.tlt.drafter
    fsdp = mesh.shape["fsdp"]  # a rollout group's devices the drafter's batches split over
    for field, what in (("batch_size", "trains"), ("eval_rows", "is scored")):
        rows = c[field]
        if rows % fsdp:
            raise ValueError(f"tlt.drafter.{field}={rows} must be a multiple of mesh.fsdp={fsdp}: the drafter {what} "
                             "on a rollout group's devices, its batch split over their fsdp axis; make it "
                             f"{-(-rows // fsdp) * fsdp}.")
    if not c.init and c.num_layers < 1:
        raise ValueError(f"tlt.drafter.num_layers={c.num_layers}: a drafter needs at least one layer.")
    # A schedule the run cannot reach the end of never gives the learning rate it was set for.
    most = config.steps * config.tlt.spot.max_steps_per_rl_step
    o = c.optimizer
    length = o.warmup_steps + (o.decay_steps if o.schedule == "cosine" else 0)
    if length > most:
        field = "decay_steps" if o.schedule == "cosine" else "warmup_steps"
        raise ValueError(f"tlt.drafter.optimizer.{field}={o[field]}: the drafter's schedule runs {length} optimizer "
                         f"steps, more than the {most} this run can take (steps={config.steps} x "
                         f"tlt.spot.max_steps_per_rl_step={config.tlt.spot.max_steps_per_rl_step}); shorten it or "
                         "use schedule='constant'.")
    launch.check_path(config, "tlt.drafter.init", kind="directory",
                      hint="pass a drafter export (`python -m experiments.train_drafter` writes one), or set "
                           "--config.tlt.drafter.init='' to start the drafter from scratch.")
    if not tuner.strategies:
        logging.warning("tlt.tuner offers no drafting strategy: TLT will only train the drafter.")


def train_rl(config, *, progress: bool = True, stop_after: int | None = None) -> dict:
    """Runs (or resumes) the RL job; returns a summary with SFT and final eval accuracy.
    `stop_after` ends the process's work after that many steps (tests of resumption)."""
    check_config(config)
    run_dir = config.run_dir
    finished = recorded_result(run_dir, config.steps)
    if finished is not None:
        metrics.report(f"{run_dir} holds a finished run of {config.steps} steps; its recorded result follows "
                       "(a new run needs a new --config.run_dir, more steps a larger --config.steps).")
        _report_result(finished)
        return finished
    metrics.report(f"RL run in {run_dir}: {config.steps} steps, TLT {'on' if config.tlt.enabled else 'off'}, "
                   f"model {config[WARM_START_FIELD] or '(SFT trained first)'}")
    os.makedirs(run_dir, exist_ok=True)
    run = _Run(config)
    end = config.steps if stop_after is None else min(config.steps, run.start + stop_after)
    try:
        rollouts, last_eval = run.train(end, progress)
    finally:
        run.close()
    summary = run.finish(end, rollouts, last_eval)
    _report_result(summary)
    return summary


def _build_loop(config, model_cfg, params, tokenizer, problems, mesh) -> tuple[RLLoop, TrainState, Future]:
    """The run's RLLoop (engine, learner, TLT when enabled, data), the learner's initial
    train state, and the warm-up of plain decode's chunks under way (its result: seconds)."""
    r = config.rollout
    sp = _sampling_params(r)
    env = envs.EnvConfig.from_config(config)
    # The chunks the rollouts run: with an environment, its stop sequences, its token budget
    # and the multi-turn slots, so that warm_up compiles those and not others.
    rollout_sp = envs.rollout_sampling_params(envs.env_class(env.name), env, tokenizer, sp) if env.name else sp
    tlt_on = config.tlt.enabled
    tuner = tuner_lib.from_config(config.tlt.tuner) if tlt_on else None
    dcfg, dparams = _drafter_warm_start(config.tlt.drafter, model_cfg, params) if tlt_on else (None, None)
    depth = max([s.depth for s in tuner.strategies], default=1) if tlt_on else 8
    end_ids = end_token_ids(tokenizer, model_cfg.end_token_ids)
    engine = RolloutEngine(model_cfg, params, mesh, _rollout_config(r, eos_token_id=end_ids, max_draft_depth=depth),
                           dcfg, dparams)
    learner = Learner(model_cfg, _learner_config(config), mesh)
    state = learner.init_state(params)
    keep_reference = config.grpo.kl_coef > 0 or config.track_kl
    ref_params = jax.device_put(params, learner.param_shardings(params)) if keep_reference else None
    tlt = None
    if tlt_on:
        online = OnlineDrafter(engine, model_cfg, dcfg, dparams,
                               _online_drafter_config(config.tlt.drafter, r.max_prompt_length, r.max_tokens),
                               temperature=r.temperature, seed=config.seed)
        tlt = TLT(tuner, online, _spot_config(config))
        # Where the drafter trains; its buffer holds one row at most per sample of a step (with
        # partial rollouts, a step may learn the groups of max_carry_steps earlier steps too).
        partial = _partial_config(config)
        most = config.prompts_per_step * config.num_samples * (1 + partial.max_carry_steps * partial.enabled)
        if tlt.spot is not None:
            online.warm_up(most, background=bool(r.get("background_compiles", False)))
    # Plain decode's chunks (the baseline's too: neither mode pays a kv bucket's first compile
    # inside a timed rollout) compile and run on a thread of their own while the starting
    # checkpoint is evaluated (greedy: other programs); `_Run` waits for them before a step.
    decode = background.start(functools.partial(engine.warm_up, rollout_sp, tuner, turns=bool(env.name)),
                              "decode_warm_up", one_device=bool(r.get("background_compiles", False))
                              and all(g.mesh.devices.size == 1 for g in engine.local_groups))
    loop = RLLoop(engine=engine, learner=learner, tokenizer=tokenizer, train_examples=problems.train,
                  eval_examples=problems.eval, sampling_params=sp, step_config=_step_config(config),
                  seq_len=r.max_prompt_length + r.max_tokens, seed=config.seed, ref_params=ref_params, tlt=tlt,
                  prompt_format=problems.prompt_format,
                  correctness_reward=_step_reward(config) if env.name else
                  rewards.reward_from_config(config, sources.correctness_reward(config.data, config.reward)),
                  end_token_ids=end_ids, env=env)
    return loop, state, decode


class _Run:
    """One RL run between its start and its summary: the loop, the train state, the data
    position, the starting checkpoint's eval and the checkpointers, resumed from run_dir."""

    def __init__(self, config):
        self.config, run_dir = config, config.run_dir
        self.model_cfg, params, self.tokenizer, model_path = _warm_start(config)
        self.mesh = sharding.make_mesh(config.mesh)
        self.problems = sources.problems_for(model_path, config.data, config.rollout.max_prompt_length)
        dropped = {split: n for split, n in self.problems.dropped.items() if n}
        if dropped:
            counts = ", ".join(f"{n} of {split}" for split, n in dropped.items())
            metrics.report(f"Dropped prompts longer than rollout.max_prompt_length="
                           f"{config.rollout.max_prompt_length}: {counts}")
        self.loop, self.state, decode = _build_loop(config, self.model_cfg, params, self.tokenizer, self.problems,
                                                    self.mesh)
        self.tlt = self.loop.tlt
        self.ckpt = checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints"), max_to_keep=3)
        # The drafter's own checkpoints (trainable weights, optimizer, buffer), async, on their
        # cadence, written by the process where it trains.
        self.drafter_ckpt = (checkpoint.Checkpointer(os.path.join(run_dir, "drafter_checkpoints"), max_to_keep=2,
                                                     this_process_only=True)
                             if self.tlt is not None and self.tlt.spot is not None else None)
        self.start, self.data_position, self.sft_eval = 0, 0, None
        self._resume()
        self.writer = metrics.MetricsWriter(run_dir, resume_step=self.start, wandb=_wandb_config(config))
        if self.sft_eval is None:
            self._evaluate_start()
        self._report_warm_up(decode.result())

    def _report_warm_up(self, decode_s: float) -> None:
        line = f"Compiled plain decode in {decode_s:.1f} s"
        if self.tlt is not None:
            where = "on a thread " if self.config.rollout.get("background_compiles", False) else ""
            line += (f" (each of the {len(self.tlt.tuner.strategies)} drafting strategies compiles {where}when the "
                     "tuner first picks it; the drafter step in the background)")
        metrics.report(line)

    def _saved_tree(self) -> dict:
        # The key as one array of the mesh: each process holds its own copy of it.
        tree = {"train": self.state, "key": jax.device_put(np.asarray(self.loop.key), sharding.replicated(self.mesh))}
        if self.loop.ref_params is not None:
            tree["ref"] = self.loop.ref_params
        if self.loop.off_policy is not None:  # the engine's weights, one update behind the learner's
            tree["behaviour"] = self.loop.off_policy.behaviour(self.state.params)
        return tree

    def _resume(self) -> None:
        """The last good checkpoint's state, key, data position and starting eval, with the
        tuner's and drafter's, when run_dir holds one."""
        off_policy.check_resume(self.ckpt, self.config.get("off_policy_steps", 0))
        restored, meta = self.ckpt.resume(self._saved_tree())
        if not meta:
            return
        loop, tlt = self.loop, self.tlt
        self.state, loop.ref_params = restored["train"], restored.get("ref")
        loop.key = jnp.asarray(np.asarray(restored["key"]))
        self.start, self.data_position, self.sft_eval = meta["step"], meta["data_position"], meta["sft_eval"]
        if loop.off_policy is not None:
            loop.off_policy.restore(loop.engine, restored["behaviour"], meta["off_policy"])
        else:
            loop.engine.update_params(self.state.params)
        if loop.carry is not None:  # the samples in flight: a resume mid-carry goes on with them
            loop.carry.load_state_dict(meta.get("carry"))
        if tlt is not None and meta.get("tlt") is None:
            logging.warning("Resuming a run saved with TLT off: the tuner and drafter start fresh.")
        elif tlt is not None:
            tlt.load_state_dict(meta["tlt"])
            if self.drafter_ckpt is not None:
                _restore_drafter(tlt.drafter, self.drafter_ckpt, self.start)
            tlt.drafter.to_engine()
        metrics.report(f"Resumed {self.config.run_dir} at step {self.start} of {self.config.steps}")

    def _evaluate_start(self) -> None:
        self.sft_eval = self.loop.evaluate(0)
        self.writer.write(0, {k: self.sft_eval[k] for k in ("eval_accuracy", "eval_length_mean",
                                                             "eval_truncated_share")})
        self.writer.write_samples(0, self.loop.last_eval_samples)
        metrics.report(f"Starting checkpoint: eval accuracy {self.sft_eval['eval_accuracy']:.3f}, "
                       f"{self.sft_eval['eval_truncated_share']:.0%} cut off at max_tokens")

    def _save(self, step: int) -> None:
        with self.loop.gap("checkpoint"):
            self.ckpt.save(step, self._saved_tree(),
                           {"step": step, "data_position": self.data_position, "sft_eval": self.sft_eval,
                            "config": json.loads(self.config.to_json_best_effort()),
                            "tlt": self.tlt.state_dict() if self.tlt is not None else None,
                            "carry": self.loop.carry.state_dict() if self.loop.carry is not None else None,
                            "off_policy": None if self.loop.off_policy is None else self.loop.off_policy.state_dict()})

    def _save_drafter(self, step: int) -> None:
        tree, meta = self.tlt.drafter.checkpoint()  # before a gap lets it train
        with self.loop.gap("drafter_checkpoint"):
            self.drafter_ckpt.save(step, tree, meta)

    def train(self, end: int, progress: bool):
        """The steps from the resumed one up to `end`, each recorded, evaluated and
        checkpointed on its cadence; returns (the last step's rollouts, the last eval)."""
        config, loop = self.config, self.loop
        bar = metrics.ProgressBar(config.steps, ["reward_mean", "accuracy", "eval_accuracy"], initial=self.start,
                                  desc="rl", disable=not progress or not multihost.is_leader())
        rollouts, last_eval = None, None
        try:
            for step in range(self.start, end):
                self.state, record, self.data_position, rollouts = loop.step(self.state, step, self.data_position,
                                                                             last=step + 1 == end)
                if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
                    last_eval = loop.evaluate(step + 1, self.state.params)
                    record.update(last_eval)
                    self.writer.write_samples(step + 1, loop.last_eval_samples)
                self.writer.write(step + 1, record)
                bar.update(record)
                loop.check_finite(step + 1)
                if self.drafter_ckpt is not None and _due(step + 1, config.tlt.drafter.checkpoint_every,
                                                          config.steps):
                    self._save_drafter(step + 1)
                if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
                    self._save(step + 1)
        finally:
            bar.close()
        return rollouts, last_eval

    def close(self) -> None:
        self.ckpt.wait()
        self.ckpt.close()
        if self.drafter_ckpt is not None:
            self.drafter_ckpt.close()
        self.writer.close()
        self.loop.close()

    def finish(self, end: int, rollouts, last_eval: dict | None) -> dict:
        """Plots, exports (the policy, the drafter) and the run's summary, recorded in
        result.json once the last step is done."""
        config, run_dir, tlt = self.config, self.config.run_dir, self.tlt
        leader = multihost.is_leader()  # it writes the metrics, plots and result
        records = metrics.read_metrics(os.path.join(run_dir, "metrics.jsonl")) if leader else []
        if leader:
            _plot(run_dir, records, rollouts, end, tlt is not None)
        if end == config.steps and (config.save_hf or tlt is not None):
            self._export(end)
        # A run resumed at its last step evaluates nothing: its final eval is on record.
        final_eval = last_eval or next((r for r in reversed(records) if r["step"] == end and "eval_accuracy" in r),
                                       {})
        summary = {"steps": end, "sft_eval_accuracy": self.sft_eval["eval_accuracy"],
                   "final_eval_accuracy": final_eval.get("eval_accuracy"),
                   "final_eval_truncated_share": final_eval.get("eval_truncated_share"),
                   "dropped_prompts": self.problems.dropped,
                   "nonfinite_steps": self.loop.nonfinite_steps, "reward_failures": self.loop.reward_failures,
                   "run_dir": run_dir}
        if tlt is not None:
            summary["tlt"] = tlt_summary(records, tlt.drafter.version)
        if leader:
            summary = launch.with_config_changes(run_dir, summary)
        summary = multihost.broadcast_object(summary)  # process 0 read the records
        if end == config.steps and leader:
            metrics.write_json(os.path.join(run_dir, RESULT_FILENAME), summary)
        return summary

    def _export(self, end: int) -> None:
        """The trained policy as a Hugging Face checkpoint (save_hf) and, with TLT, the
        trained drafter, a free by-product, as an export that decodes on its own
        (`experiments.generate --target=<run_dir>/hf --drafter=<run_dir>/drafter`)."""
        run_dir = self.config.run_dir
        policy = jax.tree.map(sharding.to_host, self.state.params)  # gathered from every process
        if self.config.save_hf:
            save_hf(os.path.join(run_dir, "hf"), self.model_cfg, policy, tokenizer=self.tokenizer, overwrite=True)
        if self.tlt is not None:  # it trained on process 0
            drafter = self.tlt.drafter
            drafter_params = multihost.broadcast_arrays(jax.device_get(drafter.state.params))
            drafter_io.save_drafter(os.path.join(run_dir, "drafter"), drafter_params, drafter.drafter_config,
                                    self.model_cfg, fingerprint.fingerprint_arrays(policy), step=end)


def _plot(run_dir: str, records, rollouts, end: int, tlt_on: bool) -> None:
    """The run's plots, from its metrics records and the last step's rollouts."""
    metrics.plot_curves(records, ["reward_mean", "accuracy", "eval_accuracy"], os.path.join(run_dir, "reward.png"),
                        title=f"GRPO reward and accuracy ({run_dir})", bounds={"reward_mean": rewards.SCORE_RANGE})
    metrics.plot_time_split([r for r in records if "time_rollout_s" in r],
                            ["time_rollout_s", "time_reward_s", "time_learner_s", "time_weight_sync_s"],
                            os.path.join(run_dir, "time_split.png"), title="Where each RL step's time went")
    if rollouts is not None:
        metrics.plot_length_histogram(rollouts.lengths, os.path.join(run_dir, "response_lengths.png"),
                                      title=f"Response lengths of RL step {end} (n={len(rollouts.lengths)})")
        metrics.plot_rollout_timeline(rollouts.timeline, os.path.join(run_dir, "rollout_timeline.png"),
                                      title=f"Rollout of RL step {end}")
    if tlt_on:
        metrics.plot_curves(records, ["acceptance_length", "drafter/served_accept_rate", "drafter/initial_accept_rate",
                                      "policy_kl_from_start", "speculative_token_share", "rollout_tokens_per_s",
                                      "drafter_version", "spot/steps", "spot/hidden_share"],
                            os.path.join(run_dir, "tlt.png"), title="TLT: speculation and the spot-trained drafter")
        tuner_lib.plot_arm_choices([r for r in records if any(k.startswith("tuner/") for k in r)],
                                   os.path.join(run_dir, "tuner_arms.png"))


def recorded_result(run_dir: str, steps: int) -> dict | None:
    """The recorded summary of a run in run_dir that finished `steps` steps, else None."""
    path = os.path.join(run_dir, RESULT_FILENAME)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        result = json.load(f)
    return result if result.get("steps") == steps else None


def _report_result(summary: dict) -> None:
    final = summary["final_eval_accuracy"]
    line = (f"Eval accuracy {'n/a' if final is None else f'{final:.3f}'} after {summary['steps']} steps "
            f"(SFT checkpoint {summary['sft_eval_accuracy']:.3f})")
    if "tlt" in summary:
        t = summary["tlt"]
        line += (f"; TLT: {t['speculative_token_share']:.0%} of rollout tokens speculative, mean acceptance "
                 f"length {t['acceptance_length_mean']:.2f}, drafter version {t['drafter_version']}, "
                 f"{t['rollout_tokens_per_s_median']:.0f} rollout tokens/s")
    line += launch.describe_config_changes(summary.get("config_changes"))
    metrics.report(line + f". Metrics, plots and exports in {summary['run_dir']}")


def tlt_summary(records, drafter_version: int) -> dict:
    """What TLT did over the run's steps: mean acceptance length of the speculative steps,
    the share of rollout tokens committed speculatively, the drafter version reached and
    the median rollout throughput."""
    steps = [r for r in records if "rollout_tokens" in r]
    tokens = sum(r["rollout_tokens"] for r in steps)
    spec_tokens = sum(r["speculative_token_share"] * r["rollout_tokens"] for r in steps)
    accepted = [r["acceptance_length"] for r in steps if r["acceptance_length"] > 0]
    return {"acceptance_length_mean": float(np.mean(accepted)) if accepted else 0.0,
            "speculative_token_share": spec_tokens / max(tokens, 1), "drafter_version": drafter_version,
            "rollout_tokens_per_s_median": float(np.median([r["rollout_tokens_per_s"] for r in steps]))
            if steps else 0.0}


def learning_metrics(record: dict) -> dict:
    """A metrics record without wall-clock timings: what must match after a resume."""
    return {k: v for k, v in record.items() if not k.startswith(_TIMING_KEYS)}
