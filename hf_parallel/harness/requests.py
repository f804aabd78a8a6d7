"""Errors that name the harness request or model argument at fault, and the names they use."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the model cannot answer (an empty context, a continuation past the model's window, ...); the
    message names the request: its task, document and request index."""


class ModelArgumentError(ValueError):
    """A `--model_args` entry hf-parallel does not take, or a value it refuses; the message names it."""


def describe(request) -> str:
    """The request's task, document and index, as an error message names it (an `lm_eval` Instance)."""
    return f"{request.request_type} request {request.idx} of {request.task_name} document {request.doc_id}"


def shorten(text: str, limit: int = 60) -> str:
    """`text` as a message quotes it: its repr, cut to about `limit` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."
