"""A reward called so that no sample's failure costs the others their scores.

`safe_rewards` is how the RL loop calls a reward: a sample whose score raises or is not
finite scores 0 and is counted, without zeroing the rest of the batch, and the warning
shows one such sample (`FailedSample`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

import numpy as np

from tlt_jax.rewards.verifiers import RewardFn

logger = logging.getLogger(__name__)


def _finite_or_none(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


_EXAMPLE_CHARS = 200  # of a prompt, completion or outcome, in a warning


def _clip(text: str, limit: int = _EXAMPLE_CHARS) -> str:
    """`text`, its middle cut to keep `limit` characters: a prompt's question and a
    completion's answer are at their ends."""
    return text if len(text) <= limit else f"{text[:limit // 2]} [...] {text[-(limit // 2):]}"


@dataclasses.dataclass(frozen=True)
class FailedSample:
    """A sample a reward failed on, as `safe_rewards` warns of it: str() is one line."""

    prompt: str
    completion: str
    outcome: str  # what the reward returned or raised for it

    def __str__(self) -> str:
        return f"prompt {_clip(self.prompt)!r}, completion {_clip(self.completion)!r}: {_clip(self.outcome)}"


def checked_rewards(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str], fields: dict,
                     warn: bool = True) -> tuple[np.ndarray, int, FailedSample | None, list[dict | None]]:
    """`safe_rewards`, the first sample that failed (None if none did) and each score's
    `ExplainedScore.info` (None for a plain float); warn=False leaves the warning to the caller
    (`scoring.PendingBatch`, which warns once for its batch)."""
    batch = len(completions)
    problems = {}  # sample -> what went wrong, where its score does not tell
    try:
        scores = list(fn(list(prompts), list(completions), **fields))
        if len(scores) != batch:
            raise ValueError(f"{len(scores)} scores for {batch} samples")
    except Exception as error:  # noqa: BLE001 - any reward bug must not stop training
        logger.debug("reward %s failed on the batch (%r); scoring samples one by one.",
                     getattr(fn, "__name__", fn), error)
        scores = []
        for i in range(batch):
            try:
                single = fn([prompts[i]], [completions[i]], **{k: v[i:i + 1] for k, v in fields.items()})
            except Exception as error:  # noqa: BLE001
                scores.append(None)
                problems[i] = f"raised {error!r}"
                continue
            if hasattr(single, "__len__") and len(single) == 1:
                scores.append(list(single)[0])
            else:
                scores.append(None)
                problems[i] = f"returned {single!r} for 1 sample"
    finite = [_finite_or_none(s) for s in scores]
    failed = [i for i, s in enumerate(finite) if s is None]
    first = None
    if failed:
        i = failed[0]
        first = FailedSample(str(prompts[i]), str(completions[i]), problems.get(i, f"returned {scores[i]!r}"))
        if warn:
            warn_failures(fn, len(failed), batch, first)
    infos = [getattr(s, "info", None) for s in scores]
    return np.array([0.0 if s is None else s for s in finite], dtype=np.float32), len(failed), first, infos


def warn_failures(reward, failed: int, batch: int, first: FailedSample) -> None:
    logger.warning("reward %s failed on %d of %d samples; they score 0. The first: %s",
                   getattr(reward, "__name__", reward), failed, batch, first)


def safe_rewards(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str],
                 **fields) -> tuple[np.ndarray, int]:
    """Scores [B] float32 from `fn`, and how many samples failed (scored 0 instead).

    The batch is scored in one call; if that raises or returns the wrong number of scores,
    each sample is scored alone so only the bad ones get 0. A score that is NaN, inf or
    not a number is a failure too. Fields must be per-sample sequences of length B.
    Failures are logged as one warning per call, which shows the first failed sample: its
    prompt, completion and what the reward returned or raised (`FailedSample`).
    """
    scores, failures, _, _ = checked_rewards(fn, prompts, completions, fields)
    return scores, failures


def safe_rewards_with_info(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str],
                           **fields) -> tuple[np.ndarray, int, list[dict | None]]:
    """`safe_rewards`, and each sample's `ExplainedScore.info` (None where the score is a plain float)."""
    scores, failures, _, infos = checked_rewards(fn, prompts, completions, fields)
    return scores, failures, infos

