"""One door (`hf_parallel.engine.requests`): the same bad request gets the same message on every front end that takes
it (`generate_tokens`, the serving engine, the batch runner, scoring), each front end naming the prompt its own way."""

from __future__ import annotations

import json

import pytest

from hf_parallel import generate_tokens, score_continuations
from hf_parallel.frontends.serving import Engine
from hf_parallel.server.batch import run_batch
from tests.helpers.char_tokenizers import char_tokenizer
from tests.helpers.models import tiny_model
from tests.helpers.serving import Collector

NAMES = ("prompt 0", "the prompt")  # how generate_tokens and the engine call a request's prompt


def _body(message: str) -> str:
    """A refusal without the name it starts with."""
    for name in NAMES:
        if message.startswith(name):
            return message[len(name) :]
    return message


def _engine_error(engine: Engine, prompt: list[int], options: dict) -> Exception:
    collected = Collector()
    engine.submit(prompt, options, 1, collected)
    assert collected.wait().error is not None, "the engine took a bad request"
    return collected.error


def _batch_error(engine: Engine, prompt: list[int], options: dict, tmp_path) -> dict:
    body = {"model": "m", "prompt": prompt, **options}
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    out.unlink(missing_ok=True)
    run_batch(engine, char_tokenizer(), "m", source, out, progress=False)
    response = json.loads(out.read_text())["response"]
    assert response["status_code"] == 400
    return response["body"]["error"]


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_text"])
def test_the_same_bad_request_gets_the_same_message_everywhere(arch, tmp_path):
    model = tiny_model(arch)
    limit = model.config.max_position_embeddings
    too_long = [5] * (limit - 4)
    cases = [(too_long, dict(max_new_tokens=8), ValueError)]  # past the positions with its new tokens
    if arch == "qwen3_5_text":  # recurrent layers: no drafts
        cases.append(([5, 6, 7], dict(max_new_tokens=4, prompt_lookup_num_tokens=3), NotImplementedError))
    engine = Engine(model, max_memory="64MiB", max_streams=4)
    try:
        for prompt, options, kind in cases:
            with pytest.raises(kind) as raised:
                generate_tokens(model, [prompt], **options)
            message = _body(str(raised.value))
            served = _engine_error(engine, prompt, options)
            assert type(served) is type(raised.value) and _body(str(served)) == message
            batch_options = {"max_tokens": options.pop("max_new_tokens"), **options}
            assert _body(_batch_error(engine, prompt, batch_options, tmp_path)["message"]) == message
        with pytest.raises(TypeError) as raised:  # an option generate does not know
            generate_tokens(model, [[5, 6]], max_new_tokens=2, no_such_option=1)
        assert str(_engine_error(engine, [5, 6], dict(max_new_tokens=2, no_such_option=1))) == str(raised.value)
    finally:
        engine.close(30)
    # scoring: the prompt with its continuation past the positions (the continuation's last token only a target)
    with pytest.raises(ValueError) as scored:
        score_continuations(model, [[5] * (limit - 3)], [[[5] * 5]])
    with pytest.raises(ValueError) as generated:
        generate_tokens(model, [[5] * (limit + 1)], max_new_tokens=1)
    assert str(scored.value).startswith(f"prompt 0 with continuation 0 has {limit + 1} tokens")
    assert str(scored.value).split("would exceed")[1] == str(generated.value).split("would exceed")[1]
    assert scored.value.code == generated.value.code == "context_length_exceeded"
