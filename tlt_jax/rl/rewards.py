"""Reward functions for verifiable tasks, as plain callables.

Every reward has the signature `fn(prompts, completions, **fields) -> list[float]`, one
score per sample. `fields` are per-sample lists named after what they carry (`answer`,
`task`, ...; `tasks.reward_fields` builds them); a reward takes the ones it needs and
ignores the rest, so the RL loop can pass every field to every reward. Completions are
decoded text without special tokens (no <eos>).

`safe_rewards` is how the RL loop calls a reward: a sample whose score raises or is not
finite scores 0 and is counted, without zeroing the rest of the batch.
"""
from __future__ import annotations

import logging
import math
import re
from fractions import Fraction
from typing import Callable, Sequence

import numpy as np

from tlt_jax.rl import tasks

RewardFn = Callable[..., list[float]]
logger = logging.getLogger(__name__)

_ALPHABET = frozenset(tasks.ALPHABET)
_ANSWER_LINE = re.compile(re.escape(tasks.ANSWER_PREFIX.rstrip()) + r"\s*(.*)")


def parse_answer(completion: str) -> str | None:
    """The text after ANSWER_PREFIX on the last answer line, or None if there is none.
    The last one counts, as a reader would take the final answer."""
    answers = [m.group(1).strip() for line in completion.split("\n") if (m := _ANSWER_LINE.match(line))]
    return answers[-1] if answers else None


def is_well_formed(completion: str) -> bool:
    """One or more non-empty trace lines, then exactly one answer line, last and non-empty,
    and only ALPHABET characters (trailing whitespace is tolerated)."""
    lines = completion.rstrip().split("\n")
    answer_lines = [i for i, line in enumerate(lines) if _ANSWER_LINE.match(line)]
    return (len(lines) >= 2 and answer_lines == [len(lines) - 1] and parse_answer(lines[-1]) != ""
            and all(line.strip() for line in lines) and set(completion) <= _ALPHABET)


def answer_correctness(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                       task: Sequence[str] | None = None, **_) -> list[float]:
    """1.0 where the parsed answer solves the problem, else 0.0.

    With `task`, the task's own checker decides (countdown accepts any valid expression);
    without it, the parsed answer must equal `answer` exactly (after stripping spaces).
    """
    scores = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        predicted = parse_answer(completion)
        if predicted is None:
            correct = False
        elif task is None:
            correct = predicted == answer[i].strip()
        else:
            correct = tasks.check_answer(task[i], predicted, answer[i], prompt)
        scores.append(float(correct))
    return scores


def format_reward(prompts: Sequence[str], completions: Sequence[str], **_) -> list[float]:
    """1.0 for a well-formed completion (see `is_well_formed`), else 0.0."""
    return [float(is_well_formed(c)) for c in completions]


# Partial credit for well-formed but wrong answers: enough to pull a fresh policy toward
# the format, while a correct answer stays worth ten times more.
FORMAT_CREDIT = 0.1


def task_reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                task: Sequence[str] | None = None, **_) -> list[float]:
    """The default reward for our tasks, with partial credit:

    1.0  well-formed and correct;
    0.1  well-formed but wrong (FORMAT_CREDIT);
    0.0  malformed, even if an answer line happens to be correct (the format is part of
         the task, and this stops trailing junk after the answer being free).
    """
    correct = answer_correctness(prompts, completions, answer=answer, task=task)
    return [(1.0 if right else FORMAT_CREDIT) if is_well_formed(c) else 0.0
            for c, right in zip(completions, correct, strict=True)]


# A minus right after a digit is an operator ("10-15"), not a sign.
_NUMBER = r"(?<!\d)-?\d[\d,]*(?:\.\d+)?(?:/\d+)?"


def _last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...}, with nested braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None


def extract_final_number(text: str) -> Fraction | None:
    """The final numeric answer of a GSM8K-style text, exactly, or None.

    Looks, in order, after the last '####', inside the last \\boxed{}, and otherwise at the
    last number anywhere. Thousands separators, '$' and '%' are ignored; "3/4" and
    "\\frac{3}{4}" parse as fractions.
    """
    # The first number after '####' or in a box is the answer; in free text, the last.
    if "####" in text:
        region, position = text.rsplit("####", 1)[1], 0
    elif (boxed := _last_boxed(text)) is not None:
        region, position = re.sub(r"\\d?frac\{(\d+)\}\{(\d+)\}", r"\1/\2", boxed), 0
    else:
        region, position = text, -1
    numbers = re.findall(_NUMBER, region.replace("$", ""))
    if not numbers:
        return None
    token = numbers[position]
    try:
        return Fraction(token.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def gsm8k_correctness(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                      **_) -> list[float]:
    """1.0 where the completion's final number equals the reference numerically, else 0.0.

    `answer` may be a bare number ("1,234") or a full GSM8K solution ending "#### 1234";
    both sides go through `extract_final_number`, so "72.0", "$72" and "\\boxed{72}" all
    match 72.
    """
    scores = []
    for completion, reference in zip(completions, answer, strict=True):
        predicted, expected = extract_final_number(completion), extract_final_number(reference)
        scores.append(float(predicted is not None and expected is not None and predicted == expected))
    return scores


REWARDS: dict[str, RewardFn] = {
    "answer_correctness": answer_correctness,
    "format": format_reward,
    "task": task_reward,
    "gsm8k": gsm8k_correctness,
}


def get_reward(name: str) -> RewardFn:
    """The registered reward function `name`."""
    if name not in REWARDS:
        raise KeyError(f"unknown reward {name!r}; known: {sorted(REWARDS)}")
    return REWARDS[name]


def _finite_or_none(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def safe_rewards(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str],
                 **fields) -> tuple[np.ndarray, int]:
    """Scores [B] float32 from `fn`, and how many samples failed (scored 0 instead).

    The batch is scored in one call; if that raises or returns the wrong number of scores,
    each sample is scored alone so only the bad ones get 0. A score that is NaN, inf or
    not a number is a failure too. Fields must be per-sample sequences of length B.
    Failures are logged as one warning per call.
    """
    batch = len(completions)
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
                scores.append(single[0] if len(single) == 1 else None)
            except Exception:  # noqa: BLE001
                scores.append(None)
    finite = [_finite_or_none(s) for s in scores]
    failures = sum(s is None for s in finite)
    if failures:
        logger.warning("reward %s failed on %d of %d samples; they score 0.",
                        getattr(fn, "__name__", fn), failures, batch)
    return np.array([0.0 if s is None else s for s in finite], dtype=np.float32), failures


def safe_rewards_by_name(job):
    """`safe_rewards` for (reward name, prompts, completions, fields): what a reward
    worker process runs (a top-level function of a module without JAX, cheap to spawn)."""
    name, prompts, completions, fields = job
    return safe_rewards(get_reward(name), prompts, completions, **fields)
