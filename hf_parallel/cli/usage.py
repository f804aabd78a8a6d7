"""The parser of `hf-parallel` and of `eval/quality.py`: argparse whose usage errors are one line.

It lives here, the lowest layer that both command lines reach, so that the evaluation's own script
answers a user's mistake as `hf-parallel` does.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

USAGE_ERROR, INTERRUPTED = 2, 130  # exit statuses: a usage error; Ctrl-C (128 + SIGINT), as shells report it


class UsageParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose usage errors are `PROG: error: MESSAGE`, without the usage block.

    `error` (argparse's hook for flags it cannot parse, and for flag values a config refuses) adds one
    line pointing to --help; `fail` (for the inputs the flags name: a file, a model) prints the message
    line alone.  Both exit with status 2.  `interrupted` ends a run stopped by Ctrl-C with one line
    saying what was saved, exit status 130.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n({self.prog} --help lists the options)\n")

    def fail(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")

    def interrupted(self, saved: str) -> NoReturn:
        self.exit(INTERRUPTED, f"{self.prog}: interrupted; {saved}\n")


THREADS_HELP = (
    "CPU threads torch computes on (default: the CPUs this process may use, by its affinity and cgroup quota, less "
    "those other work keeps busy; OMP_NUM_THREADS where set)"
)


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """`--threads N`, which every command takes (`frontends.threads`)."""
    parser.add_argument("--threads", type=positive_int, metavar="N", help=THREADS_HELP)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse turns the error into a usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
