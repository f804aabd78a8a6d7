"""The command line: `hf-parallel demo` (also `python -m hf_parallel demo`)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hf-parallel", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="answer questions about a built-in passage with SmolLM2")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        run(max_new_tokens=args.max_new_tokens)
