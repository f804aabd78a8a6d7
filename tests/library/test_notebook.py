"""notebooks/quickstart.ipynb runs top to bottom: its code cells in one namespace, the model loaded once per session,
and imports only what `hf_parallel` itself exports (besides the standard library, torch, transformers, datasets).

The cell tagged "install" (a `%pip install` from the clone, for a kernel that cannot import hf_parallel yet) is
not run with the others: the tests must never install anything.  It is checked on its own, with IPython's
transformer and a stand-in for the shell, to install nothing when everything is importable.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest

import hf_parallel
from hf_parallel.evaluation.config import OFFLINE_DATA, SHARED_DATA
from tests.helpers.blocks import refused_imports
from tests.helpers.project import ROOT

NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
INSTALL_TAG = "install"


def code_cells(path: Path = NOTEBOOK) -> list[tuple[str, str, list[str]]]:
    """(name, source, tags) of each code cell, in order."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    return [(f"{path.name}[{i}]", "".join(c["source"]), c["metadata"].get("tags", [])) for i, c in enumerate(cells)]


def run_cells(cells, namespace: dict) -> list[str]:
    """Execute the cells in order in one namespace, each one's stdout returned; the first one that raises stops the
    run and fails it."""
    printed = []
    for name, source in cells:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(source, name, "exec"), namespace)
        printed.append(out.getvalue())
    return printed


def saved_outputs(path: Path = NOTEBOOK) -> list[str]:
    """The stdout each code cell (but the install cell) printed when the notebook was saved."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    streams = [[o for o in c["outputs"] if o.get("name") == "stdout"] for c in cells if INSTALL_TAG not in
               c["metadata"].get("tags", [])]  # fmt: skip
    return ["".join("".join(o["text"]) for o in outputs) for outputs in streams]


def without_timings(text: str) -> list[str]:
    """`text`'s lines with every timing masked: "1.71 s", "2.8x", and the table's wall s and speedup columns."""
    lines = []
    for line in text.splitlines():
        line = re.sub(r"\d+\.\d+( s|x)", "<time>", line)
        if re.match(r"\| (standard|parallel|batch) \|", line):
            cells = line.split("|")
            line = "|".join(cells[:4] + ["<time>", "<time>"] + cells[6:])
        lines.append(line)
    return lines


def test_only_the_install_cell_installs():
    cells = code_cells()
    install = [source for _, source, tags in cells if INSTALL_TAG in tags]
    assert len(install) == 1 and "%pip install" in install[0]
    installing = ("%pip", "!pip", "pip install", "subprocess")
    others = [(name, source) for name, source, tags in cells if INSTALL_TAG not in tags]
    assert not [name for name, source in others if any(s in source for s in installing)]


def test_install_cell_installs_only_when_missing(monkeypatch):
    transform = pytest.importorskip("IPython.core.inputtransformer2").TransformerManager().transform_cell
    (source,) = [source for _, source, tags in code_cells() if INSTALL_TAG in tags]

    class Shell:  # stands in for get_ipython(): records the magics instead of running them
        def __init__(self):
            self.magics = []

        def run_line_magic(self, name, line, *args, **kwargs):
            self.magics.append((name, line))

    shell = Shell()
    run_cells([("install", transform(source))], {"get_ipython": lambda: shell})
    assert shell.magics == []  # everything installed here: the cell does nothing

    find_spec = importlib.util.find_spec

    def without_hf_parallel(name, *args):  # as if hf_parallel were not installed: the cell installs it
        return None if name == "hf_parallel" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_hf_parallel)
    run_cells([("install", transform(source))], {"get_ipython": lambda: shell})
    assert [name for name, _ in shell.magics] == ["pip", "pip"] and '-e "..[notebook]"' in shell.magics[0][1]


def test_the_notebook_imports_only_public_names():
    cells = [source for _, source, tags in code_cells() if INSTALL_TAG not in tags]  # the install cell: %pip magics
    assert sum("from hf_parallel import" in source for source in cells) >= 2
    assert [name for source in cells for name in refused_imports(source)] == []


def test_a_raising_cell_fails_the_run():
    namespace: dict = {}
    with pytest.raises(ZeroDivisionError):
        run_cells([("a", "x = 1"), ("b", "y = x / 0"), ("c", "z = 2")], namespace)
    assert namespace["x"] == 1 and "z" not in namespace


@pytest.mark.slow
def test_quickstart_notebook_runs(smollm2, monkeypatch, capsys):
    monkeypatch.setattr(hf_parallel, "load_smollm2", lambda *a, **k: smollm2)  # the name the notebook imports
    namespace: dict = {}
    printed = run_cells([(name, source) for name, source, tags in code_cells() if INSTALL_TAG not in tags], namespace)
    assert namespace["answers"] == namespace["alone"]  # the notebook's own claim, checked again here
    assert "identical: 4/4" in printed[2] and "department ->" in printed[3]
    # what the notebook shows is what it prints (its timings aside; without the offline SQuAD, its last cell says so)
    compared = len(printed) if (SHARED_DATA / OFFLINE_DATA["squad"]).exists() else len(printed) - 1
    saved = [without_timings(text) for text in saved_outputs()]
    assert [without_timings(text) for text in printed[:compared]] == saved[:compared]
    # the scoring example picks the passage's city, by far
    ranked = sorted(zip(namespace["scores"], namespace["cities"]), reverse=True)
    assert ranked[0][1] == " Paris" and ranked[0][0] - ranked[1][0] > 5
