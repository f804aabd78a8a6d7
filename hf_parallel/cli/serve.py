"""`hf-parallel serve` (an OpenAI-compatible HTTP server) and `hf-parallel batch` (an OpenAI batch file).

Both load one model, start one `Engine` over it and send every request to it, so requests that share
a document or a system prompt share its computation.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ..decoding.options import parse_memory
from ..engine.serving import Engine
from ..frontends.model_loading import DEFAULT_NAME, MODEL_HELP
from ..server.batch import run_batch
from .answer import ATTENTION, DTYPES, load_named
from .usage import UsageParser, positive_int

SERVE_HELP = """\
An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (streamed or not), /v1/models,
/health and /metrics.  Concurrent requests become streams of one packed row: a document or system prompt
that several requests share is computed once, and every answer is what the model writes for its prompt alone.

  hf-parallel serve --port 8000
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8}'

On SIGTERM (or Ctrl-C) it takes no new requests, lets those in flight finish for --grace seconds, and exits 0.
"""
BATCH_HELP = """\
Answer an OpenAI Batch API file: one {"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body"} object a line.  OUT gets one {"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"} line per input line, appended as each finishes.  Lines that share a prefix are
grouped whatever their order; a bad line becomes an error line and the others complete; run again after an
interruption, it answers only the lines OUT lacks.

  hf-parallel batch --input requests.jsonl --output results.jsonl
"""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `serve` and `batch` share: the model and its row."""
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help=f"the model's name in requests and /v1/models (default: --model, else {DEFAULT_NAME})",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on CUDA, float32 on the CPU (default: auto)"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    parser.add_argument(
        "--max-memory",
        default=None,
        metavar="SIZE",
        help="what the packed row may take, such as 40GiB (default: half what the GPU has free; on the CPU 512MiB)",
    )
    parser.add_argument(
        "--max-streams",
        type=positive_int,
        default=256,
        metavar="N",
        help="most streams decoding at once (default: 256)",
    )
    parser.add_argument(
        "--max-n", type=positive_int, default=16, metavar="N", help="most choices (n) per request (default: 16)"
    )
    parser.add_argument(
        "--attn",
        choices=ATTENTION,
        default="auto",
        help="attention path (default: auto: triton on CUDA, else reference)",
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("HF_PARALLEL_API_KEY"),
        help="when set, /v1/ requests need 'Authorization: Bearer KEY' (else 401); default: $HF_PARALLEL_API_KEY",
    )
    parser.add_argument(
        "--max-queue",
        type=positive_int,
        default=1024,
        metavar="N",
        help="most requests waiting for room; past it a request gets 429 (default: 1024)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may take to finish (default: 30)",
    )


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--input", required=True, metavar="IN.jsonl", help="the batch file")
    parser.add_argument("--output", required=True, metavar="OUT.jsonl", help="appended to and resumed from")


def serve(parser: UsageParser, args: argparse.Namespace) -> None:
    """`hf-parallel serve`: until SIGTERM or Ctrl-C, then exit 0."""
    try:
        import uvicorn  # optional: the `serve` extra

        from ..server.app import create_app  # optional: FastAPI, of the `serve` extra
    except ImportError as error:
        parser.fail(f"hf-parallel serve needs FastAPI and uvicorn ({error}): pip install 'hf-parallel[serve]'")

    engine, tokenizer, name = _engine(parser, args, max_queue=args.max_queue)
    app = create_app(engine, tokenizer, name, api_key=args.api_key, max_n=args.max_n)
    config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=args.grace)
    server = uvicorn.Server(config)
    # uvicorn handles SIGTERM by shutting down gracefully, then raises it again under the handler it found: a
    # handler that does nothing, so that a graceful shutdown exits 0
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    engine.close(args.grace)


def batch(parser: UsageParser, args: argparse.Namespace) -> None:
    """`hf-parallel batch`: every line answered; exit 0 when every line has an answer (4xx ones included)."""
    if not os.path.exists(args.input):
        parser.fail(f"--input {args.input}: no such file")
    engine, tokenizer, name = _engine(parser, args, max_queue=sys.maxsize)
    try:
        summary = run_batch(engine, tokenizer, name, args.input, args.output, max_n=args.max_n)
    except KeyboardInterrupt:
        parser.interrupted(f"the answered lines are in {args.output}; run again to answer the rest")
    finally:
        engine.close(1)
    print(
        f"{summary.answered} lines answered ({summary.failed} with an error), {summary.skipped} already in "
        f"{args.output}",
        file=sys.stderr,
    )


def _engine(parser: UsageParser, args: argparse.Namespace, max_queue: int):
    """(Engine, tokenizer, served name) from the model flags; a usage error where they cannot be met."""
    if args.max_memory is not None:
        try:
            parse_memory(args.max_memory)
        except ValueError as error:
            parser.fail(f"--max-memory: {error}")
    model, tokenizer = load_named(parser, args.model, args.dtype, args.device, args.attn)
    name = args.served_model_name or args.model or DEFAULT_NAME
    try:
        engine = Engine(
            model, max_memory=args.max_memory, max_streams=args.max_streams, max_queue=max_queue, attn=args.attn
        )
    except (ValueError, NotImplementedError) as error:
        parser.fail(str(error))
    return engine, tokenizer, name
