"""Which requests go into one call: neighbours in token order, so that requests sharing a prefix share a call.

Sorted by their tokens, sequences that share a prefix are neighbours, and the prefix tree of a run of them holds
each sequence's tokens less its common prefix with the one before: the size of a call is known as it grows.
On an attention path that reads every key of its call (the dense reference), a sequence's new tokens also read
the keys of every unrelated sequence beside them, so there a sequence joins a call only where what it shares saves
more than that reading costs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from transformers import PretrainedConfig


@dataclass(frozen=True)
class Packing:
    """How requests are packed into calls.

    attn:        the attention path ("auto", "reference", "triton"), as in `GenerationOptions`.
    max_memory:  the memory a call may take (bytes or "40GiB"); None: what the device has free.
    call_tokens: the most tokens of one call's prefix tree; None: as many as the memory budget holds.
    keys_per_token: on the dense reference path, `dense_keys_per_token` of the model (`calls_by_prefix`); else None.
    """

    attn: str = "auto"
    max_memory: int | str | None = None
    call_tokens: int | None = None
    keys_per_token: float | None = None


def calls_by_prefix(
    sequences: list[list[int]], cap: int | None, keys_per_token: float | None = None
) -> list[list[int]]:
    """Indices into `sequences` per call, in token order, each call's prefix tree at most `cap` tokens (None: no
    bound); a sequence longer than `cap` gets a call of its own.

    keys_per_token: where a call's every query reads every key of the call, how many keys cost as much as a token's
    other work (`dense_keys_per_token`); a sequence then joins the call only where its shared tokens save at least
    what its new tokens' reading of the call's keys costs (shared * keys_per_token >= new * call size)."""
    order = sorted(range(len(sequences)), key=sequences.__getitem__)
    calls: list[list[int]] = []
    size, previous = 0, []
    for i in order:
        tokens = sequences[i]
        shared = len(os.path.commonprefix([previous, tokens]))  # works on lists: the longest common prefix
        grow = len(tokens) - shared
        fits = cap is None or size + grow <= cap
        worth = keys_per_token is None or shared * keys_per_token >= grow * size
        if calls and fits and worth:
            calls[-1].append(i)
            size += grow
        else:
            calls.append([i])
            size = len(tokens)
        previous = tokens
    return calls


def tree_tokens(sequences: list[list[int]]) -> int:
    """Tokens of the prefix tree of `sequences` (each shared prefix once)."""
    ordered = sorted(sequences)
    return sum(len(b) - len(os.path.commonprefix([a, b])) for a, b in zip([[]] + ordered, ordered))


def dense_keys_per_token(config: PretrainedConfig) -> float:
    """A token's matrix work (projections and MLP, FLOPs per layer) over one query's attention to one key."""
    config = config.get_text_config()
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    inner = getattr(config, "intermediate_size", None) or 4 * hidden
    inner = inner if isinstance(inner, int) else max(inner)
    projections = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, k, v and o
    return 2 * (projections + 3 * hidden * inner) / (4 * heads * head_dim)  # a key: q.k and p.v for every head
