"""The Colab notebooks: each runs top to bottom on CPU at its smoke sizes and draws at least
one image; the committed notebooks carry no outputs and match their sources in colab/src."""
import os
import re
import sys

import nbformat
import pytest

from tests.support import REPO

COLAB = os.path.join(REPO, "colab")
NOTEBOOKS = sorted(f for f in os.listdir(COLAB) if f.endswith(".ipynb"))


def _read(name):
    return nbformat.read(os.path.join(COLAB, name), as_version=4)


def test_the_five_notebooks_exist():
    assert [n[:2] for n in NOTEBOOKS] == ["01", "02", "03", "04", "05"], NOTEBOOKS


@pytest.mark.costly
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_draws(name, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    # The kernel is a fresh process: one CPU device (not the test process's 8), smoke sizes,
    # runs written under tmp_path, compiled fast (conftest's JAX_DISABLE_MOST_OPTIMIZATIONS).
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    monkeypatch.setenv("XLA_FLAGS", flags.strip())
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("TLT_NOTEBOOK_SMOKE", "1")
    monkeypatch.setenv("TLT_NOTEBOOK_RUNS", str(tmp_path))
    nb = _read(name)
    # A cell that raises fails the test with the cell and its traceback (CellExecutionError).
    NotebookClient(nb, timeout=600, kernel_name="python3", extra_arguments=["--InteractiveShell.colors=NoColor"],
                   resources={"metadata": {"path": COLAB}}).execute()
    images = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs
              if "image/png" in o.get("data", {})]
    assert images, f"{name} drew no image"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_has_no_outputs(name):
    for i, cell in enumerate(_read(name).cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: cell {i} carries outputs"


def test_notebooks_match_their_sources():
    sys.path.insert(0, COLAB)
    try:
        import build_notebooks
    finally:
        sys.path.remove(COLAB)
    assert build_notebooks.main(["--check"]) == 0, "run `python colab/build_notebooks.py`"
