r"""Functions and files over the project's length bars.

  python -m experiments.check_lengths [PATH ...] [--max_function=80] [--max_file=600]

Walks each PATH (a .py file or a directory of them; default tlt_jax) with `ast` and prints
every function longer than --max_function lines, counted from its `def` (decorators
excluded) to its last line, docstring included, and every file longer than --max_file
lines. A nested function counts on its own and inside its parent. Exits 1 when anything is
over a bar, else 0. Standard library only.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from typing import Iterator, NamedTuple


class Offence(NamedTuple):
    path: str
    line: int  # 1-based; 0 for a whole file
    name: str  # the function's qualified name; "" for a whole file
    lines: int

    def __str__(self) -> str:
        where = f"{self.path}:{self.line} {self.name}" if self.name else self.path
        return f"{where}: {self.lines} lines"


def python_files(paths: list[str]) -> Iterator[str]:
    for path in paths:
        if os.path.isfile(path):
            yield path
            continue
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: no such file or directory; give .py files or directories of them.")
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
            yield from (os.path.join(root, f) for f in sorted(files) if f.endswith(".py"))


def function_lengths(source: str) -> Iterator[tuple[int, str, int]]:
    """(line of the def, qualified name, lines from the def to its last line) of every
    function and method in `source`, nested ones included."""
    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[int, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield child.lineno, name, child.end_lineno - child.lineno + 1
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)
    yield from walk(ast.parse(source), "")


def offences(paths: list[str], max_function: int = 80, max_file: int = 600) -> list[Offence]:
    out = []
    for path in python_files(paths):
        with open(path, encoding="utf-8") as f:
            source = f.read()
        num_lines = len(source.splitlines())
        if num_lines > max_file:
            out.append(Offence(path, 0, "", num_lines))
        out.extend(Offence(path, line, name, n) for line, name, n in function_lengths(source) if n > max_function)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=["tlt_jax"])
    parser.add_argument("--max_function", type=int, default=80)
    parser.add_argument("--max_file", type=int, default=600)
    args = parser.parse_args(argv)
    found = offences(args.paths, args.max_function, args.max_file)
    for offence in found:
        print(offence)
    print(f"{len(found)} over the bars (functions > {args.max_function} lines, files > {args.max_file} lines)",
          file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
