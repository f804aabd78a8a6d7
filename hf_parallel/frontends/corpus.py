"""Many documents, each with its own questions: `answer_corpus` answers them several documents per call,
each document's answers as soon as its last answer is done (from inside the call, in the order they finish).

Also the JSON-lines files of `hf-parallel answer --corpus`: `read_corpus` reads the input (a bad
line is reported, not fatal), `finished_answers` what an earlier run already wrote to the output,
so that an interrupted run resumes (`hf_parallel.frontends.jsonlines` appends the finished ones).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..decoding.inputs import check_text, check_tokens, eos_token_ids
from .generate import stream_tokens
from .jsonlines import append_json_lines, read_json_lines
from .prompting import render_prompts

# Prompt tokens per generate_tokens call (each document's shared prefix counted once): enough to
# pack many short documents into one call, small enough that the dense reference path's memory
# stays bounded (prefill goes in chunks; the answers' room comes on top).
TOKENS_PER_CALL = 65536


@dataclass(frozen=True)
class CorpusAnswer:
    """One document's answers, in the order of its questions.

    index: the record's position in the input; id: the record's "id", else its index.
    answers: one string per question (a list of n per question with num_return_sequences=n > 1).
    """

    index: int
    id: object
    document: str
    questions: list[str]
    answers: list


def answer_corpus(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Iterable,
    template: str | None = None,
    use_chat_template: bool | None = None,
    system_prompt: str | None = None,
    tokens_per_call: int = TOKENS_PER_CALL,
    progress: bool | None = None,
    **options,
) -> Iterator[CorpusAnswer]:
    """Answer every record's questions about its document; one `CorpusAnswer` per record, yielded as soon as the
    record's last answer is done, even within a call: in the order records finish, which `index` names.

    records: (document, questions) pairs, or dicts with "document", "questions" and an optional
        "id"; a sequence is checked whole before any model work, any other iterable is read lazily.
    Prompts are rendered as `generate_parallel` renders them (template, use_chat_template,
    system_prompt), and consecutive documents share one `generate_tokens` call while their
    prompt tokens (each document's shared prefix once) fit in `tokens_per_call`; a larger
    document gets a call of its own.  Answers are decoded as `generate_parallel` decodes them.
    progress: a bar over questions answered on stderr; default: when stderr is a terminal.
    options: generation options, as for `generate_parallel` (its own bar, `progress`, is this one's).
    """
    if isinstance(tokens_per_call, bool) or not isinstance(tokens_per_call, int) or tokens_per_call < 1:
        raise ValueError(f"tokens_per_call must be an integer >= 1, got {tokens_per_call!r}")
    options.setdefault("eos_token_id", eos_token_ids(model, tokenizer))
    options.setdefault("tokenizer", tokenizer)  # for stop_strings, as generate_parallel passes it
    options["progress"] = False  # the call's bar over its answers: this function's bar over questions instead
    render = {"template": template, "use_chat_template": use_chat_template, "system_prompt": system_prompt}
    items = ((i, as_record(r, f"record {i}")) for i, r in enumerate(records))
    total = None
    if isinstance(records, Sequence):
        items = list(items)
        total = sum(len(questions) for _, (_, _, questions) in items)
    bar = {"total": total, "disable": not (sys.stderr.isatty() if progress is None else progress)}
    return _answers(model, tokenizer, _calls(model, tokenizer, items, render, tokens_per_call, options), options, bar)


def as_record(record, name: str) -> tuple[object, str, list[str]]:
    """(id or None, document, questions) of a (document, questions) pair or a dict; errors name `name`."""
    if isinstance(record, dict):
        missing = [key for key in ("document", "questions") if key not in record]
        if missing:
            raise ValueError(f"{name} has no {' or '.join(map(repr, missing))}")
        record_id, document, questions = record.get("id"), record["document"], record["questions"]
    elif isinstance(record, (tuple, list)) and len(record) == 2:
        record_id, (document, questions) = None, record
    else:
        raise TypeError(f"{name} must be a (document, questions) pair or a dict, got {type(record).__name__}")
    check_text(f"{name}'s document", document)
    if isinstance(questions, str) or not isinstance(questions, Sequence):
        raise TypeError(f"{name}'s questions must be a list of strings, got {type(questions).__name__}")
    for j, question in enumerate(questions):
        check_text(f"{name}'s question {j}", question)
    return record_id, document, list(questions)


def _calls(model, tokenizer, items, render: dict, tokens_per_call: int, options: dict):
    """Batches of (index, record, prompts): consecutive documents whose prompt tokens fit `tokens_per_call`."""
    room = options.get("max_new_tokens") if isinstance(options.get("max_new_tokens"), int) else 0
    batch, size = [], 0
    for index, record in items:
        prompts = render_prompts(tokenizer, record[1], record[2], **render)
        name = f"record {index}" + (f" (id {record[0]!r})" if record[0] is not None else "")
        for j, prompt in enumerate(prompts):  # named by record here: generate_tokens would name a call's prompt
            check_tokens(model, f"{name}'s question {j}", prompt, room)
        tokens = prompt_tokens(prompts)
        if batch and size + tokens > tokens_per_call:
            yield batch
            batch, size = [], 0
        batch.append((index, record, prompts))
        size += tokens
    if batch:
        yield batch


def document_tokens(tokenizer: PreTrainedTokenizerBase, document: str, questions: list[str], **render) -> int:
    """The prompt tokens a document puts in a call (its shared prefix once); render: as for `answer_corpus`."""
    return prompt_tokens(render_prompts(tokenizer, document, questions, **render))


def prompt_tokens(prompts: list[list[int]]) -> int:
    """Tokens a document's prompts put in the packed row: their common prefix once, then each one's rest."""
    shared = len(os.path.commonprefix(prompts)) if prompts else 0
    return shared + sum(len(p) - shared for p in prompts)


def _answers(model, tokenizer, calls, options: dict, bar_options: dict) -> Iterator[CorpusAnswer]:
    n = _returns_per_prompt(model, options)
    with tqdm(desc="questions", unit="q", **bar_options) as bar:
        for batch in calls:
            yield from _call(model, tokenizer, batch, n, options, bar)


def _call(model, tokenizer, batch: list, n: int, options: dict, bar) -> Iterator[CorpusAnswer]:
    """One call's records, each as soon as its last stream is done (a record without questions at once).

    The call's streams are its records' questions in order, n contiguous streams a question (n:
    num_return_sequences).
    """
    asked = [(position, j) for position, (_, (_, _, qs), _) in enumerate(batch) for j in range(len(qs))]
    texts = [[None] * (len(qs) * n) for _, (_, _, qs), _ in batch]  # per record: its streams' answers
    left, question_left = [len(t) for t in texts], [n] * len(asked)
    for position in (p for p, count in enumerate(left) if count == 0):
        yield _answer(batch[position], [])
    prompts = [p for _, _, ps in batch for p in ps]
    for stream, tokens in stream_tokens(model, prompts, **options) if prompts else ():
        question = stream // n
        position, j = asked[question]
        texts[position][j * n + stream % n] = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        left[position], question_left[question] = left[position] - 1, question_left[question] - 1
        if question_left[question] == 0:
            bar.update(1)
        if left[position] == 0:
            done = texts[position]
            yield _answer(batch[position], done if n == 1 else [done[i : i + n] for i in range(0, len(done), n)])


def _answer(item: tuple, answers: list) -> CorpusAnswer:
    index, (record_id, document, questions), _ = item
    return CorpusAnswer(index, index if record_id is None else record_id, document, questions, answers)


def _returns_per_prompt(model, options: dict) -> int:
    """Answers per prompt (num_return_sequences), merged as generate merges it: the keyword over
    generation_config= over the model's generation_config."""
    config = options.get("generation_config") or getattr(model, "generation_config", None)
    return options.get("num_return_sequences") or getattr(config, "num_return_sequences", None) or 1


# --------------------------------------------------------------------------- JSON-lines files


def read_corpus(path: str | Path) -> tuple[list[dict], list[tuple[int, str]]]:
    """The records of a JSON-lines corpus, one {"id"?, "document", "questions"} object a line (`corpus_records`)."""
    with open(path, encoding="utf-8") as lines:
        return corpus_records(lines)


def corpus_records(lines: Iterable[str]) -> tuple[list[dict], list[tuple[int, str]]]:
    """The records of a JSON-lines corpus's lines, one {"id"?, "document", "questions"} object a line.

    Returns the good lines' records ({"line", "id", "document", "questions"}; "id" None when
    the line has none) and (line number, message) per bad line; blank lines are skipped.
    A line is bad when it is not a JSON object, its document or a question is not a non-empty
    string, it has no questions, or its id is not a string or integer or repeats another's.
    """
    records, problems, seen = [], [], {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(_corpus_line(number, line, seen))
        except (TypeError, ValueError) as error:
            problems.append((number, str(error)))
    return records, problems


def _corpus_line(number: int, line: str, seen: dict) -> dict:
    try:
        row = json.loads(line.rstrip("\r\n"))  # an error names the column, not "line 2 column 1"
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error})") from None
    return corpus_record(number, row, seen)


def corpus_record(number: int, row, seen: dict) -> dict:
    """The record {"line", "id", "document", "questions"} of the corpus's line (or row) `number`, a dict with
    "document", "questions" and an optional "id"; a TypeError or ValueError says why it is bad (`corpus_records`).

    seen: the ids of the lines before it, and their numbers (this one's is added).
    """
    if not isinstance(row, dict):
        raise TypeError(f'expected a JSON object with "document" and "questions", got {type(row).__name__}')
    record_id, document, questions = as_record(row, "the line")
    if not questions:
        raise ValueError("the document has no questions")
    if record_id is not None:
        if isinstance(record_id, bool) or not isinstance(record_id, (str, int)):
            raise TypeError(f"its id must be a string or an integer, got {json.dumps(record_id)}")
        if record_id in seen:
            raise ValueError(f"its id {json.dumps(record_id)} is line {seen[record_id]}'s too")
        seen[record_id] = number
    return {"line": number, "id": record_id, "document": document, "questions": questions}


def answer_key(record: dict) -> tuple:
    """What identifies a corpus document across runs: its id, else its line number."""
    return ("id", record["id"]) if record.get("id") is not None else ("line", record["line"])


def finished_answers(path: str | Path) -> dict[tuple, dict]:
    """The input lines an earlier run wrote a line for to an output file, answered or an error line: `answer_key`
    -> its line (an error line, {"line", "error"}, has no id: its key is its line number).

    A last line cut short by an interruption is removed from the file (its document runs again);
    any other line that is not an answer line or an error line raises ValueError naming it.
    """
    return finished_lines(read_json_lines(path), str(path))


def finished_lines(lines: Iterable, name: str) -> dict[tuple, dict]:
    """`finished_answers` of an output's lines (their JSON values, None for a line that is not JSON); errors name
    the output `name`."""
    finished = {}
    for number, record in enumerate(lines, 1):
        if not is_output_line(record):
            raise ValueError(f"{name} line {number} is not an answer line of `hf-parallel answer --corpus`")
        finished[answer_key(record)] = record
    return finished


def is_output_line(record) -> bool:
    """Whether a JSON value is a line of `hf-parallel answer --corpus`'s output: an answer line or an error line."""
    if not isinstance(record, dict):
        return False
    return {"line", "questions", "answers"} <= record.keys() or {"line", "error"} <= record.keys()


def sort_output(path: str | Path) -> None:
    """Rewrite an output file with its lines in input order (by "file", where a line has one, then "line"); the new
    file replaces the old at once, so an interruption leaves one or the other."""
    lines = [line for line in read_json_lines(path) if isinstance(line, dict)]
    lines.sort(key=lambda line: (line.get("file") or "", line.get("line", 0)))
    sorting = Path(f"{path}.sorting")
    sorting.unlink(missing_ok=True)
    append_json_lines(sorting, lines)
    os.replace(sorting, path)


# --------------------------------------------------------------------------- the output's lines

# the generation options that change answers, recorded in each line (the others change only the speed)
ANSWER_OPTIONS = ("max_new_tokens", "do_sample", "temperature", "top_p", "seed")


def run_record(
    model: str | None, dtype: str, options: dict, template: str | None = None, system_prompt: str | None = None
) -> dict:
    """What each output line records of its run: {"model", "options"}.

    model: the model's name (None: the embedded SmolLM2; a directory: its absolute path); dtype: the
    dtype's name it runs in; options: the generation options, of which those that change answers
    (`ANSWER_OPTIONS`) are recorded, with the prompt's template and system prompt where given.
    """
    from .model_loading import DEFAULT_NAME  # start-up: as in model_loading, nothing heavy

    name = model or DEFAULT_NAME
    if model and Path(model).expanduser().is_dir():
        name = str(Path(model).expanduser().resolve())
    generation = {k: v for k, v in options.items() if k in ANSWER_OPTIONS}
    prompts = {"template": template, "system_prompt": system_prompt}
    return {"model": name, "options": {"dtype": dtype, **generation, **{k: v for k, v in prompts.items() if v}}}


def answer_line(record: dict, answers: list, recorded: dict) -> dict:
    """A document's output line: {"line", "id" (where the record has one), "questions", "answers"} and the run's
    {"model", "options"} (`run_record`); record: as `corpus_records` reads it."""
    line = {"line": record["line"], "id": record.get("id"), "questions": record["questions"], "answers": answers}
    return {k: v for k, v in line.items() if k != "id" or v is not None} | recorded


def error_line(line: int, problem: str, record_id, recorded: dict) -> dict:
    """A bad input line's output line: {"line", "id" (where the line has one), "error"} and the run's record."""
    return {"line": line} | ({"id": record_id} if record_id is not None else {}) | {"error": problem} | recorded


def prompt_problem(model, tokenizer, record: dict, room: int, **render) -> str | None:
    """Why a record's prompts do not fit the model (the positions its prompt and `room` new tokens need), else
    None; render: as for `answer_corpus`.  A ValueError where the prompt cannot be rendered at all (a system
    prompt without a chat template)."""
    prompts = render_prompts(tokenizer, record["document"], record["questions"], **render)
    try:
        for j, prompt in enumerate(prompts):
            check_tokens(model, f"question {j}'s prompt", prompt, room)
    except ValueError as error:
        return str(error)
    return None
