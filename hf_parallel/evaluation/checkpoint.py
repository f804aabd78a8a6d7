"""A run's finished generate calls on disk, so that an interrupted run resumes where it stopped."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..frontends.jsonlines import CheckpointError, append_json_lines, read_json_lines
from .config import QualityConfig

# What shapes a run's generate calls: a checkpoint written with other values holds other calls.
CALL_SHAPE = "dataset max_new_tokens standard_batch_size docs_per_call batch_rows dtype device attn".split()


class Checkpoint:
    """A run's finished generate calls, one JSON line each after a header line saying which run it is.

    An interrupted run started again with the same checkpoint file skips the calls it holds; a
    line cut short by the interruption is dropped (that call runs again).  A file whose header is
    another run's raises `CheckpointError`.
    """

    def __init__(self, path: str | Path, header: dict):
        self.path, self.done = Path(path), {}
        lines = read_json_lines(self.path)
        if not lines:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            append_json_lines(self.path, [header])
        elif lines[0] != header:
            first = json.dumps(lines[0])[:300]
            raise CheckpointError(
                f"{self.path} is the checkpoint of another run (its first line: {first}); pass "
                "another --checkpoint file or delete it"
            )
        for record in filter(None, lines[1:]):
            self.done[(record["method"], record["call"])] = record

    def get(self, method: str, call: int, indices: list[int]) -> dict | None:
        record = self.done.get((method, call))
        return record if record is not None and record["indices"] == indices else None

    def add(self, method: str, call: int, indices: list[int], outputs: list[str], seconds: float) -> None:
        record = {"method": method, "call": call, "indices": indices, "outputs": outputs, "seconds": seconds}
        append_json_lines(self.path, [record])


def checkpoint_header(config: QualityConfig, items, model_name: str) -> dict:
    """What must match for a checkpoint's calls to be reused: the questions and all that shapes the calls.

    items: the run's (document, item) pairs, in order.
    """
    ids = hashlib.sha1("\n".join(item.id for _, item in items).encode()).hexdigest()
    return {
        "hf_parallel_quality_checkpoint": 1,
        "model": model_name,
        "questions": len(items),
        "question_ids": ids,
        **{k: getattr(config, k) for k in CALL_SHAPE},
    }
