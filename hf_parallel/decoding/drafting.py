"""Drafts for speculative decoding: each stream's next tokens guessed from its own history (prompt lookup).

A stream's history is its prompt, then its answer so far.  Its draft follows the earliest earlier occurrence
of the history's last n tokens (n from `max_matching_ngram_size` down to 1): the tokens that came after it
there, at most k of them, cut before the first EOS.  That is what transformers' `PromptLookupCandidateGenerator`
proposes for a prompt asked alone; each stream reads only its own history.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NAMES = ("prompt_lookup_num_tokens", "max_matching_ngram_size")  # generate's names for prompt-lookup decoding


@dataclass(frozen=True)
class Speculation:
    """How streams draft.

    num_tokens: most draft tokens a stream offers a forward (`prompt_lookup_num_tokens`).
    max_ngram:  longest tail matched in the history (`max_matching_ngram_size`; generate's default 2).
    adaptive:   each stream's draft limit follows its acceptance: +2 (up to num_tokens) after a forward that
                accepted its whole draft, -1 (down to 1) after one that did not.  False: always num_tokens.
    assistant:  the drafts are an assistant model's greedy tokens (`num_assistant_tokens`), not prompt lookup.
    """

    num_tokens: int
    max_ngram: int = 2
    adaptive: bool = True
    assistant: bool = False

    def __post_init__(self):
        if self.num_tokens < 1:
            name = "num_assistant_tokens" if self.assistant else "prompt_lookup_num_tokens"
            raise ValueError(f"{name} must be >= 1, got {self.num_tokens}")
        if self.max_ngram < 1:
            raise ValueError(f"max_matching_ngram_size must be >= 1, got {self.max_ngram}")


class PromptLookup:
    """Every stream's history and its n-grams' first occurrences; `draft` looks one up.

    The first start of each n-gram (n <= max_ngram) is kept as the history grows, so a draft is one dictionary
    lookup per n, not a scan of the history.  A prefix that several streams share (a document) is indexed once:
    `shared[s]` names stream s's prefix (a key, its tokens); what follows it is the stream's own.
    """

    def __init__(self, speculation: Speculation, prompts: list, eos_ids=(), shared: list | None = None):
        self.max_ngram = speculation.max_ngram
        self.eos = frozenset(int(e) for e in eos_ids)
        self.history: list[list[int]] = []
        self.first: list[dict[tuple, int]] = []  # each stream's own n-grams (those starting in its prefix too)
        self.base: list[dict[tuple, int]] = []  # the n-grams of the stream's shared prefix (shared, read only)
        indexed: dict = {}
        for s, prompt in enumerate(prompts):
            prompt = [int(t) for t in prompt]
            key, prefix = shared[s] if shared is not None else (None, ())
            prefix = [int(t) for t in prefix]
            if prompt[: len(prefix)] != prefix:
                raise ValueError(f"stream {s}'s shared prefix does not start its prompt")
            if key not in indexed:
                indexed[key] = _first_starts(prefix, self.max_ngram)
            self.base.append(indexed[key])
            self.history.append(prefix)
            self.first.append({})
            self.extend(s, prompt[len(prefix) :])

    def extend(self, stream: int, tokens: list[int]) -> None:
        """Append `tokens` to a stream's history."""
        history, first, base = self.history[stream], self.first[stream], self.base[stream]
        for token in tokens:
            history.append(token)
            end = len(history)
            for n in range(1, min(self.max_ngram, end) + 1):
                gram = tuple(history[end - n :])
                if gram not in base:
                    first.setdefault(gram, end - n)

    def draft(self, stream: int, k: int) -> list[int]:
        """Up to `k` tokens guessed to follow the stream's history (none where no tail recurs)."""
        history, first, base = self.history[stream], self.first[stream], self.base[stream]
        end = len(history)
        if k < 1:
            return []
        for n in range(min(self.max_ngram, end - 1), 0, -1):
            gram = tuple(history[end - n :])
            start = base.get(gram, first.get(gram))
            if start is not None and start < end - n:  # an earlier occurrence than the tail itself
                draft = history[start + n : min(start + n + k, end)]
                for i, token in enumerate(draft):
                    if token in self.eos:
                        return draft[:i]
                return draft
        return []


def shared_prefixes(prompts: list[list[int]]) -> list[tuple[int, list[int]]]:
    """For each prompt, (a key, the prefix it shares with every other prompt of its first token): a document's
    tokens, which `PromptLookup` indexes once for all the streams that read it."""
    groups: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt[0], []).append(i)
    shared = [None] * len(prompts)
    for first, members in groups.items():
        prefix = prompts[members[0]]
        for i in members[1:]:
            n = min(len(prefix), len(prompts[i]))
            if prefix[:n] != prompts[i][:n]:
                n = int(np.flatnonzero(np.asarray(prefix[:n]) != np.asarray(prompts[i][:n]))[0])
            prefix = prefix[:n]
        for i in members:
            shared[i] = (first, prefix if len(members) > 1 else [])
    return shared


def _first_starts(tokens: list[int], max_ngram: int) -> dict[tuple, int]:
    """The first start of every n-gram (n <= max_ngram) of `tokens`."""
    first: dict[tuple, int] = {}
    for n in range(1, max_ngram + 1):
        for start in range(len(tokens) - n, -1, -1):  # the last write of a key is its first start
            first[tuple(tokens[start : start + n])] = start
    return first
