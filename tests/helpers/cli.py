"""The command line in-process: a usage error's checks, a corpus and its JSON-lines file, SmolLM2's loader replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_parallel import cli

CORPUS = [
    {"id": "cat", "document": "The cat is named Tom. Tom lives in Paris with Anna, who is a baker.",
     "questions": ["What is the cat called?", "Where does Tom live?"]},
    {"document": "Mount Everest is 8849 metres high and lies in the Himalayas.", "questions": ["How high is it?"]},
    {"id": 3, "document": "Water boils at 100 degrees Celsius at sea level.", "questions": ["When does water boil?"]},
]  # fmt: skip


def usage_error(capsys, argv: list[str]) -> str:
    """`hf-parallel argv` in-process; checks it exits as a usage error without the usage block, returns its stderr."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err and "usage:" not in err
    return err


def load_as_smollm2(monkeypatch, model_and_tokenizer) -> list:
    """`hf-parallel answer` without --model gets `model_and_tokenizer`; returns the loads' (dtype, device)."""
    loads = []

    def load(dtype, device, progress=None):
        loads.append((dtype, device))
        return model_and_tokenizer

    monkeypatch.setattr("hf_parallel.frontends.default_model.load_smollm2", load)
    return loads


def write_lines(path: Path, rows: list) -> Path:
    """`rows` one a line at `path` (a string as it is, anything else as JSON); returns `path`."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path
