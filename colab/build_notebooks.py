r"""Writes colab/NAME.ipynb from colab/src/NAME.py, the notebooks' source.

A source is a Python file in the percent format: `# %%` starts a code cell and
`# %% [markdown]` a markdown cell whose lines are `# `-commented text. Every notebook
gets the "Open in Colab" badge on its first markdown cell and the install cell (below)
as its first code cell, and is written without outputs, so that diffs stay readable.

  python colab/build_notebooks.py           # rewrite every notebook from its source
  python colab/build_notebooks.py --check   # exit 1 if a notebook differs from its source
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import nbformat

COLAB_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.path.join(COLAB_DIR, "src")
REPOSITORY = "tlt-jax/tlt_jax"
BADGE = ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
         "(https://colab.research.google.com/github/{repository}/blob/main/colab/{name}.ipynb)")

INSTALL_CELL = f"""\
# Installs the project where it is not importable yet (a fresh Colab runtime: clone and
# editable install, a minute or two); where it is installed, this only finds the checkout.
import importlib.util
import os
import subprocess
import sys

if importlib.util.find_spec("tlt_jax") is None:
    if not os.path.isdir("tlt-jax"):
        subprocess.run(["git", "clone", "--depth=1", "https://github.com/{REPOSITORY}.git", "tlt-jax"], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", "./tlt-jax"], check=True)
    sys.path.insert(0, os.path.abspath("tlt-jax"))  # a running kernel does not see a new editable install

import tlt_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tlt_jax.__file__)))
os.chdir(ROOT)  # assets/ and configs/ are read relative to the checkout
print("tlt_jax checkout:", ROOT)"""

_CELL = re.compile(r"^# %%(?P<markdown> \[markdown\])?[^\n]*$", re.MULTILINE)


def read_cells(path: str) -> list[tuple[str, str]]:
    """(kind, text) of each cell of a percent-format source, kind "code" or "markdown"."""
    with open(path) as f:
        text = f.read()
    marks = list(_CELL.finditer(text))
    if not marks or text[:marks[0].start()].strip():
        raise ValueError(f"{path}: the source must start with a `# %%` cell marker.")
    cells = []
    for mark, after in zip(marks, marks[1:] + [None]):
        body = text[mark.end():after.start() if after else len(text)].strip("\n")
        if mark["markdown"]:
            lines = body.splitlines()
            bad = [line for line in lines if line and not line.startswith("#")]
            if bad:
                raise ValueError(f"{path}: markdown lines must be `# `-commented; got {bad[0]!r}.")
            cells.append(("markdown", "\n".join(line[2:] if line.startswith("# ") else line[1:] for line in lines)))
        else:
            cells.append(("code", body))
    return cells


def build(name: str) -> nbformat.NotebookNode:
    """The notebook of colab/src/NAME.py: badge, install cell, the source's cells; no outputs."""
    cells = read_cells(os.path.join(SOURCE_DIR, name + ".py"))
    if cells[0][0] != "markdown":
        raise ValueError(f"{name}: the first cell must be the markdown title.")
    badge = BADGE.format(repository=REPOSITORY, name=name)
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                   "language_info": {"name": "python"}, "colab": {"provenance": []}}
    nb.cells = [nbformat.v4.new_markdown_cell(badge + "\n\n" + cells[0][1]), nbformat.v4.new_code_cell(INSTALL_CELL)]
    for kind, text in cells[1:]:
        nb.cells.append(nbformat.v4.new_markdown_cell(text) if kind == "markdown" else nbformat.v4.new_code_cell(text))
    for i, cell in enumerate(nb.cells):
        cell.id = f"{name[:2]}-{i:02d}"  # stable ids: rebuilding an unchanged source changes nothing
    nbformat.validate(nb)
    return nb


def names() -> list[str]:
    return sorted(f[:-3] for f in os.listdir(SOURCE_DIR) if f.endswith(".py"))


def serialize(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="Only report notebooks that differ from their source.")
    args = parser.parse_args(argv)
    stale = []
    for name in names():
        path = os.path.join(COLAB_DIR, name + ".ipynb")
        text = serialize(build(name))
        current = open(path).read() if os.path.exists(path) else None
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            with open(path, "w") as f:
                f.write(text)
    verb = "differ from their source" if args.check else "rewritten"
    print(f"{len(stale)} notebook(s) {verb}" + "".join(f"\n  {p}" for p in stale))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
