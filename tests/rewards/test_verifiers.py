"""Rewards: own solutions score 1, corruptions less, format rules, GSM8K and math checkers,
reasoning-gym's own scoring, rewards named module:function, safe_rewards and its warning."""
import logging
import math
import sys

import numpy as np
import pytest

from tests.support import rewards as own_rewards
from tlt_jax import rewards
from tlt_jax.data import tasks


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


@pytest.mark.parametrize("completion, reference", [
    ("\\frac{1}{2}", "0.5"),
    ("0.5", "\\frac{1}{2}"),
    ("So the share is \\boxed{3/4}.", "0.75"),
    ("3 * 24 = 72 dollars.\n#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72"),
    ("The answer is $72$.", "#### 72"),
    ("1,000", "1000"),
    ("\\boxed{1000}", "1,000"),
    ("$2\\sqrt{2}$", "\\sqrt{8}"),
    ("\\boxed{2\\sqrt{2}}", "$\\sqrt{8}$"),
    ("#### 2\\sqrt{2}", "\\sqrt{8}"),
    ("14 * 5 = \\boxed{70}, plus 2 more.\n#### 72", "72"),   # '####' wins over a box
    ("first 70, then 72", "72"),                 # the last answer counts
    ("\\boxed{\\frac{\\pi}{2}}", "\\dfrac{\\pi}{2}"),
    ("temperature drops to $-5$", "-5"),
])
def test_math_equivalent_answers(completion, reference):
    assert rewards.math_correctness(["q"], [completion], answer=[reference]) == [1.0]


@pytest.mark.parametrize("completion, reference", [
    ("\\frac{1}{2}", "\\frac{1}{3}"),
    ("\\boxed{5}", "50"),
    ("3 * 24 = 72 dollars.\n#### 71", "#### 72"),
    ("72 first, but #### 71", "72"),              # after '####' is the answer
    ("we get 72\n#### 71", "#### 72"),
    ("\\boxed{72} at first; corrected:\n#### 70", "72"),
    ("$2\\sqrt{3}$", "\\sqrt{8}"),
    ("first 72, then 70", "72"),
    ("no answer here", "72"),
    ("", "0.5"),
])
def test_math_different_answers_score_zero(completion, reference):
    assert rewards.math_correctness(["q"], [completion], answer=[reference]) == [0.0]


def test_math_reference_it_cannot_read_is_a_failure():
    scores, failures = rewards.safe_rewards(rewards.math_correctness, ["q"] * 2, ["72", "72"], answer=["72", ""])
    assert scores.tolist() == [1.0, 0.0] and failures == 1


_MATH_BATCH = [("\\frac{1}{2}", "0.5"), ("\\boxed{3/4}", "0.75"), ("#### 72", "72"), ("$2\\sqrt{2}$", "\\sqrt{8}"),
               ("\\boxed{5}", "50"), ("x", "1,000")]


def test_math_in_a_scoring_thread_scores_as_in_the_main_thread():
    # math-verify's own timeouts are signal.alarm, which raises outside the main thread;
    # the Scorer with a deadline scores inline on a thread.
    prompts, completions, answer = ["q"] * len(_MATH_BATCH), [c for c, _ in _MATH_BATCH], [a for _, a in _MATH_BATCH]
    main = rewards.math_correctness(prompts, completions, answer=answer)
    assert main == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    threaded = rewards.Scorer("math", timeout_s=120.0)(prompts, completions, {"answer": answer})
    assert threaded.scores.tolist() == main and threaded.failures == threaded.timed_out == 0


def _gym_cases(name):
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(name, size=4, seed=7)
    entries = list(dataset)
    completions = [f"<answer>{e['answer']}</answer>" for e in entries]                  # right
    completions += [f"I think <answer>{e['answer']}</answer>, no: <answer>{e['answer']}9</answer>"
                    for e in entries]                                                   # wrong: the last counts
    completions += [str(e["answer"]) for e in entries]                                  # no tags
    entries = entries * 3
    own = [dataset.score_answer(answer=reasoning_gym.utils.extract_answer(c), entry=e)
           for c, e in zip(completions, entries)]
    return [e["question"] for e in entries], completions, entries, own


@pytest.mark.parametrize("name", ["basic_arithmetic", "chain_sum", "leg_counting"])
def test_reasoning_gym_scores_as_the_task_itself(name):
    pytest.importorskip("reasoning_gym")
    prompts, completions, entries, own = _gym_cases(name)
    n = len(entries) // 3
    assert own[:n] == [1.0] * n and own[2 * n:] == [0.0] * n and max(own[n:2 * n]) < 1.0
    fields = {"entry": entries, "answer": [str(e["answer"]) for e in entries]}
    assert rewards.get_reward("reasoning_gym")(prompts, completions, **fields) == own
    scored = rewards.Scorer("reasoning_gym")(prompts, completions, fields)
    np.testing.assert_allclose(scored.scores, own, rtol=1e-6)  # float32
    assert scored.failures == 0


def test_reasoning_gym_without_its_entry_is_a_failure():
    pytest.importorskip("reasoning_gym")
    scores, failures = rewards.safe_rewards(rewards.reasoning_gym_score, ["q"], ["<answer>3</answer>"], entry=[None])
    assert scores.tolist() == [0.0] and failures == 1


def test_registry():
    assert set(rewards.REWARDS) == {"answer_correctness", "format", "task", "gsm8k", "math", "reasoning_gym", "code"}
    assert rewards.get_reward("task") is rewards.task_reward
    assert rewards.get_reward("math") is rewards.math_correctness


def test_a_missing_optional_package_fails_at_lookup(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    with pytest.raises(ImportError, match=r"reward='reasoning_gym'.*pip install -e '\.\[envs\]'"):
        rewards.get_reward("reasoning_gym")


def test_a_reward_of_ones_own_by_module_and_function():
    reward = rewards.get_reward("tests.support.rewards:exact_answer")
    assert reward is own_rewards.exact_answer
    prompts, completions, fields = ["p"] * 4, ["1", "2", " 3", "x"], {"answer": ["1", "0", "3", "4"]}
    inline = rewards.Scorer("tests.support.rewards:exact_answer")(prompts, completions, fields)
    scorer = rewards.Scorer("tests.support.rewards:exact_answer", workers=1)  # the worker resolves the name itself
    try:
        pooled = scorer(prompts, completions, fields)
    finally:
        scorer.close()
    assert inline.scores.tolist() == pooled.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert inline.failures == pooled.failures == 0


@pytest.mark.parametrize("name, error, message", [
    ("bleu", ValueError, r"reward='bleu' is not a registered reward \(answer_correctness, code, format, gsm8k, "
                         r"math, reasoning_gym, task\) nor module\.path:function"),
    ("no_such_package.rewards:fn", ImportError,
     r"reward='no_such_package.rewards:fn': cannot import module 'no_such_package.rewards' "
     r"\(ModuleNotFoundError: No module named 'no_such_package'\)"),
    ("tests.support.rewards:missing", ValueError,
     r"reward='tests.support.rewards:missing': module 'tests.support.rewards' has no attribute 'missing'"),
    ("tests.support.rewards:not_a_reward", ValueError,
     r"reward='tests.support.rewards:not_a_reward': tests.support.rewards.not_a_reward is a float, not a function"),
    ("tests.support.rewards:", ValueError, r"not a registered reward"),
])
def test_bad_reward_names_fail_in_one_line(name, error, message):
    with pytest.raises(error, match=message) as raised:
        rewards.get_reward(name)
    assert "\n" not in str(raised.value)
    with pytest.raises(error, match=message):
        rewards.Scorer(name)  # a bad name fails before anything is scored


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


def test_the_warning_shows_one_failed_sample(caplog):
    prompts = ["what is 1?", "what is 2?", "what is 3?", "what is 4?"]
    with caplog.at_level(logging.WARNING, logger=rewards.__name__):
        rewards.safe_rewards(_nan_on_odd_answers, prompts, ["one", "two", "three", "four"], answer=["1", "2", "3", "4"])
    assert "3 of 4" in caplog.text and "'what is 1?'" in caplog.text and "'one'" in caplog.text
    assert "returned nan" in caplog.text and "what is 3?" not in caplog.text  # one example, the first
    caplog.clear()

    with caplog.at_level(logging.WARNING, logger=rewards.__name__):
        rewards.safe_rewards(_raises_on_boom, ["Q" * 1000, "q"], ["boom" + "c" * 1000, "1"], answer=["1", "1"])
    assert "raised RuntimeError('reward bug')" in caplog.text and "boomccc" in caplog.text
    assert len(caplog.records) == 1 and len(caplog.records[0].getMessage()) < 700  # long texts are cut

    scored = rewards.Scorer(_raises_on_boom)(["p", "the prompt"], ["1", "boom"], {"answer": ["1", "1"]})
    assert scored.failures == 1 and scored.failed_sample == rewards.FailedSample(
        "the prompt", "boom", "raised RuntimeError('reward bug')")
    assert rewards.Scorer(_raises_on_boom)(["p"], ["1"], {"answer": ["1"]}).failed_sample is None


def test_safe_rewards_passes_healthy_batches_through(examples):
    scores, failures = rewards.safe_rewards(rewards.task_reward, [e.prompt for e in examples],
                                            [e.solution for e in examples], **tasks.reward_fields(examples))
    assert failures == 0 and scores.shape == (len(examples),) and np.all(scores == 1.0)
