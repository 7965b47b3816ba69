"""A sandboxed interpreter that lives across calls: a tool's (the python tool's), one per
episode, fed one cell at a time, its state kept from cell to cell, no cell ever run twice.

The interpreter plays the harness's `session` role: the solution's loop on a small
program of ours (`_TOOL_PROGRAM`) whose one function runs a cell in the namespace the
earlier cells left and returns what it printed. Each cell is one call through the host,
within its own window of `timeout_s`; the host caps what the interpreter says as for a
test. A cell that ends the interpreter (its window passed, memory, the output cap, an
exit) ends the state with it: the next cell starts a fresh interpreter, and the failed
cell's `Outcome` says so.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import weakref

from tlt_jax.sandbox import harness, modes
from tlt_jax.sandbox import interpreter as interpreter_lib
from tlt_jax.sandbox.interpreter import Interpreter
from tlt_jax.sandbox.judges import Judge, json_object
from tlt_jax.sandbox.relay import Relay
from tlt_jax.sandbox.spec import DETAIL_CHARS, Limits, Outcome, Suite

_CELL_FUNCTION = "_tool_cell"
# Run as the session's program: __name__ is "__main__" for the cells, and a cell's stdout
# is kept up to `cap` characters as JSON writes them (the rest counted), its error's last
# line included.
_TOOL_PROGRAM = f'''
import json as _json, sys as _sys, traceback as _traceback
__name__ = "__main__"
class _Captured:
    def __init__(self, cap):
        self.parts, self.size, self.cap = [], 0, cap
    def write(self, text):
        text = str(text)
        self.size += len(_json.dumps(text)) - 2
        if self.size <= self.cap:
            self.parts.append(text)
        return len(text)
    def flush(self):
        pass
def {_CELL_FUNCTION}(source, cap):
    out, stdout = _Captured(cap), _sys.stdout
    _sys.stdout = out
    try:
        exec(compile(source, "<cell>", "exec"), globals())
    except BaseException as error:
        out.write(_traceback.format_exception_only(type(error), error)[-1].strip() + "\\n")
    finally:
        _sys.stdout = stdout
    if out.size > out.cap:
        return {{"kind": "output_limit", "detail": f"more than {{out.cap}} characters of output"}}
    return {{"stdout": "".join(out.parts)}}
'''
_ENDED = "; the interpreter was restarted, and what earlier cells defined is gone"


class _CellJudge(Judge):
    """The host's side of one cell: the interpreter's load, then the cell's reply."""

    def __init__(self, source: str, limits: Limits, loaded: bool):
        super().__init__(Suite("cell", [source]), limits)
        self.loaded, self.stdout = loaded, ""

    def on_line(self, interpreter: Interpreter, line: bytes) -> None:
        record = json_object(line)
        if record is None:
            return
        if record.get("event") == "ready":
            interpreter.ready = True
        elif self.on_event(record) or self.results:
            return
        elif "value" in record:
            with contextlib.suppress(ValueError, TypeError):
                reply = harness.decode_value(record["value"])
                if isinstance(reply, dict) and "stdout" in reply:
                    self.stdout = str(reply["stdout"])
                    return self.end_test(None)
                if isinstance(reply, dict) and reply.get("kind") == "output_limit":
                    return self.end_test("output_limit", reply.get("detail", ""))
            self.end_test("sandbox_error", f"the tool's interpreter replied {str(record)[:80]}")
        else:  # the call itself failed (a cell that rebound our function, memory on the way back)
            self.end_test(harness.solution_kind(record), record.get("detail", ""))


class Session:
    """One sandboxed interpreter for a tool, started at the first cell (see the module
    doc). limits, mode, python: as for `run`; cells: the most cells one interpreter runs,
    which sizes its CPU-time limit (each cell's window, as for a test). Cells run one at a
    time; `close` may come from any thread, and ends a cell that runs."""

    def __init__(self, limits: Limits = Limits(), mode: str = "auto", python: str = "", cells: int = 16):
        self.limits, self.cells = limits, cells
        self.python = python or modes.default_python()
        self.mode = modes.resolve_mode(mode, self.python)
        self._lock = threading.Lock()
        self._interpreter: Interpreter | None = None
        self._stop = None  # ends the interpreter and everything of it (a finalizer: at garbage collection too)
        self._loaded = False
        self._closed = False

    def run_cell(self, source: str) -> tuple[str, Outcome]:
        """Runs `source` after the cells before it: (what it printed, its Outcome: failure
        None when the cell ran, an exception it raised printed as the last line)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("This session is closed; a closed tool runs no more cells.")
            if self._interpreter is None:
                self._start()
            interpreter = self._interpreter
            interpreter.output_bytes = interpreter.said_bytes = 0  # the caps are per cell, as per test
            request = {"op": "call", "name": _CELL_FUNCTION, "args": [source, self.limits.output_bytes]}
            interpreter.tell(json.dumps(request).encode())
            judge = _CellJudge(source, self.limits, self._loaded)
            Relay([interpreter], judge).run()
            self._loaded = judge.loaded
            outcome = judge.outcome([interpreter])
            if outcome.failure is not None and not judge.results:  # the interpreter did not answer: it ends
                self._end()
                detail = {"timeout": f"the cell did not end within code.timeout_s={self.limits.timeout_s:g} s",
                          "runtime_error": "the interpreter exited during the cell"}.get(
                    outcome.failure, outcome.detail[:DETAIL_CHARS])
                outcome = Outcome(0, 1, outcome.failure, detail + _ENDED)
            return judge.stdout, outcome

    def _start(self) -> None:
        stack = contextlib.ExitStack()
        job = {"program": _TOOL_PROGRAM, "setup": "", "windows": self.cells}
        self._interpreter = stack.enter_context(interpreter_lib.start("session", job, self.mode, self.python,
                                                                      self.limits))
        self._stop = weakref.finalize(self, stack.close)
        self._loaded = False

    def _end(self) -> None:
        if self._stop is not None:
            self._stop()
        self._interpreter = self._stop = None

    def close(self) -> None:
        """Ends the interpreter, at once: a cell that runs ends too (its run_cell returns)."""
        self._closed = True
        interpreter = self._interpreter
        if interpreter is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(interpreter.process.pid, signal.SIGKILL)
        with self._lock:
            self._end()
