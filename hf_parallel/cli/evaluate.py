"""`hf-parallel eval` and `python eval/quality.py`: the answer-quality evaluation's command line.

Its flags are `QualityConfig`'s, one a field (`hf_parallel.evaluation.config`); `merge` joins the
reports of runs of different methods.  Wrong input is a one-line usage error (exit status 2); Ctrl-C
ends with one line saying what the checkpoint holds (exit status 130).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..evaluation import quality
from ..evaluation.config import QualityConfig, add_arguments
from ..evaluation.loaders import DatasetFileError
from ..evaluation.report import merge_reports, read_report, table
from ..frontends.jsonlines import CheckpointError
from ..frontends.model_loading import ModelSourceError
from .usage import UsageParser


def parse_config(argv: list[str] | None = None, prog: str | None = None) -> QualityConfig:
    """The config from command-line flags; a value the config refuses is a usage error (exit status 2)."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    try:
        return QualityConfig(**vars(args))
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """`python eval/quality.py [flags]` or `... merge A.json B.json --out C.json`.

    Wrong input is a one-line usage error (exit status 2); Ctrl-C ends with one line saying what the
    checkpoint holds (exit status 130).
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:], f"{prog} merge" if prog else "quality.py merge")
    config = parse_config(argv, prog)
    try:
        quality.evaluate_quality(config)
    except (DatasetFileError, ModelSourceError, CheckpointError) as error:  # the user's input, not a bug
        _parser(prog).fail(str(error))
    except KeyboardInterrupt:
        _parser(prog).interrupted(
            f"the finished generate calls are in {config.checkpoint}; run the same command again to resume"
            if config.checkpoint
            else "nothing was saved (with --checkpoint FILE, a run started again resumes)"
        )


def _parser(prog: str | None) -> UsageParser:
    parser = UsageParser(prog=prog, description=quality.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def merge_main(argv: list[str] | None = None, prog: str = "quality.py merge") -> None:
    """`python eval/quality.py merge A.json B.json --out C.json`: see `merge_reports`."""
    parser = UsageParser(prog=prog, description=merge_reports.__doc__)
    parser.add_argument("reports", nargs="+", help="report JSONs (.json or .json.gz)")
    parser.add_argument("--out", required=True, help="merged JSON path; the table goes beside it as .md")
    args = parser.parse_args(argv)
    reports = []
    for path in args.reports:
        try:
            reports.append(read_report(path))
        except (OSError, ValueError) as error:  # missing, not gzip, not JSON, not a report
            parser.fail(f"cannot read the report {path}: {error}")
    try:
        report = merge_reports(reports)
    except ValueError as error:  # reports of other questions, models or settings
        parser.fail(str(error))
    quality.write_report(report, Path(args.out))
    print(table(report))
