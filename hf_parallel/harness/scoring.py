"""Log-likelihood and greedy flag of (context, continuation) token pairs, in calls that fit the memory budget.

The pairs go into calls of neighbours in token order (`calls_by_prefix`), each call one prefix tree scored by
`score_tree` in forwards of the attention path's prefill size, so that pairs sharing a prefix compute it once.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from ..attention import resolve_backend
from ..frontends.probe import check_support
from ..frontends.scoring import score_tree
from ..runner.sizing import size_row
from .packing import Packing, calls_by_prefix


@dataclass
class Scored:
    """Per pair (log-likelihood, is_greedy), in input order, and the tokens the calls ran (shared prefixes once)."""

    results: list[tuple[float, bool]]
    computed_tokens: int


def score_pairs(model: PreTrainedModel, pairs: list[tuple[list[int], list[int]]], packing: Packing) -> Scored:
    """Sum of log p(continuation | context) and whether every continuation token is the argmax, per pair.

    pairs: (context, continuation) token lists, both non-empty, checked by the caller against the model's
    vocabulary and positions.  Each result equals a plain forward of that pair alone (float32 log-probabilities).
    Raises ValueError where `packing.max_memory` holds not even one short call.
    """
    if not pairs:
        return Scored([], 0)
    backend = resolve_backend(packing.attn, model.device)
    chunk = backend.prefill_chunk
    row = size_row(model, check_support(model), chunk, packing.max_memory, streams=chunk)
    chunk = min(chunk, row.streams)  # a forward's logits rows, float32 [chunk, V], are in the budget's streams
    cap = row.capacity if packing.call_tokens is None else min(row.capacity, packing.call_tokens)
    sequences = [context + continuation[:-1] for context, continuation in pairs]
    results: list[tuple[float, bool] | None] = [None] * len(pairs)
    computed = 0
    for call in calls_by_prefix(sequences, cap, packing.keys_per_token):
        contexts = [pairs[i][0] for i in call]
        scores = score_tree(model, contexts, [[pairs[i][1]] for i in call], backend, chunk)
        for i, (logprobs,), (greedy,) in zip(call, scores.token_logprobs, scores.greedy):
            results[i] = float(logprobs.sum()), greedy
        computed += scores.computed_tokens
    return Scored(results, computed)
