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
                      <answer>...</answer> (the optional extra `envs`);
  code                the completion's program run against its row's tests in a sandbox
                      (`CodeReward`, options from config.code; docs/code.md).
`get_reward` also takes `module.path:function`, any importable reward of the same
convention, so a verifier of one's own needs no change here. A score may be a `Scored`
float, whose `info` (why it scored so) `safe_rewards_with_info` hands on.

`safe_rewards` is how the RL loop calls a reward: a sample whose score raises or is not
finite scores 0 and is counted, without zeroing the rest of the batch, and the warning
shows one such sample (`FailedSample`). `Scorer` runs it for the loop, in this process or
in worker processes, under a per-batch deadline: a reward that hangs scores 0 and is
counted too, as does a sample whose worker process dies (replaced at once), and the run
goes on. `Scorer.begin` scores a batch sample by sample as each
sample finishes decoding (`Scoring`), so a slow verifier runs while the rest decode.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import queue
import re
import signal
import threading
import time
from fractions import Fraction
from typing import Callable, Sequence

import numpy as np

from tlt_jax.data import code_tests, environments, sandbox, tasks

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


class Scored(float):
    """A reward's score of one sample with `info`, a small JSON-able dict saying why it
    scored so (the code reward's: passed, total, failure, detail), which eval_samples.jsonl
    shows as reward_info. A float, so every caller of a reward keeps working; it pickles
    whole, to and from reward workers."""

    def __new__(cls, value: float, info: dict):
        scored = super().__new__(cls, value)
        scored.info = info
        return scored

    def __reduce__(self):
        return Scored, (float(self), self.info)

    def __repr__(self) -> str:
        return f"{float(self)!r} ({self.info})"


@dataclasses.dataclass(frozen=True)
class CodeReward:
    """The `code` reward: each completion's program (`code_tests.program_of`) run against
    its row's tests (`code_tests.row_tests`) in a fresh sandbox (`sandbox.run`).

    Scores the share of tests passed (partial_credit=False: 1 only if all pass), as
    `Scored` with passed / total and the first failure's kind. A sample whose sandbox
    failed before its program ran scores NaN: counted as a failed sample, scored 0 and
    shown once per batch by `safe_rewards`, while the rest of the batch scores as usual.

    partial_credit: see above; sandbox: a mode of `sandbox.MODES`; timeout_s (per test),
    memory_mb, output_bytes, file_bytes, processes, disk_mb: each program's `sandbox.Limits`;
    forgeable: what to do with a test the checker cannot decide without the program in its
    own interpreter (`sandbox.Outcome.forgeable`; one warning names the first): "skip" it
    (left out of the share; a sample with no other test scores 0), "run" the row the old,
    forgeable way, or raise an "error";
    max_parallel: sandboxes at once (0: four per CPU: a sandbox spends much of its life
    starting and waiting, and the loops of a batch should time out side by side); python: the interpreter programs
    run with ("": `sandbox.default_python`).
    """

    partial_credit: bool = True
    sandbox: str = "auto"
    timeout_s: float = 5.0
    memory_mb: int = 1024
    output_bytes: int = 1 << 20
    file_bytes: int = 16 << 20
    processes: int = 16
    disk_mb: int = 64
    forgeable: str = "skip"
    max_parallel: int = 0
    python: str = ""

    def __post_init__(self):
        _ = self.limits  # whose checks name the bad field
        if self.forgeable not in FORGEABLE_POLICIES:
            raise ValueError(f"code.forgeable={self.forgeable!r}; choose from {', '.join(FORGEABLE_POLICIES)}.")
        if self.max_parallel < 0:
            raise ValueError(f"code.max_parallel={self.max_parallel} must be >= 0 (0: four per CPU).")
        if self.sandbox not in sandbox.MODES:
            raise ValueError(f"code.sandbox={self.sandbox!r}; choose from {', '.join(sandbox.MODES)}.")

    @property
    def limits(self) -> sandbox.Limits:
        return sandbox.Limits(self.timeout_s, self.memory_mb, self.output_bytes, self.file_bytes, self.processes,
                              self.disk_mb)

    @property
    def parallel(self) -> int:
        """Sandboxes at once: within a call, and the threads `Scorer` scores samples on."""
        return self.max_parallel or 4 * (os.cpu_count() or 1)

    def check(self) -> str:
        """The sandbox mode this machine runs ours as (ValueError, one line, if it cannot)."""
        return sandbox.resolve_mode(self.sandbox, self.python or sandbox.default_python())

    def _outcome(self, prompt, completion: str, row: dict) -> sandbox.Outcome:
        suite = code_tests.row_tests(prompt, row)
        program = code_tests.program_of(completion, suite)
        outcome = sandbox.run(program, suite, self.limits, self.sandbox, self.python)
        if outcome.forgeable:
            _warn_forgeable(self.forgeable, suite, outcome)
            if self.forgeable == "error":
                raise ValueError(f"code.forgeable='error': a test of the row {suite.tests[0]!r:.80} cannot be decided "
                                 f"outside the program's interpreter ({outcome.detail}); set code.forgeable='skip' "
                                 "to leave such tests out, or 'run' to run them forgeably.")
            if self.forgeable == "run":
                outcome = dataclasses.replace(sandbox.run(program, suite, self.limits, self.sandbox, self.python,
                                                          inline=True), forgeable=outcome.forgeable)
        return outcome

    def _score(self, outcome: sandbox.Outcome) -> Scored:
        info = {k: v for k, v in dataclasses.asdict(outcome).items() if k != "forgeable" or v}
        if outcome.failure == "sandbox_error":
            return Scored(float("nan"), info)
        decided = outcome.total - (outcome.forgeable if self.forgeable == "skip" else 0)
        share = outcome.passed / max(decided, 1)
        return Scored(share if self.partial_credit else float(decided > 0 and outcome.passed == decided), info)

    def __call__(self, prompts: Sequence, completions: Sequence[str], **fields) -> list[Scored]:
        rows = [{k: v[i] for k, v in fields.items()} for i in range(len(completions))]
        for prompt, row in zip(prompts, rows, strict=True):
            code_tests.row_tests(prompt, row)  # a bad row fails the batch before any sandbox runs
        self.check()
        with concurrent.futures.ThreadPoolExecutor(max(1, min(self.parallel, len(completions)))) as pool:
            return [self._score(o) for o in pool.map(self._outcome, prompts, completions, rows)]


FORGEABLE_POLICIES = ("skip", "run", "error")


_forgeable_warned = threading.Event()


def _warn_forgeable(policy: str, suite: sandbox.Suite, outcome: sandbox.Outcome) -> None:
    """Once per process, for the first row with tests the checker cannot decide."""
    if not _forgeable_warned.is_set():
        _forgeable_warned.set()
        logger.warning("code reward: %d of %d tests of the row %r cannot be decided outside the program's own "
                       "interpreter (%s); code.forgeable=%r (counted in reward_info['forgeable']).",
                       outcome.forgeable, outcome.total, str(suite.tests[0])[:80], outcome.detail, policy)


REWARDS: dict[str, RewardFn] = {
    "answer_correctness": answer_correctness,
    "format": format_reward,
    "task": task_reward,
    "gsm8k": gsm8k_correctness,
    "math": math_correctness,
    "reasoning_gym": reasoning_gym_score,
    "code": CodeReward(),
}
# Rewards with options, config.<name>: get_reward(name, **options) builds one.
_CONFIGURABLE = {"code": CodeReward}
SCORE_RANGE = (0.0, 1.0)  # every reward of REWARDS scores within it (plots clip reward bands to it)
# Rewards that need a package: reward -> (module, how to install it).
_NEEDS = {"math": ("math_verify", "pip install -e ."),
          "reasoning_gym": ("reasoning_gym", environments.INSTALL_HINT)}


def get_reward(name: str, **options) -> RewardFn:
    """The reward `name`: one of `REWARDS`, or `module.path:function` for any importable
    reward of the convention above (a user's own verifier). `options` configure a reward
    that has them (`code`: `CodeReward`'s fields, config.code).

    Raises ValueError for a name that names no reward, ImportError for a module or package
    that cannot be imported; each message is one line naming the config field `reward`.
    """
    if name in _CONFIGURABLE:
        reward = _CONFIGURABLE[name](**options)
        reward.check()
        return reward
    if options:
        raise ValueError(f"reward={name!r} takes no options (given {sorted(options)}).")
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


def reward_from_config(config, name: str | None = None) -> RewardFn:
    """The reward `name` (default config.reward) with its options from the config:
    get_reward("code", **config.code), get_reward(name) for a reward without options."""
    name = config.reward if name is None else name
    return get_reward(name, **config[name]) if name in _CONFIGURABLE else get_reward(name)


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


def _checked_rewards(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str], fields: dict,
                     warn: bool = True) -> tuple[np.ndarray, int, FailedSample | None, list[dict | None]]:
    """`safe_rewards`, the first sample that failed (None if none did) and each score's
    `Scored.info` (None for a plain float); warn=False leaves the warning to the caller
    (`Scoring`, which warns once for its batch)."""
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
            _warn_failures(fn, len(failed), batch, first)
    infos = [getattr(s, "info", None) for s in scores]
    return np.array([0.0 if s is None else s for s in finite], dtype=np.float32), len(failed), first, infos


def _warn_failures(reward, failed: int, batch: int, first: FailedSample) -> None:
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
    scores, failures, _, _ = _checked_rewards(fn, prompts, completions, fields)
    return scores, failures


def safe_rewards_with_info(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str],
                           **fields) -> tuple[np.ndarray, int, list[dict | None]]:
    """`safe_rewards`, and each sample's `Scored.info` (None where the score is a plain float)."""
    scores, failures, _, infos = _checked_rewards(fn, prompts, completions, fields)
    return scores, failures, infos


_START_TIMEOUT_S = 300.0  # for a new worker process to be up


def _score_job(job) -> tuple[np.ndarray, int, FailedSample | None, float, int]:
    """`safe_rewards` for (reward name or function, prompts, completions, fields, warn),
    with its first failed sample, the seconds the reward took and how many samples had
    tests only the program's own interpreter could decide (the code reward's
    `reward_info['forgeable']`): what a scoring thread or worker process runs (a worker
    imports only this module, no JAX, and resolves a reward's name itself, module:function too)."""
    reward, prompts, completions, fields, warn = job
    fn = get_reward(reward) if isinstance(reward, str) else reward
    t0 = time.perf_counter()
    scores, failures, first, infos = _checked_rewards(fn, prompts, completions, fields, warn)
    forgeable = sum(bool(info and info.get("forgeable")) for info in infos)
    return scores, failures, first, time.perf_counter() - t0, forgeable


def _sample_job(job, i: int):
    """Sample `i` of a job, as a job of its own."""
    reward, prompts, completions, fields, warn = job
    return reward, [prompts[i]], [completions[i]], {k: v[i:i + 1] for k, v in fields.items()}, warn


def _worker_main(connection) -> None:
    """A reward worker process: scores the jobs `connection` brings, one at a time, until
    None (or until the training process is gone)."""
    connection.send("ready")
    while True:
        try:
            job = connection.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            reply = (True, _score_job(job))
        except Exception as error:  # noqa: BLE001 - the waiting side raises it
            reply = (False, error)
        try:
            connection.send(reply)
        except Exception as error:  # noqa: BLE001 - a result or exception that does not pickle
            connection.send((False, RuntimeError(f"a reward worker could not send back {reply[1]!r:.200}: {error!r}")))


def _exit_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit status {exitcode}"


@dataclasses.dataclass(frozen=True)
class _Died:
    """A job's result when its worker process died while scoring it."""

    sample: FailedSample  # the job's first sample
    exitcode: int | None

    @classmethod
    def of(cls, job, exitcode: int | None) -> _Died:
        _, prompts, completions, _, _ = job
        return cls(FailedSample(str(prompts[0]), str(completions[0]),
                                f"its reward worker died ({_exit_text(exitcode)})"), exitcode)


class _Workers:
    """`count` spawned worker processes, each scoring one job at a time, fed in order of
    submission by one thread of this process per worker.

    A multiprocessing.Pool replaces a worker that dies but loses the job it held, which
    then waits out the batch's deadline (or forever, without one). Here the job's future
    gets `_Died` at once, and a fresh process takes the dead one's place. `terminate` kills
    every worker (a deadline passed); `close` lets them finish what they were given."""

    def __init__(self, count: int):
        # Spawned, not forked: forking a process that runs JAX threads can deadlock.
        self._context = multiprocessing.get_context("spawn")
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: set = set()
        self._closing = False
        started = [self._spawn() for _ in range(count)]  # side by side: they start in parallel
        deadline = time.monotonic() + _START_TIMEOUT_S
        workers = [self._await_ready(*w, deadline) for w in started]
        self._threads = [threading.Thread(target=self._serve, args=w, name="reward-worker", daemon=True)
                         for w in workers]
        for thread in self._threads:
            thread.start()

    def submit(self, job) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self._jobs.put((future, job))
        return future

    def _spawn(self):
        parent_end, child_end = self._context.Pipe()
        process = self._context.Process(target=_worker_main, args=(child_end,), name="reward-worker", daemon=True)
        process.start()
        child_end.close()  # so that the worker's death reads as the end of the pipe
        with self._lock:
            self._live.add(process)
            if self._closing:  # terminate ran meanwhile
                process.kill()
        return process, parent_end

    @staticmethod
    def _await_ready(process, connection, deadline: float):
        if connection.poll(max(deadline - time.monotonic(), 0.0)):
            try:
                if connection.recv() == "ready":
                    return process, connection
            except EOFError:  # it died on the way up
                process.join(5.0)
        connection.close()
        if process.exitcode is None:
            process.kill()
            process.join()
            raise RuntimeError(f"A reward worker did not start within {_START_TIMEOUT_S:g} s.")
        raise RuntimeError(f"A reward worker died as it started ({_exit_text(process.exitcode)}).")

    def _start(self):
        return self._await_ready(*self._spawn(), time.monotonic() + _START_TIMEOUT_S)

    @staticmethod
    def _exchange(process, connection, job):
        """The worker's reply to `job`, or None if the worker died first."""
        try:
            connection.send(job)
            # Its sentinel too: a program the reward started may hold the pipe open past its death.
            if connection in multiprocessing.connection.wait([connection, process.sentinel]):
                return connection.recv()
        except (EOFError, OSError):
            pass
        return None

    def _serve(self, process, connection) -> None:
        while (item := self._jobs.get()) is not None and not self._closing:
            future, job = item
            if not future.set_running_or_notify_cancel():
                continue
            if process is None:  # the last replacement failed to start: try again, for this job
                try:
                    process, connection = self._start()
                except RuntimeError as error:
                    future.set_exception(error)
                    continue
            reply = self._exchange(process, connection, job)
            if reply is not None:
                ok, value = reply
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)
                continue
            process.join()
            connection.close()
            with self._lock:
                self._live.discard(process)
            if self._closing:  # terminated: killed, not dead
                return
            future.set_result(_Died.of(job, process.exitcode))
            try:
                process, connection = self._start()
            except RuntimeError as error:
                if self._closing:
                    return
                logger.error("%s The next job tries again.", error)
                process = connection = None
        if process is not None:
            with contextlib.suppress(OSError):
                connection.send(None)
            process.join()
            connection.close()

    def terminate(self) -> None:
        """Kills every worker, and what they hold with them; for a pool no one uses again."""
        with self._lock:
            self._closing = True
            live = list(self._live)
        for process in live:
            process.kill()
        for _ in self._threads:
            self._jobs.put(None)
        for process in live:
            process.join()

    def close(self) -> None:
        """Waits for the jobs given, then for every worker to exit."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()


class _ScoringThread:
    """Daemon threads scoring jobs in this process, in order of submission: submitting
    never blocks the caller (the engine's host loop), and a reward that hangs past a
    deadline is left behind with its thread (a daemon: it keeps no process alive). One
    thread, or a reward's `parallel` (one that waits on subprocesses, as `CodeReward`)."""

    def __init__(self, threads: int = 1):
        self._jobs, self._threads = queue.SimpleQueue(), threads
        for _ in range(threads):
            threading.Thread(target=self._serve, name="reward", daemon=True).start()

    def submit(self, job) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self._jobs.put((future, job))
        return future

    def _serve(self):
        while (item := self._jobs.get()) is not None:
            future, job = item
            if future.set_running_or_notify_cancel():  # cancelled: its batch passed its deadline
                try:
                    future.set_result(_score_job(job))
                except BaseException as error:  # noqa: BLE001 - the waiting side reports it
                    future.set_exception(error)

    def close(self):
        for _ in range(self._threads):
            self._jobs.put(None)


@dataclasses.dataclass(frozen=True)
class Scores:
    """A batch's rewards as the RL loop gets them from `Scorer`."""

    scores: np.ndarray  # [B] float32; 0 where a sample failed
    failures: int  # samples scored 0: their reward raised, was not finite, not in time, or its worker died
    timed_out: int  # of those, the samples whose scoring passed the batch's deadline
    failed_sample: FailedSample | None = None  # the first whose reward raised or was not finite, to show
    scoring_s: float = 0.0  # seconds the reward ran, summed over its calls (workers run them side by side)
    died: int = 0  # of the failures, the samples whose worker process died while scoring them
    forgeable: int = 0  # samples with tests only the program's own interpreter could decide (code reward)


class Scorer:
    """Scores batches with one reward: `safe_rewards` in this process (workers=0) or split
    over `workers` spawned processes, within `timeout_s` seconds per batch (0: no deadline).

    What has not finished by the deadline (the batch inline, or a worker's part of it)
    scores 0 and is counted (`Scores.timed_out`), and the next batch is scored as usual.
    Worker processes past the deadline are terminated and a fresh pool serves the next
    batch; a pool starts at once and waits for its workers to be up, so the deadline
    counts scoring, not start-up. A worker that dies (killed, or a reward that exits its
    process) is replaced at once: the sample it was scoring scores 0 and is counted
    (`Scores.died`, among the failures) and shown in one warning, and the rest of the
    batch does not wait for the deadline. A worker's part of a batch is then scored again
    sample by sample, so that only a sample that kills its worker scores 0. Inline, the
    call is left running on a daemon thread (Python cannot stop a thread), which is enough
    for a reward that waits (on I/O, a lock, a sleep); a reward that can hang while it
    computes, or that can take its process down, belongs in workers.

    `begin` scores a batch sample by sample instead, as its samples come (`Scoring`): the
    RL loop hands each sample over as it finishes decoding, so the reward runs while the
    rest decode.

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
        self._pool = _Workers(workers) if workers else None  # replaced after a deadline passes
        self._thread: _ScoringThread | None = None  # Scoring's, with workers=0; started at the first

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], fields: dict) -> Scores:
        """Scores [B] for B samples; `fields` are per-sample sequences of length B."""
        deadline = time.monotonic() + self.timeout_s if self.timeout_s > 0 else None
        parts = np.array_split(np.arange(len(completions)), max(self.workers, 1))
        jobs = [(self.reward, [prompts[i] for i in part], [completions[i] for i in part],
                 {k: [v[i] for i in part] for k, v in fields.items()}, True) for part in parts if len(part)]
        if self.workers:
            scored = self._in_workers(jobs, deadline)
        else:
            scored = [(job, self._inline(job, deadline)) for job in jobs]
        return self._gather([len(job[2]) for job, _ in scored], [result for _, result in scored], len(completions))

    def begin(self) -> Scoring:
        """A batch to score sample by sample as its samples come (see `Scoring`)."""
        return Scoring(self)

    def _gather(self, sizes: list[int], results: list, batch: int) -> Scores:
        """The Scores of consecutive parts of `sizes` samples each, from their results
        (`_score_job`'s, None for a part not scored by the deadline, or `_Died`)."""
        scores, failed_sample = [np.zeros((0,), np.float32)], None
        failures = timed_out = forgeable = 0
        seconds = 0.0
        deaths: list[tuple[int, _Died]] = []
        for n, result in zip(sizes, results, strict=True):
            if result is None or isinstance(result, _Died):
                scores.append(np.zeros((n,), np.float32))
                failures += n
                if result is None:
                    timed_out += n
                else:
                    deaths.append((n, result))
            else:
                scores.append(result[0])
                failures += result[1]
                failed_sample = failed_sample or result[2]
                seconds += result[3]
                forgeable += result[4]
        if timed_out:
            logger.warning("reward %s did not score %d of %d samples within reward_timeout_s=%g s; they score 0.",
                           getattr(self.reward, "__name__", self.reward), timed_out, batch, self.timeout_s)
        died = sum(n for n, _ in deaths)
        if died:
            logger.warning("reward %s: %d worker process(es) died (%s) while scoring %d of %d samples; they score 0, "
                           "and fresh workers took their places. The first: %s",
                           getattr(self.reward, "__name__", self.reward), len(deaths),
                           ", ".join(sorted({_exit_text(d.exitcode) for _, d in deaths})), died, batch,
                           deaths[0][1].sample)
        return Scores(np.concatenate(scores), failures, timed_out, failed_sample, seconds, died, forgeable)

    @staticmethod
    def _inline(job, deadline: float | None):
        if deadline is None:
            return _score_job(job)
        out = []
        thread = threading.Thread(target=lambda: out.append(_score_job(job)), name="reward", daemon=True)
        thread.start()
        thread.join(max(deadline - time.monotonic(), 0.0))
        return out[0] if out else None

    def _restart_pool(self) -> None:
        self._pool.terminate()  # the hung workers with it
        self._pool = _Workers(self.workers)

    def _wait(self, jobs, deadline: float | None) -> list:
        """`jobs` scored in workers: each one's result, None for one past the deadline."""
        futures = [self._pool.submit(job) for job in jobs]
        _, pending = concurrent.futures.wait(futures, None if deadline is None else
                                             max(deadline - time.monotonic(), 0.0))
        if pending:
            self._restart_pool()
        return [None if f in pending else f.result() for f in futures]

    def _in_workers(self, jobs, deadline: float | None) -> list[tuple]:
        """(job, result) for jobs that together hold `jobs`' samples in order: a job whose
        worker died is scored again sample by sample, as jobs of one sample each, unless the
        deadline passed."""
        results = self._wait(jobs, deadline)
        again = {} if any(r is None for r in results) else {
            i: [_sample_job(job, k) for k in range(len(job[2]))] for i, (job, result) in enumerate(zip(jobs, results))
            if isinstance(result, _Died) and len(job[2]) > 1}
        retried = iter(self._wait([single for singles in again.values() for single in singles], deadline))
        scored = []
        for i, (job, result) in enumerate(zip(jobs, results)):
            scored += [(single, next(retried)) for single in again[i]] if i in again else [(job, result)]
        return scored

    def _submit(self, job) -> concurrent.futures.Future:
        """Starts scoring `job` in a worker or on the scoring thread; its future result."""
        if not self.workers:
            if self._thread is None:
                fn = get_reward(self.reward) if isinstance(self.reward, str) else self.reward
                self._thread = _ScoringThread(getattr(fn, "parallel", 1))
            return self._thread.submit(job)
        return self._pool.submit(job)

    def _abandon(self, pending: Sequence[concurrent.futures.Future]) -> None:
        """After a deadline passed with `pending` unfinished: the next batch gets fresh
        workers, or a fresh scoring thread (the old one finishes its current sample, if
        ever, and skips the rest)."""
        if self.workers:
            self._restart_pool()
        else:
            for future in pending:
                future.cancel()
            self._thread.close()
            self._thread = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._thread is not None:
            self._thread.close()
            self._thread = None


class Scoring:
    """One batch scored sample by sample as its samples come (`Scorer.begin`).

    `submit` hands one sample to a worker process (reward_workers > 0) or to a scoring
    thread of this process and returns at once: the engine calls it between device chunks,
    which a reward run inline there would hold up. `result` waits for every sample and
    gives the batch's `Scores`, equal to `Scorer.__call__` on the whole batch, bit for bit,
    for a reward whose score of a sample depends on that sample alone (every reward of
    `REWARDS`): each sample is scored as the batch fallback of `safe_rewards` scores it,
    and failures warn once for the batch. The Scorer's deadline counts from `result`: it
    bounds the wait after the last sample was handed over. Submitting from several
    threads (the engine's rollout groups) is safe.
    """

    def __init__(self, scorer: Scorer):
        self._scorer = scorer
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def __contains__(self, index: int) -> bool:
        return index in self._futures

    def submit(self, index: int, prompt: str, completion: str, fields: dict) -> None:
        """Starts scoring sample `index` of the batch; `fields`: this sample's value of each."""
        with self._lock:
            if index in self._futures:
                raise ValueError(f"Sample {index} was submitted twice; each sample is scored once.")
            job = (self._scorer.reward, [prompt], [completion], {k: [v] for k, v in fields.items()}, False)
            self._futures[index] = self._scorer._submit(job)

    def result(self, batch: int) -> Scores:
        """The Scores [batch] of samples 0..batch-1, every one of them submitted."""
        missing = sorted(set(range(batch)) - set(self._futures))
        extra = sorted(set(self._futures) - set(range(batch)))
        if missing or extra:
            raise ValueError(f"A batch of {batch} samples, but samples {missing[:8]} were never submitted and "
                             f"{extra[:8]} are not of it.")
        futures = [self._futures[i] for i in range(batch)]
        timeout = self._scorer.timeout_s if self._scorer.timeout_s > 0 else None
        _, pending = concurrent.futures.wait(futures, timeout)
        results = [None if f in pending else f.result() for f in futures]
        if pending:
            self._scorer._abandon(list(pending))
        scores = self._scorer._gather([1] * batch, results, batch)
        failed = [i for i, r in enumerate(results) if isinstance(r, tuple) and r[1]]
        if failed:
            _warn_failures(self._scorer.reward, len(failed), batch, scores.failed_sample)
        return scores
