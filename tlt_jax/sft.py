"""Supervised warm start on solution traces: cross-entropy through the blockwise log-prob
(no [tokens, vocab] logits), on the same mesh and train state as every other trainer."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from tlt_jax import checkpoint, evaluation, launch, metrics, rewards, sampling, sharding
from tlt_jax.data import sources, tasks
from tlt_jax.data.packing import batch_indices, pack_examples
from tlt_jax.logprobs import token_logprobs
from tlt_jax.models import transformer as tfm
from tlt_jax.models.config import ModelConfig, from_config_dict
from tlt_jax.models.hf_io import load_hf, load_hf_config, save_hf
from tlt_jax.rollout.engine import RolloutConfig, RolloutEngine
from tlt_jax.tokenizer import end_token_ids, load_tokenizer
from tlt_jax.train_state import (
    OptimizerConfig,
    TrainState,
    init_train_state,
    jit_train_step,
    make_optimizer,
    run_steps,
    state_shardings,
)


class SFTTrainer:
    def __init__(self, model_config: ModelConfig, optimizer_config: OptimizerConfig, mesh, *, remat=False,
                 logprob_impl="auto"):
        self.model_config, self.mesh = model_config, mesh
        self.optimizer = make_optimizer(optimizer_config)
        self.remat, self.logprob_impl = remat, logprob_impl
        self._step = None

    def init_state(self, params) -> TrainState:
        return init_train_state(self.optimizer, params, tfm.param_shardings(self.model_config, params, self.mesh),
                                self.mesh)

    def loss(self, params, batch):
        """Mean negative log-likelihood of the masked targets of a packed batch."""
        logp = token_logprobs(params, self.model_config, batch["tokens"], positions_nT=batch["positions"],
                              segment_ids_nT=batch["segment_ids"], impl=self.logprob_impl, remat=self.remat)
        return -jnp.sum(logp * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1)

    def step(self, state: TrainState, batch: dict):
        """One update from a `pack_examples` batch; returns (state, metrics)."""
        if self._step is None:
            st_sh = state_shardings(self.optimizer, state.params,
                                    tfm.param_shardings(self.model_config, state.params, self.mesh), self.mesh)
            self._step = jit_train_step(self.loss, self.optimizer, st_sh,
                                        {k: sharding.batch_sharding(self.mesh, 2) for k in batch}, self.mesh)
        return self._step(state, batch)


def check_config(config) -> None:
    """Raises (naming the field) before anything is written: a given model_dir that is not
    a checkpoint with its tokenizer, a model type we do not support, bad data (missing
    files or fields, no prompt that fits eval.max_prompt_length), an unknown reward."""
    launch.check_path(config, "model_dir")
    if config.get("reward"):
        rewards.reward_from_config(config)
    if config.get("model_dir"):
        try:
            load_hf_config(config.model_dir)
        except ValueError as e:  # an architecture we do not support
            raise ValueError(f"--config.model_dir={config.model_dir!r}: {e}") from e
        sources.problems_for(config.model_dir, config.data, config.eval.max_prompt_length)
    elif sources.kind(config.data) != "tasks":
        raise ValueError(f"data.source={config.data.source!r} needs a model with its tokenizer: set "
                         "--config.model_dir to a Hugging Face checkpoint.")


def _start(config, run_dir: str):
    """(model config, params, tokenizer): the checkpoint of `model_dir`, or, with model_dir
    empty, a model of `config.model` from random weights with the synthetic tasks' tokenizer."""
    if config.get("model_dir"):
        model_cfg, params = load_hf(config.model_dir)
        return model_cfg, params, load_tokenizer(config.model_dir)
    tokenizer = tasks.build_task_tokenizer(os.path.join(run_dir, "tokenizer"))
    model_cfg = from_config_dict(config.model).replace(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return model_cfg, tfm.init_params(model_cfg, jax.random.PRNGKey(config.seed)), tokenizer


def train_sft(config, *, progress: bool = True) -> dict:
    """The SFT job of `configs/sft.py`: starts from `model_dir` (or random weights on the
    synthetic tasks), trains on the solutions of `data` (any source: `data.sources`) in
    the model's prompt format, evaluates by sampling, checkpoints with orbax (resuming when
    run again) and writes the final model in the Hugging Face format to <run_dir>/hf.
    Returns the final metrics."""
    check_config(config)
    run_dir = config.run_dir
    os.makedirs(run_dir, exist_ok=True)
    model_cfg, params, tokenizer = _start(config, run_dir)
    mesh = sharding.make_mesh(config.mesh)
    max_prompt = config.eval.max_prompt_length
    problems = (sources.problems_for(config.model_dir, config.data, max_prompt) if config.get("model_dir") else
                sources.load_problems(config.data, tokenizer=tokenizer, max_prompt_length=max_prompt))
    end_ids = end_token_ids(tokenizer, model_cfg.end_token_ids)
    train = pack_examples(tokenizer, problems.train, config.data.seq_len, problems.prompt_format, end_ids[0])
    trainer = SFTTrainer(model_cfg, OptimizerConfig(**config.optimizer), mesh)
    state = trainer.init_state(params)
    ckpt = checkpoint.Checkpointer(os.path.join(run_dir, "checkpoints"), max_to_keep=2)
    state, meta = ckpt.resume(state)
    start = meta["step"] if meta else 0
    writer = metrics.MetricsWriter(run_dir, resume_step=start)
    engine = RolloutEngine(model_cfg, state.params, mesh, RolloutConfig(
        num_slots=config.eval.num_slots, max_prompt_length=config.eval.max_prompt_length,
        max_length=config.data.seq_len, steps_per_sync=16, eos_token_id=end_ids))
    greedy = sampling.SamplingParams(temperature=0.0, max_tokens=config.data.seq_len)
    reward = rewards.reward_from_config(config, sources.correctness_reward(
        config.data, config.get("reward") or sources.default_reward(config.data)))

    def run_eval(state, step):
        engine.update_params(state.params)
        result, samples = evaluation.evaluate_samples(engine, tokenizer, problems.eval, greedy,
                                                      jax.random.PRNGKey(step), reward=reward,
                                                      prompt_format=problems.prompt_format, end_token_ids=end_ids)
        writer.write_samples(step, samples)
        return {f"eval_{k}": v for k, v in result.items()}

    def step_fn(state, step):
        idx = batch_indices(step, config.batch_size, len(train["tokens"]), config.seed)
        state, out = trainer.step(state, {k: v[idx] for k, v in train.items()})
        return state, {k: float(v) for k, v in jax.device_get(out).items()}

    bar = metrics.ProgressBar(config.steps, ["loss", "eval_accuracy"], initial=start, desc="sft", disable=not progress)
    state, record, _ = run_steps(state, start=start, steps=config.steps, step_fn=step_fn, eval_fn=run_eval,
                                 eval_every=config.eval_every, checkpoint_every=config.checkpoint_every, ckpt=ckpt,
                                 writer=writer, bar=bar)
    save_hf(os.path.join(run_dir, "hf"), model_cfg, jax.device_get(state.params), tokenizer=tokenizer, overwrite=True)
    records = metrics.read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    metrics.plot_curves(records, ["loss", "eval_accuracy"], os.path.join(run_dir, "sft_curves.png"),
                        title=f"SFT ({run_dir})")
    return record
