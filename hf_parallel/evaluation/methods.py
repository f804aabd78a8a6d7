"""The methods as lists of generate calls (`standard_calls`, `parallel_calls`, `batch_calls`), and
`execute`, which runs a method's calls, times them and checkpoints each one.

All decode greedily and stop at EOS; a call's seconds include decoding its answers to text.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..frontends.generate import generate_tokens
from .checkpoint import Checkpoint
from .config import QualityConfig


@dataclass
class GenerateCall:
    """One generate call of a method: the output positions it fills and how many questions it answers."""

    indices: list[int]  # prompts (standard, parallel) or documents (batch prompting)
    questions: int
    run: Callable[[], list[str]]  # the decoded outputs, one per index


class StopAtString(StoppingCriteria):
    """Per row: stop once the row's new text contains its own stop string (rows of one
    `generate` call have different ones, which `generate(stop_strings=...)` cannot say)."""

    def __init__(self, tokenizer, stops: list[str], prompt_width: int, window: int = 12):
        self.tokenizer, self.stops, self.width, self.window = tokenizer, stops, prompt_width, window

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        tail = input_ids[:, max(self.width, input_ids.shape[1] - self.window) :]
        texts = self.tokenizer.batch_decode(tail.tolist(), skip_special_tokens=True)
        return torch.tensor([s in t for s, t in zip(self.stops, texts)], device=input_ids.device)


def standard_calls(model, tokenizer, prompts, config: QualityConfig, eos, pad) -> list[GenerateCall]:
    """Each prompt as its own request; rows batched by length so padding stays small."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))

    def call(rows):
        return _decode(tokenizer, generate_rows(model, [prompts[i] for i in rows], config.max_new_tokens, eos, pad))

    return [
        GenerateCall(rows, len(rows), lambda rows=rows: call(rows))
        for rows in _slices(order, config.standard_batch_size)
    ]


def parallel_calls(model, tokenizer, per_document, config: QualityConfig, eos) -> list[GenerateCall]:
    """All questions of `docs_per_call` documents as streams of one packed row per call."""
    first = np.cumsum([0] + [len(doc) for doc in per_document])  # each document's first prompt

    def call(docs):
        prompts = [p for d in docs for p in per_document[d]]
        answers = generate_tokens(
            model, prompts, max_new_tokens=config.max_new_tokens, eos_token_id=eos, do_sample=False, attn=config.attn
        )
        return _decode(tokenizer, [_until_eos(a, set(eos)) for a in answers])

    calls = []
    for docs in _slices(list(range(len(per_document))), config.docs_per_call):
        indices = [int(i) for d in docs for i in range(first[d], first[d + 1])]
        calls.append(GenerateCall(indices, len(indices), lambda docs=docs: call(docs)))
    return calls


def batch_calls(model, tokenizer, documents, prompts, config: QualityConfig, eos, pad) -> list[GenerateCall]:
    """One sequence per document, its raw output text; `parse_batch_answers` splits it into answers.

    Each sequence stops at EOS, after max_new_tokens per question, or when the model starts
    an answer past the last question ("A<n+1>:"), which the parser would drop anyway.
    Sequences are batched `batch_rows` at a time, documents of similar question counts and
    prompt lengths together; a row that stops early is padded while the others go on.
    """
    order = sorted(range(len(documents)), key=lambda i: (len(documents[i].items), len(prompts[i])))

    def call(rows):
        counts = [len(documents[i].items) for i in rows]
        width = max(len(prompts[i]) for i in rows)
        stop = StopAtString(tokenizer, [f"A{n + 1}:" for n in counts], width)
        new = generate_rows(model, [prompts[i] for i in rows], config.max_new_tokens * max(counts), eos, pad, stop)
        return [
            tokenizer.decode(tokens[: config.max_new_tokens * n], skip_special_tokens=True)
            for n, tokens in zip(counts, new)
        ]

    return [
        GenerateCall(rows, sum(len(documents[i].items) for i in rows), lambda rows=rows: call(rows))
        for rows in _slices(order, config.batch_rows)
    ]


def execute(method: str, calls: list[GenerateCall], size: int, model, bar, checkpoint: Checkpoint | None = None):
    """Run the calls (those not in the checkpoint); outputs by index, the calls' summed seconds, calls resumed."""
    outputs: list[str | None] = [None] * size
    seconds, resumed = 0.0, 0
    for k, call in enumerate(calls):
        record = checkpoint.get(method, k, call.indices) if checkpoint else None
        if record is not None:
            got, took = record["outputs"], record["seconds"]
            resumed += 1
        else:
            start = _clock(model)
            got = call.run()
            took = _clock(model) - start
            if checkpoint:
                checkpoint.add(method, k, call.indices, got, took)
        for i, text in zip(call.indices, got):
            outputs[i] = text
        seconds += took
        bar.update(call.questions)
    return outputs, seconds, resumed


def generate_rows(
    model, prompts: list[list[int]], max_new_tokens: int, eos: list[int], pad: int, stop=None
) -> list[list[int]]:
    """Plain greedy `model.generate` over left-padded independent prompts; new tokens before EOS.

    stop: optional `StoppingCriteria` for `generate` (per row).
    """
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    extra = {"stopping_criteria": StoppingCriteriaList([stop])} if stop is not None else {}
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=pad,
        **extra,
    )
    return [_until_eos(row, set(eos)) for row in out[:, width:].tolist()]


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)


def _slices(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _decode(tokenizer, answers: list[list[int]]) -> list[str]:
    return [tokenizer.decode(a, skip_special_tokens=True) for a in answers]


def _clock(model) -> float:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter()
