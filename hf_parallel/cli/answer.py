"""`hf-parallel answer`: its flags (one per `AnswerConfig` field), and one document's questions answered.

A corpus (`--corpus`) is `hf_parallel.cli.corpus`'s.  This module imports nothing heavy at its top: torch,
transformers and the engine load only once the flags are checked, so that `--help` and a mistake in
the flags answer at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, fields

from ..decoding.sizes import parse_memory
from ..frontends.model_loading import MODEL_HELP, ModelSourceError, load_model, placement
from ..frontends.progress import shown
from ..frontends.templates import check_template
from .usage import UsageParser, positive_int

HELP = """\
Answer questions about documents with parallel prompting.

  one document:  hf-parallel answer --document DOC.txt --questions QUESTIONS.txt
                 (one question a line, blank lines skipped); prints each question and its answer (--json:
                 one {"questions", "answers"} object).  Either file may be - for standard input.
  a corpus:      hf-parallel answer --corpus IN.jsonl [--out OUT.jsonl]
                 IN: one {"id": ..., "document": ..., "questions": [...]} object a line ("id" optional).
                 OUT (standard output without --out): one {"line", "id", "questions", "answers", "model",
                 "options"} object per document ("id" where IN has one), written as soon as the document's
                 last answer is done, so in the order documents finish.  Run again after an interruption,
                 a run skips the documents OUT holds (by id, else by line number) and appends the others;
                 an OUT that another model or other options wrote is refused unless --force is given.  A bad
                 line (not JSON, no document, no questions, a repeated id, a prompt longer than the model
                 takes) is reported and skipped, the other documents are answered, and the command ends
                 with a usage error (exit status 2) naming the skipped lines.
  many devices:  accelerate launch --multi_gpu --num_processes N -m hf_parallel answer --corpus IN --out OUT
                 each process answers a share of the documents (balanced by prompt tokens) on its own
                 device, appending to OUT.part-RANK; the main process then appends the parts to OUT in
                 input order.  OUT is as one process writes it; a rerun with any number of processes
                 resumes from OUT and any parts left.  Several nodes need OUT on a filesystem they share.
  a Ray cluster: hf-parallel answer --corpus IN --out OUT --ray [ADDRESS] [--ray-actors N]
                 (the `ray` extra) a pool of N actors, a model each, answers batches of --ray-batch-size
                 documents; Ray restarts an actor that dies and retries its batches.  IN: a JSON-lines or
                 Parquet file or a folder of them; OUT: a JSON-lines file (.jsonl), or a folder that Ray's
                 write tasks write JSON-lines files into (Parquet where its name ends in .parquet).  Its
                 lines are one process's, in the order batches finish (--sort: input order); a rerun resumes.

Decoding is the model's generation_config's (greedy for SmolLM2) unless --temperature or --top-p is given:
--temperature 0 decodes greedily, a temperature above 0 or a --top-p samples (with --seed, reproducibly).

The embedded SmolLM2 is converted from its GGUF file once, into ~/.cache/hf_parallel (HF_HOME's, where
HF_HOME is set); later starts load it from there.
"""
# spelled out rather than imported, so that --help imports no torch; tests/cli/test_cli_answer.py keeps them equal to
# hf_parallel.attention.BACKENDS, decoding.options.DEFAULT_MAX_NEW_TOKENS and frontends.corpus.TOKENS_PER_CALL
ATTENTION = ("auto", "reference", "triton")
DEFAULT_MAX_NEW_TOKENS = 256
TOKENS_PER_CALL = 65536
DTYPES = ("auto", "float32", "bfloat16", "float16")
RAY_FLAGS = ("ray_actors", "ray_gpus_per_actor", "ray_cpus_per_actor", "ray_batch_size")
RAY_BATCH_SIZE = 32  # spelled out as TOKENS_PER_CALL is: hf_parallel.ray.corpus.Cluster's batch_size


@dataclass
class AnswerConfig:
    """One `hf-parallel answer` run; its flags map one-to-one onto these fields.

    attn, max_memory, prefill_chunk, seed, temperature, top_p and max_new_tokens reach the generate call
    as the generation options of the same names (`generation_options`).
    """

    document: str | None = None  # a text file: the document (single-document mode)
    questions: str | None = None  # a text file: one question a line
    corpus: str | None = None  # JSON lines in (corpus mode)
    out: str | None = None  # JSON lines out, appended to and resumed from; default: standard output
    model: str | None = None  # a model directory or hub id; default: the embedded SmolLM2-135M-Instruct
    max_new_tokens: int | None = None  # per answer; default: the model's generation_config, else 256
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (bfloat16 on CUDA, float32 on the CPU)
    device: str | None = None  # cpu | cuda[:N]; default: cuda when available (this process's, under accelerate)
    attn: str = "auto"  # auto | reference | triton
    max_memory: str | None = None  # what the packed row may take, such as "40GiB"; default: what is free
    prefill_chunk: int | None = None  # most prompt tokens per forward; default: the attention path's
    temperature: float | None = None  # 0: greedy decoding; above 0: sampling at this temperature
    top_p: float | None = None  # sampling from the smallest set of tokens whose probabilities reach top_p
    seed: int | None = None  # the sampling generator's seed; default: torch's global generator
    prompt_lookup_num_tokens: int | None = None  # draft tokens a stream offers each forward (speculative decoding)
    template: str | None = None  # the user turn from "{document}" and "{question}"
    system_prompt: str | None = None
    tokens_per_call: int = TOKENS_PER_CALL  # prompt tokens per generate call (corpus mode)
    progress: bool | None = None  # progress bars on stderr; default: when stderr is a terminal
    quiet: bool = False  # nothing on stderr but errors: no progress bars, notes or summary
    threads: int | None = None  # CPU threads torch computes on; default: `frontends.threads` chooses
    json: bool = False  # one document's answers as one JSON object (single-document mode)
    force: bool = False  # resume an --out that another model or other options wrote (corpus mode)
    sort: bool = False  # once every document is answered, rewrite --out in input order (corpus mode)
    ray: str | None = None  # on a Ray cluster: "" (one running here, else a new local one), "auto" or an address
    ray_actors: int | None = None  # model replicas on the cluster; default 1
    ray_gpus_per_actor: float | None = None  # default: 1 where the cluster has GPUs, else 0
    ray_cpus_per_actor: float | None = None  # default: 1
    ray_batch_size: int | None = None  # documents per batch, one engine call each; default RAY_BATCH_SIZE

    def __post_init__(self):
        self._check_inputs()
        self._check_generation()

    def _check_inputs(self) -> None:
        single = (self.document, self.questions)
        if any(single) == bool(self.corpus or self.out):
            raise ValueError("give either --document and --questions, or --corpus (and --out)")
        if any(single) and not all(single):  # one of a pair: name the other
            given, missing = ("--document", "--questions") if self.document else ("--questions", "--document")
            raise ValueError(f"{given} needs {missing}")
        if self.out and not self.corpus:
            raise ValueError("--out needs --corpus")
        self._check_modes()
        if self.document == self.questions == "-":
            raise ValueError("only one of --document and --questions can be - (standard input)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device is not None and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.template is not None:
            check_template(self.template)

    def _check_modes(self) -> None:
        self._check_ray()
        if self.sort and not self.out:
            raise ValueError("--sort rewrites --out in input order: give --out")
        if self.json and self.corpus:
            raise ValueError("--json is for one document (--document); a corpus's output is JSON lines already")
        if self.force and not self.out:
            raise ValueError("--force resumes an --out that another model or other options wrote: give --out")
        if self.quiet and self.progress:
            raise ValueError("--quiet hides the progress bars that --progress asks for: give one of them")

    def _check_ray(self) -> None:
        given = [name for name in RAY_FLAGS if getattr(self, name) is not None]
        if given and self.ray is None:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --ray")
        if self.ray is None:
            return
        if not self.corpus or not self.out:
            raise ValueError("--ray answers a corpus into a file or folder: give --corpus and --out")
        if self.device is not None and self.device not in ("cpu", "cuda"):
            raise ValueError(f"--ray: each actor runs on the GPU Ray gives it: --device cpu or cuda, not {self.device}")
        for name in ("ray_actors", "ray_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("ray_gpus_per_actor", "ray_cpus_per_actor"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def _check_generation(self) -> None:
        if self.attn not in ATTENTION:
            raise ValueError(f"attn must be one of {', '.join(ATTENTION)}, got {self.attn!r}")
        if self.max_memory is not None:
            if parse_memory(self.max_memory) < 1:
                raise ValueError(f"max_memory must be positive, got {self.max_memory!r}")
        for name in ("max_new_tokens", "prefill_chunk", "tokens_per_call", "prompt_lookup_num_tokens", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature == 0 and self.top_p is not None:
            raise ValueError("--top-p samples, and --temperature 0 decodes greedily: give one of them")

    def generation_options(self) -> dict:
        """The generation options the fields set; the model's generation_config decides the others.

        A temperature above 0 or a top_p turns sampling on (do_sample=True); temperature 0 turns it off.
        """
        sampling = {} if self.temperature is None and self.top_p is None else {"do_sample": self.temperature != 0}
        options = {
            "max_new_tokens": self.max_new_tokens,
            "attn": self.attn,
            "max_memory": self.max_memory,
            "prefill_chunk": self.prefill_chunk,
            "seed": self.seed,
            "temperature": self.temperature or None,  # 0 means greedy, which do_sample=False says
            "top_p": self.top_p,
            "prompt_lookup_num_tokens": self.prompt_lookup_num_tokens,
        }
        return {name: value for name, value in options.items() if value is not None} | sampling

    def shows_progress(self) -> bool:
        """Whether progress bars go to stderr: --progress, else not under --quiet, else when stderr is a terminal."""
        return False if self.quiet else shown(self.progress)


def add_arguments(parser: UsageParser) -> None:
    """One flag per `AnswerConfig` field."""
    add = parser.add_argument
    add("--document", metavar="FILE", help="text file: the document (- for standard input)")
    add("--questions", metavar="FILE", help="text file: one question a line (- for standard input)")
    add("--corpus", metavar="FILE", help="JSON-lines file: one document with its questions a line")
    add(
        "--out",
        metavar="FILE",
        help="JSON-lines file the corpus's answers are appended to and resumed from (default: standard output)",
    )
    add("--model", metavar="DIR_OR_HUB_ID", help=MODEL_HELP)
    add(
        "--max-new-tokens",
        type=positive_int,
        metavar="N",
        help="per answer (default: the model's generation_config max_new_tokens, else its max_length less the "
        f"prompt, else {DEFAULT_MAX_NEW_TOKENS})",
    )
    add("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on CUDA, float32 on the CPU (default: auto)")
    add(
        "--device",
        metavar="DEVICE",
        help="cpu or cuda[:N] (default: cuda when available; under `accelerate launch` with several processes, "
        "each process's own device)",
    )
    add(
        "--attn",
        choices=ATTENTION,
        default="auto",
        help="attention path; auto: triton on CUDA, else reference (default: auto)",
    )
    add(
        "--max-memory",
        metavar="SIZE",
        help="most memory the packed row may take, such as 40GiB or 500MB (default: what is free)",
    )
    add(
        "--prefill-chunk",
        type=positive_int,
        metavar="N",
        help="most prompt tokens per forward (default: the attention path's)",
    )
    add("--temperature", type=float, metavar="T", help="0: greedy decoding; above 0: sampling at this temperature")
    add(
        "--top-p",
        type=float,
        metavar="P",
        help="sampling from the most likely tokens whose probabilities reach P, in (0, 1]",
    )
    add("--seed", type=int, metavar="N", help="the sampling's seed, for answers that repeat from run to run")
    add(
        "--prompt-lookup-num-tokens",
        type=positive_int,
        metavar="N",
        help="speculative decoding: each answer drafts up to N tokens from its own prompt and answer, verified in "
        "the same forward (the same answers, fewer forwards; default: off)",
    )
    add("--template", metavar="TEXT", help='the user turn, from "{document}" and "{question}"')
    add("--system-prompt", metavar="TEXT", help="a system message (needs the tokenizer's chat template)")
    add(
        "--tokens-per-call",
        type=positive_int,
        metavar="N",
        default=TOKENS_PER_CALL,
        help=f"most prompt tokens per generate call (corpus mode; default: {TOKENS_PER_CALL})",
    )
    add(
        "--progress",
        action=argparse.BooleanOptionalAction,
        help="progress bars on stderr: loading the model, answering (default: when stderr is a terminal)",
    )
    add("--quiet", action="store_true", help="nothing on stderr but errors: no progress bars, notes or summary")
    add("--json", action="store_true", help='one document: print one {"questions", "answers"} JSON object')
    add(
        "--force",
        action="store_true",
        help="corpus mode: add to an --out that another model or other options wrote (default: refuse it)",
    )
    add(
        "--sort", action="store_true", help="corpus mode: once every document is answered, rewrite --out in input order"
    )
    add(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="corpus mode: answer on a Ray cluster (the `ray` extra): auto, an address, or, without one, a cluster "
        "running here, else a new local one",
    )
    add("--ray-actors", type=positive_int, metavar="N", help="--ray: model replicas, one actor each (default: 1)")
    add(
        "--ray-gpus-per-actor",
        type=float,
        metavar="G",
        help="--ray: GPUs each actor takes; a fraction packs several on a GPU (default: 1 where the cluster has GPUs)",
    )
    add("--ray-cpus-per-actor", type=float, metavar="C", help="--ray: CPUs each actor takes (default: 1)")
    add(
        "--ray-batch-size",
        type=positive_int,
        metavar="N",
        help=f"--ray: documents per batch, answered in one call (default: {RAY_BATCH_SIZE})",
    )


def config_from(parser: UsageParser, args: argparse.Namespace) -> AnswerConfig:
    """The config from the parsed flags; a combination it refuses is a usage error (exit status 2)."""
    try:
        return AnswerConfig(**{f.name: getattr(args, f.name) for f in fields(AnswerConfig)})
    except ValueError as error:
        parser.error(str(error))


def answer_document(parser: UsageParser, config: AnswerConfig) -> None:
    """Print each question of the questions file with its answer about the document file."""
    try:
        document = _read(parser, config.document, "document").strip()
        questions = [line.strip() for line in _read(parser, config.questions, "questions").splitlines()]
        questions = [question for question in questions if question]
        if not document:
            parser.fail(f"{_source('document', config.document)} is empty")
        if not questions:
            parser.fail(f"{_source('questions', config.questions)} has no questions (one a line; blank lines skipped)")
        model, tokenizer = load(parser, config)
        from ..frontends.prompting import generate_parallel  # start-up: torch once the files are read

        render = (config.template, None, config.system_prompt)
        options = {"progress": config.shows_progress(), **config.generation_options()}
        answers = generate_parallel(model, tokenizer, document, questions, *render, **options)
    except (ValueError, NotImplementedError) as error:  # a document longer than the model takes, a model refused
        parser.fail(str(error))
    except KeyboardInterrupt:
        parser.interrupted("nothing was saved (the answers are printed once all are done)")
    if config.json:
        print(json.dumps({"questions": questions, "answers": answers}, ensure_ascii=False))
        return
    for question, answer in zip(questions, answers):
        print(f"Q: {question}\nA: {answer}\n")


def _read(parser: UsageParser, path: str, what: str) -> str:
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as error:
        parser.fail(f"cannot read {_source(what, path)}: {error}")


def _source(what: str, path: str) -> str:
    return f"the {what} from standard input" if path == "-" else f"the {what} file {path}"


def load(parser: UsageParser, config: AnswerConfig):
    """(model, tokenizer) of the config's --model, --dtype, --device, --attn and progress (`load_named`)."""
    return load_named(parser, config.model, config.dtype, config.device, config.attn, config.shows_progress())


def load_named(
    parser: UsageParser, model: str | None, dtype: str, device: str | None, attn: str, progress: bool | None = None
):
    """(model, tokenizer): `model`, else the embedded SmolLM2, in `dtype` ("auto": bfloat16 on CUDA, float32 on the
    CPU) on `device` (None: cuda when there is one); a usage error where the model cannot be loaded or `attn` cannot
    run on the device.  progress: the loading's progress bars (None: when stderr is a terminal)."""
    import torch  # start-up: --help and a mistake in the flags import no torch

    device, dtype = placement(device, dtype)
    if attn == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.fail("--attn triton runs on CUDA; on the CPU, pass --attn reference (or auto)")
    try:
        return load_model(model, getattr(torch, dtype), device, progress)
    except ModelSourceError as error:
        parser.fail(str(error))
