"""`answer_dataset`: a `datasets.Dataset` of one question per row (documents repeated, like SQuAD's
"context" and "question") gets an answer column, each document's questions answered together.

`datasets` is optional: this module never imports it, it only calls the Dataset it is handed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from accelerate.utils import gather_object
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..decoding.inputs import check_text
from .corpus import TOKENS_PER_CALL
from .data_parallel import answer_share, merge_parts, part_files, part_path, process_state
from .jsonlines import CheckpointError, append_json_lines, read_json_lines


def answer_dataset(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset,
    document_column: str = "context",
    question_column: str = "question",
    answer_column: str = "answer",
    checkpoint: str | Path | None = None,
    template: str | None = None,
    use_chat_template: bool | None = None,
    system_prompt: str | None = None,
    tokens_per_call: int = TOKENS_PER_CALL,
    progress: bool | None = None,
    **options,
):
    """`dataset` with `answer_column` added: each row's answer to its question about its document.

    Rows with the same document text are one document, its questions asked together as
    streams that share its prefix (`answer_corpus`); the rows keep their order.
    checkpoint: a JSON-lines file of finished documents' answers (keyed by the document's first
        row) after a header naming the run; a run started again with it skips the documents it
        holds.  A checkpoint of another run (other rows, model or options, `stats=` aside) raises CheckpointError.
    template, use_chat_template, system_prompt, tokens_per_call, progress and the generation
    `options`: as for `answer_corpus`.

    Under `accelerate launch` with several processes, call it on every process with the model on
    that process's `PartialState().device`: each answers a share of the documents (balanced by
    prompt tokens) and every process gets the whole dataset back.  With a checkpoint each process
    appends to a part file of it, merged into it at the end; a rerun with any number of processes
    skips the documents the checkpoint and any leftover parts hold.
    """
    documents, questions = _columns(dataset, document_column, question_column, answer_column)
    answers = [None] * len(documents)
    render = {"template": template, "use_chat_template": use_chat_template, "system_prompt": system_prompt}
    state = process_state()
    done = _Checkpoint(checkpoint, _header(model, documents, questions, render, options), state) if checkpoint else None
    todo = []
    for rows in _documents(documents):
        if done is not None and rows[0] in done.answers:
            _fill(answers, rows, done.answers[rows[0]])
        else:
            todo.append(rows)
    state.wait_for_everyone()  # every process has read the checkpoint's parts before any appends to one
    records = [(documents[rows[0]], [questions[r] for r in rows]) for rows in todo]
    found = []
    for result in answer_share(
        model, tokenizer, records, state, render, tokens_per_call=tokens_per_call, progress=progress, **options
    ):
        found.append((result.index, result.answers))
        if done is not None:
            done.add(todo[result.index][0], result.answers)
    for index, values in gather_object(found) if state.num_processes > 1 else found:
        _fill(answers, todo[index], values)
    if done is not None:
        done.merge(state)
    return dataset.add_column(answer_column, answers)


def _columns(dataset, document_column: str, question_column: str, answer_column: str):
    """The document and question columns as lists of strings, checked before any model work."""
    names = dataset.column_names
    for column in (document_column, question_column):
        if column not in names:
            raise ValueError(f"the dataset has no column {column!r}; its columns: {names}")
    if answer_column in names:
        raise ValueError(f"the dataset already has a column {answer_column!r}; pass another answer_column=")
    documents, questions = list(dataset[document_column]), list(dataset[question_column])
    for row, (document, question) in enumerate(zip(documents, questions)):
        check_text(f"row {row}'s {document_column}", document)
        check_text(f"row {row}'s {question_column}", question)
    return documents, questions


def _documents(documents: list[str]) -> list[list[int]]:
    """The rows of each distinct document, documents in order of their first row."""
    rows = {}
    for row, document in enumerate(documents):
        rows.setdefault(document, []).append(row)
    return list(rows.values())


def _fill(answers: list, rows: list[int], values: list) -> None:
    for row, value in zip(rows, values):
        answers[row] = value


def _header(model, documents: list[str], questions: list[str], render: dict, options: dict) -> dict:
    """What must match for a checkpoint's answers to be reused: the rows, the model and the options."""
    rows = hashlib.sha1()
    for pair in zip(documents, questions):
        rows.update(json.dumps(pair).encode() + b"\n")
    header = {
        "hf_parallel_answer_dataset": 1,
        "model": getattr(model, "name_or_path", "") or type(model).__name__,
        "rows": len(documents),
        "data": rows.hexdigest(),
        "prompts": render,
        "options": {name: value for name, value in options.items() if name != "stats"},  # stats= counts the run
    }
    return json.loads(json.dumps(header, default=repr, sort_keys=True))  # as it reads back from the file


class _Checkpoint:
    """Finished documents' answers, a JSON line each ({"row": first row, "answers": [...]}) after the header.

    One process appends to the checkpoint itself, as long as no part files are left; several
    processes each append to a part file of their own, merged into the checkpoint by `merge`.
    """

    def __init__(self, path: str | Path, header: dict, state):
        self.path, self.answers = Path(path), {}
        lines = read_json_lines(self.path)
        parts = part_files(self.path) if lines else []  # parts without a checkpoint belong to no run to resume
        state.wait_for_everyone()  # every process has read the file before the main process writes a new one
        if not lines and state.is_main_process:
            for part in part_files(self.path):
                part.unlink()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(header, sort_keys=True) + "\n")
        if lines and lines[0] != header:
            raise CheckpointError(
                f"{self.path} is the checkpoint of another run (other rows, model or options); "
                "pass another checkpoint= file or delete it"
            )
        for record in lines[1:] + [line for part in parts for line in read_json_lines(part)]:
            if isinstance(record, dict) and "row" in record and "answers" in record:
                self.answers[record["row"]] = record["answers"]
        alone = state.num_processes == 1 and not parts
        self.target = self.path if alone else part_path(self.path, state.process_index)

    def add(self, row: int, answers: list) -> None:
        append_json_lines(self.target, [{"row": row, "answers": answers}])

    def merge(self, state) -> None:
        """The parts' answers appended to the checkpoint, by the main process once all are done."""
        state.wait_for_everyone()
        if state.is_main_process:
            merge_parts(self.path, lambda line: line.get("row"), lambda line: line["row"])
        state.wait_for_everyone()  # a next call reads the checkpoint whole, not half merged
