"""The verifiers: reward functions for verifiable tasks, as plain callables.

Every reward has the signature `fn(prompts, completions, **fields) -> list[float]`, one
score per sample (TRL's and tunix's convention). `fields` are per-sample lists named after
what they carry (`answer`, `task`, `entry`, ...; `tasks.reward_fields` builds them); a
reward takes the ones it needs and ignores the rest, so the RL loop can pass every field
to every reward. Completions are decoded text without special tokens (no <eos>). A score
may be an `ExplainedScore`, a float with `info` saying why it scored so.
"""
from __future__ import annotations

import functools
import re
import threading
from fractions import Fraction
from typing import Callable, Sequence

from tlt_jax.data import tasks

RewardFn = Callable[..., list[float]]

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


_MATH_DELIMITERS = ("$", "\\boxed", "\\(", "\\[")


def _parse_final_answer(text: str, reference: bool, in_main_thread: bool) -> list:
    """math-verify's parse of the final answer in `text` ([] if it finds none).

    The text after the last '####' (GSM8K style) is the answer alone, as is a reference
    without LaTeX delimiters or \\boxed{}; these are read as LaTeX math first, so that
    "2\\sqrt{2}" is not read as its first number.
    """
    from math_verify import parse

    timeout = {} if in_main_thread else {"parsing_timeout": None}  # its timeout is signal.alarm: main thread only
    if "####" in text:
        text, bare = text.rsplit("####", 1)[1].strip(), True
    else:
        bare = reference and not any(d in text for d in _MATH_DELIMITERS)
    return (bare and parse(f"${text}$", **timeout)) or parse(text, **timeout)


def math_correctness(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                     **_) -> list[float]:
    """1.0 where math-verify finds the completion's final answer equal to the reference
    `answer` (\\frac{1}{2} = 0.5, \\boxed{3/4} = 0.75, 2\\sqrt{2} = \\sqrt{8}), else 0.0.

    A completion without an answer math-verify can read scores 0; a reference it cannot
    read raises, so the sample counts as a failure of the reward (a data problem shows).
    math-verify bounds its own time with signal.alarm in the main thread only; elsewhere
    (`Scorer`'s scoring thread) it runs unbounded and the Scorer's deadline bounds it.
    """
    from math_verify import verify  # lazily: worker processes import this module, and most runs score otherwise

    in_main_thread = threading.current_thread() is threading.main_thread()
    timeout = {} if in_main_thread else {"timeout_seconds": None}
    golds, scores = {}, []
    for completion, reference in zip(completions, map(str, answer), strict=True):
        if reference not in golds:  # the samples of a group share one reference
            golds[reference] = _parse_final_answer(reference, True, in_main_thread)
        if not golds[reference]:
            raise ValueError(f"math-verify finds no answer in the reference {reference!r}")
        predicted = _parse_final_answer(completion, False, in_main_thread)
        scores.append(float(bool(predicted) and verify(golds[reference], predicted, **timeout)))
    return scores


@functools.cache
def _gym_score_answer(task: str) -> Callable[..., float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def reasoning_gym_score(prompts: Sequence[str], completions: Sequence[str], entry: Sequence[dict],
                        **_) -> list[float]:
    """The reasoning-gym task's own `score_answer(answer=, entry=)` on the completion's last
    <answer>...</answer> (0.0 without one); each sample's `entry` is the package's dataset
    entry (question, answer, metadata), whose metadata["source_dataset"] names the task."""
    from reasoning_gym.utils import extract_answer

    scores = []
    for completion, e in zip(completions, entry, strict=True):
        try:
            task = e["metadata"]["source_dataset"]
        except (KeyError, TypeError) as error:
            raise ValueError(f"field entry={e!r:.80} is not a reasoning-gym dataset entry "
                             "(with metadata['source_dataset'])") from error
        predicted = extract_answer(completion)
        scores.append(0.0 if predicted is None else float(_gym_score_answer(task)(answer=predicted, entry=e)))
    return scores


class ExplainedScore(float):
    """A reward's score of one sample with `info`, a small JSON-able dict saying why it
    scored so (the code reward's: passed, total, failure, detail), which eval_samples.jsonl
    shows as reward_info. A float, so every caller of a reward keeps working; it pickles
    whole, to and from reward workers."""

    def __new__(cls, value: float, info: dict):
        scored = super().__new__(cls, value)
        scored.info = info
        return scored

    def __reduce__(self):
        return ExplainedScore, (float(self), self.info)

    def __repr__(self) -> str:
        return f"{float(self)!r} ({self.info})"

