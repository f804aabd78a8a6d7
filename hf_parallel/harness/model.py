"""`hf-parallel`: lm-evaluation-harness's HF backend (`HFLM`) with every request answered by hf_parallel.

The model, tokenizer, tokenization, windows and text post-processing are HFLM's own (this class is one); only the
model work differs: all requests of a call are one packed row whose shared token prefixes (few-shot examples, a
passage, a question's context) are computed once, each answer exactly what HFLM computes for that request alone.

    loglikelihood          HFLM's context/continuation split, left truncation to `max_length` + 1 tokens, then
                           `score_pairs`: log-likelihood and is_greedy of every request in calls of shared prefixes
    loglikelihood_rolling  HFLM's disjoint rolling windows of `max_length` tokens, scored as above, summed
    generate_until         HFLM's gen_kwargs, left-truncated contexts and stop sequences, then `generate_group`

A call holds every request that fits, neighbours in token order so that those sharing a prefix share a call:
`max_call_tokens` bounds its prefix tree in tokens (default: as many as the memory budget holds; on the dense
reference attention path at most DENSE_CALL_TOKENS, and requests sharing too little are kept apart, since there
every query reads every key of its call).  `batch_size`, `hf`'s requests per call, is taken and ignored, with a
one-line notice where it is not the harness's default 1.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ..attention import resolve_backend
from ..attention.reference import ReferenceBackend
from ..compat.lm_eval_internals import encode_pair
from ..decoding.inputs import check_tokens
from ..decoding.sizes import parse_memory
from ..frontends.threads import choose_threads
from .arguments import batch_size_notice, call_tokens, check_arguments
from .generation import Stops, decoding_options, generate_group
from .packing import Packing, dense_keys_per_token
from .requests import ModelArgumentError, RequestError, describe, shorten
from .scoring import score_pairs

DENSE_CALL_TOKENS = 4096  # default tokens per call on the reference path (docs/benchmarks/harness.md)
logger = logging.getLogger(__name__)


@dataclass
class Usage:
    """Requests of one type, their tokens as requested (each context in full), and the tokens the rows computed."""

    requests: int = 0
    requested_tokens: int = 0
    computed_tokens: int = 0

    def add(self, requests: int, requested: int, computed: int) -> None:
        self.requests += requests
        self.requested_tokens += requested
        self.computed_tokens += computed


@register_model("hf-parallel")
class HFParallelLM(HFLM):
    """HFLM's model arguments where they apply (`pretrained`, `dtype`, `device`, `max_length`, `trust_remote_code`,
    `batch_size` taken and ignored, and `arguments.PASSED_ON`), and hf_parallel's `max_call_tokens` (the most
    tokens of one call's prefix tree), `attn` and `max_memory`.

    Raises ModelArgumentError for an argument it does not take (`arguments.REFUSED` says why for HFLM's others)
    or a bad value.
    """

    def __init__(
        self,
        pretrained,
        dtype="auto",
        device=None,
        max_length=None,
        trust_remote_code=False,
        batch_size=1,
        max_call_tokens=None,
        attn="auto",
        max_memory=None,
        **kwargs,
    ):
        check_arguments(kwargs)
        notice = batch_size_notice(batch_size)
        if notice is not None:
            logger.warning(notice)
        tokens = call_tokens(max_call_tokens)
        if max_memory is not None:
            try:
                parse_memory(max_memory)
            except (TypeError, ValueError) as error:
                raise ModelArgumentError(f"model argument max_memory={max_memory!r}: {error}") from None
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        choose_threads(str(device))  # on the CPU: the CPUs it may use, less those other work keeps busy
        super().__init__(
            pretrained,
            dtype=dtype,
            device=device,
            max_length=max_length,
            trust_remote_code=trust_remote_code,
            batch_size=1,
            **kwargs,
        )
        if self.backend != "causal":
            raise ModelArgumentError(f"hf-parallel serves causal language models; {pretrained} is {self.backend}")
        try:
            backend = resolve_backend(attn, self.model.device)
        except ValueError as error:
            raise ModelArgumentError(f"model argument attn={attn!r}: {error}") from None
        keys_per_token = None
        if isinstance(backend, ReferenceBackend):  # its attention reads every key of a call
            tokens = tokens or DENSE_CALL_TOKENS
            keys_per_token = dense_keys_per_token(self.model.config)
        self.packing = Packing(attn, max_memory, tokens, keys_per_token)
        self.usage: dict[str, Usage] = {}  # per request type

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log-likelihood, is_greedy) of each (context, continuation) request, tokenized as HFLM does."""
        pairs = [self.encode_request(request) for request in requests]
        results = self.score([describe(r) for r in requests], pairs, "loglikelihood")
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each request's whole text over HFLM's disjoint windows of `max_length` tokens."""
        windows, owner = [], []
        for r, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            rolling = get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1)
            for window in map(make_disjoint_window, rolling):
                windows.append(window)
                owner.append(r)
        names = [describe(requests[r]) for r in owner]
        scores = self.score(names, windows, "loglikelihood_rolling")
        totals = [0.0] * len(requests)
        for r, (logprob, _) in zip(owner, scores):
            totals[r] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's text as HFLM generates it, requests with the same gen_kwargs answered together."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=repr), []).append(i)
        out: list[str | None] = [None] * len(requests)
        for members in groups.values():
            texts = self.generate_same_kwargs([requests[i] for i in members], disable_tqdm)
            for i, text in zip(members, texts):
                out[i] = text
        return out

    def generate_same_kwargs(self, requests, disable_tqdm: bool = False) -> list[str]:
        """`generate_until` for requests of one gen_kwargs, mapped to generate's options as HFLM maps them."""
        first = describe(requests[0])
        kwargs = normalize_gen_kwargs(requests[0].args[1], self.max_gen_toks)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = kwargs.pop("max_gen_toks")
        if self.max_length - max_gen_toks <= 0:
            raise RequestError(f"{first}: max_gen_toks={max_gen_toks} leaves no room in max_length={self.max_length}")
        prompts = [self.encode_context(request, self.max_length - max_gen_toks) for request in requests]
        options = decoding_options(kwargs)
        if "max_length" not in options:  # an absolute max_length (HFLM's warning aside) counts from each prompt
            options["max_new_tokens"] = max_gen_toks
        progress = False if disable_tqdm else None  # None: a bar where stderr is a terminal
        own = dict(attn=self.packing.attn, max_memory=self.packing.max_memory, progress=progress)
        try:
            tokens, computed = generate_group(
                self.model,
                self.tokenizer,
                prompts,
                Stops.of(self.tokenizer, until),
                {**options, "pad_token_id": self.tokenizer.pad_token_id, **own},
                self.packing,
            )
        except (TypeError, ValueError) as error:  # generate's refusal of a gen_kwargs option or value
            raise RequestError(f"{first}: gen_kwargs {requests[0].args[1]}: {error}") from None
        self.usage.setdefault("generate_until", Usage()).add(len(prompts), sum(map(len, prompts)), computed)
        texts = [postprocess_generated_text(self.tok_decode(t), until, None) for t in tokens]
        for request, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts

    def encode_request(self, request) -> tuple[list[int], list[int]]:
        """(context, continuation) token ids of a loglikelihood request, as HFLM's TemplateLM splits them (an empty
        context: the prefix token); RequestError for an empty continuation or one of no tokens."""
        context, continuation = request.args
        if not continuation:
            raise RequestError(f"{describe(request)}: the continuation is empty (context {shorten(context)})")
        if context:
            return encode_pair(self, context, continuation)
        tokens = self.tok_encode(continuation, add_special_tokens=False)
        if tokens and tokens[0] == self.prefix_token_id:
            return tokens[:1], tokens[1:]
        return [self.prefix_token_id], tokens

    def encode_context(self, request, max_tokens: int) -> list[int]:
        """A generate_until request's context ids as HFLM encodes one, its last `max_tokens` kept; RequestError for
        an empty one, or one that with `max_length - max_tokens` new tokens would pass the model's positions."""
        ids, _ = self.tok_batch_encode([request.args[0]], left_truncate_len=max_tokens, truncation=self.truncation)
        tokens = ids[0].tolist()
        if not tokens:
            raise RequestError(f"{describe(request)}: the context {shorten(request.args[0])} has no tokens")
        try:
            check_tokens(self.model, describe(request), tokens, room=self.max_length - max_tokens)
        except ValueError as error:  # ids outside the vocabulary, or a max_length past the model's positions
            raise RequestError(str(error)) from None
        return tokens

    def score(self, names: list[str], pairs, kind: str) -> list[tuple[float, bool]]:
        """`score_pairs` of (context, continuation) ids, each left-truncated as HFLM truncates (its last
        `max_length` + 1 tokens, the last an only target); RequestError naming a request that cannot be scored."""
        fitted = []
        for name, (context, continuation) in zip(names, pairs):
            if not context or not continuation:
                part = "context" if not context else "continuation"
                raise RequestError(f"{name}: the {part} has no tokens")
            if len(continuation) > self.max_length:
                raise RequestError(
                    f"{name}: the continuation has {len(continuation)} tokens, more than the model's window "
                    f"(max_length={self.max_length})"
                )
            tokens = (context + continuation)[-(self.max_length + 1) :]
            try:
                check_tokens(self.model, name, tokens[:-1])
            except ValueError as error:
                raise RequestError(str(error)) from None
            fitted.append((tokens[: -len(continuation)], continuation))
        scored = score_pairs(self.model, fitted, self.packing)
        requested = sum(len(context) + len(continuation) - 1 for context, continuation in fitted)
        self.usage.setdefault(kind, Usage()).add(len(fitted), requested, scored.computed_tokens)
        return scored.results
