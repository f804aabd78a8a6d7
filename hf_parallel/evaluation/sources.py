"""A dataset by name: its loader, the file format it reads, and one error for a source it cannot read.

The loaders in `datasets` raise whatever reading a wrong file raises (a missing file, bad
JSON, JSON of another shape, a bad zip); `load_documents` turns all of those into one
`DatasetFileError` that names the source and the format expected, so that the command
line can report a user's wrong `--data` as a usage error rather than a traceback.
"""

from __future__ import annotations

import zipfile

from .datasets import QADocument, Source, load_drop, load_quac, load_squad

DATASETS = {"squad": load_squad, "drop": load_drop, "quac": load_quac}
FORMATS = {
    "squad": "the SQuAD v1.1 dev JSON (dev-v1.1.json; plain, .gz or .zip)",
    "drop": "the DROP dev set (simple-evals JSON lines, .jsonl or .jsonl.gz, or the official drop_dataset_dev.json)",
    "quac": "the QuAC dev JSON (val_v0.2.json; plain, .gz or .zip)",
}
# What reading a source that is not the dataset's format raises: a missing or unreadable
# file, bad JSON or UTF-8, a bad zip, JSON of another shape, a name without `datasets`.
_READ_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, ImportError,
                zipfile.BadZipFile)  # fmt: skip


class DatasetFileError(ValueError):
    """A dataset source that cannot be read as its dataset; the message names it and the format expected."""


def load_documents(dataset: str, source: Source, limit_questions: int | None = None) -> list[QADocument]:
    """`dataset`'s documents from `source` (a file or a `datasets` name) through its loader.

    A source that cannot be read raises `DatasetFileError`, the loader's error chained.
    """
    try:
        return DATASETS[dataset](source, limit_questions)
    except _READ_ERRORS as error:
        raise DatasetFileError(
            f"cannot read {source} as {FORMATS[dataset]}: {type(error).__name__}: {error}"
        ) from error
