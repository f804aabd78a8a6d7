"""OpenAI's completions and chat completions, as requests to the engine and responses from its tokens.

`parse` checks a request body and turns it into `Work`: the prompts' token ids, generate's options, n
and how to answer.  A body at fault raises `ApiError`, which becomes OpenAI's error object with a
4xx status; nothing in a body reaches the model unchecked.  `Choice` turns one stream's tokens into
text as they come: stop sequences cut off (OpenAI returns text up to a stop sequence, without it),
text held back while it may still be the start of one, and no half of a multi-byte character sent.

The fields taken, besides `model`, `prompt` / `messages` (each a role and its content: a string, or OpenAI's
list of content parts, text parts only, joined by newlines; another part type is refused by name) and `stream`:
    max_tokens, max_completion_tokens   new tokens per choice (else the model's generation config)
    temperature                         0: greedy; above 0: sampling (else the generation config's)
    top_p, n, stop, seed
    presence_penalty, frequency_penalty only 0: transformers has no processor for them
    stream_options.include_usage, user  (user is ignored)
    ignore_eos                          vLLM's and SGLang's: true decodes past EOS to max_tokens
    prompt_lookup_num_tokens            hf_parallel's: draft tokens a stream offers a forward by prompt lookup
                                        (transformers' generate option), over the server's
                                        `--prompt-lookup-num-tokens`; null: no drafts
    priority                            vLLM's: an integer, lower is admitted first where the server schedules
                                        by priority (`--scheduling-policy priority`); default 0
Every other field is refused by name.  The prompt's length is checked by the engine, as every front end's is
(`engine.requests`: too long, code "context_length_exceeded").
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..decoding.inputs import eos_token_ids

SHARED = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
          "presence_penalty", "frequency_penalty", "user", "ignore_eos", "prompt_lookup_num_tokens",
          "priority"}  # fmt: skip
FIELDS = {"completions": SHARED | {"prompt"}, "chat": SHARED | {"messages", "max_completion_tokens"}}
CLIENT_FAULTS = (ValueError, TypeError, NotImplementedError)  # what the engine raises for a request at fault
MAX_STOP = 4  # stop sequences per request, as OpenAI takes
ROLES = {"system", "developer", "user", "assistant", "tool"}


def fault_status(err: Exception) -> int:
    """The HTTP status of a request the engine failed with `err`: 400 where the request is at fault, else 500."""
    return 400 if isinstance(err, CLIENT_FAULTS) else 500


def engine_error(err: Exception, kind: str = "completions") -> ApiError:
    """The `ApiError` of a `kind` request the engine failed with `err`, with the error's `code` where it names one (a
    request larger than the row: `row_too_small`; past the model's positions: `context_length_exceeded`, whose
    param is the prompt, or max_tokens where the new tokens pass them)."""
    status = fault_status(err)
    message = str(err) if status < 500 else f"the request failed: {err}"
    param = None
    if hasattr(err, "by_prompt"):
        param = ("prompt" if kind == "completions" else "messages") if err.by_prompt else "max_tokens"
    return ApiError(status, message, param=param, code=getattr(err, "code", None))


def answer_eos(model, tokenizer) -> set[int]:
    """The EOS ids an `Answer` ends at (a stop with finish_reason "stop")."""
    return set(eos_token_ids(model, tokenizer))


class ApiError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Work:
    """A checked request: what the engine runs and how the answer is written."""

    kind: str  # "completions" or "chat"
    prompts: list[list[int]]  # token ids of each prompt (chat: one, the template applied)
    options: dict  # generate's options for every prompt
    n: int
    stream: bool
    include_usage: bool
    stop: list[str]
    model: str
    priority: int = 0
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def parse(kind: str, body, tokenizer, served: str, max_n: int) -> Work:
    """A request body (parsed JSON) of `kind` checked into `Work` for the model `served`; `ApiError` for anything at
    fault."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name not in FIELDS[kind]:
            raise ApiError(400, f"unknown or unsupported field {name!r}", param=name, code="unsupported_field")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' is required: a string", param="model")
    if model != served:
        raise ApiError(
            404, f"the model {model!r} does not exist; this server serves {served!r}", "model", "model_not_found"
        )
    prompts = _prompts(body, tokenizer) if kind == "completions" else [_chat_prompt(body, tokenizer)]
    n = _int(body, "n", 1, 1)
    if n > max_n:
        raise ApiError(400, f"n={n} is more than this server's limit of {max_n}", param="n")
    options = {"tokenizer": tokenizer}
    max_tokens = _max_tokens(body, kind)
    if max_tokens is not None:
        options["max_new_tokens"] = max_tokens
    temperature = _number(body, "temperature", 0, 2)
    if temperature is not None:
        options.update(do_sample=False) if temperature == 0 else options.update(do_sample=True, temperature=temperature)
    top_p = _number(body, "top_p", 0, 1)
    if top_p is not None:
        if top_p == 0:
            raise ApiError(400, "top_p must be above 0", param="top_p")
        options["top_p"] = top_p
    seed = body.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ApiError(400, "seed must be an integer", param="seed")
        options["seed"] = seed
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, -2, 2)
        if value:
            raise ApiError(
                400,
                f"{name} is not supported: transformers has no logits processor for it; pass 0 or leave it out",
                param=name,
            )
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "ignore_eos must be true or false", param="ignore_eos")
    if ignore_eos:
        options["eos_token_id"] = []
    if "prompt_lookup_num_tokens" in body:  # the extension: null turns the server's default drafts off
        lookup = body["prompt_lookup_num_tokens"]
        options["prompt_lookup_num_tokens"] = None if lookup is None else _int(body, "prompt_lookup_num_tokens", 1, 1)
    stop = _stop(body)
    if stop:
        options["stop_strings"] = stop
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
        raise ApiError(400, "stream_options takes only include_usage", param="stream_options")
    priority = body.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ApiError(400, "priority must be an integer", param="priority")
    include_usage = bool(stream_options.get("include_usage", False))
    return Work(kind, prompts, options, n, stream, include_usage, stop, model, priority)


def _prompts(body: dict, tokenizer) -> list[list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(400, "'prompt' is required: a string, a list of strings or token ids", param="prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            ids = tokenizer(p, add_special_tokens=True)["input_ids"]
        elif isinstance(p, list) and all(_is_id(t) for t in p):
            ids = list(p)
        else:
            raise ApiError(400, "each prompt must be a string or a list of token ids", param="prompt")
        if not ids:
            raise ApiError(400, "a prompt is empty", param="prompt")
        out.append(ids)
    return out


def _chat_prompt(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required: a non-empty list", param="messages")
    messages = [_message(i, m) for i, m in enumerate(messages)]
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as err:  # noqa: BLE001 - a template that refuses these messages (its own checks)
        raise ApiError(400, f"the chat template refused the messages: {err}", param="messages") from err
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _message(i: int, message) -> dict:
    """messages[i] with its content as one string: a string as it is, text parts joined by newlines (as vLLM
    joins them); ApiError naming what is at fault: the message, its role, its content or a part of it."""
    if not isinstance(message, dict):
        raise ApiError(400, f"messages[{i}] must be an object with a role and content", param=f"messages[{i}]")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise ApiError(
            400, f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}, not {role!r}", f"messages[{i}].role"
        )
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return message
    if not isinstance(content, list) or not content:
        raise ApiError(400, f"{param} must be a string or a non-empty list of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            what = f"part type {kind!r}" if isinstance(kind, str) else "a part without a type"
            raise ApiError(400, f"{param}[{j}] is {what}: this server takes text parts only", param=f"{param}[{j}]")
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{param}[{j}].text must be a string", param=f"{param}[{j}].text")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def _max_tokens(body: dict, kind: str) -> int | None:
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    for name in names:
        value = _int(body, name, None, 1)
        if value is not None:
            return value
    return None


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise ApiError(400, f"stop must be a non-empty string or a list of up to {MAX_STOP}", param="stop")
    return stop


def _int(body: dict, name: str, default, low: int):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ApiError(400, f"{name} must be an integer >= {low}", param=name)
    return value


def _number(body: dict, name: str, low: float, high: float):
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise ApiError(400, f"{name} must be a number from {low} to {high}", param=name)
    return value


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


class Choice:
    """One stream's answer as text: `add` its new tokens, then `finish`; each returns the text to send next.

    Tokens are decoded incrementally (a window from the last complete character on, as TGI and vLLM do), so a
    long answer costs one short decode a token; `finish` decodes the whole answer once, the text a response
    holds.
    """

    def __init__(self, tokenizer, stop: list[str], eos: set[int]):
        self.tokenizer, self.stop, self.eos = tokenizer, stop, eos
        self.tokens: list[int] = []
        self.text = ""  # the complete characters decoded so far
        self.prefix, self.read = 0, 0  # the decode window's start, and where its new tokens start
        self.sent = ""
        self.stopped = False  # a stop sequence was found: the text ends before it
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, tokens: list[int]) -> str:
        if self.stopped:
            return ""
        self.tokens += tokens
        before = self.tokenizer.decode(self.tokens[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.tokens[self.prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):  # a character still incomplete: wait
            return ""
        self.text += after[len(before) :]
        self.prefix, self.read = self.read, len(self.tokens)
        text = self._cut(self.text)
        return self._send(text if self.stopped else text[: len(text) - self.hold])

    def finish(self, limit: int | None) -> tuple[str, str]:
        """(the rest of the text, the finish reason: "stop" at EOS or a stop sequence, else "length")."""
        rest = self._send(self._cut(self.tokenizer.decode(self.tokens, skip_special_tokens=True)))
        ended = self.stopped or (self.tokens and self.tokens[-1] in self.eos)
        return rest, "stop" if ended or (limit is not None and len(self.tokens) < limit) else "length"

    def _cut(self, text: str) -> str:
        """`text` up to its first stop sequence (then `stopped`)."""
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return text[:cut]
        return text

    def _send(self, text: str) -> str:
        """What `text` adds to the text sent so far (where a later token changed earlier text, from the first
        change on: sent text cannot be taken back)."""
        common = len(self.sent) if text.startswith(self.sent) else _common_prefix(text, self.sent)
        if len(text) <= common:
            return ""
        new, self.sent = text[common:], text
        return new


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Answer:
    """One request's response, written from its engine events: `apply` each event (prompt p's), then `body()`;
    a stream sends `chunk`s as `apply` gives text."""

    def __init__(self, work: Work, tokenizer, eos: set[int], limits: list[int]):
        self.work, self.limits = work, limits  # each prompt's most new tokens (the engine's)
        self.choices = [Choice(tokenizer, work.stop, eos) for _ in range(len(work.prompts) * work.n)]
        self.texts = [""] * len(self.choices)
        self.reasons: list[str | None] = [None] * len(self.choices)
        self.cached = [0] * len(work.prompts)
        self.open = len(work.prompts)  # prompts not done

    def apply(self, p: int, kind: str, value) -> list[tuple[int, str, str | None]]:
        """(choice index, new text, finish reason or None) of one engine event of prompt p."""
        n, out = self.work.n, []
        if kind == "start":
            self.cached[p] = value
        elif kind == "tokens":
            out = [(p * n + j, self.choices[p * n + j].add([token]), None) for j, token in value]
        elif kind == "finish":
            text, reason = self.choices[p * n + value].finish(self.limits[p])
            out = [(p * n + value, text, reason)]
        elif kind == "done":
            self.open -= 1
        for i, text, reason in out:
            self.texts[i] += text
            self.reasons[i] = reason or self.reasons[i]
        return out

    def head(self) -> dict:
        chat = self.work.kind == "chat"
        return {
            "id": ("chatcmpl-" if chat else "cmpl-") + self.work.id,
            "object": ("chat.completion.chunk" if self.work.stream else "chat.completion")
            if chat
            else "text_completion",
            "created": self.work.created,
            "model": self.work.model,
        }

    def chunk(self, i: int, delta, reason) -> dict:
        """A streamed chunk of choice i: `delta` (chat: a message delta; completions: text)."""
        choice = {"index": i, ("delta" if self.work.kind == "chat" else "text"): delta, "logprobs": None}
        return {**self.head(), "choices": [{**choice, "finish_reason": reason}]}

    def usage(self) -> dict:
        """OpenAI's usage, with the prompt tokens found resident (`cached_tokens`) and those computed."""
        prompt = sum(len(p) for p in self.work.prompts)
        completion = sum(len(c.tokens) for c in self.choices)
        cached = sum(self.cached)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached, "computed_tokens": prompt - cached},
        }

    def body(self) -> dict:
        """The whole (non-streamed) response."""
        if self.work.kind == "chat":
            choices = [
                {"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None, "finish_reason": r}
                for i, (t, r) in enumerate(zip(self.texts, self.reasons))
            ]
        else:
            choices = [
                {"index": i, "text": t, "logprobs": None, "finish_reason": r}
                for i, (t, r) in enumerate(zip(self.texts, self.reasons))
            ]
        return {**self.head(), "choices": choices, "usage": self.usage()}
