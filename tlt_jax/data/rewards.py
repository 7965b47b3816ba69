"""Reward functions for verifiable tasks, as plain callables.

Every reward has the signature `fn(prompts, completions, **fields) -> list[float]`, one
score per sample (TRL's and tunix's convention). `fields` are per-sample lists named after
what they carry (`answer`, `task`, `entry`, ...; `tasks.reward_fields` builds them); a
reward takes the ones it needs and ignores the rest, so the RL loop can pass every field
to every reward. Completions are decoded text without special tokens (no <eos>).

The registry, `REWARDS` (each scores within `SCORE_RANGE`, [0, 1]):
  task                our synthetic tasks, with partial credit for the format;
  answer_correctness  our synthetic tasks' checkers alone;
  format              our synthetic tasks' format alone;
  gsm8k               the final number against the reference, exactly;
  math                math-verify's equivalence of the final answer and the reference
                      (LaTeX, \\boxed{}, fractions, plain numbers);
  reasoning_gym       a reasoning-gym task's own `score_answer` on the last
                      <answer>...</answer> (the optional extra `envs`).
`get_reward` also takes `module.path:function`, any importable reward of the same
convention, so a verifier of one's own needs no change here.

`safe_rewards` is how the RL loop calls a reward: a sample whose score raises or is not
finite scores 0 and is counted, without zeroing the rest of the batch, and the warning
shows one such sample (`FailedSample`). `Scorer` runs it for the loop, in this process or
in worker processes, under a per-batch deadline: a reward that hangs scores 0 and is
counted too, and the run goes on.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
import math
import multiprocessing
import re
import threading
import time
from fractions import Fraction
from typing import Callable, Sequence

import numpy as np

from tlt_jax.data import environments, tasks

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


REWARDS: dict[str, RewardFn] = {
    "answer_correctness": answer_correctness,
    "format": format_reward,
    "task": task_reward,
    "gsm8k": gsm8k_correctness,
    "math": math_correctness,
    "reasoning_gym": reasoning_gym_score,
}
SCORE_RANGE = (0.0, 1.0)  # every reward of REWARDS scores within it (plots clip reward bands to it)
# Rewards that need a package: reward -> (module, how to install it).
_NEEDS = {"math": ("math_verify", "pip install -e ."),
          "reasoning_gym": ("reasoning_gym", environments.INSTALL_HINT)}


def get_reward(name: str) -> RewardFn:
    """The reward `name`: one of `REWARDS`, or `module.path:function` for any importable
    reward of the convention above (a user's own verifier).

    Raises ValueError for a name that names no reward, ImportError for a module or package
    that cannot be imported; each message is one line naming the config field `reward`.
    """
    if name in REWARDS:
        module, install = _NEEDS.get(name, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ImportError(f"reward={name!r} needs the package {module}, which is not installed: {install}")
        return REWARDS[name]
    module_name, _, attribute = name.partition(":")
    if not (module_name and attribute):
        raise ValueError(f"reward={name!r} is not a registered reward ({', '.join(sorted(REWARDS))}) "
                         "nor module.path:function naming a reward of your own.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"reward={name!r}: cannot import module {module_name!r} "
                          f"({type(error).__name__}: {error}).") from error
    if not hasattr(module, attribute):
        raise ValueError(f"reward={name!r}: module {module_name!r} has no attribute {attribute!r}.")
    fn = getattr(module, attribute)
    if not callable(fn):
        raise ValueError(f"reward={name!r}: {module_name}.{attribute} is a {type(fn).__name__}, not a function "
                         "fn(prompts, completions, **fields) -> list[float].")
    return fn


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


def _checked_rewards(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str],
                     **fields) -> tuple[np.ndarray, int, FailedSample | None]:
    """`safe_rewards`, and the first sample that failed (None if none did)."""
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
        logger.warning("reward %s failed on %d of %d samples; they score 0. The first: %s",
                       getattr(fn, "__name__", fn), len(failed), batch, first)
    return np.array([0.0 if s is None else s for s in finite], dtype=np.float32), len(failed), first


def safe_rewards(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str],
                 **fields) -> tuple[np.ndarray, int]:
    """Scores [B] float32 from `fn`, and how many samples failed (scored 0 instead).

    The batch is scored in one call; if that raises or returns the wrong number of scores,
    each sample is scored alone so only the bad ones get 0. A score that is NaN, inf or
    not a number is a failure too. Fields must be per-sample sequences of length B.
    Failures are logged as one warning per call, which shows the first failed sample: its
    prompt, completion and what the reward returned or raised (`FailedSample`).
    """
    scores, failures, _ = _checked_rewards(fn, prompts, completions, **fields)
    return scores, failures


_START_TIMEOUT_S = 300.0  # for the workers of a new pool to be up


def _wait_for_all(barrier, timeout_s: float) -> None:
    """Where the workers of a new pool and the process that started it meet."""
    try:
        barrier.wait(timeout_s)
    except threading.BrokenBarrierError:  # a worker that replaced a dead one meets no one
        pass


def _score_job(job) -> tuple[np.ndarray, int, FailedSample | None]:
    """`safe_rewards` for (reward name or function, prompts, completions, fields), with its
    first failed sample: what a scoring thread or worker process runs (a worker imports
    only this module, no JAX, and resolves a reward's name itself, module:function too)."""
    reward, prompts, completions, fields = job
    return _checked_rewards(get_reward(reward) if isinstance(reward, str) else reward, prompts, completions, **fields)


@dataclasses.dataclass(frozen=True)
class Scores:
    """A batch's rewards as the RL loop gets them from `Scorer`."""

    scores: np.ndarray  # [B] float32; 0 where a sample failed
    failures: int  # samples scored 0: their reward raised, was not finite, or not in time
    timed_out: int  # of those, the samples whose scoring passed the batch's deadline
    failed_sample: FailedSample | None = None  # the first whose reward raised or was not finite, to show


class Scorer:
    """Scores batches with one reward: `safe_rewards` in this process (workers=0) or split
    over `workers` spawned processes, within `timeout_s` seconds per batch (0: no deadline).

    What has not finished by the deadline (the batch inline, or a worker's part of it)
    scores 0 and is counted (`Scores.timed_out`), and the next batch is scored as usual.
    Worker processes past the deadline are terminated and a fresh pool serves the next
    batch; a pool starts at once and waits for its workers to be up, so the deadline
    counts scoring, not start-up. Inline, the call is left running on a daemon thread
    (Python cannot stop a thread), which is enough for a reward that waits (on I/O, a
    lock, a sleep); a reward that can hang while it computes belongs in workers.

    reward: a name `get_reward` resolves (of `REWARDS`, or module.path:function), or a
    reward function (with workers: a module-level one, as it is pickled by reference).
    """

    def __init__(self, reward: str | RewardFn, workers: int = 0, timeout_s: float = 0.0):
        if isinstance(reward, str):
            get_reward(reward)  # a bad name fails here, not in a worker at the first batch
        if workers < 0:
            raise ValueError(f"reward_workers={workers} must be >= 0 (0: score in the training process).")
        if not timeout_s >= 0:
            raise ValueError(f"reward_timeout_s={timeout_s} must be >= 0 (0: no deadline).")
        self.reward, self.workers, self.timeout_s = reward, workers, timeout_s
        self._pool = self._start_pool() if workers else None  # replaced after a deadline passes

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], fields: dict) -> Scores:
        """Scores [B] for B samples; `fields` are per-sample sequences of length B."""
        deadline = time.monotonic() + self.timeout_s if self.timeout_s > 0 else None
        parts = np.array_split(np.arange(len(completions)), max(self.workers, 1))
        jobs = [(self.reward, [prompts[i] for i in part], [completions[i] for i in part],
                 {k: [v[i] for i in part] for k, v in fields.items()}) for part in parts if len(part)]
        results = self._in_workers(jobs, deadline) if self.workers else [self._inline(job, deadline) for job in jobs]
        scores, failures, timed_out, failed_sample = [np.zeros((0,), np.float32)], 0, 0, None
        for job, result in zip(jobs, results):
            if result is None:
                n = len(job[2])
                scores.append(np.zeros((n,), np.float32))
                failures, timed_out = failures + n, timed_out + n
            else:
                scores.append(result[0])
                failures += result[1]
                failed_sample = failed_sample or result[2]
        if timed_out:
            logger.warning("reward %s did not score %d of %d samples within reward_timeout_s=%g s; they score 0.",
                           getattr(self.reward, "__name__", self.reward), timed_out, len(completions), self.timeout_s)
        return Scores(np.concatenate(scores), failures, timed_out, failed_sample)

    @staticmethod
    def _inline(job, deadline: float | None):
        if deadline is None:
            return _score_job(job)
        out = []
        thread = threading.Thread(target=lambda: out.append(_score_job(job)), name="reward", daemon=True)
        thread.start()
        thread.join(max(deadline - time.monotonic(), 0.0))
        return out[0] if out else None

    def _start_pool(self):
        # Spawned, not forked: forking a process that runs JAX threads can deadlock.
        context = multiprocessing.get_context("spawn")
        ready = context.Barrier(self.workers + 1)
        pool = context.Pool(self.workers, initializer=_wait_for_all, initargs=(ready, _START_TIMEOUT_S))
        _wait_for_all(ready, _START_TIMEOUT_S)
        return pool

    def _in_workers(self, jobs, deadline: float | None):
        pending = [self._pool.apply_async(_score_job, (job,)) for job in jobs]
        results = []
        for p in pending:
            try:
                results.append(p.get(None if deadline is None else max(deadline - time.monotonic(), 0.0)))
            except multiprocessing.TimeoutError:
                results.append(None)
        if any(r is None for r in results):
            self._pool.terminate()  # the hung workers with it
            self._pool.join()
            self._pool = self._start_pool()
        return results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None
