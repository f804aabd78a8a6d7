"""Loaders for SQuAD v1.1, DROP and QuAC into one structure: documents holding questions.

Each loader takes a path to the official file (plain, ``.gz`` or ``.zip``) or, where
the path does not exist, a Hugging Face ``datasets`` name (``datasets`` is imported only
then).  Documents keep the order of first appearance in the source.

`load_documents` picks the loader by name and turns whatever reading a wrong source raises
(a missing file, bad JSON, JSON of another shape, a bad zip) into one `DatasetFileError`
naming the source and the format expected, so that the command line reports a user's wrong
`--data` as a usage error rather than a traceback.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Source = str | os.PathLike
_PATH_SUFFIXES = (".json", ".jsonl", ".gz", ".zip")


@dataclass
class QAItem:
    """One question with its gold answers (every answer string the official scorer uses)."""

    id: str
    question: str
    answers: list[str]
    history: tuple[tuple[str, str], ...] = ()  # QuAC: earlier (question, answer) turns
    # DROP official json only: each gold answer as its tuple of spans, which the DROP
    # scorer aligns span by span.  ``answers`` then holds the spans joined by " and ",
    # the form simple-evals' file uses; empty when the source already flattened them.
    answer_spans: tuple[tuple[str, ...], ...] = ()

    @property
    def drop_references(self) -> list[str | tuple[str, ...]]:
        """Gold answers in the form ``metrics.drop_em_f1`` scores most faithfully."""
        return list(self.answer_spans) if self.answer_spans else list(self.answers)


@dataclass
class QADocument:
    """One context (paragraph / passage / dialogue section) and its questions."""

    id: str
    text: str
    items: list[QAItem]


# --------------------------------------------------------------------------- helpers


def _read_text(path: Path) -> str:
    """File text; a .gz is decompressed, a .zip yields its (first) .json/.jsonl member."""
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith((".json", ".jsonl"))]
            if not names:
                raise ValueError(f"{path}: no .json or .jsonl file inside the zip")
            return archive.read(names[0]).decode("utf-8")
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            return handle.read()
    return path.read_text(encoding="utf-8")


def _local_path(source: Source) -> Path | None:
    """The path if it exists; None for a dataset name; error for a missing file path."""
    path = Path(source)
    if path.exists():
        return path
    # A missing file must not silently turn into a hub download ("owner/name" is a
    # valid hub name, so only a PathLike or a file suffix marks a path).
    if not isinstance(source, str) or source.endswith(_PATH_SUFFIXES):
        raise FileNotFoundError(f"no such dataset file: {source}")
    return None


def _hf_rows(name: str, split: str = "validation") -> Iterable[dict[str, Any]]:
    """Rows of a Hugging Face dataset; needs the optional ``datasets`` package."""
    try:
        import datasets  # optional: only a source that is no file needs the `datasets` package
    except ImportError as error:
        raise ImportError(
            f"{name!r} is not an existing file, so it was taken as a Hugging Face dataset "
            "name, which needs the 'datasets' package (pip install datasets)"
        ) from error
    return datasets.load_dataset(name, split=split)


def _limit(documents: list[QADocument], limit_questions: int | None) -> list[QADocument]:
    """Whole documents until ``limit_questions`` is reached; the last one truncated."""
    if limit_questions is None:
        return documents
    kept, remaining = [], limit_questions
    for document in documents:
        if remaining <= 0:
            break
        items = document.items[:remaining]
        kept.append(QADocument(document.id, document.text, items))
        remaining -= len(items)
    return kept


def _unique(strings: Iterable[str]) -> list[str]:
    """Strip, drop blanks and duplicates, keep order (max over golds is unchanged)."""
    return list(dict.fromkeys(s.strip() for s in strings if s.strip()))


def _group(rows: Iterable[tuple[str, str, QAItem]]) -> list[QADocument]:
    """Documents from (document key, text, item) rows, in order of first appearance."""
    documents: dict[str, QADocument] = {}
    for key, text, item in rows:
        documents.setdefault(key, QADocument(key, text, [])).items.append(item)
    return list(documents.values())


# --------------------------------------------------------------------------- SQuAD


def load_squad(source: Source, limit_questions: int | None = None) -> list[QADocument]:
    """SQuAD v1.1 (``dev-v1.1.json`` or a zip of it): one document per paragraph."""
    path = _local_path(source)
    if path is None:
        return _limit(_group(_squad_hf_rows(str(source))), limit_questions)
    documents = []
    for article in json.loads(_read_text(path))["data"]:
        for index, paragraph in enumerate(article["paragraphs"]):
            items = [QAItem(qa["id"], qa["question"], [a["text"] for a in qa["answers"]]) for qa in paragraph["qas"]]
            documents.append(QADocument(f"{article['title']}/{index}", paragraph["context"], items))
    return _limit(documents, limit_questions)


def _squad_hf_rows(name: str) -> Iterable[tuple[str, str, QAItem]]:
    keys: dict[tuple[str, str], str] = {}  # the hub copy has one row per question
    for row in _hf_rows(name):
        key = keys.setdefault((row["title"], row["context"]), f"{row['title']}/{len(keys)}")
        yield key, row["context"], QAItem(row["id"], row["question"], list(row["answers"]["text"]))


# --------------------------------------------------------------------------- DROP

# simple-evals' context: "Passage: ...\nQuestion: ...\nAnswer:".  Taking the last
# "Passage:" keeps this right should a file carry few-shot examples before it.
_DROP_CONTEXT = re.compile(r"Passage: (?P<passage>.*)\nQuestion: (?P<question>.*?)\s*\nAnswer:\s*$", re.S)


def load_drop(source: Source, limit_questions: int | None = None) -> list[QADocument]:
    """DROP dev: simple-evals jsonl(.gz), the official ``drop_dataset_dev.json``, or a hub name.

    Questions that share a passage text form one document.
    """
    path = _local_path(source)
    if path is None:
        return _limit(_group(_drop_hf_rows(str(source))), limit_questions)
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # several JSON values: one object per line
        data = None
    if isinstance(data, dict) and "context" not in data:
        return _limit(_drop_official(data), limit_questions)
    return _limit(_group(_drop_simple_evals_rows(text)), limit_questions)


def _drop_simple_evals_rows(text: str) -> Iterable[tuple[str, str, QAItem]]:
    passage_keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        context = row["context"]
        match = _DROP_CONTEXT.match(context, max(0, context.rfind("Passage: ")))
        if match is None:
            raise ValueError(f"DROP line {number + 1}: context is not 'Passage: ...\\nQuestion: ...\\nAnswer:'")
        passage = match["passage"]
        key = passage_keys.setdefault(passage, f"drop-passage-{len(passage_keys)}")
        answers = _unique(row["ref_text"].split("|"))
        yield key, passage, QAItem(f"drop-{number}", match["question"], answers)


def _drop_spans(answer: dict[str, Any]) -> tuple[str, ...]:
    """The official ``answer_json_to_strings``: number, else spans, else the date."""
    if answer.get("number"):
        return (str(answer["number"]),)
    if answer.get("spans"):
        return tuple(answer["spans"])
    date = answer.get("date") or {}
    return (f"{date.get('day', '')} {date.get('month', '')} {date.get('year', '')}".strip(),)


def _drop_official(data: dict[str, Any]) -> list[QADocument]:
    documents = []
    for passage_id, entry in data.items():
        items = []
        for qa in entry["qa_pairs"]:
            golds = [qa["answer"]] + list(qa.get("validated_answers") or [])
            # Blank golds are skipped by the official scorer, so they are not kept.
            spans = tuple(dict.fromkeys(s for s in map(_drop_spans, golds) if s[0].strip()))
            answers = [" and ".join(s) for s in spans]
            items.append(QAItem(qa["query_id"], qa["question"], answers, answer_spans=spans))
        documents.append(QADocument(passage_id, entry["passage"], items))
    return documents


def _drop_hf_rows(name: str) -> Iterable[tuple[str, str, QAItem]]:
    # The hub copy keeps only the validated answers, flattened: every span becomes a
    # separate string, so multi-span golds cannot be rebuilt; each span is one gold.
    for row in _hf_rows(name):
        item = QAItem(row["query_id"], row["question"], _unique(row["answers_spans"]["spans"]))
        yield row["section_id"], row["passage"], item


# --------------------------------------------------------------------------- QuAC


def load_quac(source: Source, limit_questions: int | None = None) -> list[QADocument]:
    """QuAC ``val_v0.2.json``: one document per dialogue, turns in dialogue order.

    ``answers`` holds every annotator's answer (what the scorer uses, "CANNOTANSWER"
    included); ``history`` holds the earlier turns with the dialogue's own
    ``orig_answer``.  The "CANNOTANSWER" token that QuAC appends to each context for
    span models is removed from the document text.
    """
    path = _local_path(source)
    if path is None:
        raise ValueError(f"QuAC needs the official val_v0.2.json file; {source!r} does not exist")
    documents = []
    for article in json.loads(_read_text(path))["data"]:
        for paragraph in article["paragraphs"]:
            text = re.sub(r"\s*CANNOTANSWER\s*$", "", paragraph["context"])
            documents.append(QADocument(paragraph["id"], text, _quac_items(paragraph["qas"])))
    return _limit(documents, limit_questions)


def _quac_items(qas: list[dict[str, Any]]) -> list[QAItem]:
    items, history = [], []
    for qa in qas:
        answers = [a["text"] for a in qa["answers"]]
        items.append(QAItem(qa["id"], qa["question"], answers, history=tuple(history)))
        original = qa.get("orig_answer") or (qa["answers"][0] if qa["answers"] else {"text": ""})
        history.append((qa["question"], original["text"]))
    return items


DATASETS = {"squad": load_squad, "drop": load_drop, "quac": load_quac}
FORMATS = {
    "squad": "the SQuAD v1.1 dev JSON (dev-v1.1.json; plain, .gz or .zip)",
    "drop": "the DROP dev set (simple-evals JSON lines, .jsonl or .jsonl.gz, or the official drop_dataset_dev.json)",
    "quac": "the QuAC dev JSON (val_v0.2.json; plain, .gz or .zip)",
}
# What reading a source that is not the dataset's format raises: a missing or unreadable
# file, bad JSON or UTF-8, a bad zip, JSON of another shape, a name without `datasets`.
_READ_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, ImportError, zipfile.BadZipFile)


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
