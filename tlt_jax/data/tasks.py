"""Verifiable synthetic reasoning tasks: the RL baseline's data.

Each task procedurally generates problems with a step-by-step solution trace and a short
final answer that a program can check. Trace lengths are long-tailed on purpose (most
short, a few several times the median) so rollouts show the straggler problem that
speculative decoding in the tail attacks.

Text conventions (shared by SFT, rollout and rewards):
  * the model is given `Example.prompt` (one line ending in a newline) after <bos>, and
    must produce `Example.solution` followed by <eos>;
  * a solution is one or more trace lines and then exactly one final line
    `ANSWER_PREFIX + answer`, with no trailing newline;
  * every character is in `ALPHABET`, so `build_task_tokenizer` (one id per character,
    plus <pad>, <bos>, <eos>, <unk>) covers all tasks.

Tasks (difficulty knobs are dataclass fields; `TASKS` holds the default presets):
  collatz    "collatz 6\n" -> "3 10 5 16 8 4 2 1\nanswer: 8", the trajectory to 1, ten
             values a line, answer = number of steps.
  addition   "add 487+356\n" -> "7+6=13\n8+5+1=14\n4+3+1=8\nanswer: 843", one line per
             digit from the right with the carry written as "+1".
             With `trace_share` < 1, a solution is that worked trace with that
             probability and otherwise the bare answer "at once\nanswer: 843".
  countdown  "countdown 9 7 6 to 105\n" -> a depth-first search over pairwise operations,
             one line per tried operation ("9+7=16", then " 16+6=22" one level down),
             ending at the first value equal to the target; answer = an expression over
             the given numbers, here "(9+6)*7"; any correct expression is accepted.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import re
from fractions import Fraction
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

ANSWER_PREFIX = "answer: "
# Every character any task writes, prompts included; tests check that nothing escapes it.
ALPHABET = "0123456789 \n:+-*/=()acdelnorstuwz"

# The one line before a bare answer (Addition.trace_share): a solution needs a line before
# its answer line (rewards.is_well_formed), and a fixed one makes the first token choose
# the format.
BARE_ANSWER_LINE = "at once"

# Percent of problems (by hash of the prompt) reserved for evaluation.
EVAL_PERCENT = 10
SPLITS = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class Example:
    """One problem: `prompt` is what the model sees, `solution` what it must write.

    For the synthetic tasks `answer` is the text after ANSWER_PREFIX on the solution's last
    line, `task` names the task in `TASKS` (rewards use it to pick the checker) and
    `fields` holds task-specific metadata (e.g. the Collatz start value). Problems from
    files and environments use the same record: a prompt may then be a conversation (a
    tuple of {role, content} messages), `answer` is the reference a reward checks, and
    `fields` the row's other columns, which reach the reward as keyword fields.
    """

    prompt: str | tuple
    solution: str
    answer: str
    task: str
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Task(Protocol):
    """A problem generator with a checker for its answers."""

    name: str

    def sample(self, rng: np.random.Generator) -> Example:
        """A random problem; deterministic given the generator's state."""

    def check(self, predicted: str, answer: str, prompt: str) -> bool:
        """Whether `predicted` (text after ANSWER_PREFIX) solves the problem in `prompt`."""


def _solution(trace_lines: Sequence[str], answer: str) -> str:
    return "\n".join([*trace_lines, ANSWER_PREFIX + answer])


def solution_format(completion: str) -> str:
    """"bare" where a completion opens with BARE_ANSWER_LINE (Addition.trace_share), else
    "trace"."""
    return "bare" if completion.split("\n", 1)[0].strip() == BARE_ANSWER_LINE else "trace"


def _exact_match(predicted: str, answer: str) -> bool:
    return predicted.strip() == answer.strip()


@dataclasses.dataclass(frozen=True)
class Collatz:
    """Collatz trajectory of a start value drawn log-uniformly from [2, max_start].

    Log-uniform starts make most problems short while a few (e.g. 27: 111 steps, peak
    9232) run to hundreds of characters. Values are written ten a line so the step count
    can be read off line by line rather than counted over one long line.
    """

    max_start: int = 400
    values_per_line: int = 10
    name: str = "collatz"

    def sample(self, rng: np.random.Generator) -> Example:
        start = int(math.exp(rng.uniform(math.log(2), math.log(self.max_start + 1))))
        trajectory = []
        value = start
        while value != 1:
            value = value // 2 if value % 2 == 0 else 3 * value + 1
            trajectory.append(value)
        lines = [" ".join(map(str, trajectory[i:i + self.values_per_line]))
                 for i in range(0, len(trajectory), self.values_per_line)]
        answer = str(len(trajectory))
        return Example(f"collatz {start}\n", _solution(lines, answer), answer, self.name,
                       {"start": start, "steps": len(trajectory), "peak": max(trajectory)})

    def check(self, predicted: str, answer: str, prompt: str) -> bool:
        return _exact_match(predicted, answer)


@dataclasses.dataclass(frozen=True)
class Addition:
    """Schoolbook addition of two integers, one trace line per digit from the right.

    Each operand's digit count follows a Zipf law with exponent `digits_zipf`, truncated
    at `max_digits` (P(d) ~ d^-2 by default): mostly 1-2 digits, now and then tens of
    digits, a heavier tail than a geometric law gives. A line is
    "a+b=s" or "a+b+1=s" when a carry comes in; a missing digit of the shorter operand is
    written as 0 so every line has the same shape.
    """

    digits_zipf: float = 2.0
    max_digits: int = 30
    # Operands shorter than this are redrawn: a floor under the Zipf law, so that few
    # problems are small enough to add without a trace.
    min_digits: int = 1
    # The probability that a solution is the worked trace; otherwise it is the bare answer
    # (BARE_ANSWER_LINE, then the answer line), drawn per example, so nothing in the prompt
    # says which. A warm start trained mostly on bare answers, which a small model gets
    # wrong past a few digits, has a reliable format it rarely uses for RL to find
    # (configs/common.py: tasks_drift_learn).
    trace_share: float = 1.0
    name: str = "addition"

    def _operand(self, rng: np.random.Generator) -> int:
        num_digits = int(rng.zipf(self.digits_zipf))
        while not self.min_digits <= num_digits <= self.max_digits:
            num_digits = int(rng.zipf(self.digits_zipf))
        # Digit by digit: numpy integers overflow past 18 digits.
        leading = int(rng.integers(0 if num_digits == 1 else 1, 10))
        return int(str(leading) + "".join(map(str, rng.integers(0, 10, num_digits - 1))))

    def sample(self, rng: np.random.Generator) -> Example:
        a, b = self._operand(rng), self._operand(rng)
        digits_a, digits_b = str(a)[::-1], str(b)[::-1]
        lines, carry = [], 0
        for i in range(max(len(digits_a), len(digits_b))):
            da = int(digits_a[i]) if i < len(digits_a) else 0
            db = int(digits_b[i]) if i < len(digits_b) else 0
            total = da + db + carry
            lines.append(f"{da}+{db}{'+1' if carry else ''}={total}")
            carry = total // 10
        answer = str(a + b)
        # Drawn only below 1, so that the default's stream of problems stays as it was.
        if self.trace_share < 1.0 and rng.random() >= self.trace_share:
            lines = [BARE_ANSWER_LINE]
        return Example(f"add {a}+{b}\n", _solution(lines, answer), answer, self.name, {"a": a, "b": b})

    def check(self, predicted: str, answer: str, prompt: str) -> bool:
        return _exact_match(predicted, answer)


_COUNTDOWN_PROMPT = re.compile(r"countdown ((?:\d+ )+)to (\d+)")


def _combinations(a: int, b: int):
    """(op, value) pairs for a >= b: positive integer results only, skipping no-ops (x*1,
    x/1) and zero, which shrinks the search without losing any reachable target."""
    yield "+", a + b
    if a > b:
        yield "-", a - b
    if b > 1:
        yield "*", a * b
        if a % b == 0:
            yield "/", a // b


@dataclasses.dataclass(frozen=True)
class Countdown:
    """Reach a target from `num_numbers` values in [1, max_number] with + - * /.

    The target is built from a random expression over all the numbers, but the trace is
    a depth-first search in a fixed order that stops at the first value equal to the
    target (any subset of the numbers may be used), so how long the trace is depends on
    how early the search stumbles on a solution: usually a few lines, sometimes the whole
    tree. Trace line: depth-1 spaces, then "a op b=c" with a >= b, combining two values
    of the current state. Problems whose search exceeds `max_trace_lines` are redrawn
    (relevant from four numbers on, where the tree has thousands of nodes).
    """

    num_numbers: int = 3
    max_number: int = 10
    max_trace_lines: int = 120
    name: str = "countdown"

    def _random_target(self, numbers: list[int], rng: np.random.Generator) -> int:
        values = list(numbers)
        while len(values) > 1:
            i, j = rng.choice(len(values), size=2, replace=False)
            a, b = max(values[i], values[j]), min(values[i], values[j])
            options = list(_combinations(a, b))
            value = options[int(rng.integers(len(options)))][1]
            values = [v for k, v in enumerate(values) if k not in (i, j)] + [value]
        return values[0]

    def _search(self, state: list[tuple[int, str]], target: int, depth: int, lines: list[str]):
        """Depth-first search; appends trace lines and returns the solving expression or None.
        `state` holds (value, expression) pairs sorted by value, descending."""
        for i, j in itertools.combinations(range(len(state)), 2):
            (a, expr_a), (b, expr_b) = state[i], state[j]
            rest = [s for k, s in enumerate(state) if k not in (i, j)]
            for op, value in _combinations(a, b):
                if len(lines) >= self.max_trace_lines:
                    return None  # over budget: the caller redraws the problem
                lines.append(f"{' ' * depth}{a}{op}{b}={value}")
                expr = f"({expr_a}{op}{expr_b})"
                if value == target:
                    return expr[1:-1]
                if rest:
                    found = self._search(sorted(rest + [(value, expr)], reverse=True), target, depth + 1, lines)
                    if found:
                        return found
        return None

    def sample(self, rng: np.random.Generator) -> Example:
        while True:
            numbers = sorted((int(v) for v in rng.integers(1, self.max_number + 1, self.num_numbers)), reverse=True)
            target = self._random_target(numbers, rng)
            if target in numbers:
                continue  # a zero-step problem teaches nothing
            lines: list[str] = []
            answer = self._search([(n, str(n)) for n in numbers], target, 0, lines)
            if answer is not None:
                prompt = f"countdown {' '.join(map(str, numbers))} to {target}\n"
                return Example(prompt, _solution(lines, answer), answer, self.name,
                               {"numbers": numbers, "target": target})

    def check(self, predicted: str, answer: str, prompt: str) -> bool:
        """Any expression over a sub-multiset of the prompt's numbers that evaluates
        exactly (rational arithmetic) to the target is correct, not only `answer`."""
        match = _COUNTDOWN_PROMPT.match(prompt)
        if match is None:
            raise ValueError(f"not a countdown prompt: {prompt!r}")
        numbers, target = [int(v) for v in match.group(1).split()], int(match.group(2))
        parsed = _evaluate_expression(predicted.strip())
        if parsed is None:
            return False
        value, used = parsed
        available = list(numbers)
        for n in used:
            if n not in available:
                return False
            available.remove(n)
        return value == target


def _evaluate_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """Value and literals of an arithmetic expression over non-negative integers with
    + - * / and parentheses; None if it does not parse or divides by zero."""
    tokens = re.findall(r"\d+|[-+*/()]", text)
    if not tokens or "".join(tokens) != text.replace(" ", ""):
        return None
    position = 0
    literals: list[int] = []

    def peek():
        return tokens[position] if position < len(tokens) else None

    def take():
        nonlocal position
        position += 1
        return tokens[position - 1]

    def expression():
        value = term()
        while peek() in ("+", "-"):
            value = value + term() if take() == "+" else value - term()
        return value

    def term():
        value = factor()
        while peek() in ("*", "/"):
            if take() == "*":
                value *= factor()
            else:
                divisor = factor()
                value /= divisor  # ZeroDivisionError is caught below
        return value

    def factor():
        token = take() if peek() is not None else None
        if token == "(":
            value = expression()
            if take() != ")":
                raise SyntaxError
            return value
        if token is None or not token.isdigit():
            raise SyntaxError
        literals.append(int(token))
        return Fraction(int(token))

    try:
        value = expression()
    except (SyntaxError, ZeroDivisionError, IndexError):
        return None
    return (value, literals) if position == len(tokens) else None


TASKS: dict[str, Task] = {task.name: task for task in (Collatz(), Addition(), Countdown())}


def get_task(name: str, **knobs) -> Task:
    """The registered task `name`, with any difficulty knobs overridden."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    return dataclasses.replace(TASKS[name], **knobs) if knobs else TASKS[name]


def check_answer(task: str, predicted: str, answer: str, prompt: str) -> bool:
    """Whether `predicted` answers the problem; checkers do not depend on difficulty knobs."""
    return get_task(task).check(predicted, answer, prompt)


@dataclasses.dataclass(frozen=True)
class Mixture:
    """Samples a task by weight, then a problem from it; a Task for `make_split`."""

    tasks: tuple[Task, ...]
    weights: tuple[float, ...]
    name: str = "mixture"

    def __post_init__(self):
        if len(self.tasks) != len(self.weights) or not self.tasks or min(self.weights) < 0 or sum(self.weights) <= 0:
            raise ValueError(f"need one non-negative weight per task, positive total; got {self.weights}.")

    def sample(self, rng: np.random.Generator) -> Example:
        probabilities = np.asarray(self.weights, dtype=np.float64) / sum(self.weights)
        return self.tasks[int(rng.choice(len(self.tasks), p=probabilities))].sample(rng)


def mixture(weights: Mapping[str, float] | None = None) -> Mixture:
    """A mixture of registered tasks by name -> weight (default: all tasks, equal weight)."""
    weights = dict(weights) if weights is not None else {name: 1.0 for name in TASKS}
    return Mixture(tuple(get_task(name) for name in weights), tuple(float(w) for w in weights.values()))


def split_of(prompt: str) -> str:
    """"train" or "eval", a fixed function of the problem, so splits never overlap
    whatever the seeds or knobs (blake2b: stable across processes, unlike hash())."""
    bucket = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little") % 100
    return "eval" if bucket < EVAL_PERCENT else "train"


def make_split(task: Task | Mixture, split: str, n: int, seed: int = 0, unique: bool = False) -> list[Example]:
    """`n` examples of `split` ("train" or "eval"), deterministic in (task, split, n, seed).

    Problems are drawn with replacement and kept when `split_of` assigns them to `split`;
    a small problem space can therefore repeat problems within a split, unless `unique`
    (evaluation sets: each problem counts once).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    examples: list[Example] = []
    seen: set[str] = set()
    # Generous: ~10% of draws land in eval; fewer than that means the problem space is tiny.
    max_draws = 100 * n + 1000
    for _ in range(max_draws):
        if len(examples) == n:
            break
        example = task.sample(rng)
        if split_of(example.prompt) == split and not (unique and example.prompt in seen):
            examples.append(example)
            seen.add(example.prompt)
    if len(examples) < n:
        raise RuntimeError(f"only {len(examples)} of {n} {split} problems in {max_draws} draws from "
                           f"{task.name}; widen its knobs.")
    return examples


def reward_fields(examples: Sequence[Example]) -> dict[str, list]:
    """Per-sample keyword fields for reward functions: answer=[...], task=[...], and each
    field of the examples' `fields` (a dataset's other columns; None where an example has
    none of that name)."""
    reserved = {"answer", "task", "prompts", "completions"}
    names = sorted({name for e in examples for name in e.fields} - reserved)
    out = {name: [e.fields.get(name) for e in examples] for name in names}
    out.update(answer=[e.answer for e in examples], task=[e.task for e in examples])
    return out


def length_stats(examples: Sequence[Example]) -> dict[str, float]:
    """Solution length in characters: median, p90, max, and the tail ratio max/median."""
    lengths = np.array([len(e.solution) for e in examples])
    median = float(np.median(lengths))
    return {"median": median, "p90": float(np.percentile(lengths, 90)), "max": float(lengths.max()),
            "tail_ratio": float(lengths.max()) / median}


def build_task_tokenizer(out_dir: str):
    """Writes (and returns, loaded back) the character tokenizer for all tasks:
    <pad>=0, <bos>=1, <eos>=2, <unk>=3, then one id per ALPHABET character."""
    from tlt_jax.tokenizer import build_char_tokenizer
    return build_char_tokenizer(out_dir, ALPHABET)


def from_spec(spec: Mapping[str, Mapping[str, Any]]) -> Task | Mixture:
    """A task or weighted mixture from a config: {name: {"weight": w, **knobs}}."""
    if not spec:
        raise ValueError("The task spec is empty; name at least one of " + ", ".join(sorted(TASKS)) + ".")
    built, weights = [], []
    for name, settings in spec.items():
        settings = dict(settings)
        weights.append(float(settings.pop("weight", 1.0)))
        built.append(get_task(name, **settings))
    return built[0] if len(built) == 1 else Mixture(tuple(built), tuple(weights))
