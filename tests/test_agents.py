"""Environments: the built-ins, loading one by name, observations through the chat template."""
import pytest

from tlt_jax.data import agents


@pytest.mark.parametrize("num_disks", [1, 3, 4])
def test_hanoi_scorer_accepts_the_generators_solutions_and_nothing_short_or_illegal(num_disks):
    moves = agents.hanoi_solution(num_disks)
    assert len(moves) == 2 ** num_disks - 1
    assert agents.score_moves(num_disks, moves) == 1.0
    assert agents.score_moves(num_disks, moves[:-1]) == 0.0
    if num_disks > 1:
        assert agents.score_moves(num_disks, ["A->B", "A->B"] + moves) == 0.0  # a larger disk on a smaller one


def test_hanoi_observation_says_why_a_move_is_illegal():
    env = agents.TowerOfHanoi({"num_disks": 2})
    assert "A:[2, 1]" in env.reset()
    assert env.step("I move A->B")[0] == "State: A:[2] B:[1] C:[]"
    observation, reward, done = env.step("A->B")
    assert "disk 2 is larger than disk 1" in observation and (reward, done) == (0.0, False)


class _NoStep:
    def __init__(self, example):
        pass

    def reset(self):
        return None


def test_bad_env_names_are_refused_naming_the_field():
    assert agents.env_class("python_tool") is agents.PythonTool
    for name, words in (("nope.module:Env", "cannot be imported"), ("tests.test_agents:Missing", "cannot be imported"),
                        ("tests.test_agents:_NoStep", "no step"), ("python", "neither a built-in")):
        with pytest.raises(ValueError, match=words):
            agents.env_class(name)
    with pytest.raises(ValueError, match="env.max_turns=0"):
        agents.EnvConfig(name="python_tool", max_turns=0).check(64)
    with pytest.raises(ValueError, match="env.max_total_tokens=100"):
        agents.EnvConfig(name="python_tool", max_total_tokens=100).check(64)


@pytest.mark.xdist_group("test_code_reward")
def test_python_tool_keeps_the_interpreters_state_and_scores_the_final_answer():
    env = agents.PythonTool({"prompt": "2 + 3?", "answer": "5"})
    assert env.step("```python\nx = 2 + 3\nprint(x)\n```\n```output") == ("\n5\n```\n", 0.0, False)
    observation, _, _ = env.step("```python\nprint(x * 2)\n1 / 0\n```\n```output")
    assert observation == "\n10\nZeroDivisionError: division by zero\n```\n"
    assert env.step("So the answer is \\boxed{5}.") == (None, 1.0, True)
