"""One-line notes on stderr about what a start does once and that takes a while, or about how it runs: converting
the embedded model, the first build of the Triton kernels, the threads chosen on a busy CPU.

They are printed whether or not stderr is a terminal, so that a log, a CI job or a service shows them too; a
command's --quiet turns them off while it runs (`silenced`).  This module imports neither torch nor Triton: the
command line uses it before either loads.
"""

from __future__ import annotations

import contextlib
import sys

_QUIET = [False]  # one switch for the whole process: the engine's threads read it too


def note(message: str) -> None:
    """`message` as one line on stderr, unless notes are off (`silenced`)."""
    if not _QUIET[0]:
        print(message, file=sys.stderr, flush=True)


def notes_on() -> bool:
    """Whether `note` prints."""
    return not _QUIET[0]


@contextlib.contextmanager
def silenced(quiet: bool = True):
    """Within the block (a command under --quiet) `note` prints nothing where `quiet`; after it, as before."""
    saved, _QUIET[0] = _QUIET[0], _QUIET[0] or quiet
    try:
        yield
    finally:
        _QUIET[0] = saved
