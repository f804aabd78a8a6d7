"""The command line: `hf-parallel demo` and `hf-parallel eval` (also `python -m hf_parallel ...`)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hf-parallel", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="answer questions about a built-in passage with SmolLM2")
    demo.add_argument("--max-new-tokens", type=_positive_int, default=48)
    # eval's flags (and --help) belong to the evaluation runner, imported only when asked
    # for: it needs the `eval` extra (scipy, tqdm), which the demo does not.
    commands.add_parser("eval", help="answer quality: standard vs parallel vs batch prompting", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "eval":
        from .evaluation.quality import main as evaluate

        evaluate(rest, prog="hf-parallel eval")
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from .demo import run

    run(max_new_tokens=args.max_new_tokens)


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse turns the error into a usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
