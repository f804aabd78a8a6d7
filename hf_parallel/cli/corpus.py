"""`hf-parallel answer --corpus IN --out OUT`: every document of a JSON-lines corpus, resumable.

Answered documents are appended to OUT as they finish; a rerun skips those OUT holds.  Under
`accelerate launch` with several processes each answers a share of the documents, appending to a
part file of OUT, and the main process merges the parts into OUT in input order.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from ..decoding.inputs import check_tokens
from ..frontends.corpus import answer_key, finished_answers, read_corpus
from ..frontends.data_parallel import answer_share, merge_parts, part_files, part_path, process_state
from ..frontends.jsonlines import append_json_lines
from ..frontends.prompting import render_prompts
from .answer import AnswerConfig, load
from .usage import INTERRUPTED, UsageParser


def answer_corpus(parser: UsageParser, config: AnswerConfig) -> None:
    """Answer the corpus's documents that --out does not hold yet, appending each line as it finishes.

    Under `accelerate launch` with several processes each answers its share on its own device and
    appends to a part file of --out; once all are done, the main process appends the parts to --out
    in input order.  Parts left by an interrupted run are honoured the same way by one process.
    """
    state = process_state(cpu=True if (config.device or "").startswith("cpu") else None)
    try:
        problems = _answer_share(parser, config, state)
    except KeyboardInterrupt:
        if not state.is_main_process:
            parser.exit(INTERRUPTED)
        parser.interrupted(_saved(config, state.num_processes))
    state.wait_for_everyone()
    if state.is_main_process:
        merge_parts(config.out, answer_key, lambda line: line["line"])
    if problems:
        lines = ", ".join(str(line) for line, _ in sorted(problems))
        parser.fail(
            f"skipped {len(problems)} bad line(s) of {config.corpus} (line {lines}, reported above); the other "
            f"documents' answers are in {config.out}"
        )


def _answer_share(parser: UsageParser, config: AnswerConfig, state) -> list[tuple]:
    """Answer this process's share of the documents --out does not hold; the corpus's bad lines."""
    # --out gets lines directly only from one process with no part files left, whose lines would have to be ordered
    target = config.out if state.num_processes == 1 and not part_files(config.out) else None
    records, problems = _corpus_todo(parser, config)
    state.wait_for_everyone()  # every rank reads --out and the parts (and so splits alike) before any appends
    if not records:
        return problems
    if config.device is None and state.num_processes > 1:
        config = replace(config, device=str(state.device))
    if state.num_processes > 1:  # one note per process: which one, where (and that the launch made several)
        where = f"process {state.process_index} of {state.num_processes} on {config.device or 'cuda'}"
        print(f"{parser.prog}: {where}", file=sys.stderr)
    model, tokenizer = load(parser, config)
    records = _fitting(parser, model, tokenizer, records, config, problems)
    pairs = [(r["document"], r["questions"]) for r in records]
    render = {"template": config.template, "use_chat_template": None, "system_prompt": config.system_prompt}
    options = {"tokens_per_call": config.tokens_per_call, "progress": config.progress, **config.generation_options()}
    try:
        for result in answer_share(model, tokenizer, pairs, state, render, **options):
            line = _answer_line(records[result.index], result.answers)
            append_json_lines(target or part_path(config.out, state.process_index), [line])
    except (ValueError, NotImplementedError) as error:  # options the model or the device refuses
        parser.fail(str(error))
    return problems


def _saved(config: AnswerConfig, processes: int) -> str:
    """What an interrupted corpus run leaves in --out, and how to go on."""
    again = "run the same command again to answer the rest"
    if processes > 1:  # the other processes may still be writing their parts: not read here
        return f"the answered documents are in {config.out} and its part files; {again}"
    try:
        held = len(_held(config))
    except (OSError, UnicodeDecodeError, ValueError):
        return f"the answered documents are in {config.out}; {again}"
    return f"{config.out} holds the answers of {held} document(s); {again}"


def _corpus_todo(parser: UsageParser, config: AnswerConfig) -> tuple[list[dict], list[tuple]]:
    """The corpus's good records that neither --out nor its part files hold yet, and its bad lines
    (reported on stderr)."""
    try:
        records, problems = read_corpus(config.corpus)
    except (OSError, UnicodeDecodeError) as error:
        parser.fail(f"cannot read the corpus {config.corpus}: {error}")
    for line, problem in problems:
        _skip(parser, config, line, problem)
    if not records and not problems:
        parser.fail(f'the corpus {config.corpus} is empty (expected one {{"document", "questions"}} object a line)')
    finished = _finished(parser, config)
    questions = {answer_key(r): r["questions"] for r in records}
    for key, asked in finished.items():
        if questions.get(key) != asked:
            parser.fail(
                f"{config.out} holds the answers of another corpus (its {key[0]} {key[1]!r} has other questions "
                f"in {config.corpus}, or none); pass another --out or delete it"
            )
    if finished:
        _report(parser, f"{len(finished)} document(s) already answered in {config.out}")
    return [r for r in records if answer_key(r) not in finished], problems


def _finished(parser: UsageParser, config: AnswerConfig) -> dict:
    """`_held`, with --out's folder made; an --out that is no answers file is a usage error."""
    try:
        finished = _held(config)
        Path(config.out).parent.mkdir(parents=True, exist_ok=True)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        parser.fail(f"cannot resume from {config.out}: {error}; pass another --out or delete it")
    return finished


def _held(config: AnswerConfig) -> dict:
    """The documents --out and its part files (from an interrupted run over several processes) hold."""
    finished = {}
    for path in [config.out, *part_files(config.out)]:
        finished.update(finished_answers(path))
    return finished


def _fitting(parser, model, tokenizer, records: list[dict], config: AnswerConfig, problems: list) -> list[dict]:
    """The records whose prompts fit the model's positions; each other one becomes a reported bad line."""
    fitting = []
    for record in records:
        try:
            render = (config.template, None, config.system_prompt)
            prompts = render_prompts(tokenizer, record["document"], record["questions"], *render)
        except ValueError as error:  # a flag the tokenizer cannot honour: a system prompt without a chat template
            parser.fail(str(error))
        try:
            for j, prompt in enumerate(prompts):
                check_tokens(model, f"question {j}'s prompt", prompt, config.max_new_tokens or 0)
            fitting.append(record)
        except ValueError as error:
            problems.append((record["line"], str(error)))
            _skip(parser, config, *problems[-1])
    return fitting


def _skip(parser: UsageParser, config: AnswerConfig, line: int, problem: str) -> None:
    _report(parser, f"{config.corpus} line {line}: {problem}; skipped")


def _report(parser: UsageParser, message: str) -> None:
    """A note on stderr, from the main process only: every process of a launch finds the same."""
    if process_state().is_main_process:
        print(f"{parser.prog}: {message}", file=sys.stderr)


def _answer_line(record: dict, answers: list) -> dict:
    line = {"line": record["line"], "id": record["id"], "questions": record["questions"], "answers": answers}
    return line if record["id"] is not None else {k: v for k, v in line.items() if k != "id"}
