"""notebooks/quickstart.ipynb runs top to bottom (its code cells in one namespace, the model loaded once per session)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs(smollm2, monkeypatch, capsys):
    monkeypatch.setattr("hf_parallel.models.load_smollm2", lambda *a, **k: smollm2)
    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    namespace: dict = {}
    for cell in cells:
        exec(compile("".join(cell["source"]), f"{NOTEBOOK.name}[{cells.index(cell)}]", "exec"), namespace)
    assert namespace["answers"] == namespace["alone"]  # the notebook's own claim, checked again here
    out = capsys.readouterr().out
    assert "identical: 4/4" in out and "department ->" in out
