"""Accuracy by sampling: prompts through the rollout engine, completions scored by a reward.

A prompt reaches the engine as `prompts.PromptFormat` makes it (the tokenizer's chat
template or a format string); a completion is the text of the answer's tokens without
its end token (any of the model's end tokens). `evaluate_samples` also returns one
record per sample, what `eval_samples.jsonl` holds: the prompt as templated text, the
completion, the reference answer, the reward (and `reward_info`, where the reward says
why: `rewards.ExplainedScore`), the length, and whether the sample ended on an end token or was
cut off (`max_tokens`, or the engine's cache length).

With an environment (`env`, `envs`) each sample is a multi-turn episode: its
record's `completion` is the whole transcript after the prompt (the model's turns and the
observations), `turns` its steps ({action, observation, reward}, and `error` where the
environment failed), `reward` the total (step rewards plus `reward` on the transcript),
and `accuracy` the share of samples whose total is positive, as in the RL step.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from tlt_jax import envs, rewards, sampling
from tlt_jax.data import prompts, tasks

_DEFAULT_FORMAT = prompts.PromptFormat()
_ENDED = ("eos", "stop")  # finish reasons of a sample that ended on its own (not on max_tokens or the cache)


def encode_prompts(tokenizer, examples: Sequence[tasks.Example],
                   prompt_format: prompts.PromptFormat = _DEFAULT_FORMAT) -> list[list[int]]:
    """The token ids of each example's prompt, as the engine receives them."""
    return [prompt_format.example_ids(tokenizer, e) for e in examples]


def decode_completions(tokenizer, token_lists, end_token_ids: Sequence[int] | None = None) -> list[str]:
    """Completion text without its end tokens (`end_token_ids`; default the tokenizer's eos)."""
    ends = set(end_token_ids) if end_token_ids is not None else {tokenizer.eos_token_id}
    return [tokenizer.decode([t for t in tokens.tolist() if t not in ends]) for tokens in token_lists]


def accuracy_by_task(tasks_n: Sequence[str], scores_n) -> dict[str, float]:
    """{"accuracy/<task>": mean score of that task's samples} where the samples come from
    several tasks (a mixture's tasks learn at their own pace); {} for one task."""
    if len(set(tasks_n)) < 2:
        return {}
    scores_n, tasks_n = np.asarray(scores_n, np.float64), np.asarray(tasks_n)
    return {f"accuracy/{task}": float(scores_n[tasks_n == task].mean()) for task in sorted(set(tasks_n))}


def evaluate_samples(engine, tokenizer, examples: Sequence[tasks.Example], sampling_params: sampling.SamplingParams,
                     key: jax.Array, num_samples: int = 1, *, reward: str | rewards.RewardFn = "answer_correctness",
                     prompt_format: prompts.PromptFormat = _DEFAULT_FORMAT,
                     end_token_ids: Sequence[int] | None = None,
                     env: envs.EnvConfig | None = None) -> tuple[dict, list[dict]]:
    """(metrics, samples): the mean of `reward` over the samples (accuracy: pass@1 averaged
    over samples for a 0/1 reward), the answer lengths, the share of samples cut off before
    an end token; and a record per sample (see the module doc). env: with a name, one
    environment per sample (multi-turn; metrics then add reward_mean and
    `envs.Episodes.metrics`: environment time, failures, turns per sample)."""
    examples = list(examples)
    episodes = None
    if env is not None and env.name:
        ends = tuple(end_token_ids) if end_token_ids is not None else (tokenizer.eos_token_id,)
        episodes = envs.Episodes(envs.env_class(env.name), examples, num_samples, tokenizer, prompt_format, ends,
                                 env)
        try:
            out = engine.generate(episodes.prompt_ids(), num_samples, episodes.sampling_params(sampling_params), key,
                                  episodes=episodes)
        finally:
            episodes.close()
        prompt_texts = episodes.prompt_texts()
    else:
        out = engine.generate(encode_prompts(tokenizer, examples, prompt_format), num_samples, sampling_params, key)
        prompt_texts = None
    completions = decode_completions(tokenizer, out.tokens, end_token_ids)
    chosen = [examples[i] for i in out.prompt_index]
    fields = tasks.reward_fields(chosen)
    fn = rewards.get_reward(reward) if isinstance(reward, str) else reward
    scores, _, infos = rewards.safe_rewards_with_info(fn, [e.prompt for e in chosen], completions, **fields)
    correct = scores
    if episodes is not None:  # a sample's reward: its steps' plus the reward on its transcript
        scores = episodes.total_rewards(scores)
        correct = (scores > 0).astype(np.float32)
    lengths = out.lengths
    ended = np.asarray([reason in _ENDED for reason in out.finish_reason], bool)
    metrics = {"accuracy": float(np.mean(correct)) if len(correct) else 0.0,
               "length_mean": float(lengths.mean()) if len(lengths) else 0.0,
               "length_max": int(lengths.max(initial=0)),
               "truncated_share": float(1.0 - ended.mean()) if len(ended) else 0.0,
               **accuracy_by_task([e.task for e in chosen], correct)}
    if episodes is not None:
        metrics.update(reward_mean=float(np.mean(scores)) if len(scores) else 0.0, **episodes.metrics())
    texts = {}
    samples = []
    for i, example_index in enumerate(out.prompt_index.tolist()):
        if example_index not in texts:
            texts[example_index] = prompt_texts[example_index] if prompt_texts is not None else \
                prompt_format.example_text(tokenizer, examples[example_index])
        samples.append({"prompt": texts[example_index], "completion": completions[i],
                        "reference": examples[example_index].answer, "reward": float(scores[i]),
                        "length": int(lengths[i]), "finish_reason": out.finish_reason[i],
                        "ended": bool(ended[i])})
        if infos[i] is not None:  # why the reward scored so (the code reward's tests passed, first failure)
            samples[-1]["reward_info"] = infos[i]
        if episodes is not None:
            samples[-1]["turns"] = episodes.turns[i]
    return metrics, samples


def evaluate(engine, tokenizer, examples: Sequence[tasks.Example], sampling_params: sampling.SamplingParams,
             key: jax.Array, num_samples: int = 1, **kwargs) -> dict:
    """The metrics of `evaluate_samples`."""
    return evaluate_samples(engine, tokenizer, examples, sampling_params, key, num_samples, **kwargs)[0]
