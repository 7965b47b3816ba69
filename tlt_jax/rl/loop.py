"""One RL step end to end, and the run around it.

    prompts --> rollout engine (G samples each) --> rewards on the host
            --> learner: log-probs at the start of the step (+ reference), GRPO updates
            --> new weights to the rollout engine

`RLLoop.step` runs it as named phases (rollout, score, advantages, batch, learn, drafter,
sync), methods that return small dataclasses (`StepRollout`, `StepScores`,
`StepLearning`, `StepSync`), timed by one span helper (`Spans`); `step_metrics` makes the
step's record from those in one place. The learner's jitted steps stay pure functions of
the train state and the batch.

Every step records its time split (rollout per group, reward, learner, weight sync) and
the rollout's long-tail losses (group idle, slot idle): the numbers speculation and spot
training attack. Randomness and data are functions of (seed, step), and the checkpoint
holds everything else, so a run killed and resumed continues exactly.

With several processes every process runs each step on the same host data: the engine
hands every process all samples, rewards are process 0's, batches are built on each host
and enter the learner as arrays over all devices, and what the host reads back (old
log-probs, the drafter's data) is gathered from every process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax import envs, evaluation, faults, fingerprint, multihost, rewards, sampling, sharding
from tlt_jax.data import tasks
from tlt_jax.data.packing import Packing, pack_spans
from tlt_jax.data.prompts import PromptFormat
from tlt_jax.drafter_training.online import DrafterData
from tlt_jax.rl import grpo
from tlt_jax.rl.carry import STREAM as _PARTIAL_STREAM
from tlt_jax.rl.carry import Carry, PartialConfig
from tlt_jax.rl.learner import Learner
from tlt_jax.rl.off_policy import OneStepOff, check_steps
from tlt_jax.rl.tlt import TLT
from tlt_jax.rollout.engine import RolloutEngine, Rollouts
from tlt_jax.rollout.timeline import ROLLOUT_PARTS
from tlt_jax.train_state import TrainState

_EVAL_STREAM = 0x7FFFFFFF  # evaluation samples from its own key stream


class TooManyNonFiniteSteps(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class RLStepConfig:
    prompts_per_step: int = 8
    num_samples: int = 8  # G, answers per prompt
    advantage: str = "grpo"
    reward: str | rewards.RewardFn = "task"  # a name, or a reward with its options (rewards.reward_from_config)
    reward_workers: int = 0  # > 0: score in a process pool (slow reward functions)
    # A batch not scored by then (with overlap: after the rollout) scores 0, counted (0: no deadline).
    reward_timeout_s: float = 600.0
    # Score each sample as it finishes, while the rest decode (`rewards.PendingBatch`): the same
    # rewards as scoring the batch after the rollout, for a reward that scores each sample
    # on its own (every registered one); False for a reward that reads the whole batch.
    reward_overlap: bool = True
    max_consecutive_skips: int = 3
    # Each epoch's order takes the tasks in turn (each task's examples shuffled), so that a
    # step of k >= T prompts holds every one of the T tasks (a shorter task's examples
    # recur within the epoch); False: one shuffle of all examples.
    balance_tasks: bool = False
    # Partial rollouts (`carry.py`): a step stops its rollout once partial.share of its samples
    # finished and carries the rest over; share 0 (the default): every step waits for all.
    partial: PartialConfig = PartialConfig()
    # One-step-off (`off_policy.py`): 1 learns each step's samples drawn by the policy one
    # update older than the learner's; 0 (the default): synchronous steps.
    off_policy_steps: int = 0

    def __post_init__(self):
        check_steps(self.off_policy_steps)


def build_batch(prompt_ids: Sequence[Sequence[int]], rollouts: Rollouts, advantages_n: np.ndarray, seq_len: int,
                pad_id: int, *, num_minibatches: int = 1,
                minibatch_rows: Callable[[int], int] = lambda rows: rows) -> tuple[dict, Packing]:
    """The learner batch of packed rows (fields: learner.py) and where each sample went.

    The n samples (prompt then answer) split in order into num_minibatches equal parts,
    the learner's minibatches, as in a layout of one sample per row; each part is packed
    greedily into rows of seq_len tokens (`packing.pack_spans`, the project's one packing
    rule) and padded with empty rows (segment 0, loss mask False) to
    R = minibatch_rows(most rows a part needs) (`Learner.minibatch_rows`: bucketed, so
    that the compiled shapes stay few). The batch has num_minibatches * R rows, and the
    learner's minibatch i holds exactly the samples of part i. Returns (batch, packing):
    packing places sample i (in rollout order) in the batch's rows (`unpack_samples`).
    Multi-turn samples (`rollouts.observation_mask`): observation tokens are context, never
    actions: off the loss mask, with advantage 0.
    """
    n, k = len(rollouts), num_minibatches
    if n % k:
        raise ValueError(f"{n} samples do not split into {k} minibatches.")
    prompts = [np.asarray(prompt_ids[i], np.int32) for i in rollouts.prompt_index]
    lengths = np.asarray([len(p) + len(a) for p, a in zip(prompts, rollouts.tokens)], np.int64)
    if np.any(lengths > seq_len):
        i = int(np.argmax(lengths > seq_len))
        raise ValueError(f"Prompt ({len(prompts[i])}) plus answer ({len(rollouts.tokens[i])}) exceed the learner's "
                         f"seq_len={seq_len}.")
    parts = [pack_spans(part, seq_len) for part in np.split(lengths, k)]
    rows = minibatch_rows(max(p.num_rows for p in parts))
    packing = Packing(seq_len, lengths, np.concatenate([p.row_N + m * rows for m, p in enumerate(parts)]),
                      np.concatenate([p.offset_N for p in parts]), np.concatenate([p.segment_N for p in parts]),
                      k * rows)
    actions = [np.ones(len(a), bool) for a in rollouts.tokens] if rollouts.observation_mask is None else \
        [~np.asarray(m, bool) for m in rollouts.observation_mask]
    fields = packing.rows([np.concatenate([p, a]) for p, a in zip(prompts, rollouts.tokens)],
                          [np.concatenate([np.zeros(len(p), bool), act]) for p, act in zip(prompts, actions)],
                          pad_id=pad_id)
    # Per-token values, shifted by one: position t carries those of the token it predicts.
    per_token = lambda values: packing.scatter(
        [np.concatenate([np.zeros(len(p), np.float32), v]) for p, v in zip(prompts, values)], np.float32)[:, 1:]
    advantages_n = np.asarray(advantages_n, np.float32)
    batch = dict(tokens=fields["tokens"], positions=fields["positions"], segment_ids=fields["segment_ids"],
                 loss_mask=fields["mask"], rollout_logp=per_token(rollouts.logprobs),
                 advantages=per_token([np.where(act, adv, 0.0).astype(np.float32)
                                       for act, adv in zip(actions, advantages_n)]))
    return batch, packing


def observed_tokens(rollouts: Rollouts, prompt_lengths_n, width: int) -> np.ndarray | None:
    """bool [n, width]: True at each sample's observation tokens, in the layout of
    `unpack_samples` (prompt then transcript from column 0); None for single-turn rollouts."""
    if rollouts.observation_mask is None:
        return None
    out = np.zeros((len(rollouts), width), bool)
    for i, (p, observed) in enumerate(zip(prompt_lengths_n, rollouts.observation_mask)):
        out[i, p:p + len(observed)] = observed
    return out


def unpack_samples(packing: Packing, x_R, width: int, fill=0) -> np.ndarray:
    """The inverse of `Packing.scatter`: [n, width, ...] numpy, row i sample i's entries
    x_R[row_i, offset_i : offset_i + length_i] from column 0, as many as x_R's columns and
    width hold; `fill` elsewhere. x_R [R, S', ...]: per column of the packed rows (S' may
    be S - 1, the positions that predict a next token)."""
    x_R = np.asarray(x_R)
    n, cols = len(packing.lengths_N), np.arange(width)
    src = packing.offset_N[:, None] + cols
    valid = (cols < packing.lengths_N[:, None]) & (src < x_R.shape[1]) & (packing.row_N[:, None] >= 0)
    out = np.full((n, width, *x_R.shape[2:]), fill, x_R.dtype)
    sample, col = np.nonzero(valid)
    out[sample, col] = x_R[packing.row_N[sample], src[sample, col]]
    return out


def unpack_drafter_data(packing: Packing, data: DrafterData) -> DrafterData:
    """The learner's DrafterData of packed rows [R, S-1, ...] as one sample per
    row [n, S-1, ...] (numpy): the layout `OnlineDrafter.add` reads, with the tokens
    `unpack_samples(packing, batch["tokens"], S, pad_id)`. Equal to the pass over one
    sample per row at every position of each sample but its last (see DrafterData)."""
    host = jax.tree.map(sharding.to_host, data)  # gathered from every process when it spans several
    width = packing.seq_len - 1
    unpack = lambda x: None if x is None else unpack_samples(packing, x, width)
    return DrafterData(unpack(host.hidden), unpack(host.ids), unpack(host.logp), unpack(host.layers))


class Spans:
    """Wall-clock seconds of the named spans of one RL step: `with spans(name):` times a
    span (a name timed twice adds up), `end(name)` records the seconds since the Spans
    began."""

    def __init__(self):
        self._start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def end(self, name: str) -> None:
        self.seconds[name] = time.perf_counter() - self._start


@dataclasses.dataclass(frozen=True)
class StepRollout:
    """The rollout phase: the step's prompts and their samples."""

    examples: list[tasks.Example]  # the step's prompts; sample i is of examples[rollouts.prompt_index[i]]
    prompt_ids: list  # each prompt's tokens, as the engine read them
    episodes: envs.Episodes | None  # the samples' environments (multi-turn), else None
    rollouts: Rollouts
    scoring: rewards.PendingBatch | None  # with reward_overlap: the samples scored as they finished
    completions: dict[int, str]  # the decoded completions of the samples handed to `scoring`, by index
    fresh_prompts: int  # the prompts the step took from the train stream
    # Partial rollouts and one-step-off: what was carried, the learned tokens' ages.
    carry_metrics: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepScores:
    """The score phase: every sample's reward, process 0's on every process."""

    tasks_n: list[str]  # each sample's task
    reward_n: np.ndarray  # [n] float32; 0 where scoring failed
    correct_n: np.ndarray  # [n] the correctness reward (`RLLoop.correctness_reward`), or reward > 0 with an env
    failures: int  # samples scored 0 because their reward (or environment) failed
    timed_out: int  # of those, the samples past the reward's deadline
    forgeable: int  # samples with tests only the program's own interpreter could decide (code reward)
    scoring_s: float  # seconds the reward ran, summed over its calls


@dataclasses.dataclass(frozen=True)
class StepLearning:
    """The learn phase: the state after the step's GRPO updates and what their forward gave."""

    state: TrainState
    updates: list[dict]  # per update, host floats: loss, grad_norm, clip_fraction, rollout_logp_gap, skipped[, kl]
    skipped: int  # updates skipped for a non-finite loss or gradient
    entropy: jax.Array  # [R, S-1] per-token entropy of the policy at the step's start, on the batch's rows
    drafter_data: DrafterData | None  # the drafter's data from the same forward (None without a drafter)


@dataclasses.dataclass(frozen=True)
class StepSync:
    """The sync phase: what TLT reported at the step's end (tuner, spot trainer, drafter)."""

    tlt_metrics: dict


def step_metrics(rollout: StepRollout, scores: StepScores, learned: StepLearning, loss_mask: np.ndarray,
                 synced: StepSync, spans: Spans) -> dict:
    """One RL step's metrics record (metrics.jsonl, TensorBoard, plots), from the phases'
    results and the spans that timed them."""
    rollouts, updates, seconds = rollout.rollouts, learned.updates, spans.seconds
    lengths, timeline, last = rollouts.lengths, rollouts.timeline.summary(), updates[-1]
    reward, correct = scores.reward_n, scores.correct_n
    metrics = {
        "reward_mean": float(reward.mean()), "reward_std": float(reward.std()),
        "accuracy": float(correct.mean()),
        **evaluation.accuracy_by_task(scores.tasks_n, correct),
        "response_length_mean": float(lengths.mean()), "response_length_p50": float(np.percentile(lengths, 50)),
        "response_length_p90": float(np.percentile(lengths, 90)), "response_length_max": int(lengths.max()),
        # Which samples the step drew: equal across runs that drew the same tokens (coupled
        # speculation, `rollout.spec_coupled`, makes runs with different drafters do so).
        "samples_digest": fingerprint.digest_sequences(rollouts.tokens),
        "entropy": float((sharding.to_host(learned.entropy) * loss_mask).sum() / max(loss_mask.sum(), 1)),
        "loss": float(np.mean([u["loss"] for u in updates])), "grad_norm": float(last["grad_norm"]),
        "clip_fraction": float(np.mean([u["clip_fraction"] for u in updates])),
        "rollout_logp_gap": float(np.mean([u["rollout_logp_gap"] for u in updates])),
        "kl": float(np.mean([u["kl"] for u in updates])) if "kl" in last else 0.0,
        # How far the policy has moved: the first update's forward is the policy as the step
        # starts, on the step's own response tokens (what the drafter must draft for).
        **({"policy_kl_from_start": float(updates[0]["kl"])} if "kl" in last else {}),
        "skipped_updates": learned.skipped, "reward_failures": scores.failures, "reward_timeouts": scores.timed_out,
        "code_forgeable_share": scores.forgeable / len(rollouts),
        "time_rollout_s": seconds["rollout"], "time_reward_s": seconds["reward"],
        # Of time_reward_s, the wait on the scorer; beside the seconds the reward ran in all,
        # most of them hidden in the rollout with reward_overlap.
        "time_reward_wait_s": seconds["reward_wait"], "time_reward_scoring_s": scores.scoring_s,
        "time_batch_s": seconds["batch"], "time_ref_logp_s": seconds["ref_logp"],
        "time_old_logp_s": seconds.get("old_logp", 0.0),  # 0 where the update's own forward gives them
        "time_learner_s": seconds["learner"], "time_weight_sync_s": seconds["weight_sync"],
        "time_tlt_end_s": seconds["tlt_end"], "time_step_s": seconds["step"],
        "time_idle_s": timeline["group_idle_s"],
        # The rollout's wall by part, summed over groups: decode chunks, prefill, harvest,
        # and the host's other time between chunks.
        **{f"time_rollout_{part}_s": timeline[f"{part}_s"] for part in ROLLOUT_PARTS},
        "rollout_group_idle_fraction": timeline["group_idle_fraction"],
        "rollout_slot_idle_fraction": timeline["slot_idle_fraction"],
        "rollout_tokens_per_s": timeline["tokens_per_s"],
        "rollout_tokens": timeline["tokens"],
        "acceptance_length": timeline["acceptance_length"],
        "speculative_token_share": timeline["speculative_tokens"] / max(timeline["tokens"], 1),
        **{f"accept_depth_{d}": rate for d, rate in enumerate(rollouts.timeline.acceptance_by_depth(), 1)
           if rate is not None},
        **synced.tlt_metrics,
        **rollout.carry_metrics,
    }
    if rollout.episodes is not None:  # environment time, failures, turns per sample; observations' share
        observed = sum(int(np.sum(m)) for m in rollouts.observation_mask)
        metrics.update(rollout.episodes.metrics(), observation_token_share=observed / max(int(lengths.sum()), 1))
    for g in rollouts.timeline.groups:
        metrics[f"time_rollout_group{g.group}_s"] = g.end - g.start
    return metrics


class RLLoop:
    """Owns the engine, the learner and the data of one run; `step` does one RL step."""

    def __init__(self, *, engine: RolloutEngine, learner: Learner, tokenizer, train_examples: Sequence[tasks.Example],
                 eval_examples: Sequence[tasks.Example], sampling_params: sampling.SamplingParams,
                 step_config: RLStepConfig, seq_len: int, seed: int, ref_params=None, tlt: TLT | None = None,
                 prompt_format: PromptFormat | None = None,
                 correctness_reward: str | rewards.RewardFn = "answer_correctness",
                 end_token_ids: Sequence[int] | None = None, env: envs.EnvConfig | None = None):
        """train_examples / eval_examples: any sequences (a dataset from disk makes its
        examples on access); prompt_format: how a prompt becomes the engine's tokens;
        correctness_reward: the reward whose mean is `accuracy` and `eval_accuracy`;
        end_token_ids: the model's end tokens (default the tokenizer's eos); env: with a
        name, multi-turn rollouts (`envs`): each sample's reward is its environment's
        step rewards summed plus the step's reward on the whole transcript."""
        self.engine, self.learner, self.tokenizer = engine, learner, tokenizer
        self.tlt = tlt  # None: the baseline (plain rollouts, no drafter)
        self.train_examples, self.eval_examples = train_examples, eval_examples
        self.prompt_format, self.correctness_reward = prompt_format or PromptFormat(), correctness_reward
        self.end_token_ids = tuple(end_token_ids) if end_token_ids is not None else (tokenizer.eos_token_id,)
        self.env = env if env is not None and env.name else None
        self.env_class = envs.env_class(self.env.name) if self.env is not None else None
        self.last_eval_samples: list[dict] = []  # the records of the latest `evaluate`
        self._epoch_order: tuple[int, np.ndarray] | None = None
        self.sampling_params, self.config, self.seq_len, self.seed = sampling_params, step_config, seq_len, seed
        self.ref_params = ref_params
        self.key = jax.random.PRNGKey(seed)  # checkpointed; every step's randomness derives from it
        self.consecutive_skips = 0
        self.nonfinite_steps = 0
        self.reward_failures = 0
        # The groups in flight across steps (partial rollouts), checkpointed with the run.
        self.carry = Carry(step_config.partial, step_config.prompts_per_step, step_config.num_samples) \
            if step_config.partial.enabled else None
        # One-step-off: the engine's weights, one update behind the learner's, checkpointed with
        # the run; the next step's rollout overlaps the learner where that is safe (off_policy.py).
        self.off_policy = OneStepOff(overlap=learner.mesh.devices.size == 1 and tlt is None and self.env is None) \
            if step_config.off_policy_steps else None
        self._scorer = rewards.Scorer(step_config.reward, step_config.reward_workers, step_config.reward_timeout_s)

    def close(self):
        if self.off_policy is not None:
            self.off_policy.wait()
        self._scorer.close()
        if self.tlt is not None:
            self.tlt.close()

    def gap(self, name: str):
        """A host phase during which the devices would idle: TLT trains the drafter there."""
        return self.tlt.gap(name) if self.tlt is not None else contextlib.nullcontext()

    def prompts_for(self, data_position: int) -> list[tasks.Example]:
        """The next prompts_per_step examples of the train stream (reshuffled each epoch)."""
        # RLLoop's own example_at: a stand-in that borrows this method need not define it.
        return [RLLoop.example_at(self, pos)
                for pos in range(data_position, data_position + self.config.prompts_per_step)]

    def example_at(self, position: int) -> tasks.Example:
        """The train stream's example at `position` (counted over epochs)."""
        n = len(self.train_examples)
        epoch, offset = divmod(position, n)
        return self.train_examples[int(self._order(epoch, n)[offset])]

    def _order(self, epoch: int, n: int) -> np.ndarray:
        """The train stream's order in `epoch`, drawn once per epoch."""
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(n)
            if self.config.balance_tasks:
                by_task: dict[str, list[int]] = {}
                for i in order:
                    by_task.setdefault(self.train_examples[int(i)].task, []).append(int(i))
                turns = [by_task[t] for t in sorted(by_task)]
                order = np.asarray([turns[pos % len(turns)][(pos // len(turns)) % len(turns[pos % len(turns)])]
                                    for pos in range(n)])
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def step(self, state, step: int, data_position: int, on_group_done: Callable[[int], None] | None = None,
             last: bool = False):
        """One RL step: rollout, score, advantages, batch, learn, drafter, sync, each a
        phase of its own, timed by `Spans`; the metrics from what the phases returned
        (`step_metrics`). last: no step follows (one-step-off starts no next rollout).
        Returns (state, metrics, new data position, rollouts)."""
        spans = Spans()
        with spans("rollout"):
            rollout = self._rollout(step, data_position, on_group_done)
        with spans("reward"), self.gap("reward"):
            scores = self._score(step, rollout, spans)
            advantages_n = self._advantages(scores.reward_n)
        with spans("batch"), self.gap("batch"):
            batch, packing = build_batch(rollout.prompt_ids, rollout.rollouts, advantages_n, self.seq_len,
                                         self.tokenizer.pad_token_id,
                                         num_minibatches=self.learner.config.num_minibatches,
                                         minibatch_rows=self.learner.minibatch_rows)
        if self.off_policy is not None:  # the engine's next weights, copied before the update donates them
            with spans("weight_sync"):
                self.off_policy.hold(step, state.params)
                if not last:  # with the overlap, the next step's rollout starts under them now
                    self.off_policy.start_next(self.engine, step, functools.partial(
                        self._rollout, step + 1, data_position + rollout.fresh_prompts, on_group_done))
        with spans("learner"):
            learned = self._learn(state, batch, spans)
            self._drafter(step, rollout, scores, batch, packing, learned.drafter_data)
            faults.maybe_kill("learner", step)
        synced = self._sync(learned.state, spans)
        spans.end("step")
        self.nonfinite_steps += learned.skipped
        self.consecutive_skips = self.consecutive_skips + 1 if learned.skipped == len(learned.updates) else 0
        metrics = step_metrics(rollout, scores, learned, batch["loss_mask"], synced, spans)
        return learned.state, metrics, data_position + rollout.fresh_prompts, rollout.rollouts

    def _rollout(self, step: int, data_position: int, on_group_done: Callable[[int], None] | None) -> StepRollout:
        """The step's prompts decoded, G samples each; with reward_overlap each sample is
        handed to the scorer as it finishes, while the rest decode."""
        cfg, tlt = self.config, self.tlt
        if self.off_policy is not None and (started := self.off_policy.take(step)) is not None:
            return started  # drawn while the step before learned
        if self.carry is not None:
            return self._partial_rollout(step, data_position, on_group_done)
        examples = self.prompts_for(data_position)
        episodes, sp = None, self.sampling_params
        if self.env is not None:
            episodes = envs.Episodes(self.env_class, examples, cfg.num_samples, self.tokenizer, self.prompt_format,
                                       self.end_token_ids, self.env)
            prompt_ids, sp = episodes.prompt_ids(), episodes.sampling_params(sp)
        else:
            prompt_ids = evaluation.encode_prompts(self.tokenizer, examples, self.prompt_format)
        key = jax.random.fold_in(self.key, step)
        group_done = self._begin_rollout(step, on_group_done)
        scoring = self._scorer.begin() if cfg.reward_overlap else None
        example_fields = tasks.reward_fields(examples)  # per prompt; sample i is of prompt i // G
        completions: dict[int, str] = {}

        def sample_done(i, tokens):
            p, completion = i // cfg.num_samples, evaluation.decode_completions(self.tokenizer, [tokens],
                                                                                 self.end_token_ids)[0]
            completions[i] = completion
            scoring.submit(i, examples[p].prompt, completion, {k: v[p] for k, v in example_fields.items()})

        rollouts = self.engine.generate(prompt_ids, cfg.num_samples, sp, key,
                                        on_group_done=group_done, speculation=tlt.tuner if tlt is not None else None,
                                        on_sample_done=sample_done if scoring is not None else None,
                                        episodes=episodes)
        if tlt is not None:
            tlt.after_rollout()
        return StepRollout(examples, prompt_ids, episodes, rollouts, scoring, completions, cfg.prompts_per_step,
                           self.off_policy.metrics(step, rollouts) if self.off_policy is not None else {})

    def _begin_rollout(self, step: int, on_group_done: Callable[[int], None] | None) -> Callable[[int], None]:
        """TLT's rollout start; returns what runs as each rollout group finishes."""
        if self.tlt is not None:
            self.tlt.begin(step, self.engine.num_groups)

        def group_done(g):
            faults.maybe_kill("rollout", step)
            if self.tlt is not None:
                self.tlt.on_group_done(g)
            if on_group_done is not None:
                on_group_done(g)

        return group_done

    def _partial_rollout(self, step: int, data_position: int,
                         on_group_done: Callable[[int], None] | None) -> StepRollout:
        """The groups in flight (carried, then fresh prompts) decoded until the step's stop
        rule (`carry.py`); the groups that completed are the step's samples, scored after
        the rollout."""
        groups, fresh = self.carry.start(step, data_position)
        examples = [self.example_at(group.data_position) for group in groups]
        prompt_ids = evaluation.encode_prompts(self.tokenizer, examples, self.prompt_format)
        # One key stream for the run, named by each prompt's place in the train stream: a
        # sample's tokens do not depend on the step that draws them.
        rollouts = self.engine.generate(prompt_ids, self.config.num_samples, self.sampling_params,
                                        jax.random.fold_in(self.key, _PARTIAL_STREAM),
                                        on_group_done=self._begin_rollout(step, on_group_done),
                                        speculation=self.tlt.tuner if self.tlt is not None else None,
                                        prompt_ids=[group.data_position for group in groups],
                                        partial=self.carry.requests(step))
        if self.tlt is not None:
            self.tlt.after_rollout()
        learned = self.carry.absorb(step, rollouts)
        done = [groups.index(group) for group in learned.groups]
        return StepRollout([examples[i] for i in done], [prompt_ids[i] for i in done], None, learned.rollouts,
                           None, {}, fresh, learned.metrics)

    def _score(self, step: int, rollout: StepRollout, spans: Spans) -> StepScores:
        """Every sample's reward (process 0's on every process) and correctness. What the
        engine did not hand over (without overlap: every sample; with several processes:
        the other processes' groups') is decoded and scored now."""
        cfg, rollouts, episodes = self.config, rollout.rollouts, rollout.episodes
        chosen = [rollout.examples[i] for i in rollout.rollouts.prompt_index]
        late = [i for i in range(len(rollouts)) if i not in rollout.completions]
        completions = {**rollout.completions, **dict(zip(late, evaluation.decode_completions(
            self.tokenizer, [rollouts.tokens[i] for i in late], self.end_token_ids)))}
        completions_n = [completions[i] for i in range(len(rollouts))]
        prompts, fields = [e.prompt for e in chosen], tasks.reward_fields(chosen)
        with spans("reward_wait"):
            if rollout.scoring is None:
                scored = self._scorer(prompts, completions_n, fields)
            else:
                for i in late:
                    rollout.scoring.submit(i, prompts[i], completions_n[i], {k: v[i] for k, v in fields.items()})
                scored = rollout.scoring.result(len(rollouts))
        # Process 0's scores everywhere: a reward that times out, or draws, on one process only
        # must not split the learner's batch between processes.
        if episodes is not None:  # a sample's reward: its steps' plus the reward on its transcript
            scored = dataclasses.replace(scored, scores=episodes.total_rewards(scored.scores),
                                         failures=scored.failures + episodes.failures)
        reward, failures = multihost.broadcast_object((scored.scores, scored.failures))
        faults.maybe_kill("reward", step)
        # With an environment, a sample is correct where its total reward is positive.
        correct = (reward > 0).astype(np.float32) if episodes is not None else (
            reward if self.correctness_reward == cfg.reward else rewards.safe_rewards(
            rewards.get_reward(self.correctness_reward) if isinstance(self.correctness_reward, str)
            else self.correctness_reward, prompts, completions_n, **fields)[0])
        self.reward_failures += failures
        return StepScores([e.task for e in chosen], reward, correct, failures, scored.timed_out, scored.forgeable,
                          scored.scoring_s)

    def _advantages(self, reward_n: np.ndarray) -> np.ndarray:
        """float32 [n]: each sample's advantage within its prompt's G samples."""
        estimator = grpo.get_advantage_estimator(self.config.advantage)
        return np.asarray(estimator(jnp.asarray(reward_n), self.config.num_samples))

    def _learn(self, state, batch: dict, spans: Spans) -> StepLearning:
        """The GRPO updates of the step's batch (the learner's pure jitted steps), with the
        reference's log-probs first when the run keeps one; the same target forward gives
        the old log-probs and, with a drafter, its data."""
        rows = (batch["tokens"], batch["positions"], batch["segment_ids"])
        drafter = self.tlt.drafter if self.tlt is not None else None
        data_kw = {} if drafter is None else dict(top_k=drafter.config.top_k,
                                                  feature_layers=drafter.drafter_config.feature_layers)
        with spans("ref_logp"):  # the starting policy's forward: a phase of its own, for the KL alone
            if self.ref_params is not None:
                batch["ref_logp"] = sharding.to_host(self.learner.logprobs(self.ref_params, *rows))
        if self.learner.on_policy:
            # The update's own forward gives the old log-probs, the entropy and the drafter's data.
            state, updates, entropy, drafter_data = self.learner.update_on_policy(state, batch, **data_kw)
        else:
            with spans("old_logp"):  # one target forward: GRPO's old log-probs and the drafter's data
                if drafter is not None:
                    old_logp, entropy, drafter_data = self.learner.logprobs_and_drafter_data(state.params, *rows,
                                                                                             **data_kw)
                else:
                    (old_logp, entropy), drafter_data = self.learner.logprobs(state.params, *rows,
                                                                              with_entropy=True), None
                batch["old_logp"] = sharding.to_host(old_logp)
            state, updates = self.learner.update(state, batch)
        return StepLearning(state, updates, int(sum(u["skipped"] for u in updates)), entropy, drafter_data)

    def _drafter(self, step: int, rollout: StepRollout, scores: StepScores, batch: dict, packing: Packing,
                 drafter_data: DrafterData | None) -> None:
        """The learner forward's by-products into the drafter's buffer, one sample per row."""
        if self.tlt is None or self.tlt.drafter is None:
            return
        rollouts, prompt_ids = rollout.rollouts, rollout.prompt_ids
        prompt_lengths = np.asarray([len(prompt_ids[i]) for i in rollouts.prompt_index])
        self.tlt.add(step, unpack_samples(packing, batch["tokens"], self.seq_len, self.tokenizer.pad_token_id),
                     prompt_lengths, rollouts.lengths, unpack_drafter_data(packing, drafter_data), scores.tasks_n,
                     observed_nT=observed_tokens(rollouts, prompt_lengths, self.seq_len))

    def _sync(self, state, spans: Spans) -> StepSync:
        """The new policy to the rollout engine (one-step-off: the one the step started from);
        TLT's step end (catch-up drafter steps, the drafter's publish) and its metrics."""
        with spans("weight_sync"):
            if self.off_policy is not None:
                self.off_policy.sync(self.engine)
            else:
                self.engine.update_params(state.params)
        with spans("tlt_end"):
            return StepSync(self.tlt.end() if self.tlt is not None else {})

    def check_finite(self, step: int) -> None:
        """Raises once max_consecutive_skips RL steps in a row changed nothing."""
        if self.consecutive_skips >= self.config.max_consecutive_skips:
            raise TooManyNonFiniteSteps(
                f"{self.consecutive_skips} RL steps in a row had a non-finite loss or gradient (last: step {step}); "
                "stopping with the last good checkpoint intact. Lower the learning rate or check the rewards.")

    def evaluate(self, step: int, params=None) -> dict:
        """Greedy eval metrics (`eval_accuracy`, ...) of the learner's policy `params` (the
        engine's weights when None or synchronous); the samples stay in `last_eval_samples`."""
        greedy = dataclasses.replace(self.sampling_params, temperature=0.0)
        if self.off_policy is not None:
            self.off_policy.wait()  # a rollout under way uses the engine
        # One-step-off: the engine holds the policy one update behind; it evaluates the learner's.
        holding = self.off_policy.engine_holding(self.engine, params) \
            if self.off_policy is not None and params is not None else contextlib.nullcontext()
        with holding:
            result, self.last_eval_samples = evaluation.evaluate_samples(
                self.engine, self.tokenizer, self.eval_examples, greedy,
                jax.random.fold_in(jax.random.fold_in(self.key, _EVAL_STREAM), step),
                reward=self.correctness_reward, prompt_format=self.prompt_format,
                end_token_ids=self.end_token_ids, env=self.env)
        return {f"eval_{k}": v for k, v in result.items()}
