"""`hf-parallel serve` and `hf-parallel batch` as processes: the start-up line and SIGTERM's drain, and `kill -9`
mid-batch.

Each starts the command line on the embedded SmolLM2 (about 20 s to load on the CPU), on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx2")  # the HTTP client the openai package is built on

from hf_parallel.frontends.serving import Engine  # noqa: E402
from hf_parallel.server.batch import run_batch  # noqa: E402
from tests.helpers.server import NAME, batch_lines  # noqa: E402

pytestmark = pytest.mark.slow
STARTUP = 180  # seconds a command may take to load the model and listen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "hf_parallel", *args]


def test_sigterm_drains_finishes_the_requests_in_flight_and_exits_0():
    """The start-up line names what is served and where; on SIGTERM /health answers 503 while the streams in
    flight run to their end; then the server exits 0."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(_command("serve", "--port", str(port), "--grace", "60"), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(server.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + STARTUP
        while True:
            assert server.poll() is None, "".join(output)
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        capacity = next(line.split()[1] for line in httpx.get(f"{url}/metrics").text.splitlines()
                        if line.startswith("hf_parallel_row_slots_capacity "))  # fmt: skip
        started_line = f"Serving {NAME} (float32, cpu, attention reference, a row of {capacity} tokens) at {url}"
        assert any(re.fullmatch(rf"INFO: +{re.escape(started_line)}\n", line) for line in output), output
        results, started = {}, threading.Barrier(9)

        def stream(i):
            body = {"model": NAME, "prompt": f"Story number {i}: once upon a time", "max_tokens": 48,
                    "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                started.wait()
                results[i] = [first] + [line for line in lines if line.startswith("data:")]

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        started.wait(timeout=120)  # every stream has its first chunk
        server.send_signal(signal.SIGTERM)
        health = httpx.get(f"{url}/health", timeout=10)
        for t in threads:
            t.join(120)
        assert server.wait(120) == 0
    finally:
        if server.poll() is None:
            server.kill()
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    assert sorted(results) == list(range(8))
    for lines in results.values():
        assert lines[-1] == "data: [DONE]"
        finals = [json.loads(x[5:])["choices"][0]["finish_reason"] for x in lines[:-1]]
        assert finals[-1] in ("stop", "length")  # every stream ran to its end
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)


def test_a_batch_killed_mid_run_resumes_with_no_line_lost_or_repeated(smollm2, tmp_path):
    """`kill -9` once some lines are written, then the same command again: every line once, each as an
    uninterrupted run answers it."""
    model, tokenizer = smollm2
    lines = batch_lines(tokenizer) * 1
    for i, line in enumerate(lines):
        line["body"]["max_tokens"] = 6 + 3 * i  # lines finish one after another
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = _command("batch", "--input", str(source), "--output", str(out))
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + STARTUP
    while not (out.exists() and out.read_text().count("\n") >= 2):
        assert first.poll() is None, "the batch ended before it was killed"
        assert time.monotonic() < deadline, "no line was written"
        time.sleep(0.02)
    first.kill()  # SIGKILL: nothing is flushed or cleaned up
    first.wait()
    written = out.read_text().count("\n")
    assert 2 <= written < len(lines)
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in records) == sorted(line["custom_id"] for line in lines)
    whole = tmp_path / "whole.jsonl"
    engine = Engine(model)
    try:
        run_batch(engine, tokenizer, NAME, source, whole, progress=False)
    finally:
        engine.close(10)
    expected = {r["custom_id"]: r["response"]["body"]["choices"] for r in map(json.loads, whole.open())}
    assert {r["custom_id"]: r["response"]["body"]["choices"] for r in records} == expected
