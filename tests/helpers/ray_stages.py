"""`Answerer` subclasses for the Ray tests, imported by the cluster's actors: one that logs what it answers, one that
kills its own process once.  Both keep their files in the folder named by HF_PARALLEL_TEST_RAY (set for the
cluster's workers by the test's `ray.init`)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from hf_parallel.ray import Answerer


def _folder() -> Path:
    return Path(os.environ["HF_PARALLEL_TEST_RAY"])


def _log(name: str, lines: list[str]) -> None:
    if not lines:  # an empty batch (Ray Data hands those too): nothing answered
        return
    with open(_folder() / name, "a", encoding="utf-8") as log:
        log.write("".join(line + "\n" for line in lines))


class LoggingAnswerer(Answerer):
    """An Answerer that logs each actor's start (its pid, in actors.log) and the keys of the rows it answers (in
    answered.log)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _log("actors.log", [str(os.getpid())])
        self.batches = 0

    def __call__(self, batch):
        self.batches += 1
        _log("answered.log", batch.column("key").to_pylist())
        return super().__call__(batch)


class DyingAnswerer(LoggingAnswerer):
    """A LoggingAnswerer whose process kills itself (SIGKILL) once per folder, at the start of an actor's second
    batch: an actor that dies mid-run, after it has answered a batch."""

    def __call__(self, batch):
        if self.batches == 1:
            try:
                os.close(os.open(_folder() / "killed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                _log("killed.log", [str(os.getpid())])
                os.kill(os.getpid(), signal.SIGKILL)
        return super().__call__(batch)
