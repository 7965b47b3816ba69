"""What a sandboxed run is given and gives back: the program's `Limits`, the `Suite` of
its tests, the `Outcome`."""
from __future__ import annotations

import dataclasses
from typing import Sequence

FAILURE_KINDS = ("wrong_answer", "runtime_error", "timeout", "memory", "output_limit", "disk_limit",
                 "syntax_error", "sandbox_error", "forgeable")
DETAIL_CHARS = 300  # of a failure's detail


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one program may use. timeout_s: wall seconds per test (and for loading the
    program); memory_mb: address space, MiB; output_bytes: what the sandbox may write to
    stdout and stderr, and each stdin/stdout test's output; file_bytes: the largest file it
    may write; processes: tasks of its uid at once (threads count); disk_mb: all it may
    write, together, under bwrap (a size-capped tmpfs; rlimits cannot bound it)."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    output_bytes: int = 1 << 20
    file_bytes: int = 16 << 20
    processes: int = 16
    disk_mb: int = 64

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "output_bytes", "file_bytes", "processes", "disk_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"code.{name}={getattr(self, name)!r} must be > 0.")


@dataclasses.dataclass(frozen=True)
class Suite:
    """The tests of one program, as the harness runs them.

    layout: "asserts" (tests: statements, MBPP's test_list; setup: run once before them),
    "check" (tests: [HumanEval's test code]; entry_point: what check() gets; preamble:
    the prompt's code, whose helpers the tests may use), "call" (tests: argument lists
    for fn_name), or "stdio" (tests: stdin texts).
    expected: per test, the return value ("call", compared in the checker) or stdout
    ("stdio", compared on the host); it never enters the program's sandbox.
    """

    layout: str
    tests: Sequence
    setup: str = ""
    entry_point: str = ""
    fn_name: str = ""
    expected: Sequence | None = None
    preamble: str = ""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """passed of total tests; failure: the first failed test's kind (FAILURE_KINDS) or None;
    sandbox_error means the sandbox itself failed before the program ran; forgeable: tests
    the checker could not decide without the program in its own interpreter (an argument
    that is no builtin value, a setup that builds the program's objects)."""

    passed: int
    total: int
    failure: str | None = None
    detail: str = ""
    forgeable: int = 0


def stdout_matches(actual: str, expected: str) -> bool:
    """Line by line, trailing whitespace and trailing blank lines ignored."""
    lines = lambda text: [line.rstrip() for line in text.rstrip().splitlines()]
    return lines(actual) == lines(expected)

