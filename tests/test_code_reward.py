"""The code reward and its sandbox: every test layout (None fields, verl's answer), reward
hacks that pass nothing, bombs and loops that score 0 with the host unharmed (a canary
file, no process left, no secret of ours, no network), parallel scoring under timeouts,
a dead sandbox counted once, reward_info, bad input, and the example dataset."""
import dataclasses
import functools
import itertools
import json
import pickle
import socket
import time

import pytest

from experiments import make_code_dataset
from tlt_jax.data import code_tests, files, rewards, sandbox

# One worker runs them all: a test checks that no sandbox process is left, of any test.
pytestmark = pytest.mark.xdist_group("test_code_reward")
MODES = ["bwrap", "rlimits"]
STRONG = sandbox.resolve_mode("auto", sandbox.default_python())


def _mode(mode: str) -> str:
    if mode == "bwrap" and STRONG != "bwrap":
        pytest.skip(f"bwrap is not available here: {sandbox._bwrap_problem(sandbox.default_python())}")
    return mode


def _score(completions, *, mode="auto", prompts=None, **options_and_fields):
    """Scores of CodeReward(options) on completions, with per-sample fields."""
    option_names = {f.name for f in dataclasses.fields(rewards.CodeReward)}
    options = {k: v for k, v in options_and_fields.items() if k in option_names}
    fields = {k: v for k, v in options_and_fields.items() if k not in option_names}
    options.setdefault("timeout_s", 3.0)
    reward = rewards.get_reward("code", sandbox=mode, **options)
    return reward(prompts or [""] * len(completions), completions, **fields)


def _leftover_processes() -> list[int]:
    return [pid for live, _ in sandbox._processes_by_uid(sandbox.SANDBOX_UIDS).values() for pid in live]


@pytest.fixture
def canary(tmp_path):
    path = tmp_path / "canary.txt"
    path.write_text("untouched")
    yield path
    assert path.read_text() == "untouched"
    assert not _leftover_processes()


def _vandal(canary) -> str:
    """Lines that try to harm the host: write and remove a file outside the sandbox."""
    return (f"import os\ntry:\n    open({str(canary)!r}, 'w').write('harmed')\nexcept OSError:\n    pass\n"
            f"try:\n    os.remove({str(canary)!r})\nexcept OSError:\n    pass\n")


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\nDone."


def test_extract_program_takes_the_last_python_block():
    assert code_tests.extract_program("a\n```python\nx = 1\n```\nb\n```\ny = 2\n```") == "y = 2\n"
    assert code_tests.extract_program("```py\nx = 1\n```\n```text\nnot code\n```") == "x = 1\n"
    assert code_tests.extract_program("```python\ncut = 'off") == "cut = 'off"  # cut by max_tokens
    assert code_tests.extract_program("x = 3") == "x = 3"


def test_every_layout_in_one_batch_with_none_fields():
    """A batch mixing layouts, as a dataset mixing sources gives it: each row's other
    fields None. Right programs score 1, half-right ones partial credit."""
    io = json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7"]})
    call = {"inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]], "fn_name": "add"}
    humaneval_prompt = 'def add(a, b):\n    """a + b"""\n'
    rows = [  # (completion, prompt, fields)
        (fenced("def add(a, b):\n    return a + b"), "",
         {"test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"], "test_setup_code": "import math"}),
        (fenced("def add(a, b):\n    return 3"), "", {"test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}),
        ("    return a + b\n", humaneval_prompt,  # HumanEval: the body continues the prompt
         {"test": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "entry_point": "add"}),
        (fenced("def add(a, b):\n    return a - b"), humaneval_prompt,
         {"test": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "entry_point": "add"}),
        (fenced("a, b = map(int, input().split())\nprint(a + b)   "), "", {"input_output": io}),
        (fenced("print(3)"), "", {"input_output": io}),
        (fenced("def add(a, b):\n    return a + b"), "", {"input_output": call}),
        (fenced("class Solution:\n    def add(self, a, b):\n        return a + b"), "", {"tests": json.dumps(call)}),
        (fenced("print(sum(map(int, input().split())))"), "",
         {"tests": [{"input": "1 2", "output": "3"}, {"input": "5 5", "output": "11"}]}),  # DeepCoder's list
        (fenced("print(sum(map(int, input().split())))"), "", {"answer": io}),  # verl: ground truth as answer
        (fenced("print(sum(map(int, input().split())))"), "", {"answer": str(json.loads(io))}),  # str() of a dict
    ]
    expected = [1.0, 0.5, 1.0, 0.0, 1.0, 0.5, 1.0, 1.0, 0.5, 1.0, 1.0]
    names = {"test_list", "test_setup_code", "test", "entry_point", "input_output", "tests", "answer"}
    fields = {name: [row[2].get(name) for row in rows] for name in names}
    fields["answer"] = [a if a is not None else "" for a in fields["answer"]]  # files give "" without answer_field
    scores = _score([r[0] for r in rows], prompts=[r[1] for r in rows], **fields)
    assert [float(s) for s in scores] == expected, [s.info for s in scores]
    assert scores[1].info == {"passed": 1, "total": 2, "failure": "wrong_answer", "detail": "AssertionError: "}
    assert scores[5].info["failure"] == "wrong_answer" and scores[5].info["detail"] == "printed '3\\n'"
    strict = _score([rows[1][0]], partial_credit=False, test_list=[rows[1][2]["test_list"]])
    assert strict == [0.0]


def test_bad_input_is_one_line_naming_the_field():
    with pytest.raises(ValueError, match=r"none of the code reward's test fields \(test_list.*answer_field="):
        _score(["x = 1"], test_list=[None], input_output=[None], answer=[""])
    for option, value in (("timeout_s", 0), ("memory_mb", -1), ("output_bytes", 0), ("processes", 0)):
        with pytest.raises(ValueError, match=f"code.{option}={value} must be > 0"):
            rewards.get_reward("code", **{option: value})
    with pytest.raises(ValueError, match="code.sandbox='docker'; choose from auto, bwrap, rlimits"):
        rewards.get_reward("code", sandbox="docker")
    with pytest.raises(ValueError, match="takes no options"):
        rewards.get_reward("math", timeout_s=1.0)


def test_unavailable_sandbox_mode_says_which_one_runs(monkeypatch):
    monkeypatch.setattr(sandbox, "_bwrap_problem", lambda python: "bwrap is not installed (apt-get ...)")
    with pytest.raises(ValueError) as error:
        sandbox.resolve_mode("bwrap", "python3")
    assert "\n" not in str(error.value)
    assert "code.sandbox='bwrap' is not available" in str(error.value) and "code.sandbox='rlimits'" in str(error.value)
    assert sandbox.resolve_mode("auto", "python3") == "rlimits"


def test_config_builds_the_reward_and_scores_pickle():
    from configs import rl

    config = rl.get_config("tiny")
    config.reward = "code"
    config.code.update(timeout_s=2.0, partial_credit=False)
    reward = rewards.reward_from_config(config)
    assert reward == rewards.CodeReward(timeout_s=2.0, partial_credit=False)
    assert pickle.loads(pickle.dumps(reward)) == reward  # to reward workers
    scored = rewards.Scored(0.5, {"passed": 1, "total": 2})
    again = pickle.loads(pickle.dumps(scored))
    assert again == 0.5 and again.info == scored.info
    assert rewards.get_reward("code") == rewards.REWARDS["code"] == rewards.CodeReward()  # bare: the defaults


HACKS = {
    "sys.exit(0) at import": "import sys\nsys.exit(0)",
    "os._exit(0) at import": "import os\nos._exit(0)",
    "exit() at import": "exit()",
    "exit 0 inside the function": "def add(a, b):\n    import os\n    os._exit(0)",
    "a forged report": "import os\nfor fd in range(3, 20):\n    try:\n"
                       "        os.write(fd, b'{\"test\": 0}\\n{\"test\": 1}\\n')\n"
                       "    except OSError:\n        pass\nos._exit(0)",
    "kills its parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "an object equal to anything, called": "class Any:\n    def __eq__(self, other):\n        return True\n"
                                           "def add(a, b):\n    return Any()",
}


@pytest.mark.parametrize("mode", MODES)
def test_reward_hacks_pass_nothing(mode, canary):
    _mode(mode)
    call = json.dumps({"inputs": [[1, 2], [3, 4]], "outputs": [3, 7], "fn_name": "add"})
    asserts = ["assert add(1, 2) == 3", "assert add(3, 4) == 7"]
    hacks = list(HACKS.values())
    scores = _score([fenced(h) for h in hacks] * 2, mode=mode,
                    test_list=[asserts] * len(hacks) + [None] * len(hacks),
                    input_output=[None] * len(hacks) + [call] * len(hacks))
    by_hack = {f"{name} ({layout})": (float(s), s.info) for layout, chunk in (("asserts", scores[:len(hacks)]),
                                                                          ("call", scores[len(hacks):]))
               for name, s in zip(HACKS, chunk)}
    # In-process asserts trust the objects they compare (docs/code.md); call-based ones do not.
    del by_hack["an object equal to anything, called (asserts)"]
    assert all(score == 0.0 for score, _ in by_hack.values()), by_hack


@pytest.mark.parametrize("mode", MODES)
def test_expected_values_never_reach_the_sandbox(mode):
    """A program that looks everywhere it can for the expected outputs finds nothing."""
    _mode(mode)
    snoop = ("import gc, os, sys\nfound = []\n"
             "for root, _, names in os.walk('.'):\n    for n in names:\n"
             "        found.append(open(os.path.join(root, n), errors='ignore').read())\n"
             "found.append(sys.stdin.read())\n"
             "found += [o for o in gc.get_objects() if isinstance(o, str)]\n"
             "hits = [s for s in found if 'EXPECTED' in s and 'hits' not in s]\n"
             "print(hits[0].split()[0] if hits else 'nothing')")
    io = {"inputs": ["x\n"], "outputs": ["EXPECTED_7391"]}
    score = _score([fenced(snoop)], mode=mode, input_output=[io])[0]
    assert score == 0.0 and score.info["detail"] == "printed 'nothing\\n'"


_PROBE_LIMIT = 8
_FORK_PROBE = ("import os, time\ncount = 0\nfor _ in range(64):\n    try:\n        pid = os.fork()\n"
               "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
               "    count += 1\n")


@functools.cache
def _process_limit_binds(mode: str) -> bool:
    """Whether a program that forks up to 64 sleeping children gets fewer than
    code.processes of them: what a fork bomb's test needs first."""
    score = _score([fenced(_FORK_PROBE)], mode=mode, processes=_PROBE_LIMIT,
                   test_list=[[f"assert count < {_PROBE_LIMIT}"]])[0]
    return score == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_process_limit_binds(mode, canary):
    _mode(mode)
    if not sandbox.process_limit_binds():
        pytest.skip("not root: the process limit counts this user's processes too (docs/code.md)")
    assert _process_limit_binds(mode), f"a program forked {_PROBE_LIMIT} or more processes (code.processes)"


@pytest.mark.parametrize("mode", MODES)
def test_bombs_and_loops_score_zero_and_leave_nothing(mode, canary):
    """A fork bomb, a memory bomb, a giant output and an infinite loop (in a test, and in a
    stdin/stdout program): each scores 0 with its kind, the canary stays, no process is
    left (the canary fixture checks both), and no run waits much past its timeout."""
    _mode(mode)
    if not (sandbox.process_limit_binds() and _process_limit_binds(mode)):
        pytest.skip("never a fork bomb without a binding process limit (test_process_limit_binds)")
    vandal = _vandal(canary)
    programs = {
        "fork bomb": vandal + "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "memory bomb": vandal + "x = bytearray(1 << 34)",
        "giant output": vandal + "while True:\n    print('x' * 10000)",
        "infinite loop in a test": vandal + "def f():\n    while True:\n        pass",
    }
    kinds = {"fork bomb": "timeout", "memory bomb": "memory", "giant output": "output_limit",
             "infinite loop in a test": "timeout"}
    asserts = ["assert f() == 1", "assert True"]
    completions = [fenced(p) for p in programs.values()] + [fenced(vandal + "while True:\n    print('y' * 10000)"),
                                                            fenced(vandal + "while True:\n    pass")]
    io = {"inputs": ["1\n", "2\n"], "outputs": ["1", "2"]}
    start = time.monotonic()
    scores = _score(completions, mode=mode, timeout_s=1.0, max_parallel=2, processes=_PROBE_LIMIT,
                    test_list=[asserts] * len(programs) + [None, None], input_output=[None] * len(programs) + [io, io])
    elapsed = time.monotonic() - start
    assert [float(s) for s in scores] == [0.0] * len(completions), [s.info for s in scores]
    assert [s.info["failure"] for s in scores] == list(kinds.values()) + ["output_limit", "timeout"]
    assert scores[-1].info["detail"].startswith("no test ended within code.timeout_s=1 s")
    assert elapsed < 12.0, elapsed  # 3 timeouts of 1 s, 2 at once; the rest end at once


@pytest.mark.parametrize("mode", MODES)
def test_the_program_sees_no_secret_of_ours(mode, monkeypatch):
    _mode(mode)
    monkeypatch.setenv("TLT_TEST_SECRET", "hunter2")
    program = ("import os\ndef leaks():\n    seen = [str(os.environ)]\n"
               "    for pid in (os.getppid(), 1):\n        try:\n"
               "            seen.append(open(f'/proc/{pid}/environ', errors='ignore').read())\n"
               "        except OSError:\n            pass\n    return 'hunter2' in ''.join(seen)")
    score = _score([fenced(program)], mode=mode, test_list=[["assert not leaks()"]])[0]
    assert score == 1.0, score.info


def test_no_network_to_a_localhost_listener():
    _mode("bwrap")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        program = ("import socket\ndef reach():\n    try:\n"
                   f"        socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
                   "        return True\n    except OSError:\n        return False")
        tests = [["assert reach()"]]
        assert _score([fenced(program)], mode="bwrap", test_list=tests) == [0.0]
        assert _score([fenced(program)], mode="rlimits", test_list=tests) == [1.0]  # the fallback cannot stop it


def test_parallel_loops_cost_one_timeout_not_one_each():
    """16 programs, 4 of them infinite loops, 4 sandboxes at once: about one or two
    timeouts more than the honest programs alone, not four."""
    timeout_s, asserts = 1.0, ["assert f() == 1"]
    honest = [fenced("def f():\n    return 1")] * 12
    start = time.monotonic()
    assert _score(honest, timeout_s=timeout_s, max_parallel=4, test_list=[asserts] * 12) == [1.0] * 12
    honest_s = time.monotonic() - start
    loops = [fenced("def f():\n    while True:\n        pass")] * 4
    start = time.monotonic()
    scores = _score(honest + loops, timeout_s=timeout_s, max_parallel=4, test_list=[asserts] * 16)
    elapsed = time.monotonic() - start
    assert scores == [1.0] * 12 + [0.0] * 4
    assert elapsed < honest_s + 2 * timeout_s + 1.0, (elapsed, honest_s)


def test_a_dead_sandbox_scores_zero_counted_once(monkeypatch, caplog):
    """A sandbox that dies before its program runs: NaN, so the callers count it among
    failed samples and show it once; the rest of the batch scores as usual."""
    real, calls = sandbox._command, itertools.count()
    monkeypatch.setattr(sandbox, "_command", lambda mode, workdir, python: (
        ["/bin/sh", "-c", "echo sandbox crashed >&2; exit 1"] if next(calls) == 0 else real(mode, workdir, python)))
    reward = rewards.get_reward("code", timeout_s=3.0)
    scores, failures, infos = rewards.safe_rewards_with_info(
        reward, ["", ""], [fenced("def f():\n    return 1")] * 2, test_list=[["assert f() == 1"]] * 2)
    assert failures == 1 and sorted(scores.tolist()) == [0.0, 1.0]
    dead = [i for i in infos if i["failure"] == "sandbox_error"]
    assert len(dead) == 1 and "sandbox crashed" in dead[0]["detail"]
    assert sum("failed on 1 of 2 samples" in r.message for r in caplog.records) == 1


def test_scorer_overlaps_code_samples_on_parallel_threads():
    """Scored sample by sample (the RL loop's overlap): code.max_parallel threads, so one
    sample's loop does not hold up the others."""
    reward = rewards.get_reward("code", timeout_s=1.0, max_parallel=4)
    scorer = rewards.Scorer(reward, workers=0, timeout_s=60)
    try:
        scoring = scorer.begin()
        programs = [fenced("def f():\n    while True:\n        pass")] * 3 + [fenced("def f():\n    return 1")]
        start = time.monotonic()
        for i, program in enumerate(programs):
            scoring.submit(i, "", program, {"test_list": ["assert f() == 1"]})
        result = scoring.result(len(programs))
        assert result.scores.tolist() == [0.0, 0.0, 0.0, 1.0] and result.failures == 0
        assert time.monotonic() - start < 2.8  # one after the other: over 3 s
    finally:
        scorer.close()


def test_example_dataset_loads_without_answer_column_and_its_solutions_pass(tmp_path):
    paths = make_code_dataset.write_dataset(str(tmp_path), num_train=4, num_eval=12, seed=3)
    problems = files.FileProblems(files.load_table(paths["eval"], "data.eval"), prompt_field="prompt",
                                  answer_field="", response_field="solution")
    examples = list(problems)
    assert examples[0].answer == "" and examples[0].solution.startswith("```python")
    from tlt_jax.data import tasks

    fields = tasks.reward_fields(examples)
    assert _score([e.solution for e in examples], prompts=[e.prompt for e in examples], **fields) == [1.0] * 12
    wrong = [e.solution.replace("def ", "def misnamed_") for e in examples]
    assert _score(wrong, prompts=[e.prompt for e in examples], **fields) == [0.0] * 12
