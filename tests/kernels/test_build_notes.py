"""The notes on a first build of the Triton kernels (`prebuild.announce`): a line once builds have run for a while and
one when they are done, with where Triton keeps them; nothing for builds its cache on disk held (they end at once)
or under a command's --quiet.  The builds here are threads that sleep as long as a build would take: what is
tested is what is said, and when, which the GPU's builds go through the same way."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("triton")

from hf_parallel.kernels import prebuild  # noqa: E402
from hf_parallel.kernels.notices import silenced  # noqa: E402


def builds(*seconds: float, fail: bool = False) -> list:
    """Futures of stand-in builds, each done after its seconds (the last raising where `fail`)."""

    def build(s: float, last: bool):
        time.sleep(s)
        if fail and last:
            raise RuntimeError("ptxas failed")

    pool = ThreadPoolExecutor(max_workers=len(seconds))
    return [pool.submit(build, s, i == len(seconds) - 1) for i, s in enumerate(seconds)]


def test_builds_that_take_long_are_said_when_they_start_and_when_they_end(capsys):
    watcher = prebuild.announce(builds(0.6, 0.3), after_s=0.1, cache="/cache/triton")
    time.sleep(0.3)
    assert capsys.readouterr().err == (
        "building 2 Triton kernels for this model's first call (once: later starts load them from /cache/triton)\n"
    )
    watcher.join(5)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("built 2 Triton kernels in ") and line.endswith(" s, into /cache/triton")
    assert 0.5 < float(line.split(" in ")[1].split(" s")[0]) < 5


def test_builds_that_end_at_once_say_nothing(capsys):
    futures = builds(0.0, 0.0)
    watcher = prebuild.announce(futures, after_s=1.0)
    watcher.join(5)
    assert capsys.readouterr().err == "" and not watcher.is_alive()
    assert prebuild.announce([]) is None


def test_a_failed_build_is_said(capsys):
    prebuild.announce(builds(0.4, fail=True), after_s=0.1, cache="/c").join(5)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "building 1 Triton kernel for this model's first call (once: later starts load them from /c)"
    assert lines[1].endswith("into /c; 1 failed, and fail again at their launch")


def test_quiet_says_nothing(capsys):
    with silenced():
        assert prebuild.announce(builds(0.3), after_s=0.05) is None
    time.sleep(0.4)
    assert capsys.readouterr().err == ""


def test_the_cache_folder_is_tritons(monkeypatch, tmp_path):
    monkeypatch.setattr(prebuild.triton.knobs.cache, "dir", str(tmp_path))
    assert prebuild.cache_folder() == str(tmp_path)
