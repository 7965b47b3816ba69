"""Accuracy by sampling: prompts through the rollout engine, completions scored by a reward."""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from tlt_jax import sampling
from tlt_jax.data import rewards, tasks


def encode_prompts(tokenizer, examples: Sequence[tasks.Example]) -> list[list[int]]:
    return [tokenizer(e.prompt)["input_ids"] for e in examples]


def decode_completions(tokenizer, token_lists) -> list[str]:
    """Completion text without the trailing <eos>."""
    eos = tokenizer.eos_token_id
    return [tokenizer.decode([t for t in tokens.tolist() if t != eos]) for tokens in token_lists]


def evaluate(engine, tokenizer, examples: Sequence[tasks.Example], sampling_params: sampling.SamplingParams,
             key: jax.Array, num_samples: int = 1) -> dict:
    """Mean answer correctness (pass@1 averaged over samples) and answer lengths."""
    out = engine.generate(encode_prompts(tokenizer, examples), num_samples, sampling_params, key)
    completions = decode_completions(tokenizer, out.tokens)
    chosen = [examples[i] for i in out.prompt_index]
    fields = tasks.reward_fields(chosen)
    correct, _ = rewards.safe_rewards(rewards.answer_correctness, [e.prompt for e in chosen], completions, **fields)
    lengths = out.lengths
    return {"accuracy": float(np.mean(correct)) if len(correct) else 0.0,
            "length_mean": float(lengths.mean()) if len(lengths) else 0.0,
            "length_max": int(lengths.max(initial=0))}
