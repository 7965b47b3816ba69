"""The sandbox's containment, through the code reward: a process limit that binds, bombs and
loops that score 0 with the host unharmed (a canary file, no process left), no secret of ours,
no network, parallel timeouts, the modes' availability, and the value codec (a subclass
arrives as its base value)."""
import functools
import json
import socket
import time

import pytest

from tests.support import sandboxed
from tests.support.sandboxed import MODES, fenced
from tlt_jax import sandbox
from tlt_jax.sandbox import modes as sandbox_modes
from tlt_jax.sandbox import uids as sandbox_uids

# The code reward's worker runs these too: a test checks that no sandbox process is left, of any test.
pytestmark = pytest.mark.xdist_group("test_code_reward")


def test_unavailable_sandbox_mode_says_which_one_runs(monkeypatch):
    monkeypatch.setattr(sandbox_modes, "bwrap_problem", lambda python: "bwrap is not installed (apt-get ...)")
    with pytest.raises(ValueError) as error:
        sandbox.resolve_mode("bwrap", "python3")
    assert "\n" not in str(error.value)
    assert "code.sandbox='bwrap' is not available" in str(error.value) and "code.sandbox='rlimits'" in str(error.value)
    assert sandbox.resolve_mode("auto", "python3") == "rlimits"


def test_values_cross_as_their_builtin_base_value():
    """The codec: every builtin type round-trips exactly, a subclass arrives as its base
    value (a rigged __eq__ never reaches the comparison), and nothing else crosses."""
    import collections

    from tlt_jax.sandbox import harness

    def crossed(value):
        return harness.loads_value(json.dumps(harness.encode_value(value)))

    values = [None, True, False, 0, -7, 1 << 70, -(1 << 64), 10 ** 5000, 1.5, -0.0, float("inf"), float("-inf"),
              1e308, 3 + 4j, complex(float("nan"), 1), "", "tab\t\udc80", b"\x00\xff", [1, [2, (3,)]], (1, "a"),
              {1: "x", (2, 3): [4], "k": {frozenset({5}): None}}, {1, 2.5, "s"}, frozenset({(1, 2)}), []]
    for value in values:
        back = crossed(value)
        assert type(back) is type(value) and (back == value if type(value) is int else repr(back) == repr(value))
    nan = crossed(float("nan"))
    assert type(nan) is float and nan != nan

    class Rigged(int):
        def __eq__(self, other):
            return True
        __hash__ = int.__hash__

    assert type(crossed(Rigged(4))) is int and crossed(Rigged(4)) != 5
    counter = crossed(collections.Counter("aab"))
    assert type(counter) is dict and counter == {"a": 2, "b": 1}
    assert type(crossed(collections.OrderedDict(a=1))) is dict
    assert type(crossed(collections.namedtuple("P", "x y")(1, 2))) is tuple
    for other in (object(), collections.deque([1]), [object()], {"k": print}):
        with pytest.raises(TypeError, match="not a builtin value"):
            harness.encode_value(other)
    with pytest.raises(ValueError, match="nested more than"):
        harness.encode_value(functools.reduce(lambda inner, _: [inner], range(200), []))
    for forged in ('{"pickle": "x"}', '{"set": [[1]]}', 'NaN', '{"int": 5}', '{"tuple": [1], "set": [2]}',
                   '{"dict": [[[1], 2]]}'):
        with pytest.raises((TypeError, ValueError)):
            harness.loads_value(forged)


def test_auto_without_bubblewrap_says_what_is_not_contained(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_modes, "bwrap_problem", lambda python: "bwrap is not installed (test_code_reward)")
    assert sandbox.resolve_mode("auto", "python3") == "rlimits"
    warned = [r.getMessage() for r in caplog.records if "resource limits alone" in r.getMessage()]
    assert len(warned) == 1 and "the network" in warned[0] and sandbox.INSTALL_HINT in warned[0]


_PROBE_LIMIT = 8


_FORK_PROBE = ("import os, time\ncount = 0\nfor _ in range(64):\n    try:\n        pid = os.fork()\n"
               "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
               "    count += 1\n")


@functools.cache
def _process_limit_binds(mode: str) -> bool:
    """Whether a program that forks up to 64 sleeping children gets fewer than
    code.processes of them: what a fork bomb's test needs first."""
    score = sandboxed.score([fenced(_FORK_PROBE)], mode=mode, processes=_PROBE_LIMIT,
                   test_list=[[f"assert count < {_PROBE_LIMIT}"]])[0]
    return score == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_process_limit_binds(mode, canary):
    sandboxed.require_mode(mode)
    if not sandbox_uids.process_limit_binds():
        pytest.skip("not root: the process limit counts this user's processes too (docs/code.md)")
    assert _process_limit_binds(mode), f"a program forked {_PROBE_LIMIT} or more processes (code.processes)"


@pytest.mark.parametrize("mode", MODES)
def test_bombs_and_loops_score_zero_and_leave_nothing(mode, canary):
    """A fork bomb, a memory bomb, a giant output and an infinite loop (in a test, and in a
    stdin/stdout program): each scores 0 with its kind, the canary stays, no process is
    left (the canary fixture checks both), and no run waits much past its timeout."""
    sandboxed.require_mode(mode)
    if not (sandbox_uids.process_limit_binds() and _process_limit_binds(mode)):
        pytest.skip("never a fork bomb without a binding process limit (test_process_limit_binds)")
    vandal = sandboxed.vandal(canary)
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
    scores = sandboxed.score(completions, mode=mode, timeout_s=1.0, max_parallel=2, processes=_PROBE_LIMIT,
                    test_list=[asserts] * len(programs) + [None, None], input_output=[None] * len(programs) + [io, io])
    elapsed = time.monotonic() - start
    assert [float(s) for s in scores] == [0.0] * len(completions), [s.info for s in scores]
    assert [s.info["failure"] for s in scores] == list(kinds.values()) + ["output_limit", "timeout"]
    assert scores[-1].info["detail"].startswith("no test ended within code.timeout_s=1 s")
    assert elapsed < 12.0, elapsed  # 3 timeouts of 1 s, 2 at once; the rest end at once


@pytest.mark.parametrize("mode", MODES)
def test_the_program_sees_no_secret_of_ours(mode, monkeypatch):
    sandboxed.require_mode(mode)
    monkeypatch.setenv("TLT_TEST_SECRET", "hunter2")
    program = ("import os\ndef leaks():\n    seen = [str(os.environ)]\n"
               "    for pid in (os.getppid(), 1):\n        try:\n"
               "            seen.append(open(f'/proc/{pid}/environ', errors='ignore').read())\n"
               "        except OSError:\n            pass\n    return 'hunter2' in ''.join(seen)")
    score = sandboxed.score([fenced(program)], mode=mode, test_list=[["assert not leaks()"]])[0]
    assert score == 1.0, score.info


def test_no_network_to_a_localhost_listener():
    sandboxed.require_mode("bwrap")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        program = ("import socket\ndef reach():\n    try:\n"
                   f"        socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
                   "        return True\n    except OSError:\n        return False")
        tests = [["assert reach()"]]
        assert sandboxed.score([fenced(program)], mode="bwrap", test_list=tests) == [0.0]
        # The fallback cannot stop it.
        assert sandboxed.score([fenced(program)], mode="rlimits", test_list=tests) == [1.0]


def test_parallel_loops_cost_one_timeout_not_one_each():
    """16 programs, 4 of them infinite loops, 4 sandboxes at once: about one or two
    timeouts more than the honest programs alone, not four."""
    timeout_s, asserts = 1.0, ["assert f() == 1"]
    honest = [fenced("def f():\n    return 1")] * 12
    start = time.monotonic()
    assert sandboxed.score(honest, timeout_s=timeout_s, max_parallel=4, test_list=[asserts] * 12) == [1.0] * 12
    honest_s = time.monotonic() - start
    loops = [fenced("def f():\n    while True:\n        pass")] * 4
    start = time.monotonic()
    scores = sandboxed.score(honest + loops, timeout_s=timeout_s, max_parallel=4, test_list=[asserts] * 16)
    elapsed = time.monotonic() - start
    assert scores == [1.0] * 12 + [0.0] * 4
    assert elapsed < honest_s + 2 * timeout_s + 1.0, (elapsed, honest_s)

