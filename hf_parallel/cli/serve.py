"""`hf-parallel serve` (an OpenAI-compatible HTTP server) and `hf-parallel batch` (an OpenAI batch file).

Both load one model, start one `Engine` over it and send every request to it, so requests that share
a document or a system prompt share its computation.  The flags and help import no torch, engine or
server: those load inside the commands, so that `hf-parallel --help` answers at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ..decoding.sizes import parse_memory
from ..frontends.model_loading import DEFAULT_NAME, MODEL_HELP
from ..kernels.notices import silenced
from .answer import ATTENTION, DTYPES
from .usage import UsageParser, add_threads_argument, positive_int

SERVE_HELP = """\
An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (streamed or not), /v1/models,
/health and /metrics.  Concurrent requests become streams of one packed row: a document or system prompt
that several requests share is computed once, and every answer is what the model writes for its prompt alone.

  hf-parallel serve --port 8000
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8}'

On SIGTERM (or Ctrl-C) it drains: /health and new requests answer 503 (a load balancer takes it out of rotation)
while the requests in flight finish, for --grace seconds at most; then it exits 0.
"""
BATCH_HELP = """\
Answer an OpenAI Batch API file: one {"custom_id", "method": "POST", "url": "/v1/chat/completions" or
"/v1/completions", "body"} object a line.  OUT gets one {"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"} line per input line, appended as each finishes: in finishing order (custom_id
says which line it answers), or with --sort rewritten in input order at the end.  Lines that share a prefix are
grouped whatever their order.  Run again after an interruption, it answers only the lines OUT lacks, and with
none left it loads no model.

A bad line becomes an error line (error set, or a response whose status_code is not 200) and the others
complete, as in OpenAI's Batch API and vLLM's run_batch: the exit status is 0 once OUT has a line for every
input line, error lines included, and a summary line on stderr counts the failed ones; 2 for a usage error
(a bad flag, no input file, a model that cannot load), 130 when interrupted.

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
        "--progress",
        action=argparse.BooleanOptionalAction,
        help="progress bars on stderr: loading the model (batch: and answering) (default: when stderr is a terminal)",
    )
    parser.add_argument(
        "--max-memory",
        default=None,
        metavar="SIZE",
        help="what the packed row may take, such as 40GiB (default: half what the GPU has free; on the CPU 512MiB; "
        "either, at least one request of the model's whole context)",
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
    parser.add_argument(
        "--prompt-lookup-num-tokens",
        type=positive_int,
        default=None,
        metavar="K",
        help="every request's streams draft up to K tokens a forward from their own prompt and answer, verified in "
        "the same forward (the same answers in fewer forwards); a request's own prompt_lookup_num_tokens field "
        "overrides it, null turning drafts off (default: no drafts)",
    )
    add_threads_argument(parser)  # `hf-parallel` itself takes it, before these flags: here for --help

    parser.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="the order waiting requests are admitted in: fcfs, first come first served; priority, by each request's "
        "priority field (lower first), then first come first served (default: fcfs)",
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
        "--max-body",
        default="4MiB",
        metavar="SIZE",
        help="the largest request body, such as 4MiB; past it a request gets 413 before its body is read "
        "(default: 4MiB)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may take to finish while /health answers 503 (default: 30)",
    )


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--input", required=True, metavar="IN.jsonl", help="the batch file")
    parser.add_argument("--output", required=True, metavar="OUT.jsonl", help="appended to and resumed from")
    parser.add_argument("--sort", action="store_true", help="once every line is answered, rewrite OUT in input order")
    parser.add_argument("--quiet", action="store_true", help="nothing on stderr but errors: no bars, no summary")


def serve(parser: UsageParser, args: argparse.Namespace) -> None:
    """`hf-parallel serve`: until SIGTERM or Ctrl-C, then exit 0."""
    max_body = _size(parser, "--max-body", args.max_body)  # the flags before torch loads: a mistake answers at once
    if args.max_memory is not None:
        _size(parser, "--max-memory", args.max_memory)
    try:
        import uvicorn  # optional: the `serve` extra

        from ..server.app import create_app  # optional: FastAPI, of the `serve` extra
        from ..server.draining import DrainingServer  # optional: uvicorn, of the `serve` extra
    except ImportError as error:
        parser.fail(f"hf-parallel serve needs FastAPI and uvicorn ({error}): pip install 'hf-parallel[serve]'")
    try:
        engine, tokenizer, name = _engine(parser, args, max_queue=args.max_queue)
    except KeyboardInterrupt:
        parser.interrupted("the server had not started")
    app = create_app(engine, tokenizer, name, api_key=args.api_key, max_n=args.max_n, max_body=max_body)
    config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=args.grace)
    server = DrainingServer(config, args.grace, _banner(engine, name, args.attn))
    # after its shutdown uvicorn raises the signals it handled again, under the handlers it found: ones that do
    # nothing, so that a graceful shutdown exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    engine.close(args.grace)


def batch(parser: UsageParser, args: argparse.Namespace) -> None:
    """`hf-parallel batch`: every line of --input answered into --output (BATCH_HELP); no model loaded where every
    line is answered already.  Exit status 0 once every line has an output line, error lines included."""
    if args.quiet and args.progress:
        parser.fail("--quiet hides the progress bars that --progress asks for: give one of them")
    with silenced(args.quiet):
        _batch(parser, args)


def _batch(parser: UsageParser, args: argparse.Namespace) -> None:
    if not os.path.exists(args.input):
        parser.fail(f"--input {args.input}: no such file")
    if args.max_memory is not None:
        _size(parser, "--max-memory", args.max_memory)
    # start-up: the server and the engine load only once the flags are checked (module docstring)
    from ..server.batch import Summary, run_batch, sort_output, tally, unanswered

    summary = Summary()
    todo, summary.skipped = unanswered(args.input, args.output)
    if todo:
        engine = None
        try:
            engine, tokenizer, name = _engine(parser, args, max_queue=sys.maxsize)
            progress = False if args.quiet else args.progress
            summary = run_batch(engine, tokenizer, name, args.input, args.output, max_n=args.max_n, progress=progress)
        except KeyboardInterrupt:
            parser.interrupted(f"the answered lines are in {args.output}; run again to answer the rest")
        finally:
            if engine is not None:
                engine.close(1)
    if args.sort:
        sort_output(args.input, args.output)
    lines, failed = tally(args.output)
    if args.quiet:
        return
    print(
        f"{summary.answered} lines answered now, {summary.skipped} already in {args.output}; "
        f"{failed} of its {lines} lines failed (error set, or a status_code other than 200)",
        file=sys.stderr,
    )


def _engine(parser: UsageParser, args: argparse.Namespace, max_queue: int):
    """(Engine, tokenizer, served name) from the model flags; a usage error where they cannot be met."""
    # start-up: torch, transformers and the engine load only when a command runs
    from ..frontends.serving import Engine
    from .answer import load_named  # start-up, as above

    progress = False if getattr(args, "quiet", False) else args.progress
    model, tokenizer = load_named(parser, args.model, args.dtype, args.device, args.attn, progress)
    name = args.served_model_name or args.model or DEFAULT_NAME
    try:
        engine = Engine(
            model,
            max_memory=args.max_memory,
            max_streams=args.max_streams,
            max_queue=max_queue,
            prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
            scheduling=args.scheduling_policy,
            attn=args.attn,
        )
    except (ValueError, NotImplementedError) as error:
        parser.fail(str(error))
    return engine, tokenizer, name


def _size(parser: UsageParser, flag: str, text: str) -> int:
    """Bytes of a size flag (such as 4MiB); a usage error for one that is no size."""
    try:
        size = parse_memory(text)
    except ValueError:
        size = 0
    if size < 1:
        parser.fail(f"{flag} {text!r}: expected a size such as 4MiB, 40GiB or 500KB")
    return size


def _banner(engine, name: str, attn: str) -> str:
    """What the server serves, as its start-up line says it: the model, dtype, device, attention path and row."""
    from ..attention import BACKENDS, resolve_backend  # start-up: it imports torch

    model = engine.model
    backend = resolve_backend(attn, model.device)
    path = next((key for key, value in BACKENDS.items() if value is backend), type(backend).__name__)
    dtype = str(model.dtype).removeprefix("torch.")
    return f"Serving {name} ({dtype}, {model.device}, attention {path}, a row of {engine.counters.capacity} tokens)"
