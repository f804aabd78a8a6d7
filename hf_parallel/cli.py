"""The command line: `hf-parallel demo`, `eval` and `answer` (also `python -m hf_parallel ...`)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

from .frontends.corpus import TOKENS_PER_CALL

ANSWER_HELP = """\
Answer questions about documents with parallel prompting.

  one document:  hf-parallel answer --document DOC.txt --questions QUESTIONS.txt
                 (one question a line, blank lines skipped); prints each question and its answer.
                 Either file may be - for standard input.
  a corpus:      hf-parallel answer --corpus IN.jsonl --out OUT.jsonl
                 IN: one {"id": ..., "document": ..., "questions": [...]} object a line ("id" optional).
                 OUT: one {"line", "id", "questions", "answers"} object per document ("id" where IN has one),
                 in input order, appended as documents finish.  Run again after an interruption, a run skips the
                 documents OUT holds (by id, else by line number) and appends the others.  A bad line
                 (not JSON, no document, no questions, a repeated id, a prompt longer than the model
                 takes) is reported and skipped, the other documents are answered, and the command
                 ends with a usage error (exit status 2) naming the skipped lines.
  many devices:  accelerate launch --multi_gpu --num_processes N -m hf_parallel answer --corpus IN --out OUT
                 each process answers a share of the documents (balanced by prompt tokens) on its own
                 device, appending to OUT.part-RANK; the main process then appends the parts to OUT in
                 input order.  OUT is as one process writes it; a rerun with any number of processes
                 resumes from OUT and any parts left.  Several nodes need OUT on a filesystem they share.
"""


@dataclass
class AnswerConfig:
    """One `hf-parallel answer` run; its flags map one-to-one onto these fields."""

    document: str | None = None  # a text file: the document (single-document mode)
    questions: str | None = None  # a text file: one question a line
    corpus: str | None = None  # JSON lines in (corpus mode)
    out: str | None = None  # JSON lines out, appended to and resumed from
    model: str | None = None  # a local path or hub id; default: the embedded SmolLM2-135M-Instruct
    max_new_tokens: int | None = None  # per answer; default: the model's generation_config (else 256)
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (bfloat16 on CUDA, float32 on the CPU)
    device: str | None = None  # cpu | cuda[:N]; default: cuda when available (this process's, under accelerate)
    template: str | None = None  # the user turn from "{document}" and "{question}"
    system_prompt: str | None = None
    tokens_per_call: int = TOKENS_PER_CALL  # prompt tokens per generate call (corpus mode)
    progress: bool | None = None  # a progress bar (corpus mode); default: when stderr is a terminal

    def __post_init__(self):
        from .frontends.prompting import check_template

        single, corpus = (self.document, self.questions), (self.corpus, self.out)
        if any(single) == any(corpus):
            raise ValueError("give either --document and --questions, or --corpus and --out")
        flags, values = (("--document", "--questions"), single) if any(single) else (("--corpus", "--out"), corpus)
        if not all(values):  # one of a pair: name the other
            given, missing = flags if values[0] else flags[::-1]
            raise ValueError(f"{given} needs {missing}")
        if self.document == self.questions == "-":
            raise ValueError("only one of --document and --questions can be - (standard input)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device is not None and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.template is not None:
            check_template(self.template)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hf-parallel", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="answer questions about a built-in passage with SmolLM2")
    demo.add_argument("--max-new-tokens", type=_positive_int, default=48)
    # eval's flags (and --help) belong to the evaluation runner, imported only when asked
    # for: it needs the `eval` extra (scipy, tqdm), which the demo does not.
    commands.add_parser("eval", help="answer quality: standard vs parallel vs batch prompting", add_help=False)
    answer = commands.add_parser("answer", help="answer questions about a document or a JSON-lines corpus",
                                 description=ANSWER_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    _answer_arguments(answer)
    args, rest = parser.parse_known_args(argv)
    if args.command == "eval":
        from .evaluation.quality import main as evaluate

        evaluate(rest, prog="hf-parallel eval")
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "answer":
        config = _answer_config(answer, args)
        _answer_corpus(answer, config) if config.corpus else _answer_document(answer, config)
        return
    from .frontends.demo import run

    run(max_new_tokens=args.max_new_tokens)


def _answer_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `AnswerConfig` field."""
    parser.add_argument("--document", help="text file: the document (- for standard input)")
    parser.add_argument("--questions", help="text file: one question a line (- for standard input)")
    parser.add_argument("--corpus", help="JSON-lines file: one document with its questions a line")
    parser.add_argument("--out", help="JSON-lines file the corpus's answers are appended to (and resumed from)")
    parser.add_argument("--model", help="local path or hub id (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max-new-tokens", type=_positive_int, help="per answer (default: the model's config)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="auto: bfloat16 on CUDA, float32 on the CPU")  # fmt: skip
    parser.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available; under `accelerate launch` "
                        "with several processes, each process's own device)")  # fmt: skip
    parser.add_argument("--template", help='the user turn, from "{document}" and "{question}"')
    parser.add_argument("--system-prompt", help="a system message (needs the tokenizer's chat template)")
    parser.add_argument("--tokens-per-call", type=_positive_int, default=TOKENS_PER_CALL,
                        help="most prompt tokens per generate call (corpus mode)")  # fmt: skip
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction,
                        help="a progress bar on stderr (default: when stderr is a terminal)")  # fmt: skip


def _answer_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> AnswerConfig:
    """The config from the parsed flags; a combination it refuses is a usage error (exit status 2)."""
    try:
        return AnswerConfig(**{f.name: getattr(args, f.name) for f in fields(AnswerConfig)})
    except ValueError as error:
        parser.error(str(error))


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse turns the error into a usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# --------------------------------------------------------------------------- hf-parallel answer


def _answer_document(parser: argparse.ArgumentParser, config: AnswerConfig) -> None:
    """Print each question of the questions file with its answer about the document file."""
    from .frontends.prompting import generate_parallel

    document = _read(parser, config.document, "document").strip()
    questions = [line.strip() for line in _read(parser, config.questions, "questions").splitlines() if line.strip()]
    if not document:
        parser.error(f"{_source('document', config.document)} is empty")
    if not questions:
        parser.error(f"{_source('questions', config.questions)} has no questions (one a line; blank lines are skipped)")
    model, tokenizer = _load(parser, config)
    try:
        answers = generate_parallel(model, tokenizer, document, questions, config.template, None,
                                    config.system_prompt, **_options(config))  # fmt: skip
    except ValueError as error:  # a document longer than the model takes, a system prompt without a chat template
        parser.error(str(error))
    for question, answer in zip(questions, answers):
        print(f"Q: {question}\nA: {answer}\n")


def _answer_corpus(parser: argparse.ArgumentParser, config: AnswerConfig) -> None:
    """Answer the corpus's documents that --out does not hold yet, appending each line as it finishes.

    Under `accelerate launch` with several processes each answers its share on its own device and
    appends to a part file of --out; once all are done, the main process appends the parts to --out
    in input order.  Parts left by an interrupted run are honoured the same way by one process.
    """
    from .frontends.corpus import answer_key
    from .frontends.data_parallel import answer_share, merge_parts, part_files, part_path, process_state
    from .frontends.jsonlines import append_json_lines

    state = process_state(cpu=True if (config.device or "").startswith("cpu") else None)
    # --out gets lines directly only as before: one process, no parts to put in order with them
    target = config.out if state.num_processes == 1 and not part_files(config.out) else None
    records, problems = _corpus_todo(parser, config)
    state.wait_for_everyone()  # every rank reads --out and the parts (and so splits alike) before any appends
    if records:
        if config.device is None and state.num_processes > 1:
            config = replace(config, device=str(state.device))
        if state.num_processes > 1:  # one note per process: which one, where (and that the launch made several)
            print(f"{parser.prog}: process {state.process_index} of {state.num_processes} on {config.device or 'cuda'}",
                  file=sys.stderr)  # fmt: skip
        model, tokenizer = _load(parser, config)
        records = _fitting(parser, model, tokenizer, records, config, problems)
        pairs = [(r["document"], r["questions"]) for r in records]
        render = {"template": config.template, "use_chat_template": None, "system_prompt": config.system_prompt}
        for result in answer_share(model, tokenizer, pairs, state, render, tokens_per_call=config.tokens_per_call,
                                   progress=config.progress, **_options(config)):  # fmt: skip
            append_json_lines(target or part_path(config.out, state.process_index),
                              [_answer_line(records[result.index], result.answers)])  # fmt: skip
    state.wait_for_everyone()
    if state.is_main_process:
        merge_parts(config.out, answer_key, lambda line: line["line"])
    if problems:
        lines = ", ".join(str(line) for line, _ in sorted(problems))
        parser.error(f"skipped {len(problems)} bad line(s) of {config.corpus} (line {lines}, reported above); the "
                     f"other documents' answers are in {config.out}")  # fmt: skip


def _corpus_todo(parser: argparse.ArgumentParser, config: AnswerConfig) -> tuple[list[dict], list[tuple]]:
    """The corpus's good records that neither --out nor its part files hold yet, and its bad lines
    (reported on stderr)."""
    from .frontends.corpus import answer_key, read_corpus

    try:
        records, problems = read_corpus(config.corpus)
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"cannot read the corpus {config.corpus}: {error}")
    for line, problem in problems:
        _skip(parser, config, line, problem)
    if not records and not problems:
        parser.error(f'the corpus {config.corpus} is empty (expected one {{"document", "questions"}} object a line)')
    finished = _finished(parser, config)
    questions = {answer_key(r): r["questions"] for r in records}
    for key, asked in finished.items():
        if questions.get(key) != asked:
            parser.error(f"{config.out} holds the answers of another corpus (its {key[0]} {key[1]!r} has other "
                         f"questions in {config.corpus}, or none); pass another --out or delete it")  # fmt: skip
    if finished:
        _report(parser, f"{len(finished)} document(s) already answered in {config.out}")
    return [r for r in records if answer_key(r) not in finished], problems


def _finished(parser: argparse.ArgumentParser, config: AnswerConfig) -> dict:
    """The documents --out and its part files (from an interrupted run over several processes) hold."""
    from .frontends.corpus import finished_answers
    from .frontends.data_parallel import part_files

    finished = {}
    try:
        for path in [config.out, *part_files(config.out)]:
            finished.update(finished_answers(path))
        Path(config.out).parent.mkdir(parents=True, exist_ok=True)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        parser.error(f"cannot resume from {config.out}: {error}; pass another --out or delete it")
    return finished


def _fitting(parser, model, tokenizer, records: list[dict], config: AnswerConfig, problems: list) -> list[dict]:
    """The records whose prompts fit the model's positions; each other one becomes a reported bad line."""
    from .decoding.inputs import check_tokens
    from .frontends.prompting import render_prompts

    fitting = []
    for record in records:
        try:
            prompts = render_prompts(tokenizer, record["document"], record["questions"], config.template, None,
                                     config.system_prompt)  # fmt: skip
        except ValueError as error:  # a flag the tokenizer cannot honour: a system prompt without a chat template
            parser.error(str(error))
        try:
            for j, prompt in enumerate(prompts):
                check_tokens(model, f"question {j}'s prompt", prompt, config.max_new_tokens or 0)
            fitting.append(record)
        except ValueError as error:
            problems.append((record["line"], str(error)))
            _skip(parser, config, *problems[-1])
    return fitting


def _skip(parser: argparse.ArgumentParser, config: AnswerConfig, line: int, problem: str) -> None:
    _report(parser, f"{config.corpus} line {line}: {problem}; skipped")


def _report(parser: argparse.ArgumentParser, message: str) -> None:
    """A note on stderr, from the main process only: every process of a launch finds the same."""
    from .frontends.data_parallel import process_state

    if process_state().is_main_process:
        print(f"{parser.prog}: {message}", file=sys.stderr)


def _answer_line(record: dict, answers: list) -> dict:
    line = {"line": record["line"], "id": record["id"], "questions": record["questions"], "answers": answers}
    return line if record["id"] is not None else {k: v for k, v in line.items() if k != "id"}


def _read(parser: argparse.ArgumentParser, path: str, what: str) -> str:
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"cannot read {_source(what, path)}: {error}")


def _source(what: str, path: str) -> str:
    return f"the {what} from standard input" if path == "-" else f"the {what} file {path}"


def _load(parser: argparse.ArgumentParser, config: AnswerConfig):
    """(model, tokenizer): --model from a local path or the hub, else the embedded SmolLM2."""
    import torch

    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    try:
        if config.model is None:
            from .frontends.default_model import load_smollm2

            return load_smollm2(getattr(torch, dtype), device)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model)
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=getattr(torch, dtype), device_map=device)
        return model.eval(), tokenizer
    except (OSError, ValueError, ImportError) as error:  # no such path or hub id, offline, a missing package
        parser.error(f"cannot load the model {config.model or 'SmolLM2-135M-Instruct'}: {error}")


def _options(config: AnswerConfig) -> dict:
    return {} if config.max_new_tokens is None else {"max_new_tokens": config.max_new_tokens}
