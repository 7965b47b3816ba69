"""What runs inside a sandbox: `modes.py` passes this file's text to `python -I -c`
(it imports only the standard library), and imports it for the value codec.

Each sandboxed interpreter reads its job, one JSON object, from stdin to the end (so
nothing of it is left there for a program), sets its own resource limits before any
untrusted code runs, and plays one role:

  solution  the policy's program, loaded and then asked for calls: the host sends
            requests ({"op": "call" | "get", ...}) on one pipe and reads replies on
            another. It holds no test, no expected value and no report pipe: all it can
            say is the value a function returned, encoded as a builtin value.
  checker   the row's own test code (MBPP's asserts and setup, HumanEval's prompt and
            `check`; for call-based rows, fn_name's calls against their expected
            values), in a process of its own: every name the tests take from the
            program (`candidate`, the entry point, a function an assert calls) is a stub
            that sends the call's arguments to the solution through the host and decodes
            the value that comes back. The comparisons, and the report of each test's end,
            happen here, on builtin values the program cannot rig.
  stdio     stdin/stdout tests: each in a forked child; the host compares its output.
            Reports carry the job's nonce (a line without it is ignored).

Values cross as tagged JSON of their builtin base type (`encode_value`, `decode_value`):
bool, int, float (nan and inf too), complex, str, bytes, None, list, tuple, dict (any
hashable keys), set, frozenset. A subclass (a Counter, an int with a rigged __eq__) is
sent as its base value; any other object fails the call that returned it. Never pickle.
"""
import ast
import builtins
import importlib
import json
import os
import re
import resource
import signal
import sys
import traceback

_MEMORY_EXIT = 97  # a stdin/stdout test's child that ran out of memory
_DETAIL_CHARS = 300
_OPEN_FILES = 64  # memfds hold memory RLIMIT_AS does not count: at most this many of file_bytes each
_MAX_DEPTH = 100  # of a value's nesting: deeper is refused, not a RecursionError mid-comparison
_FENCE = re.compile(r"```[ \t]*[\w+-]*[^\n]*\n(.*?)(?:```|\Z)", re.S)  # a prompt's code blocks
_LONG_INT = 1 << 63  # beyond: sent in hex, which no digit limit of int <-> str conversion binds
# Bound now, before a program can rebind the builtins the harness relies on.
_exec, _compile, _open, _isinstance, _dumps = exec, compile, open, isinstance, json.dumps
_BaseException, _MemoryError, _AssertionError, _SystemExit = BaseException, MemoryError, AssertionError, SystemExit


# ---- values across the boundary ----

def encode_value(value, depth=0):
    """`value` as JSON-able data of its builtin base type; TypeError for any other object."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"a value nested more than {_MAX_DEPTH} deep")
    inner = depth + 1
    if value is None or value is True or value is False:
        return value
    if _isinstance(value, int):
        number = int.__int__(value)  # the base value: a subclass's own methods are never called
        return number if -_LONG_INT < number < _LONG_INT else {"int": hex(number)}
    if _isinstance(value, float):
        number = float.__float__(value)
        return number if number - number == 0 else {"float": float.__repr__(number)}  # nan, inf: not JSON
    if _isinstance(value, complex):
        number = complex.__complex__(value)
        return {"complex": [encode_value(number.real, inner), encode_value(number.imag, inner)]}
    if _isinstance(value, str):
        return str.__str__(value)
    if _isinstance(value, bytes):
        return {"bytes": bytes.hex(value)}
    if _isinstance(value, list):
        return [encode_value(item, inner) for item in list.__iter__(value)]
    if _isinstance(value, tuple):
        return {"tuple": [encode_value(item, inner) for item in tuple.__iter__(value)]}
    if _isinstance(value, dict):
        return {"dict": [[encode_value(k, inner), encode_value(v, inner)] for k, v in dict.items(value)]}
    if _isinstance(value, (set, frozenset)):
        kind = "set" if _isinstance(value, set) else "frozenset"
        items = set.__iter__(value) if kind == "set" else frozenset.__iter__(value)
        return {kind: [encode_value(item, inner) for item in items]}
    raise TypeError(f"an object of type {type(value).__name__}, not a builtin value")


def refuse_constant(name):
    raise ValueError(f"{name} is not an encoded value")


_TEXT_TAGS = ("int", "float", "bytes")  # whose body is a string; the rest carry a list
_DECODERS = {
    "int": lambda body, depth: int(body, 16),
    "float": lambda body, depth: float(body),
    "complex": lambda body, depth: complex(*(decode_value(part, depth) for part in body)),
    "bytes": lambda body, depth: bytes.fromhex(body),
    "tuple": lambda body, depth: tuple(decode_value(item, depth) for item in body),
    "set": lambda body, depth: {decode_value(item, depth) for item in body},
    "frozenset": lambda body, depth: frozenset(decode_value(item, depth) for item in body),
    "dict": lambda body, depth: {decode_value(k, depth): decode_value(v, depth) for k, v in body},
}


def decode_value(data, depth=0):
    """The builtin value `encode_value` sent (data: what json.loads gave); ValueError or
    TypeError for anything else."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"a value nested more than {_MAX_DEPTH} deep")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode_value(item, depth + 1) for item in data]
    if type(data) is dict and len(data) == 1:
        (tag, body), = data.items()
        if tag in _DECODERS and type(body) is (str if tag in _TEXT_TAGS else list):
            return _DECODERS[tag](body, depth + 1)
    raise ValueError(f"not an encoded value: {str(data)[:80]}")


def _decoded(data):
    """decode_value, any failure of a decoder (OverflowError of a huge complex, a set of
    lists) as ValueError."""
    try:
        return decode_value(data)
    except (ValueError, TypeError, OverflowError, RecursionError, MemoryError) as error:
        raise ValueError(f"not an encoded value ({type(error).__name__}: {error})"[:_DETAIL_CHARS]) from None


def loads_value(text):
    """decode_value of one JSON text, strict JSON (no NaN tokens); ValueError for anything else."""
    try:
        data = json.loads(text, parse_constant=refuse_constant)
    except RecursionError as error:
        raise ValueError(f"nested too deep ({error})") from None
    return _decoded(data)


def value_matches(actual, expected):
    """A call's return value against the expected one, after a JSON round trip (tuples are
    lists); APPS/TACO often wrap the expected value in a one-element list. Never raises."""
    try:
        actual, expected = (json.loads(_dumps(v, default=repr)) for v in (actual, expected))
    except (TypeError, ValueError, RecursionError):  # what JSON cannot hold (non-string keys, huge ints)
        return False
    return actual == expected or (_isinstance(expected, list) and len(expected) == 1 and actual == expected[0])


# ---- shared by the roles ----

def _kind(error):
    if _isinstance(error, _MemoryError):
        return "memory"
    if _isinstance(error, OSError) and error.errno in (27, 28):  # EFBIG, ENOSPC: code.file_bytes, code.disk_mb
        return "disk_limit"
    return "wrong_answer" if _isinstance(error, _AssertionError) else "runtime_error"


def _detail(error):
    return f"{type(error).__name__}: {error}"[:_DETAIL_CHARS]


def _set_limits(limits, windows):
    """CPU seconds for every window of the run (load, then each test), the rest as given,
    and few open files. A file past file_bytes fails the write (EFBIG) rather than killing
    the process."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    for name, value in (("RLIMIT_CPU", int(limits["timeout_s"] * (windows + 1)) + 1),
                        ("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_FSIZE", limits["file_bytes"]),
                        ("RLIMIT_NPROC", limits["processes"]), ("RLIMIT_CORE", 0),
                        ("RLIMIT_NOFILE", _OPEN_FILES)):
        resource.setrlimit(getattr(resource, name), (value, value))


def _line_writer(fd, prefix=b""):
    write = os.write

    def send(**record):
        view = memoryview(prefix + _dumps(record, default=repr).encode() + b"\n")
        while view:
            view = view[write(fd, view):]
    return send


def _lines(fd):
    """The lines a pipe carries, until it closes."""
    buffer = b""
    while True:
        while b"\n" not in buffer:
            data = os.read(fd, 1 << 16)
            if not data:
                return
            buffer += data
        line, buffer = buffer.split(b"\n", 1)
        yield line


def _compiled(source, filename, send):
    try:
        return _compile(source, filename, "exec")
    except (SyntaxError, ValueError) as error:
        send(event="syntax_error", detail=_detail(error))
        return None


# ---- solution ----

def _failed(error):
    """The reply for a call that raised `error`."""
    return {"raised": type(error).__name__, "kind": _kind(error), "detail": _detail(error)}


def _answer(namespace, request):
    """The reply to one request of the host, as a dict."""
    name = request.get("name")
    if request.get("op") == "get":
        if name not in namespace:
            return {"missing": True}
        value = namespace[name]
        if callable(value):
            return {"callable": True}
        if type(value).__name__ == "module":
            return {"module": value.__name__}
        return {"value": encode_value(value)}
    try:
        args = [decode_value(a) for a in request["args"]]
        kwargs = {k: decode_value(v) for k, v in request.get("kwargs", {}).items()}
        fn = namespace[name] if name in namespace else getattr(namespace["Solution"](), name)  # LeetCode's class
        returned = fn(*args, **kwargs)
    except _BaseException as error:  # SystemExit too: the call failed, nothing passes
        return _failed(error)
    try:
        return {"value": encode_value(returned)}
    except (TypeError, ValueError, RecursionError) as error:
        return {"raised": "TypeError", "kind": "wrong_answer", "detail": f"returned {error}"[:_DETAIL_CHARS]}


def _solution(job):
    send = _line_writer(job["reply_fd"])
    _set_limits(job["limits"], job["windows"])
    send(event="ready")
    code = _compiled(job["program"], "solution.py", send)
    if code is None:
        return
    namespace = {"__name__": "solution"}
    try:
        _exec(code, namespace)
        if job.get("setup"):  # MBPP's setup runs with the program too (its imports are the program's)
            _exec(_compile(job["setup"], "setup.py", "exec"), namespace)
    except _BaseException as error:  # SystemExit too: exiting at import passes nothing
        send(event="load_error", kind=_kind(error), detail=_detail(error))
        return
    send(event="loaded")
    for line in _lines(job["request_fd"]):
        try:
            reply = _answer(namespace, json.loads(line))
        except _BaseException as error:
            reply = _failed(error)
        try:
            send(**reply)
        except (TypeError, ValueError, RecursionError) as error:
            send(raised="TypeError", kind="wrong_answer", detail=f"returned {error}"[:_DETAIL_CHARS])


# ---- checker ----

class SolutionError(Exception):
    """A call into the solution that did not return a builtin value."""


# What a failed call may be called: a program cannot name its own failure anything else
# (not `forgeable`, which only the checker decides).
_SOLUTION_KINDS = ("wrong_answer", "runtime_error", "memory", "disk_limit")
# Exceptions a test's own code treats as control flow (`map` and `all` end on StopIteration).
_CONTROL_FLOW = (StopIteration, StopAsyncIteration)


def solution_kind(reply):
    """The failure kind a solution's reply names, within `_SOLUTION_KINDS`."""
    kind = reply.get("kind") if _isinstance(reply, dict) else None
    return kind if kind in _SOLUTION_KINDS else "runtime_error"


def _raised(reply):
    """The exception a stub raises for a failed call: the builtin exception of the same
    name where there is one (so `except ValueError` in a test works), else SolutionError."""
    error_type = getattr(builtins, str(reply.get("raised")), None)
    detail = str(reply.get("detail", ""))
    error = SolutionError(detail)
    if (_isinstance(error_type, type) and issubclass(error_type, Exception) and error_type is not _AssertionError
            and not issubclass(error_type, _CONTROL_FLOW)):
        try:
            error = error_type(detail)
        except Exception:  # noqa: BLE001 - an exception type with other constructor arguments
            pass
    error.solution_kind = solution_kind(reply)  # what the test's failure is called
    return error


class _Solution:
    """The checker's line to the solution process, through the host."""

    def __init__(self, send, replies):
        self._send, self._replies = send, replies

    def ask(self, **request):
        self._send(**request)
        line = next(self._replies, None)
        if line is None:
            raise SolutionError("the solution process is gone")
        try:
            reply = json.loads(line, parse_constant=refuse_constant)
        except (ValueError, RecursionError, MemoryError) as error:
            raise SolutionError(f"a reply that is no JSON ({error})"[:_DETAIL_CHARS]) from None
        if not _isinstance(reply, dict):
            raise SolutionError("a reply that is no JSON object")
        return reply

    def stub(self, name):
        """A function that calls the solution's `name` and returns the decoded value."""
        def call(*args, **kwargs):
            try:
                request = {"op": "call", "name": name, "args": [encode_value(a) for a in args],
                           "kwargs": {k: encode_value(v) for k, v in kwargs.items()}}
            except TypeError as error:  # an object of the row's own code: only a row makes those
                raise _Unencodable(f"the test passes {error} to {name}()") from None
            except (ValueError, RecursionError) as error:  # nested too deep: built on what the program returned
                raise SolutionError(f"an argument for {name}() {error}"[:_DETAIL_CHARS]) from None
            reply = self.ask(**request)
            if "value" not in reply:
                raise _raised(reply)
            try:
                return _decoded(reply["value"])
            except ValueError as error:
                raise SolutionError(f"returned no builtin value ({error})"[:_DETAIL_CHARS]) from None
        call.__name__ = call.__qualname__ = name
        return call


class _Unencodable(Exception):
    """A test passes the solution an argument that is no builtin value (an object of the
    row's own code): this path cannot send it, so the test is `forgeable`."""


def _free_names(sources):
    """Names the code reads and defines nowhere (no assignment, import, def or argument of
    its own), less the builtins: what it needs from elsewhere."""
    read, defined = set(), set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if _isinstance(node, ast.Name):
                (read if _isinstance(node.ctx, ast.Load) else defined).add(node.id)
            elif _isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif _isinstance(node, ast.arg):
                defined.add(node.arg)
            elif _isinstance(node, ast.alias):
                defined.add((node.asname or node.name).split(".")[0])
    return sorted(read - defined - set(dir(builtins)))


def _bind_program_names(namespace, solution, names):
    """Binds each name the tests read that trusted code left undefined to the program's:
    a stub for a function, the checker's own import of a module of that name (the program
    cannot pick which module a test gets), a value by its value. Builtins and names the
    row's code defines are never the program's."""
    for name in names:
        if name in namespace:
            continue
        found = solution.ask(op="get", name=name)
        if found.get("callable"):
            namespace[name] = solution.stub(name)
        elif found.get("module") == name:  # the checker's own import, and only of the name asked for
            try:
                namespace[name] = importlib.import_module(name)
            except ImportError:
                pass
        elif "value" in found:
            try:
                namespace[name] = _decoded(found["value"])
            except ValueError:
                pass


def _prompt_code(preamble):
    """The code of a HumanEval-style prompt: the whole prompt where it compiles, else its
    last fenced block (a chat row's), else None."""
    candidates = [preamble]
    if "```" in preamble:
        candidates += _FENCE.findall(preamble)[::-1]
    for text in candidates:
        try:
            return _compile(text, "prompt.py", "exec")
        except (SyntaxError, ValueError):
            continue
    return None


def _forgeable_row(job, send, why):
    send(event="loaded")
    for i in range(len(job["tests"])):
        send(test=i, kind="forgeable", detail=why[:_DETAIL_CHARS])


def _trusted_code(job, solution, send):
    """The checker's namespace: the row's code before its tests (HumanEval's prompt, which
    defines helpers such as `poly`; the setup) and the program's names the tests read.
    Which tests are forgeable is the row's to say, before the program is asked anything:
    a setup that needs the program's names (two MBPP rows build the program's `Node`s), or
    a check whose helpers the prompt's code does not define. None: nothing to run."""
    namespace = {"__name__": "checker"}
    if job["layout"] == "call":
        return namespace
    if job.get("program") is not None:  # code.forgeable="run": the program in this interpreter, forgeable
        code = _compiled(job["program"], "solution.py", send)
        if code is None:
            return None
        try:
            _exec(code, namespace)
            if job["setup"]:
                _exec(_compile(job["setup"], "setup.py", "exec"), namespace)
        except _BaseException as error:  # noqa: BLE001
            send(event="load_error", kind=_kind(error), detail=_detail(error))
            return None
        return namespace
    if job["preamble"]:
        prompt = _prompt_code(job["preamble"])
        try:
            if prompt is not None:
                _exec(prompt, namespace)
        except _BaseException:  # noqa: BLE001 - a prompt that does not run defines nothing
            namespace = {"__name__": "checker"}
    setup_needs = [name for name in _free_names([job["setup"]]) if name not in namespace]
    if setup_needs:
        _forgeable_row(job, send, f"the row's setup code uses the program's {', '.join(setup_needs)}")
        return None
    if job["setup"]:
        try:
            _exec(_compile(job["setup"], "setup.py", "exec"), namespace)
        except _BaseException as error:  # noqa: BLE001
            send(event="load_error", kind="runtime_error", detail="the row's setup code: " + _detail(error))
            return None
    test_needs = [name for name in _free_names(job["tests"]) if name not in namespace]
    if job["layout"] == "check":
        helpers = [name for name in test_needs if name not in (job["entry_point"], "candidate")]
        if helpers:
            _forgeable_row(job, send, f"the tests use {', '.join(helpers)}, which the prompt's code does not define")
            return None
        test_needs = []
    try:
        _bind_program_names(namespace, solution, test_needs)
        if job["layout"] == "check":
            namespace[job["entry_point"]] = solution.stub(job["entry_point"])
    except SolutionError as error:  # the program is gone or broke the line: it fails, as at its load
        send(event="load_error", kind="runtime_error", detail=_detail(error))
        return None
    return namespace


def _shown(value):
    try:
        return repr(value)[:200]
    except ValueError:  # an int past the digit limit of int -> str
        return f"an {type(value).__name__} too long to show"


def _undumpable():
    """No other process of this uid may trace this one or take its descriptors (ptrace,
    pidfd_getfd, /proc/<pid>/fd): not a forked test child, not a program of the same user."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass


def _checker(job):
    _undumpable()
    send = _line_writer(job["report_fd"])
    _set_limits(job["limits"], job["windows"])
    send(event="ready")
    solution = _Solution(send, _lines(job["reply_fd"]))
    namespace = _trusted_code(job, solution, send)
    if namespace is None:
        return
    send(event="loaded")
    for i, test in enumerate(job["tests"]):
        try:
            if job["layout"] == "call":  # fn_name(*test) against the expected value, here, not in the program
                value = solution.stub(job["fn_name"])(*test)
                if not value_matches(value, job["expected"][i]):
                    send(test=i, kind="wrong_answer", detail=f"returned {_shown(value)}")
                    continue
            else:
                _exec(_compile(test, f"test_{i}.py", "exec"), namespace)
                if job["layout"] == "check":
                    namespace["check"](namespace[job["entry_point"]])
            send(test=i)
        except _Unencodable as error:
            send(test=i, kind="forgeable", detail=str(error)[:_DETAIL_CHARS])
        except _BaseException as error:  # noqa: BLE001
            send(test=i, kind=getattr(error, "solution_kind", None) or _kind(error), detail=_detail(error))


# ---- stdio ----

def _read_capped(fd, cap):
    """Everything a pipe carries, or None past `cap` bytes."""
    chunks, size = [], 0
    while data := os.read(fd, 1 << 16):
        size += len(data)
        if size > cap:
            return None
        chunks.append(data)
    return b"".join(chunks)


def _child(code, stdin_fd, stdout_fd, report_fd):
    """One stdin/stdout test: the program as __main__ with the test's input; never returns."""
    status = 1
    try:
        os.close(report_fd)
        os.dup2(stdin_fd, 0)
        os.dup2(stdout_fd, 1)
        sys.stdin, sys.stdout = _open(0, "r", closefd=False), _open(1, "w", closefd=False)
        status = 0
        try:
            _exec(code, {"__name__": "__main__"})
        except _SystemExit as error:
            status = error.code if _isinstance(error.code, int) else int(error.code is not None)
        except _MemoryError:
            status = _MEMORY_EXIT
        except _BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
    finally:
        os._exit(status)


def _stdio(job):
    _undumpable()  # a forked child runs the program: it must not take this process's report pipe
    report_fd = job["report_fd"]
    report = _line_writer(report_fd, job["nonce"].encode())
    _set_limits(job["limits"], job["windows"])
    report(event="ready")
    code = _compiled(job["program"], "solution.py", report)
    if code is None:
        return
    report(event="loaded")
    cap = job["limits"]["output_bytes"]
    for i, stdin_text in enumerate(job["tests"]):
        try:
            stdin_fd = os.memfd_create("stdin")
            os.write(stdin_fd, stdin_text.encode())
            os.lseek(stdin_fd, 0, os.SEEK_SET)
            read_fd, write_fd = os.pipe()
            pid = os.fork()
        except OSError as error:  # the process limit
            report(test=i, kind="runtime_error", detail=_detail(error))
            continue
        if pid == 0:
            _child(code, stdin_fd, write_fd, report_fd)
        os.close(write_fd)
        os.close(stdin_fd)
        out = _read_capped(read_fd, cap)
        os.close(read_fd)
        if out is None:
            os.kill(pid, 9)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if out is None:
            report(test=i, kind="output_limit", detail=f"more than {cap} bytes of output")
        elif status == 0:
            report(test=i, stdout=out.decode(errors="replace"))
        else:
            report(test=i, kind="memory" if status == _MEMORY_EXIT else "runtime_error",
                   detail=f"exit status {status}")
    report(event="done")


# session: a tool's interpreter (`session.py`), the solution's loop on the tool's own program.
_ROLES = {"solution": _solution, "checker": _checker, "stdio": _stdio, "session": _solution}


def main():
    job = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _ROLES[job["role"]](job)
    sys.stdout.flush()


if __name__ == "__main__":  # as `python -c` runs it
    main()
