"""Synthetic tasks: deterministic disjoint splits, correct traces, long tails, alphabet, tokenizer."""
import os
import re

import numpy as np
import pytest

from tlt_jax import rewards
from tlt_jax.data import packing, tasks

NUM_SAMPLES = 300


@pytest.fixture(scope="module")
def train_examples():
    return {name: tasks.make_split(tasks.get_task(name), "train", NUM_SAMPLES, seed=0) for name in tasks.TASKS}


def test_registry_and_knobs():
    assert set(tasks.TASKS) == {"collatz", "addition", "countdown"}
    assert tasks.get_task("collatz", max_start=50).max_start == 50
    assert tasks.get_task("collatz") is tasks.TASKS["collatz"]
    with pytest.raises(KeyError, match="known"):
        tasks.get_task("sudoku")


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_splits_are_deterministic_and_disjoint(name):
    task = tasks.get_task(name)
    train = tasks.make_split(task, "train", 200, seed=3)
    assert train == tasks.make_split(task, "train", 200, seed=3)
    assert train != tasks.make_split(task, "train", 200, seed=4)
    evals = [e for seed in range(3) for e in tasks.make_split(task, "eval", 100, seed=seed)]
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    assert {tasks.split_of(e.prompt) for e in evals} == {"eval"}


def test_split_errors():
    with pytest.raises(ValueError, match="split"):
        tasks.make_split(tasks.TASKS["collatz"], "test", 1)
    # Starts 2..3 give two problems; the split that holds neither cannot be filled.
    tiny = tasks.get_task("collatz", max_start=3)
    empty = set(tasks.SPLITS) - {tasks.split_of(f"collatz {s}\n") for s in (2, 3)}
    with pytest.raises(RuntimeError, match="widen"):
        tasks.make_split(tiny, empty.pop(), 1)


def test_solution_layout(train_examples):
    for examples in train_examples.values():
        for e in examples:
            assert e.prompt.endswith("\n") and e.prompt.count("\n") == 1
            *trace, last = e.solution.split("\n")
            assert trace and last == tasks.ANSWER_PREFIX + e.answer
            assert tasks.check_answer(e.task, e.answer, e.answer, e.prompt)


def test_collatz_trace():
    rng = np.random.default_rng(0)
    e = next(e for e in iter(lambda: tasks.TASKS["collatz"].sample(rng), None) if e.fields["start"] == 27)
    assert e.answer == "111" and e.fields["peak"] == 9232
    values = [int(v) for line in e.solution.split("\n")[:-1] for v in line.split()]
    assert len(values) == 111 and values[-1] == 1
    for before, after in zip([27] + values, values):
        assert after == (before // 2 if before % 2 == 0 else 3 * before + 1)


def test_addition_trace_is_schoolbook(train_examples):
    for e in train_examples["addition"]:
        digits, carry = [], 0
        for line in e.solution.split("\n")[:-1]:
            a, b, carry_in, total = re.fullmatch(r"(\d)\+(\d)(\+1)?=(\d+)", line).groups()
            assert bool(carry_in) == bool(carry) and int(total) == int(a) + int(b) + carry
            total = int(total)
            digits.append(total % 10)
            carry = total // 10
        written = int(str(carry or "") + "".join(map(str, digits[::-1])))
        assert int(e.answer) == e.fields["a"] + e.fields["b"] == written


def test_countdown_trace_and_checker(train_examples):
    apply = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__floordiv__}
    for e in train_examples["countdown"]:
        for line in e.solution.split("\n")[:-1]:
            a, op, b, c = re.fullmatch(r" ?(\d+)([-+*/])(\d+)=(\d+)", line).groups()
            assert int(a) >= int(b) and int(c) == apply[op](int(a), int(b))
        assert e.solution.split("\n")[-2].endswith(f"={e.fields['target']}")
    check = tasks.TASKS["countdown"].check
    prompt = "countdown 9 7 6 to 105\n"
    assert check("(9+6)*7", "(9+6)*7", prompt)
    assert check("7*(6+9)", "(9+6)*7", prompt)  # any valid expression counts
    assert check("(9*7-63)/6+105", "", "countdown 105 63 9 7 6 to 105\n")  # rational arithmetic
    for wrong in ["(9+6)*6", "(9+9)*7-21", "105", "(9+6)*7+0", "9/(7-7)", "(9+6*7", "", "9 6 7"]:
        assert not check(wrong, "(9+6)*7", prompt), wrong
    with pytest.raises(ValueError):
        check("1", "1", "collatz 5\n")


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_trace_lengths_are_long_tailed(train_examples, name):
    stats = tasks.length_stats(train_examples[name])
    assert stats["tail_ratio"] >= 4, stats
    assert 15 <= stats["median"] <= 80, stats  # the default preset stays small-model sized


def test_alphabet_is_exactly_the_characters_used(train_examples):
    used = {c for examples in train_examples.values() for e in examples for c in e.prompt + e.solution}
    assert used == set(tasks.ALPHABET) and len(set(tasks.ALPHABET)) == len(tasks.ALPHABET)


def test_mixture():
    examples = tasks.make_split(tasks.mixture(), "train", 300, seed=0)
    counts = {name: sum(e.task == name for e in examples) for name in tasks.TASKS}
    assert all(60 <= c <= 140 for c in counts.values()), counts
    assert tasks.length_stats(examples)["tail_ratio"] >= 4
    only = tasks.make_split(tasks.mixture({"addition": 1.0, "collatz": 0.0}), "eval", 20, seed=0)
    assert {e.task for e in only} == {"addition"}
    assert tasks.reward_fields(only[:2]) == {"answer": [e.answer for e in only[:2]], "task": ["addition"] * 2,
                                             "a": [e.fields["a"] for e in only[:2]],
                                             "b": [e.fields["b"] for e in only[:2]]}
    with pytest.raises(ValueError, match="weight"):
        tasks.mixture({"addition": -1.0})


def test_tokenizer_round_trip(tmp_path, train_examples):
    if not os.path.exists(os.path.join(os.path.dirname(tasks.__file__), "..", "tokenizer.py")):
        pytest.skip("tlt_jax/tokenizer.py (build_char_tokenizer) is not in this checkout yet")
    tok = tasks.build_task_tokenizer(str(tmp_path / "tok"))
    assert len(tok) == 4 + len(tasks.ALPHABET)
    for examples in train_examples.values():
        for e in examples[:20]:
            ids, mask = packing.encode_for_sft(tok, e)
            assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id and tok.unk_token_id not in ids
            assert len(ids) == len(e.prompt) + len(e.solution) + 2  # one id per character
            assert tok.decode(ids, skip_special_tokens=True) == e.prompt + e.solution
            completion = [i for i, m in zip(ids, mask) if m]
            assert tok.decode(completion, skip_special_tokens=False) == e.solution + "<eos>"


def test_addition_trace_share_mixes_formats_both_checked():
    task = tasks.get_task("addition", max_digits=8, min_digits=2, digits_zipf=1.6, trace_share=0.25)
    examples = tasks.make_split(task, "train", 400, seed=0)
    formats = [tasks.solution_format(e.solution) for e in examples]
    assert 0.18 <= formats.count("trace") / len(examples) <= 0.32, formats.count("trace")
    for e, kind in zip(examples, formats):
        *lines, last = e.solution.split("\n")
        assert last == tasks.ANSWER_PREFIX + e.answer and int(e.answer) == e.fields["a"] + e.fields["b"]
        assert lines == [tasks.BARE_ANSWER_LINE] if kind == "bare" else len(lines) == len(str(max(
            e.fields["a"], e.fields["b"])))
        assert min(len(str(e.fields["a"])), len(str(e.fields["b"]))) >= 2
        # Either format is scored by its final answer alone, well-formed both ways.
        assert rewards.task_reward([e.prompt], [e.solution], [e.answer], [e.task]) == [1.0]
    for share, only in ((1.0, "trace"), (0.0, "bare")):
        examples = tasks.make_split(tasks.get_task("addition", trace_share=share), "train", 50, seed=0)
        assert {tasks.solution_format(e.solution) for e in examples} == {only}
