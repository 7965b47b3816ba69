"""reasoning-gym problems: mixtures by weight, disjoint deterministic splits, the extra's
absence said plainly."""
import sys

import pytest

from tlt_jax.data import reasoning_gym_problems

pytest.importorskip("reasoning_gym")

SOURCE = "reasoning_gym:basic_arithmetic=3,chain_sum=1"


def test_mixture_splits_are_disjoint_deterministic_and_weighted():
    train = reasoning_gym_problems.make_split(SOURCE, "train", 200, seed=1)
    again = reasoning_gym_problems.make_split(SOURCE, "train", 200, seed=1)
    evals = reasoning_gym_problems.make_split(SOURCE, "eval", 40, seed=1, unique=True)
    assert [e.prompt for e in train] == [e.prompt for e in again]
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    assert len({e.prompt for e in evals}) == 40
    share = sum(e.task == "basic_arithmetic" for e in train) / len(train)
    assert 0.65 < share < 0.85, share
    example = train[0]
    assert example.fields["entry"]["question"] == example.prompt
    assert example.solution == f"<answer>{example.answer}</answer>"


def test_bad_sources_name_the_field():
    assert reasoning_gym_problems.parse_source("reasoning_gym:leg_counting") == {"leg_counting": 1.0}
    with pytest.raises(ValueError, match="unknown reasoning-gym task"):
        reasoning_gym_problems.parse_source("reasoning_gym:no_such_task")
    with pytest.raises(ValueError, match="the weight of 'chain_sum' is not a number"):
        reasoning_gym_problems.parse_source("reasoning_gym:chain_sum=lots")
    with pytest.raises(ValueError, match="data.source='reasoning_gym:'"):
        reasoning_gym_problems.parse_source("reasoning_gym:")


def test_without_the_extra_the_error_says_which_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"pip install -e '\.\[envs\]'"):
        reasoning_gym_problems.parse_source("reasoning_gym:leg_counting")
