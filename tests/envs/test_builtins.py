"""Environments: the built-ins, loading one by name, observations through the chat template;
a scripted policy evaluated through an environment."""
import numpy as np
import pytest

from tlt_jax import envs


@pytest.mark.parametrize("num_disks", [1, 3, 4])
def test_hanoi_scorer_accepts_the_generators_solutions_and_nothing_short_or_illegal(num_disks):
    moves = envs.hanoi_solution(num_disks)
    assert len(moves) == 2 ** num_disks - 1
    assert envs.score_moves(num_disks, moves) == 1.0
    assert envs.score_moves(num_disks, moves[:-1]) == 0.0
    if num_disks > 1:
        assert envs.score_moves(num_disks, ["A->B", "A->B"] + moves) == 0.0  # a larger disk on a smaller one


def test_hanoi_observation_says_why_a_move_is_illegal():
    env = envs.TowerOfHanoi({"num_disks": 2})
    assert "A:[2, 1]" in env.reset()
    assert env.step("I move A->B").observation == "State: A:[2] B:[1] C:[]"
    illegal = env.step("A->B")
    assert "disk 2 is larger than disk 1" in illegal.observation and (illegal.reward, illegal.done) == (0.0, False)


class _NoStep:
    def __init__(self, example):
        pass

    def reset(self):
        return None


def test_bad_env_names_are_refused_naming_the_field():
    assert envs.env_class("python_tool") is envs.PythonTool
    for name, error, words in ((
            "nope.module:Env", ImportError, "config.env.name='nope.module:Env': cannot import module 'nope.module'"),
            ("tests.envs.test_builtins:Missing", ValueError,
             "module 'tests.envs.test_builtins' has no attribute 'Missing'"),
            ("tests.envs.test_builtins:_NoStep", ValueError, "no step"),
            ("python", ValueError, "not a registered environment \\(python_tool, tower_of_hanoi\\)")):
        with pytest.raises(error, match=words):
            envs.env_class(name)
    with pytest.raises(ValueError, match="env.max_turns=0"):
        envs.EnvConfig(name="python_tool", max_turns=0).check(64)
    with pytest.raises(ValueError, match="env.max_total_tokens=100"):
        envs.EnvConfig(name="python_tool", max_total_tokens=100).check(64)


@pytest.mark.xdist_group("test_code_reward")
def test_python_tool_keeps_the_interpreters_state_and_scores_the_final_answer():
    env = envs.PythonTool({"prompt": "2 + 3?", "answer": "5"})
    try:
        assert env.step("```python\nx = 2 + 3\nprint(x)\n```\n```output") == envs.StepResult("\n5\n```\n")
        observation = env.step("```python\nprint(x * 2)\n1 / 0\n```\n```output").observation
        assert observation == "\n10\nZeroDivisionError: division by zero\n```\n"
        assert env.step("So the answer is \\boxed{5}.") == envs.StepResult(None, 1.0, True)
    finally:
        env.close()


@pytest.mark.xdist_group("test_code_reward")
def test_python_tool_runs_each_cell_once_in_one_interpreter_with_limits_from_config_code():
    """Cell 1's side effects (a 1.5 s sleep, a random draw) happen once: cell 2 reads its
    state without running it again. Its limits are config.code's: a cell past
    code.timeout_s ends the interpreter, and the next cell starts a fresh one."""
    import time

    from tlt_jax import rewards

    config = envs.EnvConfig(name="python_tool", max_turns=4, code=rewards.CodeReward(timeout_s=3.0))
    env = config.make(envs.PythonTool, {"prompt": "?", "answer": "1"})
    cell = "```python\n{}\n```\n```output"
    try:
        assert env.session.limits.timeout_s == 3.0 and env.session.cells == 4
        drawn = env.step(cell.format("import random, time\ntime.sleep(1.5)\nr = random.random()\nprint(r)"))
        t0 = time.monotonic()
        again = env.step(cell.format("print(r)"))
        assert time.monotonic() - t0 < 1.5  # the sleep did not run again
        assert again.observation == drawn.observation and float(drawn.observation.split()[0]) < 1
        hung = env.step(cell.format("while True:\n    pass")).observation
        assert "timeout: the cell did not end within code.timeout_s=3 s" in hung and "restarted" in hung
        assert "NameError" in env.step(cell.format("print(r)")).observation  # a fresh interpreter
    finally:
        env.close()
    with pytest.raises(RuntimeError, match="closed"):
        env.step(cell.format("print(1)"))


class _Guess:
    """A scripted environment: guess the example's answer; a wrong guess costs 0.1 and is
    told so, an unreadable one breaks the environment."""

    def __init__(self, example):
        self.answer = int(example["answer"])

    def reset(self):
        return f"guess {self.answer % 3}:"  # depends on the example alone

    def step(self, action):
        if int(action) == self.answer:  # raises on a turn that is no number
            return envs.StepResult(None, 1.0, True)
        return envs.StepResult("\nno\n", -0.1, False, {"guess": int(action)})


class _ScriptedPolicy:
    """A rollout engine whose samples say fixed turns (request i: SCRIPT[i]) through the
    episodes, each turn ending on the end token: transcript and observation mask as the
    engine builds them."""

    SCRIPT = (["3", "7"], ["7"], ["1", "2", "3", "4"], ["zz"])

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompt_ids, num_samples, sampling_params, key, episodes):
        from tlt_jax.rollout.engine import Rollouts
        from tlt_jax.rollout.timeline import RolloutTimeline

        tokens, observed, reasons = [], [], []
        for request, script in enumerate(self.SCRIPT):
            ids, mask, reason = [], [], "eos"
            for action in script:
                turn = self.tokenizer(action, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                ids, mask = ids + turn, mask + [False] * len(turn)
                answer = episodes.step(request, np.asarray(turn, np.int32), "eos")
                if isinstance(answer, str):
                    reason = answer or reason
                    break
                ids, mask = ids + list(answer), mask + [True] * len(answer)
            tokens.append(np.asarray(ids, np.int32))
            observed.append(np.asarray(mask, bool))
            reasons.append(reason)
        n = len(tokens)
        return Rollouts(np.arange(n, dtype=np.int32) // num_samples, np.arange(n, dtype=np.int32) % num_samples,
                        tokens, [np.zeros(len(t), np.float32) for t in tokens], reasons, np.zeros(n, np.int32),
                        RolloutTimeline([]), observed)


def test_scripted_policy_turns_and_rewards_read_back_from_eval_samples(tmp_path):
    """A fixed policy through a scripted environment, evaluated and written as a run
    writes it: each sample's turns (action, observation, step reward), its transcript and
    its total reward (step rewards plus the reward on the transcript) come back from
    eval_samples.jsonl; max_turns ends a sample; a failing step ends it with reward 0 (the
    transcript's reward too), counted."""
    import json

    from tlt_jax import evaluation, metrics, sampling
    from tlt_jax.data import tasks

    tokenizer = tasks.build_task_tokenizer(str(tmp_path / "tok"))
    examples = [tasks.Example("7?", "", "7", "t"), tasks.Example("12?", "", "12", "t")]
    env = envs.EnvConfig(name="tests.envs.test_builtins:_Guess", max_turns=3)
    half = lambda prompts, completions, **_: [0.5] * len(completions)
    with pytest.warns(UserWarning, match="_Guess failed on a step"):
        out, samples = evaluation.evaluate_samples(_ScriptedPolicy(tokenizer), tokenizer, examples,
                                                   sampling.SamplingParams(max_tokens=32), None, 2, reward=half,
                                                   env=env)
    with metrics.MetricsWriter(str(tmp_path / "run"), use_tensorboard=False) as writer:
        writer.write_samples(4, samples)
    with open(tmp_path / "run" / metrics.EVAL_SAMPLES_FILENAME) as f:
        back = [json.loads(line) for line in f]
    assert [r["step"] for r in back] == [4] * 4
    assert [r["prompt"] for r in back] == ["guess 1:"] * 2 + ["guess 0:"] * 2
    assert back[0]["turns"] == [{"action": "3", "observation": "\nno\n", "reward": -0.1, "info": {"guess": 3}},
                                {"action": "7", "observation": None, "reward": 1.0}]
    assert back[0]["completion"] == "3\nno\n7" and back[1]["completion"] == "7"
    assert [t["action"] for t in back[2]["turns"]] == ["1", "2", "3"] and back[2]["finish_reason"] == "max_turns"
    assert back[3]["turns"][0]["error"].startswith("ValueError") and back[3]["turns"][0]["reward"] == 0.0
    np.testing.assert_allclose([r["reward"] for r in back], [1.4, 1.5, 0.2, 0.0], atol=1e-6)
    assert out["accuracy"] == 3 / 4 and out["env_failures"] == 1 and out["env_turns_mean"] == 7 / 4
    assert out["reward_mean"] == pytest.approx(3.1 / 4)
    assert (out["env_steps"], out["env_turns_max"]) == (7, 3) and 0 < out["env_step_max_s"] <= out["env_step_s"]


def test_a_stop_string_ends_a_turn_in_any_spelling_of_its_text(tmp_path):
    """A model may spell "```output" in pieces its tokenizer would merge: every spelling
    whose text is the string (up to the bound) is a stop sequence, the tokenizer's own first."""
    from tlt_jax.tokenizer import build_bpe_tokenizer

    tokenizer = build_bpe_tokenizer(str(tmp_path / "tok"), ["```python\nprint(1)\n```\n```output\n1\n```\n"] * 50,
                                    vocab_size=300)
    text = "```output"
    canonical = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    letters = tuple(tokenizer.convert_tokens_to_ids(list(text)))  # one token a character: a byte-level alphabet
    assert len(canonical) < len(letters)  # the merges make the tokenizer's own spelling shorter
    seqs = envs.stop_sequences(tokenizer, text, limit=64)
    assert seqs[0] == canonical and letters in seqs and len(set(seqs)) == len(seqs)
    assert all(tokenizer.decode(list(s)) == text for s in seqs)
    assert [len(s) for s in seqs[1:]] == sorted(len(s) for s in seqs[1:])  # fewest tokens first
    assert len(envs.stop_sequences(tokenizer, text, limit=2)) == 2


class _Lifecycle:
    """An environment that behaves as its example's answer says: "tuple" answers the old
    way, "done" ends its episode and then raises in close, "on" goes on, "wait" waits in
    step until `release` is set. Counts its closes."""

    closes: dict = {}
    release = None

    def __init__(self, example):
        self.kind = example["answer"]

    def reset(self):
        return "go:"

    def step(self, action):
        if self.kind == "tuple":
            return None, 1.0, True
        if self.kind == "wait":
            _Lifecycle.release.wait(30)
        return envs.StepResult(None if self.kind == "done" else "\nmore\n", 0.5, self.kind == "done")

    def close(self):
        _Lifecycle.closes[self.kind] = _Lifecycle.closes.get(self.kind, 0) + 1
        if self.kind == "done":
            raise RuntimeError("the tool would not stop")


def _episodes(tmp_path, kinds, **config):
    from tlt_jax.data import prompts, tasks

    tokenizer = tasks.build_task_tokenizer(str(tmp_path / "tok"))
    examples = [tasks.Example("?", "", kind, "t") for kind in kinds]
    _Lifecycle.closes = {}
    config = envs.EnvConfig(name="tests.envs.test_builtins:_Lifecycle", max_turns=3, **config)
    episodes = envs.Episodes(_Lifecycle, examples, 1, tokenizer, prompts.PromptFormat(), [tokenizer.eos_token_id],
                             config)
    return episodes, np.asarray(tokenizer("1", add_special_tokens=False)["input_ids"], np.int32)


def test_a_malformed_step_or_a_close_that_raises_fails_its_sample_alone_and_each_env_closes_once(tmp_path):
    episodes, action = _episodes(tmp_path, ["tuple", "done", "on"])
    with pytest.warns(UserWarning, match="failed on a step") as warned:
        assert episodes.step(0, action, "eos") == ""  # the old tuple: a clear error, the sample ends
        assert episodes.step(1, action, "eos") == ""  # done: closed at once, and its close raises
        assert episodes.step(2, action, "eos") != ""  # goes on: still open
    assert _Lifecycle.closes == {"tuple": 1, "done": 1}
    episodes.close()
    episodes.close()
    assert _Lifecycle.closes == {"tuple": 1, "done": 1, "on": 1}
    assert len(warned) == 1 and "envs.StepResult(observation, reward, done, info)" in str(warned[0].message)
    assert episodes.turns[0][0]["error"].startswith("TypeError: _Lifecycle.step returned (None, 1.0, True)")
    assert episodes.turns[1][-1]["error"] == "close: RuntimeError: the tool would not stop"
    assert episodes.failed == [True, True, False] and episodes.failures == 2
    np.testing.assert_array_equal(episodes.rewards(), [0.0, 0.0, 0.5])


def test_a_step_past_its_deadline_ends_its_sample_and_its_late_answer_is_dropped(tmp_path):
    """The rollout stops waiting (`sample_failed`, then `close_episode`): the sample fails with the deadline
    named, its environment is closed, and what the step returns later changes nothing."""
    import concurrent.futures
    import threading
    import time

    episodes, action = _episodes(tmp_path, ["wait", "on"], step_timeout_s=0.5)
    assert episodes.step_timeout_s == 0.5
    _Lifecycle.release = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        late = pool.submit(episodes.step, 0, action, "eos")
        time.sleep(0.2)
        with pytest.warns(UserWarning, match="failed on a step"):  # as rollout.turns tells it
            episodes.sample_failed(0, TimeoutError("step did not return within env.step_timeout_s=0.5 s"))
            episodes.close_episode(0)
        assert episodes.step(1, action, "eos") != ""  # the other sample goes on
        for _ in range(100):
            if "wait" in _Lifecycle.closes:
                break
            time.sleep(0.05)
        _Lifecycle.release.set()
        assert late.result() == ""
    assert episodes.turns[0] == [{"action": "1", "observation": None, "reward": 0.0,
                                  "error": "TimeoutError: step did not return within env.step_timeout_s=0.5 s"}]
    assert _Lifecycle.closes == {"wait": 1} and episodes.failed == [True, False]
    episodes.close()
    assert _Lifecycle.closes == {"wait": 1, "on": 1}


def test_a_step_result_says_what_is_wrong_with_it():
    for bad, words in (({"observation": 3}, "observation is a int"), ({"observation": "", "reward": "1"}, "reward"),
                       ({"observation": "", "reward": float("nan")}, "not a finite number"),
                       ({"observation": "", "done": 1}, "done=1 is not a bool"),
                       ({"observation": "", "info": [1]}, "info is a list")):
        with pytest.raises(TypeError, match=words):
            envs.StepResult(**bad)


def test_the_episodes_answer_the_rollouts_calls_by_the_names_it_makes():
    """rollout.turns reaches the episodes through optional hooks found by name: a hook
    shadowed by an attribute, or misnamed, would be skipped without a word."""
    import inspect

    from tlt_jax.rollout import turns

    source = inspect.getsource(turns)
    for hook in ("sample_failed", "close_episode", "step"):
        assert f'"{hook}"' in source or f"episodes.{hook}" in source, hook
        assert callable(getattr(envs.Episodes, hook)), hook
    assert "step_timeout_s" in source and "overlap" in source
