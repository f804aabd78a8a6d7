"""JSON-lines files that runs append to and resume from: read whole (a line cut short dropped), appended safely.

A run that is interrupted may leave its last line half written; `read_json_lines` cuts it off the file,
so that the next append starts a line of its own and the record runs again.  `CheckpointError` is what a
reader raises for a file whose header says it belongs to another run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint file that belongs to another run (other questions, model or settings)."""


def read_json_lines(path: str | Path) -> list:
    """The values of a JSON-lines file that is appended to, None for a line that is not JSON;
    none when the file is absent or empty.

    Whatever follows the last newline, a line cut short by an interruption, is cut from the
    file, so that the next append starts a line of its own.
    """
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("rb+") as f:
            f.truncate(end)
    return [json_or_none(line) for line in data[:end].decode("utf-8").splitlines()]


def append_json_lines(path: str | Path, records: list) -> None:
    """Append one JSON line per record, on disk before returning."""
    with Path(path).open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def json_or_none(line: str):
    """The value of a JSON text, or None where it is not JSON."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None
