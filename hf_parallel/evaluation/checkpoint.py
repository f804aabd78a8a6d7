"""A run's finished generate calls on disk, so that an interrupted run resumes where it stopped."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .config import QualityConfig


class CheckpointError(ValueError):
    """A checkpoint file that belongs to another run (other questions, model or settings)."""


class Checkpoint:
    """A run's finished generate calls, one JSON line each after a header line saying which run it is.

    An interrupted run started again with the same checkpoint file skips the calls it holds; a
    line cut short by the interruption is ignored (that call runs again).
    """

    def __init__(self, path: str | Path, header: dict):
        self.path, self.done = Path(path), {}
        if self.path.exists() and self.path.stat().st_size:
            lines = self.path.read_text().splitlines()
            if _json_line(lines[0]) != header:
                raise CheckpointError(f"{self.path} is the checkpoint of another run (its first line: "
                                      f"{lines[0][:300]}); pass another --checkpoint file or delete it")  # fmt: skip
            for record in filter(None, map(_json_line, lines[1:])):
                self.done[(record["method"], record["call"])] = record
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(header) + "\n")

    def get(self, method: str, call: int, indices: list[int]) -> dict | None:
        record = self.done.get((method, call))
        return record if record is not None and record["indices"] == indices else None

    def add(self, method: str, call: int, indices: list[int], outputs: list[str], seconds: float) -> None:
        record = {"method": method, "call": call, "indices": indices, "outputs": outputs, "seconds": seconds}
        with self.path.open("rb+") as f:
            end = f.seek(0, os.SEEK_END)
            if end and f.seek(end - 1) >= 0 and f.read(1) != b"\n":  # a line cut short by an interruption
                f.write(b"\n")
            f.write((json.dumps(record) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())


def checkpoint_header(config: QualityConfig, items, model_name: str) -> dict:
    """What must match for a checkpoint's calls to be reused: the questions and all that shapes the calls.

    items: the run's (document, item) pairs, in order.
    """
    ids = hashlib.sha1("\n".join(item.id for _, item in items).encode()).hexdigest()
    keep = ("dataset", "max_new_tokens", "standard_batch_size", "docs_per_call", "batch_rows", "dtype", "device",
            "attn")  # fmt: skip
    return {"hf_parallel_quality_checkpoint": 1, "model": model_name, "questions": len(items), "question_ids": ids,
            **{k: getattr(config, k) for k in keep}}  # fmt: skip


def _json_line(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None
