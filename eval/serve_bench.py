"""Load benchmark of OpenAI-compatible servers: `hf-parallel serve` beside `transformers serve`, in one run.

The workload is SGLang's generated-shared-prefix one (`bench_serving.py --dataset-name generated-shared-prefix`),
built as SGLang builds it: `--groups` system prompts of `--system-len` random token ids and `--groups` x
`--prompts-per-group` questions of `--question-len`, each decoded to text with the served model's tokenizer; a
prompt is system prompt + "\\n\\n" + question; requests shuffled (`--seed`).  `--requests N` cycles it to N.

Every request is a streamed `/v1/completions` call, `max_tokens` = `--output-len`, `temperature` 0, at most
`--concurrency` in flight (0 or `all`: every request at once).  Per server: requests, errors, wall time,
requests/s, output tokens/s (output tokens from the stream's `usage`, else its chunks), time to first token and
end-to-end latency (p50, p99), prompt tokens sent and found resident (`usage.prompt_tokens_details.cached_tokens`),
and what the server's `/metrics` counted during the run.  Every wait is bounded (`--timeout`, `--deadline`,
`--startup-timeout`), so a run always ends.

`--servers hf-parallel,transformers` starts each server on 127.0.0.1 (a free port), waits for `/health`, sends
one untimed warm-up request, runs the workload, stops it (SIGTERM to its process group, SIGKILL after
`--grace`), then the next; `--url` runs against a server already running.  Each server's output goes to
`--out`/NAME.log; the figures to `--out`/results.json and `--out`/results.md, with the command line.

`--make-model DIR --shape NAME` writes a model folder both servers load: `smollm2` (the embedded
SmolLM2-135M-Instruct as safetensors, with its tokenizer), or random bf16 weights at a real shape (`qwen2.5-7b`,
`llama-2-7b`, ..., built on the GPU where there is one) with SmolLM2's tokenizer (`--tokenizer DIR` for another),
retrained at the model's vocabulary size where it has more tokens than that.

    python eval/serve_bench.py --make-model /tmp/smollm2 --shape smollm2
    python eval/serve_bench.py --model /tmp/smollm2 --servers hf-parallel,transformers --out /tmp/serve \\
        --groups 4 --prompts-per-group 4 --system-len 256 --question-len 32 --output-len 16 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import itertools
import json
import math
import os
import random
import re
import resource
import shlex
import signal
import socket
import subprocess
import sys
import time
import typing
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the package, from a clone (eval/'s bench.py is beside this file)
from bench import SHAPES as BENCH_SHAPES  # noqa: E402

from hf_parallel.frontends.default_model import SMOLLM2_GGUF, load_smollm2, smollm2_dir  # noqa: E402

SHAPES = {
    **BENCH_SHAPES,
    "llama-2-7b": lambda: transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
}  # fmt: skip
HOST = "127.0.0.1"
NO_TIMEOUT = aiohttp.ClientTimeout(total=None)  # aiohttp's default gives up at 5 minutes: `--timeout` bounds a request


@dataclass
class Request:
    prompt: str
    prompt_len: int  # tokens, as the tokenizer encodes the prompt
    output_len: int


@dataclass
class Outcome:
    ttft_s: float = float("nan")
    latency_s: float = float("nan")
    output_tokens: int = 0
    prompt_tokens: int = 0  # from usage; 0 where the server sent none
    cached_tokens: int = 0
    error: str = ""


# -- workload --


def gen_prompt(tokenizer, token_ids: list[int], length: int, rng: random.Random) -> str:
    """SGLang's `gen_prompt`: `length` ids drawn from the whole vocabulary (special tokens included), decoded."""
    return tokenizer.decode(rng.choices(token_ids, k=length))


def vocabulary(tokenizer) -> list[int]:
    """Every id of `tokenizer`, sorted: SGLang takes `get_vocab()`'s order, which a fast tokenizer changes from one
    process to the next, so its prompts differ from run to run under one seed."""
    return sorted(tokenizer.get_vocab().values())


def shared_prefix_workload(tokenizer, groups: int, per_group: int, system_len: int, question_len: int,
                           output_len: int, seed: int) -> list[Request]:  # fmt: skip
    """SGLang's `sample_generated_shared_prefix_requests`: the same draws in the same order (from the sorted
    vocabulary), then shuffled."""
    rng = random.Random(seed)
    token_ids = vocabulary(tokenizer)
    systems = [gen_prompt(tokenizer, token_ids, system_len, rng) for _ in range(groups)]
    questions = [gen_prompt(tokenizer, token_ids, question_len, rng) for _ in range(groups * per_group)]
    prompts = [f"{systems[g]}\n\n{questions[g * per_group + i]}" for g in range(groups) for i in range(per_group)]
    lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    requests = [Request(p, n, output_len) for p, n in zip(prompts, lengths)]
    rng.shuffle(requests)
    return requests


def warmup_request(tokenizer, prompt_len: int, output_len: int, seed: int) -> Request:
    """A prompt as long as the workload's that shares no prefix with it: the timed run starts with nothing resident
    but what the warm-up leaves."""
    rng = random.Random(f"warm-up {seed}")
    return Request(gen_prompt(tokenizer, vocabulary(tokenizer), prompt_len, rng), prompt_len, output_len)


def load_tokenizer(path: str | None):
    """The tokenizer of a model folder (or hub id), else the embedded SmolLM2's."""
    if path is None:
        return transformers.AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)
    return transformers.AutoTokenizer.from_pretrained(path)


# -- client --


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict, timeout: float) -> Outcome:
    """One streamed `/v1/completions` call, timed from sending; any failure is the outcome's `error`."""
    out, chunks, start = Outcome(), 0, time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with session.post(f"{url}/v1/completions", json=body) as response:
                if response.status != 200:
                    out.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                    return out
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        out.error = f"stream error: {str(event['error'])[:300]}"
                        return out
                    if any(choice.get("text") for choice in event.get("choices") or []):
                        chunks += 1
                        if chunks == 1:
                            out.ttft_s = time.perf_counter() - start
                    read_usage(out, event.get("usage"))
        out.latency_s = time.perf_counter() - start
        out.output_tokens = out.output_tokens or chunks
    except TimeoutError:
        out.error = f"timeout after {timeout:.0f} s"
    except (aiohttp.ClientError, ValueError) as err:
        out.error = f"{type(err).__name__}: {err}"[:300]
    return out


def read_usage(out: Outcome, usage: dict | None) -> None:
    if usage:
        out.output_tokens = usage.get("completion_tokens") or 0
        out.prompt_tokens = usage.get("prompt_tokens") or 0
        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


# `--ignore-eos`: every answer `--output-len` tokens long.  transformers serve refuses unknown fields (422) but takes a
# generation config, whose end-of-sequence id -1 no token has; other servers get SGLang's and vLLM's `ignore_eos`.
IGNORE_EOS = {"transformers": {"generation_config": json.dumps({"eos_token_id": -1})}}


def request_body(request: Request, model: str | None, extra: dict) -> dict:
    body = dict(prompt=request.prompt, max_tokens=request.output_len, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, **extra)  # fmt: skip
    return body if model is None else dict(model=model, **body)


async def run_load(url: str, requests: list[Request], args, model: str | None, extra: dict,
                   ) -> tuple[list[Outcome], float]:  # fmt: skip
    """Every request through at most `args.concurrency` at once; the ones unfinished at `args.deadline` fail."""
    limit = args.concurrency or len(requests)
    gate = asyncio.Semaphore(limit)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=limit)

    async def one(request: Request) -> Outcome:
        async with gate:
            return await stream_completion(session, url, request_body(request, model, extra), args.timeout)

    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=NO_TIMEOUT) as session:
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(r)) for r in requests]
        await asyncio.wait(tasks, timeout=args.deadline)
        wall = time.perf_counter() - start
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    late = Outcome(error=f"unfinished at the deadline ({args.deadline:.0f} s)")
    return [r if isinstance(r, Outcome) else late for r in results], wall


def summarize(outcomes: list[Outcome], wall: float) -> dict:
    ok = [o for o in outcomes if not o.error]
    errors = [o.error for o in outcomes if o.error]
    ttft = [o.ttft_s for o in ok if not math.isnan(o.ttft_s)]
    latency = [o.latency_s for o in ok]
    output = sum(o.output_tokens for o in ok)

    def pct(values, q):
        return float(np.percentile(values, q)) if values else float("nan")

    return dict(requests=len(outcomes), errors=len(errors), first_errors=list(dict.fromkeys(errors))[:3],
                wall_s=wall, requests_per_s=len(ok) / wall, output_tokens=output, output_tokens_per_s=output / wall,
                ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99), latency_p50_s=pct(latency, 50),
                latency_p99_s=pct(latency, 99), usage_prompt_tokens=sum(o.prompt_tokens for o in ok),
                usage_cached_tokens=sum(o.cached_tokens for o in ok))  # fmt: skip


# -- the server's side --


async def get(url: str, path: str, timeout: float = 10.0) -> tuple[int, str]:
    """(status, body) of a GET; (0, reason) where it fails."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(f"{url}{path}") as response:
                return response.status, await response.text()
    except (aiohttp.ClientError, TimeoutError) as err:
        return 0, f"{type(err).__name__}: {err}"


METRIC = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: each metric's samples summed over their labels (histogram buckets left out)."""
    totals: dict[str, float] = {}
    for name, value in (m.groups() for m in map(METRIC.match, text.splitlines()) if m):
        if not name.endswith("_bucket"):
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the run added to the counters that speak of tokens or requests."""
    names = [n for n in after if re.search("token|request", n) and not n.endswith("_created")]
    return {n: after[n] - before.get(n, 0.0) for n in names if after[n] != before.get(n, 0.0)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def transformers_command(model: str, port: int, args) -> list[str]:
    """`transformers serve` pinned to `model`, continuous batching on where this version has the flag.

    The model is `Serve`'s first parameter, an argument in 5.17 and 5.25 (an option in other versions is given as
    `--force-model`); `--continuous-batching` exists in both."""
    from transformers.cli.serve import Serve

    hints = typing.get_type_hints(Serve.__init__, include_extras=True)
    params = inspect.signature(Serve.__init__).parameters
    positional = type(hints["force_model"].__metadata__[0]).__name__ == "ArgumentInfo"
    command = [sys.executable, "-m", "transformers.cli.transformers", "serve"]
    command += [model] if positional else ["--force-model", model]
    command += ["--continuous-batching"] if "continuous_batching" in params else []
    command += ["--host", HOST, "--port", str(port), "--dtype", args.dtype]
    return command + shlex.split(args.transformers_args)


def hf_parallel_command(model: str | None, port: int, args) -> list[str]:
    command = [sys.executable, "-m", "hf_parallel", "serve", "--host", HOST, "--port", str(port)]
    command += (["--model", model] if model else []) + ["--dtype", args.dtype]
    command += ["--api-key", args.api_key] if args.api_key else []
    command += ["--max-memory", args.max_memory] if args.max_memory else []
    command += ["--max-streams", str(args.max_streams)]
    return command + shlex.split(args.hf_parallel_args)


COMMANDS = {"hf-parallel": hf_parallel_command, "transformers": transformers_command}


def start_server(command: list[str], log: Path) -> subprocess.Popen:
    """The server in a process group of its own (its workers too), its output to `log`; run from the repository's
    root, so `python -m hf_parallel` finds the package of this checkout."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "w") as sink:
        sink.write(shlex.join(command) + "\n")
        sink.flush()
        return subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=ROOT)  # fmt: skip


async def wait_ready(url: str, process: subprocess.Popen, timeout: float) -> str:
    """'' once `/health` (or `/v1/models`, where there is no `/health`) answers 200; else why not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"the server exited with status {process.returncode}"
        status, _ = await get(url, "/health", timeout=5)
        if status == 404:
            status, _ = await get(url, "/v1/models", timeout=5)
        if status == 200:
            return ""
        await asyncio.sleep(1.0)
    return f"not ready after {timeout:.0f} s"


def stop_server(process: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the server's process group; SIGKILL to what is left of it after `grace` seconds, or once the
    leader has exited (workers it left behind)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)


async def listed_model(url: str) -> str | None:
    """The first id of `/v1/models`, else None (requests then name no model: the server's own)."""
    status, text = await get(url, "/v1/models")
    try:
        return json.loads(text)["data"][0]["id"] if status == 200 else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


async def bench_server(url: str, requests: list[Request], warmup: Request, args, model: str | None, name: str,
                       ) -> dict:  # fmt: skip
    """Warm-up, the `/metrics` counters before, the load, the counters after."""
    extra = args.extra_body | (IGNORE_EOS.get(name, {"ignore_eos": True}) if args.ignore_eos else {})
    body = request_body(warmup, model, extra)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(headers=headers, timeout=NO_TIMEOUT) as session:
        warm = await stream_completion(session, url, body, args.timeout)
    if warm.error:
        return dict(error=f"warm-up failed: {warm.error}")
    status, before = await get(url, "/metrics")
    outcomes, wall = await run_load(url, requests, args, model, extra)
    after = (await get(url, "/metrics"))[1] if status == 200 else ""
    delta = metrics_delta(parse_metrics(before), parse_metrics(after)) if status == 200 else {}
    return dict(summarize(outcomes, wall), metrics=delta, warmup_ttft_s=warm.ttft_s)


async def run_started(name: str, requests: list[Request], warmup: Request, args) -> dict:
    """Starts server `name`, benchmarks it, stops it; the figures, or the error that stopped it."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    command = COMMANDS[name](args.model, port, args)
    log = args.out / f"{name}.log"
    print(f"[{name}] {shlex.join(command)}  (log: {log})", flush=True)
    started = time.perf_counter()
    process = start_server(command, log)
    try:
        problem = await wait_ready(url, process, args.startup_timeout)
        load_s = time.perf_counter() - started
        if problem:
            return dict(error=problem, log_tail=log.read_text()[-2000:])
        # transformers serve answers only for the name it was started with (5.17 lists the hub cache in /v1/models)
        model = args.model_name or (args.model if name == "transformers" else await listed_model(url))
        result = await bench_server(url, requests, warmup, args, model, name)
        return dict(result, startup_s=load_s, request_model=model)
    finally:
        stop_server(process, args.grace)
        with open(log, "a") as sink:
            sink.write(f"\n[serve_bench] stopped, exit status {process.poll()}\n")


def run_batch_file(requests: list[Request], args) -> dict:
    """Every request at once through `hf-parallel batch`'s runner, in this process: the model loaded and a one-line
    warm-up batch run first, untimed; then the workload as one OpenAI batch file, timed to its last output line."""
    from hf_parallel.frontends.model_loading import load_model
    from hf_parallel.frontends.serving import Engine
    from hf_parallel.server.batch import run_batch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    started = time.perf_counter()
    model, tokenizer = load_model(args.model, getattr(torch, dtype), device)
    engine = Engine(model, max_memory=args.max_memory, max_streams=args.max_streams, max_queue=sys.maxsize)
    load_s = time.perf_counter() - started
    extra = {"ignore_eos": True} if args.ignore_eos else {}

    def write(path: Path, batch: list[Request]) -> Path:
        path.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                            "body": dict(model="bench", prompt=r.prompt, max_tokens=r.output_len,
                                                         temperature=0, **extra)}) + "\n"
                                for i, r in enumerate(batch)))  # fmt: skip
        return path

    try:
        warm = [Request(requests[0].prompt[::-1], requests[0].prompt_len, min(8, requests[0].output_len))]
        for name in ("batch-warmup-out.jsonl", "batch-out.jsonl"):
            (args.out / name).unlink(missing_ok=True)
        run_batch(engine, tokenizer, "bench", write(args.out / "batch-warmup.jsonl", warm),
                  args.out / "batch-warmup-out.jsonl", progress=False)  # fmt: skip
        source, out = write(args.out / "batch-in.jsonl", requests), args.out / "batch-out.jsonl"
        before = dict(vars(engine.counters))
        start = time.perf_counter()
        summary = run_batch(engine, tokenizer, "bench", source, out, progress=False)
        wall = time.perf_counter() - start
        after = dict(vars(engine.counters))
        if device == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2**30
            print(f"[hf-parallel-batch] row of {engine.size.capacity} slots ({engine.size.bytes / 2**30:.1f} GiB "
                  f"budget); peak allocated {peak:.1f} GiB", flush=True)  # fmt: skip
    finally:
        engine.close(10)
    usage = [json.loads(line)["response"]["body"].get("usage", {}) for line in out.open()]
    output = sum(u.get("completion_tokens", 0) for u in usage)
    return dict(requests=len(requests), errors=summary.failed, wall_s=wall, requests_per_s=len(requests) / wall,
                output_tokens=output, output_tokens_per_s=output / wall, startup_s=load_s,
                usage_prompt_tokens=sum(u.get("prompt_tokens", 0) for u in usage),
                usage_cached_tokens=sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usage),
                metrics={"hf_parallel_prompt_tokens_total": after["prompt_tokens"] - before["prompt_tokens"],
                         "hf_parallel_prompt_tokens_computed_total": after["computed_tokens"]
                         - before["computed_tokens"]})  # fmt: skip


# -- model folders --


def retrained_tokenizer(tokenizer, vocab_size: int):
    """`tokenizer`'s pipeline, special tokens and chat template with a vocabulary of `vocab_size` learnt from the text
    of its own tokens (no corpus needed): for a random-weight model whose vocabulary is smaller than SmolLM2's."""
    texts = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
    return tokenizer.train_new_from_iterator([texts], vocab_size)


def dequantized_copy(model):
    """A GGUF-loaded model as a plain one of the same weights: transformers refuses to save a model loaded from
    GGUF, dequantized as it is (`save_pretrained` raises "quantized with gguf and is not serializable")."""
    config = model.config.to_dict()
    config.pop("quantization_config")
    plain = transformers.AutoModelForCausalLM.from_config(type(model.config).from_dict(config), dtype=model.dtype)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain.eval()


def make_model(folder: Path, shape: str, tokenizer_path: str | None, device: str) -> None:
    """A model folder, safetensors weights and tokenizer, that both servers load (see the module docstring)."""
    if shape == "smollm2":
        model, tokenizer = load_smollm2()
        model = dequantized_copy(model)
    else:
        config = SHAPES[shape]()
        tokenizer = load_tokenizer(tokenizer_path)
        if len(tokenizer) > config.vocab_size:
            tokenizer = retrained_tokenizer(tokenizer, config.vocab_size)
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.generation_config = transformers.GenerationConfig.from_model_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {folder}: {shape}, {params / 1e9:.2f}B parameters, {model.dtype}, vocabulary {len(tokenizer)}")


# -- report --


COLUMNS = ("server", "requests", "errors", "wall s", "req/s", "output tok/s", "TTFT p50 s", "TTFT p99 s",
           "latency p50 s", "latency p99 s", "prompt tokens (usage)", "resident (usage)", "prompt tokens (/metrics)",
           "computed (/metrics)")  # fmt: skip


def counted(metrics: dict[str, float], suffix: str) -> str:
    """The run's count of the `/metrics` counters named `*suffix` (hf-parallel's `hf_parallel_prompt_tokens_total`
    and `hf_parallel_prompt_tokens_computed_total`), '-' where the server has none."""
    values = [v for name, v in metrics.items() if name.endswith(suffix)]
    return f"{sum(values):.0f}" if values else "-"


def table(results: dict) -> str:
    rows = ["| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {name} | failed: {r['error'][:100]} |" + " |" * (len(COLUMNS) - 2))
            continue
        keys = ("ttft_p50_s", "ttft_p99_s", "latency_p50_s", "latency_p99_s")
        times = [f"{r[k]:.2f}" if k in r else "–" for k in keys]
        metrics = [counted(r["metrics"], s) for s in ("_prompt_tokens_total", "_prompt_tokens_computed_total")]
        cells = [name, r["requests"], r["errors"], f"{r['wall_s']:.1f}", f"{r['requests_per_s']:.2f}",
                 f"{r['output_tokens_per_s']:.0f}", *times, r["usage_prompt_tokens"], r["usage_cached_tokens"],
                 *metrics]  # fmt: skip
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(rows)


def report(args, workload: dict, results: dict) -> str:
    lines = [f"`{shlex.join([sys.executable, *sys.argv])}`", "", f"workload: {json.dumps(workload)}", "",
             table(results), ""]  # fmt: skip
    for name, r in results.items():
        for error in r.get("first_errors", []):
            lines.append(f"- {name} error: `{error}`")
        if r.get("metrics"):
            lines.append(f"- {name} /metrics during the run: `{json.dumps(r['metrics'])}`")
    return "\n".join(lines) + "\n"


def raise_open_files() -> None:
    """Every request at once holds a socket each: the soft limit on open files up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))


def concurrency(text: str) -> int:
    return 0 if text == "all" else int(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder or hub id, both servers (hf-parallel's default: SmolLM2)")
    parser.add_argument("--servers", default="hf-parallel,transformers",
                        help="comma list of hf-parallel, transformers, hf-parallel-batch (every request at once "
                        "through `hf-parallel batch`'s runner, in this process)")  # fmt: skip
    parser.add_argument("--url", metavar="[NAME=]URL", help="benchmark the server already running at URL (e.g. "
                        "transformers=http://127.0.0.1:8000; NAME, hf-parallel or transformers, picks --ignore-eos's "
                        "fields)")  # fmt: skip
    parser.add_argument("--model-name", help="`model` of each request (default: --model for transformers serve, "
                        "else the first id of /v1/models)")  # fmt: skip
    parser.add_argument("--tokenizer", help="tokenizer folder for the prompts (default: --model's, else SmolLM2's)")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--prompts-per-group", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=2048, help="tokens of each group's system prompt")
    parser.add_argument("--question-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256, help="max_tokens of each request")
    parser.add_argument("--seed", type=int, default=1, help="SGLang's default")
    parser.add_argument("--requests", type=int, default=0, help="cycle the workload to this many requests")
    parser.add_argument("--concurrency", type=concurrency, default=64, help="requests in flight; 0 or all: every one")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (and for the warm-up)")
    parser.add_argument("--deadline", type=float, default=3600.0, help="seconds for a server's whole load")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a server to get ready")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds from SIGTERM to SIGKILL")
    parser.add_argument("--extra-body", type=json.loads, default={}, help="JSON fields added to every request")
    parser.add_argument("--ignore-eos", action="store_true", help="answers of --output-len tokens (see IGNORE_EOS)")
    parser.add_argument("--api-key", help="sent as a bearer token; given to hf-parallel serve")
    parser.add_argument("--dtype", default="auto", help="both servers' --dtype")
    parser.add_argument("--max-memory", help="hf-parallel serve's --max-memory (e.g. 40GB)")
    parser.add_argument("--max-streams", type=int, default=256, help="hf-parallel's most live streams")
    parser.add_argument("--hf-parallel-args", default="", help="more flags for hf-parallel serve")
    parser.add_argument("--transformers-args", default="", help="more flags for transformers serve (e.g. --cb-*)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "serve")
    parser.add_argument("--make-model", type=Path, metavar="DIR", help="only write a model folder (see above)")
    parser.add_argument("--shape", choices=["smollm2", *sorted(SHAPES)], default="smollm2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="for --make-model")
    args = parser.parse_args(argv)
    if args.make_model:
        return make_model(args.make_model, args.shape, args.tokenizer, args.device)
    if "transformers" in args.servers.split(",") and not args.url and not args.model:
        parser.error("transformers serve needs --model")
    if args.model and Path(args.model).exists():  # the servers run from the repository's root
        args.model = str(Path(args.model).resolve())
    raise_open_files()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    requests = shared_prefix_workload(tokenizer, args.groups, args.prompts_per_group, args.system_len,
                                      args.question_len, args.output_len, args.seed)  # fmt: skip
    requests = list(itertools.islice(itertools.cycle(requests), max(args.requests, len(requests))))
    warmup = warmup_request(tokenizer, args.system_len + args.question_len, min(8, args.output_len), args.seed)
    workload = dict(dataset="generated-shared-prefix", groups=args.groups, prompts_per_group=args.prompts_per_group,
                    system_len=args.system_len, question_len=args.question_len, output_len=args.output_len,
                    seed=args.seed, requests=len(requests), concurrency=args.concurrency or "all",
                    mean_prompt_tokens=float(np.mean([r.prompt_len for r in requests])))  # fmt: skip
    print(f"workload: {json.dumps(workload)}", flush=True)
    results = {}
    kind, _, url = args.url.rpartition("=") if args.url else ("", "", "")
    for name in [kind or "url"] if args.url else args.servers.split(","):
        if args.url:
            model = args.model_name or asyncio.run(listed_model(url))
            results[name] = dict(asyncio.run(bench_server(url.rstrip("/"), requests, warmup, args, model, name)),
                                 url=url, request_model=model)  # fmt: skip
        elif name == "hf-parallel-batch":
            results[name] = run_batch_file(requests, args)
        else:
            results[name] = asyncio.run(run_started(name, requests, warmup, args))
        print(f"[{name}] {json.dumps(results[name])}", flush=True)
        versions = dict(transformers=transformers.__version__, torch=torch.__version__)
        (args.out / "results.json").write_text(json.dumps(dict(command=sys.argv, workload=workload, versions=versions,
                                                               results=results), indent=1))  # fmt: skip
    (args.out / "results.md").write_text(report(args, workload, results))
    print(report(args, workload, results))


if __name__ == "__main__":
    main()
