"""Rewards: own solutions score 1, corruptions less, format rules, GSM8K checker, safe_rewards."""
import logging
import math

import numpy as np
import pytest

from tlt_jax.data import rewards, tasks


@pytest.fixture(scope="module")
def examples():
    return tasks.make_split(tasks.mixture(), "eval", 300, seed=0)


def _score(name, examples, completions):
    return rewards.get_reward(name)([e.prompt for e in examples], completions, **tasks.reward_fields(examples))


def test_own_solutions_score_one(examples):
    solutions = [e.solution for e in examples]
    for name in ("answer_correctness", "format", "task"):
        assert _score(name, examples, solutions) == [1.0] * len(examples), name


def test_corrupted_answers_score_less(examples):
    # Appending a digit changes every number, and makes every countdown expression use
    # a number it was not given.
    corrupted = [e.solution + "1" for e in examples]
    assert _score("answer_correctness", examples, corrupted) == [0.0] * len(examples)
    assert _score("task", examples, corrupted) == [rewards.FORMAT_CREDIT] * len(examples)
    truncated = [e.solution.rsplit("\n", 1)[0] for e in examples]
    assert _score("task", examples, truncated) == [0.0] * len(examples)


def test_countdown_accepts_another_valid_expression():
    fields = {"answer": ["(9+6)*7"], "task": ["countdown"]}
    prompt = ["countdown 9 7 6 to 105\n"]
    assert rewards.task_reward(prompt, ["9+6=15\nanswer: 7*(9+6)"], **fields) == [1.0]
    assert rewards.task_reward(prompt, ["9+6=15\nanswer: 7*(9+9)"], **fields) == [rewards.FORMAT_CREDIT]


@pytest.mark.parametrize("completion, well_formed", [
    ("1+2=3\nanswer: 3", True),
    ("1+2=3\nanswer: 3\n", True),
    (" 1+2=3\n 3+3=6\nanswer: 6", True),
    ("answer: 3", False),                      # no trace
    ("1+2=3\n", False),                        # no answer line
    ("1+2=3\nanswer: ", False),                # empty answer
    ("1+2=3\nanswer: 3\nanswer: 3", False),    # two answer lines
    ("answer: 3\n1+2=3", False),               # answer not last
    ("1+2=3\n\nanswer: 3", False),             # empty line
    ("1+2=3 ok?\nanswer: 3", False),           # outside the alphabet
])
def test_format(completion, well_formed):
    assert rewards.is_well_formed(completion) is well_formed
    assert rewards.format_reward(["p"], [completion]) == [float(well_formed)]


def test_answer_parsing_and_exact_match_without_task():
    assert rewards.parse_answer("x\nanswer: 3\nanswer:  42 ") == "42"
    assert rewards.parse_answer("no answer") is None
    assert rewards.answer_correctness(["p"] * 3, ["answer: 42", "answer: 041", "42"], answer=["42", "41", "42"]) \
        == [1.0, 0.0, 0.0]
    # A malformed completion scores 0 in the task reward even with the right answer.
    assert rewards.task_reward(["p"], ["answer: 42\njunk"], answer=["42"]) == [0.0]


@pytest.mark.parametrize("completion, reference, correct", [
    ("so she pays 3 * 24 = 72 dollars.\n#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", True),
    ("#### 1,234", "1234", True),
    ("The answer is $1,234.00.", "1234", True),
    ("We get \\boxed{72} in the end, not 71.", "72", True),
    ("\\boxed{\\frac{3}{4}}", "0.75", True),
    ("3/4 of them", "0.75", True),
    ("temperature drops to -5 degrees", "#### -5", True),
    ("first 72, then 70", "72", False),        # the last number counts
    ("pages 10-15", "15", True),               # a minus between numbers is no sign
    ("#### 72 (or 73)", "72", True),           # after '####', the first number counts
    ("no number here", "72", False),
    ("72", "not a number", False),
    ("#### 5", "50", False),
])
def test_gsm8k(completion, reference, correct):
    assert rewards.gsm8k_correctness(["q"], [completion], answer=[reference]) == [float(correct)]


def test_registry():
    assert set(rewards.REWARDS) == {"answer_correctness", "format", "task", "gsm8k"}
    assert rewards.get_reward("task") is rewards.task_reward
    with pytest.raises(KeyError, match="known"):
        rewards.get_reward("bleu")


def _raises_on_boom(prompts, completions, answer, **_):
    if any("boom" in c for c in completions):
        raise RuntimeError("reward bug")
    return [float(c == a) for c, a in zip(completions, answer)]


def _nan_on_odd_answers(prompts, completions, answer, **_):
    return [math.nan if int(a) % 2 else (math.inf if a == "4" else 1.0) for a in answer]


def test_safe_rewards_isolates_failing_samples(caplog):
    completions, answer = ["1", "boom", "3", "x"], ["1", "2", "3", "4"]
    with caplog.at_level(logging.WARNING, logger=rewards.__name__):
        scores, failures = rewards.safe_rewards(_raises_on_boom, ["p"] * 4, completions, answer=answer)
    assert scores.dtype == np.float32 and scores.tolist() == [1.0, 0.0, 1.0, 0.0] and failures == 1
    assert "1 of 4" in caplog.text

    scores, failures = rewards.safe_rewards(_nan_on_odd_answers, ["p"] * 4, ["c"] * 4, answer=["1", "2", "3", "4"])
    assert scores.tolist() == [0.0, 1.0, 0.0, 0.0] and failures == 3

    def wrong_length(prompts, completions, **_):
        return [1.0, 1.0] if len(completions) > 1 else [0.5]
    scores, failures = rewards.safe_rewards(wrong_length, ["p"] * 3, ["c"] * 3)
    assert scores.tolist() == [0.5] * 3 and failures == 0


def test_safe_rewards_passes_healthy_batches_through(examples):
    scores, failures = rewards.safe_rewards(rewards.task_reward, [e.prompt for e in examples],
                                            [e.solution for e in examples], **tasks.reward_fields(examples))
    assert failures == 0 and scores.shape == (len(examples),) and np.all(scores == 1.0)
