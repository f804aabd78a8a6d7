"""`hf-parallel answer --corpus IN [--out OUT]`: every document of a JSON-lines corpus, resumable by the document.

Each document's line is written as soon as its last answer is done, from inside a generate call, to OUT
(appended) or to standard output; a rerun skips the documents OUT holds.  Each line records the model and
the options that change answers, and a rerun with others is refused unless --force.  Under `accelerate
launch` with several processes each answers a share of the documents, appending to a part file of OUT,
and the main process merges the parts into OUT in input order.
"""

from __future__ import annotations

import glob
import json
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..frontends.jsonlines import append_json_lines, read_json_lines
from .answer import AnswerConfig, load, placement
from .usage import INTERRUPTED, UsageParser


@dataclass
class CorpusRun:
    """One run's output: where lines go, what they record, and what this process has written."""

    parser: UsageParser
    config: AnswerConfig
    state: object = None  # accelerate's PartialState, once torch is loaded
    record: dict | None = None  # {"model", "options"}: what every line of this run records
    documents: int = 0  # written by this process
    questions: int = 0
    failed: int = 0  # error lines written by this process

    def write(self, target: Path | None, record: dict, answers: list) -> None:
        """The document's line (`answer_line`), on disk (or standard output) before returning."""
        from ..frontends.corpus import answer_line  # start-up: torch loads once the corpus is found

        self._emit(target, answer_line(record, answers, self.record))
        self.documents, self.questions = self.documents + 1, self.questions + len(record["questions"])

    def write_error(self, target: Path | None, line: int, problem: str, id=None) -> None:
        """A bad input line's error line, {"line", "id" (where the line has one), "error", "model", "options"}, as the
        document's line is written (`write`): a rerun finds it done."""
        from ..frontends.corpus import error_line  # start-up: as in write

        self._emit(target, error_line(line, problem, id, self.record))
        self.failed += 1

    @staticmethod
    def _emit(target: Path | None, line: dict) -> None:
        """One output line: appended to `target`, else printed (standard output), flushed either way."""
        if target is None:
            print(json.dumps(line, ensure_ascii=False), flush=True)
        else:
            append_json_lines(target, [line])

    def note(self, message: str) -> None:
        """A note on stderr, from the main process only (every process of a launch finds the same), unless --quiet."""
        if not self.config.quiet and (self.state is None or self.state.is_main_process):
            print(f"{self.parser.prog}: {message}", file=sys.stderr)


def answer_corpus(parser: UsageParser, config: AnswerConfig) -> None:
    """Answer the corpus's documents that --out does not hold yet, writing each line as the document finishes;
    a one-line summary on stderr at the end (but under --quiet).

    Under `accelerate launch` with several processes each answers its share on its own device and
    appends to a part file of --out; once all are done, the main process appends the parts to --out
    in input order.  Parts left by an interrupted run are honoured the same way by one process.
    """
    start, run = time.perf_counter(), CorpusRun(parser, config)
    if config.ray is not None:
        _answer_on_ray(run, start)
        return
    _check_readable(parser, config.corpus)  # before torch loads: a mistyped path is answered at once
    try:
        _answer_share(run)
    except KeyboardInterrupt:
        if run.state is not None and not run.state.is_main_process:
            parser.exit(INTERRUPTED)
        parser.interrupted(_saved(run))
    from ..frontends.data_parallel import merge_parts  # start-up: loaded by _answer_share, once the corpus is found

    run.state.wait_for_everyone()
    if run.state.is_main_process and config.out:
        from ..frontends.corpus import answer_key  # start-up: as merge_parts

        merge_parts(config.out, answer_key, lambda line: line["line"])
        if config.sort:
            from ..frontends.corpus import sort_output  # start-up: as merge_parts

            sort_output(config.out)
    if run.state.num_processes == 1:  # under several, each process knows only its own share
        where = f"answers in {config.out}" if config.out else "answers written to standard output"
        failed = f"; {run.failed} bad line(s) written as error lines (reported above)" if run.failed else ""
        run.note(
            f"{run.documents} document(s), {run.questions} question(s) answered in "
            f"{time.perf_counter() - start:.1f} s{failed}; {where}"
        )


def _check_readable(parser: UsageParser, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        parser.fail(f"cannot read the corpus {path}: {error}")


def _answer_share(run: CorpusRun) -> None:
    """Answer this process's share of the documents --out does not hold, and write the error lines of the bad lines
    it does not hold (those of the corpus's reading from the main process, those of a prompt too long from the
    process whose share it is)."""
    # start-up: torch and the engine load here, once the corpus is found
    from ..frontends.data_parallel import answer_share, part_files, part_path, process_state

    parser, config = run.parser, run.config
    run.state = state = process_state(cpu=True if (config.device or "").startswith("cpu") else None)
    if state.num_processes > 1 and not config.out:
        parser.fail("several processes need --out: each appends its share to a part file of it")
    if config.device is None and state.num_processes > 1:  # each process on its own device
        config = replace(config, device=str(state.device))
    device, dtype = placement(config.device, config.dtype)
    run.record = _recorded(config, dtype)
    # --out gets lines directly only from one process with no part files left, whose lines would have to be ordered
    direct = state.num_processes == 1 and not (config.out and part_files(config.out))
    records, problems = _corpus_todo(run)
    state.wait_for_everyone()  # every rank reads --out and the parts (and so splits alike) before any appends
    target = None if not config.out else Path(config.out) if direct else part_path(config.out, state.process_index)
    if state.is_main_process:
        for line, problem in problems:
            run.write_error(target, line, problem)
    if not records:
        return
    if state.num_processes > 1 and not config.quiet:  # one note per process: which one, where
        print(f"{parser.prog}: process {state.process_index} of {state.num_processes} on {device}", file=sys.stderr)
    model, tokenizer = load(parser, config)
    records = _fitting(run, model, tokenizer, records, target)
    pairs = [(r["document"], r["questions"]) for r in records]
    render = {"template": config.template, "use_chat_template": None, "system_prompt": config.system_prompt}
    options = {"tokens_per_call": config.tokens_per_call, "progress": config.shows_progress()}
    try:
        for result in answer_share(model, tokenizer, pairs, state, render, **options, **config.generation_options()):
            run.write(target, records[result.index], result.answers)
    except (ValueError, NotImplementedError) as error:  # options the model or the device refuses
        parser.fail(str(error))


def _recorded(config: AnswerConfig, dtype: str) -> dict:
    """What each line records: the model (a directory as its absolute path) and the options that change answers."""
    from ..frontends.corpus import run_record  # start-up: as in _answer_share

    return run_record(config.model, dtype, config.generation_options(), config.template, config.system_prompt)


def _saved(run: CorpusRun) -> str:
    """What an interrupted corpus run leaves, and how to go on."""
    config, again = run.config, "run the same command again to answer the rest"
    if not config.out:
        return f"the answers of {run.documents} document(s) went to standard output; without --out a run cannot resume"
    if run.state is not None and run.state.num_processes > 1:  # the other processes may still be writing their parts
        return f"the answered documents are in {config.out} and its part files; {again}"
    parts = glob.glob(f"{glob.escape(config.out)}.part-*")  # an earlier launch's, which this run appends to
    try:  # without the engine's modules: Ctrl-C may have come while they were loading
        held = sum(
            isinstance(line, dict) and "answers" in line
            for path in [config.out, *parts]
            for line in read_json_lines(path)
        )
    except (OSError, UnicodeDecodeError):
        return f"the answered documents are in {config.out}; {again}"
    if not held:
        return f"no document was finished, so nothing was written to {config.out}; run the same command again"
    return f"{config.out} holds the answers of {held} document(s), {run.documents} of them from this run; {again}"


def _corpus_todo(run: CorpusRun) -> tuple[list[dict], list[tuple]]:
    """The corpus's good records that neither --out nor its part files hold yet, and its bad lines that they hold
    no error line for (reported on stderr); a usage error where no line is good, or where --out holds another
    corpus's answers, or another run's."""
    from ..frontends.corpus import answer_key, read_corpus  # start-up: as in _answer_share

    parser, config = run.parser, run.config
    try:
        records, problems = read_corpus(config.corpus)
    except (OSError, UnicodeDecodeError) as error:
        parser.fail(f"cannot read the corpus {config.corpus}: {error}")
    if not records and not problems:
        parser.fail(f'the corpus {config.corpus} is empty (expected one {{"document", "questions"}} object a line)')
    if not records:
        for line, problem in problems:
            _skip(run, line, problem)
        lines = ", ".join(str(line) for line, _ in problems)
        parser.fail(
            f"no line of the corpus {config.corpus} is a document with questions (line {lines}, reported above)"
        )
    finished = _finished(parser, config) if config.out else {}
    problems = [(line, problem) for line, problem in problems if ("line", line) not in finished]
    for line, problem in problems:
        _skip(run, line, problem)
    questions = {answer_key(r): r["questions"] for r in records}
    _refuse_others(run, [(f"{key[0]} {key[1]!r}", held, questions.get(key)) for key, held in finished.items()])
    return [r for r in records if answer_key(r) not in finished], problems


def _refuse_others(run: CorpusRun, held: list[tuple[str, dict, list | None]]) -> None:
    """A usage error where --out holds another corpus's answers or, unless --force, another run's; else a note of
    what it holds.  held: (its input line's name, as "id 'x'" or "line 3"; the line in --out; the input line's
    questions, None where the corpus has no good line of that name) for each line --out holds."""
    config = run.config
    for name, line, questions in held:
        if "error" not in line and questions != line["questions"]:
            run.parser.fail(
                f"{config.out} holds the answers of another corpus (its {name} has other questions "
                f"in {config.corpus}, or none); pass another --out or delete it"
            )
        if not config.force and {k: line.get(k) for k in run.record} != run.record:
            run.parser.fail(
                f"{config.out} holds answers of another run ({_difference(line, run.record)}); pass --force to add "
                "this run's answers to it, or another --out"
            )
    answered = sum("error" not in line for _, line, _ in held)
    if held:
        errors = f" (and {len(held) - answered} error line(s))" if answered < len(held) else ""
        run.note(f"{answered} document(s) already answered in {config.out}{errors}")


def _difference(held: dict, record: dict) -> str:
    """How a held line's model and options differ from this run's, as "NAME THEIRS there, OURS here" parts."""
    theirs = {"model": held.get("model"), **(held.get("options") or {})}
    ours = {"model": record["model"], **record["options"]}
    differ = [key for key in {**theirs, **ours} if theirs.get(key) != ours.get(key)]
    return "; ".join(f"{key} {theirs.get(key, 'unset')} there, {ours.get(key, 'unset')} here" for key in differ)


def _finished(parser: UsageParser, config: AnswerConfig) -> dict:
    """`_held`, with --out's folder made; an --out that is no answers file is a usage error."""
    try:
        finished = _held(config)
        Path(config.out).parent.mkdir(parents=True, exist_ok=True)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        parser.fail(f"cannot resume from {config.out}: {error}; pass another --out or delete it")
    return finished


def _held(config: AnswerConfig) -> dict:
    """The documents' lines --out and its part files (from an interrupted run over several processes) hold."""
    from ..frontends.corpus import finished_answers  # start-up: as in _answer_share
    from ..frontends.data_parallel import part_files  # start-up: as in _answer_share

    finished = {}
    for path in [config.out, *part_files(config.out)]:
        finished.update(finished_answers(path))
    return finished


def _fitting(run: CorpusRun, model, tokenizer, records: list[dict], target: Path | None) -> list[dict]:
    """The records whose prompts fit the model's positions; each other one becomes a reported bad line and an error
    line in `target`."""
    from ..frontends.corpus import prompt_problem  # start-up: as in _answer_share

    config, fitting = run.config, []
    render = {"template": config.template, "use_chat_template": None, "system_prompt": config.system_prompt}
    for record in records:
        try:
            problem = prompt_problem(model, tokenizer, record, config.max_new_tokens or 0, **render)
        except ValueError as error:  # a flag the tokenizer cannot honour: a system prompt without a chat template
            run.parser.fail(str(error))
        if problem is None:
            fitting.append(record)
        else:
            _skip(run, record["line"], problem, share=True)
            run.write_error(target, record["line"], problem, record.get("id"))
    return fitting


def _skip(run: CorpusRun, line: int, problem: str, share: bool = False) -> None:
    """A bad line, reported on stderr under --quiet too (an error in the input): from the main process, or from
    the process whose `share` it is."""
    if share or run.state is None or run.state.is_main_process:
        print(f"{run.parser.prog}: {run.config.corpus} line {line}: {problem}; skipped", file=sys.stderr)


# --------------------------------------------------------------------------- on a Ray cluster (--ray)


def _answer_on_ray(run: CorpusRun, start: float) -> None:
    """The corpus's documents that --out does not hold, answered on a Ray cluster (`hf_parallel.ray.corpus`): lines
    as one process writes them, in the order batches finish (--sort: in input order at the end)."""
    parser, config = run.parser, run.config
    if "://" not in config.corpus and not Path(config.corpus).exists():  # before ray and torch load
        parser.fail(f"cannot read the corpus {config.corpus}: no such file or folder")
    try:
        import ray  # optional: the `ray` extra
    except ImportError as error:
        parser.fail(f"--ray needs Ray Data ({error}): pip install 'hf-parallel[ray]'")
    from ..ray import corpus as on_ray  # start-up: torch once the flags are checked

    cluster = on_ray.Cluster(
        actors=config.ray_actors or 1,
        gpus_per_actor=config.ray_gpus_per_actor,
        cpus_per_actor=1 if config.ray_cpus_per_actor is None else config.ray_cpus_per_actor,
        batch_size=config.ray_batch_size or on_ray.Cluster.batch_size,
    )
    started = False
    try:
        started = on_ray.start(config.ray or None, quiet=config.quiet)
        if config.quiet or not config.shows_progress():
            ray.data.DataContext.get_current().enable_progress_bars = False
        if on_ray.spare_cpus(cluster) < 1:
            parser.fail(
                f"{cluster.actors} actor(s) of {cluster.cpus_per_actor:g} CPU(s) leave the cluster's "
                f"{ray.cluster_resources().get('CPU', 0):g} CPU(s) none to read and write the corpus: lower "
                "--ray-actors or --ray-cpus-per-actor (0.5 shares a CPU)"
            )
        gpus = on_ray.gpus_per_actor(cluster)
        device = config.device or ("cuda" if gpus > 0 else "cpu")
        dtype = placement(device, config.dtype)[1]
        run.record = _recorded(config, dtype)
        file_out = on_ray.is_file_output(config.out)
        if config.sort and not file_out:
            parser.fail(f'--sort rewrites a JSON-lines file; {config.out} is a folder (its lines have their "line")')
        held = _held_on_ray(run, on_ray)
        rows = on_ray.corpus_dataset(config.corpus, skip=held)
        stage = {"model": config.model, "dtype": dtype, "template": config.template}
        stage |= {"system_prompt": config.system_prompt, **config.generation_options()}
        stage["device"] = "auto" if gpus > 1 and config.device is None else config.device
        lines = on_ray.answered(rows, cluster, **stage)
        if file_out:
            Path(config.out).parent.mkdir(parents=True, exist_ok=True)
            for batch in lines.iter_batches(batch_format="pyarrow", batch_size=None):
                _append_on_ray(run, [json.loads(text) for text in batch.column("json").to_pylist()])
        else:
            on_ray.write_folder(lines, config.out)
    except KeyboardInterrupt:
        parser.interrupted(_saved(run))
    except (ray.exceptions.RayError, ray.data.exceptions.UserCodeException) as error:
        parser.fail(f"the run on Ray failed: {_first_line(error)}")
    finally:
        if started:
            ray.shutdown()
    if config.sort:
        from ..frontends.corpus import sort_output  # start-up: as on_ray

        sort_output(config.out)
    where = f"answers in {config.out}" if file_out else f"answers written into {config.out} by Ray's write tasks"
    failed = f"; {run.failed} bad line(s) written as error lines (reported above)" if run.failed else ""
    count = f"{run.documents} document(s), {run.questions} question(s) answered" if file_out else "answered"
    run.note(f"{count} in {time.perf_counter() - start:.1f} s on {cluster.actors} Ray actor(s){failed}; {where}")


def _held_on_ray(run: CorpusRun, on_ray) -> dict:
    """The lines --out holds, by `line_key`, checked as a one-process run checks them (`_refuse_others`)."""
    config = run.config
    try:
        held = on_ray.held_lines(config.out)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        run.parser.fail(f"cannot resume from {config.out}: {error}; pass another --out or delete it")
    answered = [key for key, line in held.items() if "error" not in line]
    questions = on_ray.held_questions(config.corpus, answered) if answered else {}

    def name(key: str) -> str:
        file, kind, value = json.loads(key)
        return f"{kind} {value!r}" + (f" of {file}" if file is not None else "")

    _refuse_others(run, [(name(key), line, questions.get(key)) for key, line in held.items()])
    return held


def _append_on_ray(run: CorpusRun, lines: list[dict]) -> None:
    """A batch's lines appended to --out, each bad line reported as a one-process run reports it."""
    for line in lines:
        if "error" in line:
            where = f"{line['file']} " if "file" in line else ""
            print(f"{run.parser.prog}: {run.config.corpus} {where}line {line['line']}: {line['error']}; skipped",
                  file=sys.stderr)  # fmt: skip
            run.failed += 1
        else:
            run.documents, run.questions = run.documents + 1, run.questions + len(line["questions"])
    append_json_lines(run.config.out, lines)


def _first_line(error: Exception) -> str:
    """What a Ray error says went wrong: the last "SomeError: message" line of its text (which carries the remote
    traceback), else its last line."""
    cause = getattr(error, "cause", None) or error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)]
    return (named or lines or [type(cause).__name__])[-1]
