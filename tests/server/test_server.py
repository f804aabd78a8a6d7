"""`hf-parallel serve`, driven by the official `openai` client on loopback, with the embedded SmolLM2 (fp32, CPU).

Every answer is compared with plain `model.generate` on its prompt alone (greedy), computed before the server
starts; whatever else shares the row and whenever it arrives.  Bad requests, a full queue, a client that
disconnects, the API key, the body limit and the drain on SIGTERM are checked through HTTP, as a client sees them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import signal
import socket
import threading
import time

import httpx2 as httpx  # the HTTP client the openai package is built on
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from hf_parallel.frontends.demo import QUESTIONS  # noqa: E402
from hf_parallel.frontends.serving import Engine  # noqa: E402
from hf_parallel.server.app import create_app  # noqa: E402
from hf_parallel.server.draining import DrainingServer  # noqa: E402
from tests.helpers.models import random_tokens, tiny_model  # noqa: E402
from tests.helpers.server import ASKS, DOCUMENTS, NAME, batch_lines  # noqa: E402

pytestmark = pytest.mark.slow


class Server:
    """An app on 127.0.0.1 (a free port), run by uvicorn on a thread (`make`: the server class over a config);
    `stop()` shuts it down."""

    def __init__(self, app, make=uvicorn.Server, **config):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = make(uvicorn.Config(app, **{"log_level": "warning", **config}))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def served(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, max_streams=64)
    server = Server(create_app(engine, tokenizer, NAME, max_n=8))
    yield server, engine, model, tokenizer
    server.stop()


def alone(model, tokenizer, ids: list[int], max_new_tokens: int, stop: list[str] | None = None) -> str:
    """What model.generate answers for these prompt ids alone (greedy), as text; cut at a stop sequence."""
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                         do_sample=False, stop_strings=stop, tokenizer=tokenizer)  # fmt: skip
    text = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    for s in stop or []:
        text = text.split(s)[0]
    return text


def chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(f"hf_parallel_{name} ")))


def test_concurrent_requests_about_four_documents_each_as_alone(served):
    """32 requests (completions and chat, streamed and not, sync and async clients) about 4 documents, shuffled and
    arriving over time: every text equals model.generate's for that prompt alone."""
    server, engine, model, tokenizer = served
    rng = random.Random(0)
    jobs = []
    for i in range(32):
        doc, ask = DOCUMENTS[i % 4], ASKS[(i * 3) % len(ASKS)]
        if i % 2:
            messages = [{"role": "system", "content": doc}, {"role": "user", "content": ask}]
            jobs.append(("chat", messages, chat_ids(tokenizer, messages), 6 + i % 7, i % 4 == 1))
        else:
            prompt = f"{doc}\nQuestion: {ask}\nAnswer:"
            jobs.append(("completions", prompt, tokenizer(prompt)["input_ids"], 6 + i % 7, i % 4 == 0))
    rng.shuffle(jobs)
    expected = [alone(model, tokenizer, ids, max_tokens) for _, _, ids, max_tokens, _ in jobs]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    async def ask(job, delay):
        kind, prompt, _, max_tokens, stream = job
        await asyncio.sleep(delay)
        common = dict(model=NAME, max_tokens=max_tokens, temperature=0, stream=stream)
        if kind == "chat":
            response = await client.chat.completions.create(messages=prompt, **common)
            if stream:
                return "".join([c.choices[0].delta.content or "" async for c in response if c.choices])
            return response.choices[0].message.content
        response = await client.completions.create(prompt=prompt, **common)
        if stream:
            return "".join([c.choices[0].text async for c in response if c.choices])
        return response.choices[0].text

    async def main():
        return await asyncio.gather(*(ask(job, rng.random() * 2) for job in jobs))

    assert asyncio.run(main()) == expected
    sync = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    kind, prompt, _, max_tokens, _ = next(j for j in jobs if j[0] == "completions")
    again = sync.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
    assert again.choices[0].text == expected[jobs.index(next(j for j in jobs if j[0] == "completions"))]


def test_different_limits_stops_temperatures_and_n_in_one_row(served):
    server, engine, model, tokenizer = served
    doc = DOCUMENTS[0]
    prompts = [f"{doc}\nQuestion: {q}\nAnswer:" for q in QUESTIONS[:4]]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    expected = [
        alone(model, tokenizer, ids[0], 5),
        alone(model, tokenizer, ids[1], 20, stop=[" the", "."]),
        alone(model, tokenizer, ids[3], 9),
    ]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    async def main():
        return await asyncio.gather(
            client.completions.create(model=NAME, prompt=prompts[0], max_tokens=5, temperature=0),
            client.completions.create(model=NAME, prompt=prompts[1], max_tokens=20, temperature=0, stop=[" the", "."]),
            client.completions.create(model=NAME, prompt=prompts[2], max_tokens=8, temperature=0.8, seed=1),
            client.completions.create(model=NAME, prompt=prompts[3], max_tokens=9, temperature=0, n=4),
        )

    short, stopped, sampled, four = asyncio.run(main())
    assert short.choices[0].text == expected[0] and short.choices[0].finish_reason == "length"
    assert stopped.choices[0].text == expected[1] and stopped.choices[0].finish_reason == "stop"
    assert 1 <= sampled.usage.completion_tokens <= 8
    assert [c.text for c in four.choices] == [expected[2]] * 4 and [c.index for c in four.choices] == [0, 1, 2, 3]
    assert four.usage.prompt_tokens == len(ids[3])


def test_a_burst_about_one_document_computes_it_once(served):
    """Usage's cached tokens and the server's metrics count the document's tokens once for the burst."""
    server, engine, model, tokenizer = served
    doc = " ".join([DOCUMENTS[3]] * 4)  # a document no earlier test sent
    prompts = [f"{doc}\nQuestion: {q}\nAnswer:" for q in QUESTIONS[:8]]
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    before = metric(server.url, "prompt_tokens_computed_total"), metric(server.url, "prompt_tokens_total")
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    async def main():
        calls = [client.completions.create(model=NAME, prompt=p, max_tokens=4, temperature=0) for p in prompts]
        return await asyncio.gather(*calls)

    responses = asyncio.run(main())
    computed = metric(server.url, "prompt_tokens_computed_total") - before[0]
    requested = metric(server.url, "prompt_tokens_total") - before[1]
    doc_tokens = len(tokenizer(doc)["input_ids"])
    assert requested == sum(lengths)
    assert computed <= sum(lengths) - 7 * (doc_tokens - 2)  # the document once, not eight times
    details = [r.usage.prompt_tokens_details for r in responses]
    assert sum(d.cached_tokens for d in details) == requested - computed
    assert all(d.cached_tokens + d.computed_tokens == r.usage.prompt_tokens for d, r in zip(details, responses))


def test_ignore_eos_decodes_to_max_tokens(served):
    server, engine, model, tokenizer = served
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids = chat_ids(tokenizer, messages)
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False,
                         eos_token_id=[])  # fmt: skip
    expected = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=0)
    assert plain.usage.completion_tokens < 40  # it stops at EOS
    past = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    assert past.usage.completion_tokens == 40 and past.choices[0].message.content == expected
    assert past.choices[0].finish_reason == "length"


BAD = [
    (b"{not json", 400, None),
    ({"model": NAME, "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"model": NAME, "prompt": [5] * 9000}, 400, "prompt"),
    ({"model": NAME, "prompt": "x", "max_tokens": 9000}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "n": 9}, 400, "n"),
    ({"model": NAME, "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"model": NAME, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": NAME, "prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ({"model": NAME, "prompt": [10**7]}, 400, None),
    ({"model": NAME}, 400, "prompt"),
    ([1, 2], 400, None),
]


@pytest.mark.parametrize("body, status, param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_request_gets_openais_error_object(served, body, status, param):
    server = served[0]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_bad_chat_and_routes(served):
    server = served[0]
    for body in ({"model": NAME, "messages": []}, {"model": NAME, "messages": [{"role": "king", "content": "x"}]}):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"].startswith("messages")
    assert httpx.get(f"{server.url}/v1/nowhere").json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_chat_content_as_text_parts_is_the_parts_joined_by_newlines(served):
    """OpenAI clients send content as a list of parts: its text parts answer as the one string they make."""
    server, engine, model, tokenizer = served
    texts = ["What is the capital of France?", "Answer in one word."]
    expected = alone(model, tokenizer, chat_ids(tokenizer, [{"role": "user", "content": "\n".join(texts)}]), 8)
    parts = [{"type": "text", "text": t} for t in texts]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    system = {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    messages = [system, {"role": "user", "content": parts}]
    response = client.chat.completions.create(model=NAME, messages=messages[1:], max_tokens=8, temperature=0)
    assert response.choices[0].message.content == expected
    both = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "\n".join(texts)}]
    with_system = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    assert with_system.choices[0].message.content == alone(model, tokenizer, chat_ids(tokenizer, both), 8)


IMAGE = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/cat.png"}}
BAD_MESSAGES = [  # (messages, the param named, a word the message holds, a word it does not)
    ([{"role": "king", "content": "x"}], "messages[0].role", "'king'", "content"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": 5}], "messages[1].content", "content", "role"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}, IMAGE]}], "messages[0].content[1]", "'image_url'",
     "role"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0].text", "text", "role"),
    ([{"role": "user", "content": []}], "messages[0].content", "content", "role"),
    (["hello"], "messages[0]", "object", "template"),
]  # fmt: skip


@pytest.mark.parametrize("messages, param, said, unsaid", BAD_MESSAGES, ids=[str(i) for i in range(len(BAD_MESSAGES))])
def test_a_bad_message_names_its_role_content_or_part(served, messages, param, said, unsaid):
    server = served[0]
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": NAME, "messages": messages})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and said in error["message"] and unsaid not in error["message"]


def test_a_client_gone_mid_stream_gives_its_room_back(served):
    server, engine, model, tokenizer = served
    body = {"model": NAME, "prompt": DOCUMENTS[1] + " Tell me a long story.", "max_tokens": 400, "temperature": 0,
            "stream": True, "n": 3}  # fmt: skip
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(server.url, "live_streams") == 3
    deadline = time.monotonic() + 30
    while metric(server.url, "live_streams") or metric(server.url, "row_slots_used") != metric(
        server.url, "row_slots_retained"
    ):
        assert time.monotonic() < deadline, "the streams stayed"
        time.sleep(0.05)
    assert metric(server.url, "requests_cancelled_total") >= 1


@pytest.fixture(scope="module")
def guarded(smollm2):
    """A server of its own with an API key and a body limit of 4 KiB."""
    model, tokenizer = smollm2
    server = Server(create_app(Engine(model, max_memory="256MiB"), tokenizer, NAME, api_key="sesame", max_body=4096))
    yield server
    server.stop()


def test_an_api_key_is_needed_where_set_and_compared_in_constant_time(guarded, monkeypatch):
    compared = []
    constant_time = secrets.compare_digest
    monkeypatch.setattr(secrets, "compare_digest", lambda a, b: compared.append(a) or constant_time(a, b))
    wrong = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert compared == [b"Bearer guess"]
    for key in ("Bearer sesam", "Bearer sesame!", "sesame", "Bearer s\u00e9same".encode(), ""):
        response = httpx.get(f"{guarded.url}/v1/models", headers={"Authorization": key})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    right = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="sesame", max_retries=0)
    assert [m.id for m in right.models.list().data] == [NAME]


def status_line(url: str, head: str, parts: list[bytes]) -> bytes:
    """The status code a server answers a request with whose body is `parts`, not ended: it must answer before the
    body does (a socket that waits past 20 s fails the test)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(head.encode() + b"".join(parts))
        received = b""
        while b"\r\n" not in received:
            chunk = sock.recv(4096)
            assert chunk, "the server closed the connection without an answer"
            received += chunk
    return received.split(b"\r\n")[0].split()[1]


def test_a_body_past_the_limit_is_refused_with_413_before_it_is_read(guarded):
    head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sesame\r\n"
    # a gigabyte announced, none sent: refused by its Content-Length
    assert status_line(guarded.url, head + "Content-Length: 1000000000\r\n\r\n", []) == b"413"
    # chunked, 6,000 bytes sent and no end: refused once past the limit
    chunk = b"%x\r\n" % 3000 + b" " * 3000 + b"\r\n"
    chunked = head + "Transfer-Encoding: chunked\r\n\r\n"
    assert status_line(guarded.url, chunked, [chunk, chunk]) == b"413"
    body = json.dumps({"model": NAME, "prompt": "x" * 5000})
    response = httpx.post(f"{guarded.url}/v1/completions", content=body, headers={"Authorization": "Bearer sesame"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    small = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    ok = httpx.post(f"{guarded.url}/v1/completions", json=small, headers={"Authorization": "Bearer sesame"}, timeout=60)
    assert ok.status_code == 200


class Logged(logging.Handler):
    """The messages of the records a logger handles."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_drain_answers_503_to_health_and_new_requests_while_those_in_flight_finish(smollm2):
    """The drain that SIGTERM starts (the signal's handler called as the signal calls it): /health and a new
    request get 503, the stream in flight runs to its end, then the server shuts down.  The start-up line says
    where it listens, through uvicorn's own logger."""
    model, tokenizer = smollm2
    logged = Logged()
    logging.getLogger("uvicorn.error").addHandler(logged)
    app = create_app(Engine(model, max_memory="256MiB"), tokenizer, NAME)
    server = Server(app, lambda config: DrainingServer(config, grace=120, banner="Serving the test's model"),
                    log_config=None, log_level="info")  # fmt: skip
    try:
        assert f"Serving the test's model at {server.url}" in logged.messages
        body = {"model": NAME, "prompt": "Count to one hundred:", "max_tokens": 64, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.Client(timeout=60) as client, client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data:"))
            next(lines)
            server.server.handle_exit(signal.SIGTERM, None)
            health = httpx.get(f"{server.url}/health", timeout=10)
            late = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=10)
            rest = list(lines)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        assert late.status_code == 503 and late.json()["error"]["code"] == "unavailable"
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][5:])["usage"]["completion_tokens"] == 64
        server.thread.join(30)
        assert not server.thread.is_alive()
    finally:
        logging.getLogger("uvicorn.error").removeHandler(logged)
        server.stop()


def test_the_batch_runner_answers_as_the_server_and_reports_bad_lines(served, tmp_path):
    from hf_parallel.server.batch import run_batch

    server, engine, model, tokenizer = served
    lines = batch_lines(tokenizer)
    first = lines[0]["custom_id"]
    bad = ["{not json", json.dumps({"custom_id": first, "method": "POST", "url": "/v1/completions", "body": {}}),
           json.dumps({"custom_id": "x1", "method": "GET", "url": "/v1/completions", "body": {}}),
           json.dumps({"custom_id": "x2", "method": "POST", "url": "/v1/completions",
                       "body": {"model": NAME, "prompt": "x", "best_of": 2}})]  # fmt: skip
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([json.dumps(line) for line in lines[:5]] + bad + [json.dumps(x) for x in lines[5:]]))
    out = tmp_path / "out.jsonl"
    summary = run_batch(engine, tokenizer, NAME, source, out, max_n=8, progress=False)
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert summary.answered == len(records) == len(lines) + len(bad) and summary.failed == len(bad)
    by_id = {r["custom_id"]: r for r in records}
    assert len(by_id) == len(records)  # a repeated custom_id's error line is keyed by its line, as a resume reads it
    for line in lines:
        record = by_id[line["custom_id"]]
        assert record["error"] is None and record["response"]["status_code"] == 200
        served_body = httpx.post(f"{server.url}{line['url']}", json=line["body"], timeout=120).json()
        got, want = record["response"]["body"]["choices"], served_body["choices"]
        key = "message" if line["url"].endswith("chat/completions") else "text"
        assert [(c[key], c["finish_reason"]) for c in got] == [(c[key], c["finish_reason"]) for c in want]
    assert by_id["line 6"]["error"]["message"].startswith("line 6: not a JSON object")
    assert by_id["line 7"]["error"]["message"] == f"line 7: custom_id {first!r} is used by an earlier line"
    assert by_id["x1"]["error"]["code"] == "invalid_request"
    refused = by_id["x2"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "best_of"
    again = run_batch(engine, tokenizer, NAME, source, out, max_n=8, progress=False)  # all answered: nothing runs
    assert again.answered == 0 and again.skipped == len(records) and len(out.read_text().splitlines()) == len(records)
    # interrupted before the first line's answer was written (error lines are written first): a resume answers it
    kept = [x for x in out.read_text().splitlines() if json.loads(x)["custom_id"] != first]
    out.write_text("".join(x + "\n" for x in kept))
    resumed = run_batch(engine, tokenizer, NAME, source, out, max_n=8, progress=False)
    assert resumed.answered == 1 and len(out.read_text().splitlines()) == len(records)
    assert json.loads(out.read_text().splitlines()[-1])["custom_id"] == first


# -- drafts and recurrent layers through the server --


def quoting_prompts(tokenizer) -> list[tuple[str, list[int]]]:
    """Completions prompts that ask for words of their document back (SmolLM2 copies from the passage, so prompt
    lookup's drafts are accepted)."""
    prompts = []
    for doc in DOCUMENTS:
        for ask in ("Repeat the first sentence.", "Quote the passage's last sentence word for word."):
            text = f"{doc}\nQuestion: {ask}\nAnswer:"
            prompts.append((text, tokenizer(text)["input_ids"]))
    return prompts


def test_prompt_lookup_through_the_server_answers_as_alone(smollm2):
    """`--prompt-lookup-num-tokens` as the engine's default, a request's own `prompt_lookup_num_tokens` (the
    extension field: another k, or null for none): every text equals model.generate's alone, in fewer forwards
    than tokens."""
    model, tokenizer = smollm2
    prompts = quoting_prompts(tokenizer)
    expected = [alone(model, tokenizer, ids, 16) for _, ids in prompts]
    engine = Engine(model, max_streams=16, prompt_lookup_num_tokens=6)
    server = Server(create_app(engine, tokenizer, NAME))
    try:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

        async def ask(i, text):
            own = {1: {"prompt_lookup_num_tokens": 3}, 2: {"prompt_lookup_num_tokens": None}}.get(i % 3, {})
            out = await client.completions.create(model=NAME, prompt=text, max_tokens=16, temperature=0,
                                                  extra_body=own)  # fmt: skip
            return out.choices[0].text

        async def main():
            return await asyncio.gather(*(ask(i, text) for i, (text, _) in enumerate(prompts)))

        assert asyncio.run(main()) == expected
        stats = engine.core.stats
        assert stats.tokens > stats.stream_forwards  # some drafts were accepted
        bad = httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": "x",
                                                                "prompt_lookup_num_tokens": 0})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_lookup_num_tokens"
    finally:
        server.stop()
        engine.close(10)


def test_the_batch_runner_with_drafts_answers_as_alone(smollm2, tmp_path):
    from hf_parallel.server.batch import run_batch

    model, tokenizer = smollm2
    prompts = quoting_prompts(tokenizer)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bodies = [{"model": NAME, "prompt": text, "max_tokens": 16, "temperature": 0} for text, _ in prompts]
    lines = [
        {"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions", "body": b} for i, b in enumerate(bodies)
    ]
    source.write_text("\n".join(map(json.dumps, lines)))
    engine = Engine(model, max_streams=16, prompt_lookup_num_tokens=6)
    try:
        run_batch(engine, tokenizer, NAME, source, out, progress=False)
    finally:
        engine.close(10)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    got = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in records}
    assert [got[f"q{i}"] for i in range(len(prompts))] == [alone(model, tokenizer, ids, 16) for _, ids in prompts]
    assert engine.core.stats.tokens > engine.core.stats.stream_forwards


@pytest.mark.parametrize("arch", ["qwen3_next", "falcon_h1"])
def test_a_model_with_recurrent_layers_is_served_as_alone(arch, smollm2):
    """A hybrid model (tiny, random; SmolLM2's tokenizer for the text) through the server: concurrent requests
    sharing a document, each stream with its own recurrent state, each text model.generate's alone."""
    _, tokenizer = smollm2
    model = tiny_model(arch)
    gen = torch.Generator().manual_seed(5)
    doc = random_tokens(30, gen)
    prompts = [doc + random_tokens(2 + i % 4, gen) for i in range(6)]
    ids = [torch.tensor([p]) for p in prompts]
    outs = [model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=5 + i % 3, do_sample=False,
                           eos_token_id=[], pad_token_id=0)[0, x.shape[1] :] for i, x in enumerate(ids)]  # fmt: skip
    expected = [tokenizer.decode(out, skip_special_tokens=True) for out in outs]
    engine = Engine(model, max_streams=4)
    server = Server(create_app(engine, tokenizer, "hybrid"))
    try:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

        async def ask(i, prompt):
            await asyncio.sleep(0.05 * i)
            out = await client.completions.create(model="hybrid", prompt=prompt, max_tokens=5 + i % 3, temperature=0,
                                                  extra_body={"ignore_eos": True})  # fmt: skip
            return out.choices[0].text

        async def main():
            return await asyncio.gather(*(ask(i, p) for i, p in enumerate(prompts)))

        assert asyncio.run(main()) == expected
    finally:
        server.stop()
        engine.close(10)


def test_the_default_row_holds_a_whole_context_and_a_larger_request_is_refused_by_code(smollm2):
    """The CPU's default row (512 MiB) grows to hold one request of the model's whole context (SmolLM2: 8,192
    positions); a row set smaller refuses a request it cannot hold with code `row_too_small`, naming --max-memory."""
    model, tokenizer = smollm2
    engine = Engine(model, max_streams=4)
    try:
        assert engine.counters.capacity >= model.config.max_position_embeddings
    finally:
        engine.close(10)
    small = Engine(model, max_memory="160MiB", max_streams=4)
    server = Server(create_app(small, tokenizer, NAME))
    try:
        prompt = " ".join(["word"] * (small.counters.capacity + 100))
        refused = httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 4},
                             timeout=60)  # fmt: skip
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "row_too_small" and "--max-memory" in error["message"]
    finally:
        server.stop()
        small.close(10)
