"""`hf-parallel batch`: an OpenAI Batch API input file answered into an output file, resumably.

Each input line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" or "/v1/completions",
"body"}`; each output line is `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`, written as its request finishes (in finishing order, as OpenAI's Batch API: `custom_id` says
which line it answers; `sort_output` puts them in input order).  Every request goes to one `Engine` at
once, ordered by its prompt's tokens, so lines that share a prefix (a document, a system prompt) meet in
the row whatever their order in the file.  A line that is not a request becomes an output line with
`error` set and no response; a request the server would refuse becomes one with its 4xx response; the
other lines complete.  Lines already in the output (by `custom_id`) are not run again, so a run cut
short, even by `kill -9`, resumes where it stopped; `unanswered` says, without a model, what is left.
"""

from __future__ import annotations

import os
import queue
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..frontends.jsonlines import append_json_lines, json_or_none, read_json_lines
from ..frontends.progress import shown
from ..frontends.serving import Engine
from .protocol import Answer, ApiError, Work, answer_eos, engine_error, parse

URLS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


@dataclass
class Summary:
    """What a run did: lines answered now, of which failed (error line or 4xx/5xx response), and skipped (in
    the output already)."""

    answered: int = 0
    failed: int = 0
    skipped: int = 0


@dataclass
class Line:
    """A non-blank input line: its number (from 1), the key the output knows it by (custom_id, else "line N")
    and its JSON value (None where it is not JSON)."""

    number: int
    key: str
    record: object


@dataclass
class Job:
    custom_id: str
    work: Work
    answer: Answer
    requests: list


def run_batch(
    engine: Engine, tokenizer, name: str, input_path, output_path, max_n: int = 16, progress: bool | None = None
) -> Summary:
    """Answer every line of `input_path` not yet in `output_path` (module docstring) with `engine`'s model, served
    as `name`."""
    eos = answer_eos(engine.model, tokenizer)
    todo, skipped = unanswered(input_path, output_path)
    summary, jobs, seen, refused = Summary(skipped=skipped), [], set(), []
    for line in todo:
        record = line.record
        custom_id = record.get("custom_id") if isinstance(record, dict) else None
        problem = _line_problem(record, custom_id, seen)
        if problem is not None:
            error = {"code": "invalid_request", "message": f"line {line.number}: {problem}"}
            refused.append(_line(line.key, None, error))
            continue
        seen.add(custom_id)
        body = record["body"]
        try:
            if body.get("stream"):
                raise ApiError(400, "a batch answers whole: stream is not taken", param="stream")
            work = parse(URLS[record["url"]], body, tokenizer, name, max_n)
        except ApiError as err:
            refused.append(_line(custom_id, _response(err.status, err.body()), None))
            continue
        jobs.append(Job(custom_id, work, Answer(work, tokenizer, eos, [0] * len(work.prompts)), []))
    append_json_lines(output_path, refused)
    summary.answered = summary.failed = len(refused)
    _run(engine, jobs, output_path, summary, progress)
    return summary


def unanswered(input_path, output_path) -> tuple[list[Line], int]:
    """The input's lines that the output has no line for (by key), and how many it has one for."""
    lines = _lines(input_path)
    done = {r["custom_id"] for r in read_json_lines(output_path) if isinstance(r, dict) and "custom_id" in r}
    todo = [line for line in lines if line.key not in done]
    return todo, len(lines) - len(todo)


def tally(output_path) -> tuple[int, int]:
    """(lines, failed lines) of an output file: a line fails where `error` is set or its status is not 200."""
    records = [r for r in read_json_lines(output_path) if isinstance(r, dict)]
    return len(records), sum(_failed(r) for r in records)


def sort_output(input_path, output_path) -> None:
    """Rewrite the output with its lines in input order (a line about an input line that is no request where
    that line was); the new file replaces the old at once, so an interruption leaves one or the other."""
    first: dict[str, int] = {}
    for line in _lines(input_path):
        first.setdefault(line.key, line.number)
    records = [r for r in read_json_lines(output_path) if isinstance(r, dict)]
    records.sort(key=lambda r: _input_number(r, first))
    output_path = Path(output_path)
    sorting = output_path.with_name(output_path.name + ".sorting")
    sorting.unlink(missing_ok=True)
    append_json_lines(sorting, records)
    os.replace(sorting, output_path)


def _lines(input_path) -> list[Line]:
    """The input's non-blank lines; a line keyed "line N" where it has no custom_id or repeats an earlier line's
    (so that its error line never stands for the earlier line's answer when a run resumes)."""
    lines, ids = [], set()
    for number, text in enumerate(Path(input_path).read_text(encoding="utf-8").splitlines(), 1):
        if text.strip():
            record = json_or_none(text)
            custom_id = record.get("custom_id") if isinstance(record, dict) else None
            key = custom_id if isinstance(custom_id, str) and custom_id not in ids else f"line {number}"
            ids.add(custom_id)
            lines.append(Line(number, key, record))
    return lines


def _input_number(record: dict, first: dict[str, int]) -> float:
    """The input line an output line answers: the one its error names ("line N: ..."), else the first with its
    custom_id; past the end where neither is found."""
    named = re.match(r"line (\d+):", str((record.get("error") or {}).get("message", "")))
    return int(named.group(1)) if named else first.get(record.get("custom_id"), float("inf"))


def _failed(record: dict) -> bool:
    return record.get("error") is not None or (record.get("response") or {}).get("status_code") != 200


def _line_problem(record, custom_id, seen: set) -> str | None:
    if not isinstance(record, dict):
        return "not a JSON object"
    if not isinstance(custom_id, str):
        return "custom_id must be a string"
    if custom_id in seen:
        return f"custom_id {custom_id!r} is used by an earlier line"
    if record.get("method") != "POST":
        return "method must be POST"
    if record.get("url") not in URLS:
        return f"url must be one of {', '.join(URLS)}"
    if not isinstance(record.get("body"), dict):
        return "body must be a JSON object"
    return None


def _run(engine: Engine, jobs: list[Job], output_path, summary: Summary, progress: bool | None) -> None:
    """Every job submitted at once (by prompt tokens, so that shared prefixes meet), lines written as they end."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    order = sorted(range(len(jobs)), key=lambda k: jobs[k].work.prompts[0])
    for k in order:
        job = jobs[k]
        for p, prompt in enumerate(job.work.prompts):
            request = engine.submit(prompt, job.work.options, job.work.n, _forward(events, k, p), job.work.priority)
            job.requests.append(request)
    open_jobs = len(jobs)
    bar = tqdm(total=len(jobs), unit="request", disable=not shown(progress))
    with bar:
        while open_jobs:
            k, p, kind, value = events.get()
            job = jobs[k]
            if job.answer.open <= 0:
                continue  # failed already
            if kind == "accepted":
                job.answer.limits[p] = job.requests[p].max_new_tokens
                continue
            if kind == "error":
                for request in job.requests:
                    request.cancel()
                engine.wake()
                error = engine_error(value, job.work.kind)
                job.answer.open, line = 0, _line(job.custom_id, _response(error.status, error.body()), None)
            else:
                job.answer.apply(p, kind, value)
                if job.answer.open:
                    continue
                line = _line(job.custom_id, _response(200, job.answer.body()), None)
            append_json_lines(output_path, [line])
            summary.answered += 1
            summary.failed += line["response"]["status_code"] != 200
            open_jobs -= 1
            bar.update()


def _forward(events: queue.SimpleQueue, k: int, p: int):
    def on_event(kind, value):
        events.put((k, p, kind, value))

    return on_event


def _response(status: int, body: dict) -> dict:
    return {"status_code": status, "request_id": uuid.uuid4().hex, "body": body}


def _line(custom_id: str, response: dict | None, error: dict | None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}
