"""The trusted side of a sandboxed test run, inside the sandbox (`sandbox.py` passes this
file's text to `python -I -c`; it imports only the standard library).

It reads its job, one JSON object, from stdin to the end, so nothing of it is left there
for the program; sets its own resource limits before any untrusted code runs; then runs
the tests in order and reports each one's end, as one line on the report pipe, prefixed
with the job's nonce (a line without it is not ours and is ignored). A test passes only
on its own report after it ran: a program that exits before its tests leaves them
unreported. Expected values of stdin/stdout and call-based tests never enter the
sandbox: the host compares what the reports carry.
"""
import json
import os
import resource
import sys
import traceback

_MEMORY_EXIT = 97  # a stdin/stdout test's child that ran out of memory
_DETAIL_CHARS = 300
# Bound now, before the program can rebind the builtins the harness relies on.
_exec, _compile, _open, _isinstance, _dumps = exec, compile, open, isinstance, json.dumps
_BaseException, _MemoryError, _AssertionError, _SystemExit = BaseException, MemoryError, AssertionError, SystemExit


def _reporter(fd, nonce):
    prefix, write = nonce.encode(), os.write

    def report(**record):
        view = memoryview(prefix + _dumps(record, default=repr).encode() + b"\n")
        while view:
            view = view[write(fd, view):]
    return report


def _kind(error):
    if _isinstance(error, _MemoryError):
        return "memory"
    return "wrong_answer" if _isinstance(error, _AssertionError) else "runtime_error"


def _detail(error):
    return f"{type(error).__name__}: {error}"[:_DETAIL_CHARS]


def _set_limits(limits, tests):
    """CPU seconds for every window of the run (load, then each test), the rest as given."""
    for name, value in (("RLIMIT_CPU", int(limits["timeout_s"] * (tests + 1)) + 1),
                        ("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_FSIZE", limits["file_bytes"]),
                        ("RLIMIT_NPROC", limits["processes"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))


def _run_in_process(job, report):
    """asserts (MBPP), check (HumanEval) and call (fn_name) tests, in this process."""
    try:
        code = _compile(job["program"], "solution.py", "exec")
    except (SyntaxError, ValueError) as error:
        report(event="syntax_error", detail=_detail(error))
        return
    namespace = {"__name__": "solution"}
    layout = job["layout"]
    try:
        _exec(code, namespace)
        if job["setup"]:
            _exec(_compile(job["setup"], "setup.py", "exec"), namespace)
        if layout == "call":
            name = job["fn_name"]
            fn = namespace[name] if name in namespace else getattr(namespace["Solution"](), name)
    except _BaseException as error:  # SystemExit too: exiting at import passes nothing
        report(event="load_error", kind=_kind(error), detail=_detail(error))
        return
    report(event="loaded")
    for i, test in enumerate(job["tests"]):
        try:
            if layout == "asserts":
                _exec(_compile(test, f"test_{i}.py", "exec"), namespace)
                report(test=i)
            elif layout == "check":
                _exec(_compile(test, "check.py", "exec"), namespace)
                namespace["check"](namespace[job["entry_point"]])
                report(test=i)
            else:
                report(test=i, value=fn(*test))
        except _BaseException as error:
            report(test=i, kind=_kind(error), detail=_detail(error))


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


def _run_stdio(job, report, report_fd, cap):
    """stdin/stdout tests: each in a forked child, whose stdout the host compares."""
    try:
        code = _compile(job["program"], "solution.py", "exec")
    except (SyntaxError, ValueError) as error:
        report(event="syntax_error", detail=_detail(error))
        return
    report(event="loaded")
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


def main():
    job = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    report_fd = job.pop("report_fd")
    report = _reporter(report_fd, job.pop("nonce"))
    _set_limits(job["limits"], len(job["tests"]))
    report(event="ready")
    if job["layout"] == "stdio":
        _run_stdio(job, report, report_fd, job["limits"]["output_bytes"])
    else:
        _run_in_process(job, report)
    sys.stdout.flush()
    report(event="done")


if __name__ == "__main__":  # as `python -c` runs it
    main()
