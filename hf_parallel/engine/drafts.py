"""Drafters: where a drafting group's streams get their drafts (`DraftingGroup` verifies them).

    LookupDrafter     prompt lookup: each stream's draft from its own history (`decoding.drafting.PromptLookup`),
                      a document's n-grams indexed once for all its streams.
    AssistantDrafter  an assistant model's greedy tokens, decoded in one more packed row that the core drives
                      beside the model's: the same layout, every prompt chunk computed there too, then per
                      round each stream's accepted tokens the assistant has not seen, and one token a stream a
                      forward, its own argmax, as many forwards as the longest draft asked; a draft stops at EOS.

A stream's draft tokens are its queries at the slots after its answer so far, so the stream rule is unchanged;
the K/V of tokens a verification rejects lies past the stream's answer, where no query looks before the next
forward writes over it.  What a drafter knows of a stream is the stream's (`Stream.lookup`, `Stream.seen`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..decoding.drafting import PromptLookup, Speculation, shared_prefixes
from ..row.contents import PromptChunk
from ..row.layout import Layout
from ..row.plan import upload
from ..runner.model_runner import ForwardInputs, ModelRunner
from .streams import Accepted, Stream


class LookupDrafter:
    """Prompt lookup's drafts for a group's `streams`, ending before any of `eos`."""

    def __init__(self, speculation: Speculation, streams: list[Stream], eos: list[int]):
        self.num_tokens, self.adaptive = speculation.num_tokens, speculation.adaptive
        prompts = [s.prompt for s in streams]
        self.lookup = PromptLookup(speculation, prompts, eos, shared_prefixes(prompts))
        for i, stream in enumerate(streams):
            stream.lookup = i

    def drafts(self, streams: list[Stream], limits: list[int]) -> list[list[int]]:
        return [self.lookup.draft(s.lookup, k) for s, k in zip(streams, limits)]

    def accepted(self, accepted: Accepted) -> None:
        for stream, tokens in zip(accepted.streams, accepted.tokens):
            self.lookup.extend(stream.lookup, tokens)


class AssistantDrafter:
    """An assistant model's greedy drafts, in a packed row of its own that follows the model's (module docstring).

    runner: the assistant's `ModelRunner` over as many slots as the model's row; vocab: the model's vocabulary
    (a draft token past it ends the draft); eos: the ids a draft ends before.
    """

    def __init__(self, runner: ModelRunner, speculation: Speculation, vocab: int, eos: list[int]):
        self.runner, self.vocab, self.eos = runner, vocab, set(eos)
        self.num_tokens, self.adaptive = speculation.num_tokens, speculation.adaptive

    def relayout(self, layout: Layout) -> None:
        self.runner.relayout(layout)

    def prefill(self, chunk: PromptChunk) -> None:
        """The model's prompt chunk, computed in the assistant's row too."""
        if len(chunk.slots):
            tokens = upload(torch.from_numpy(chunk.tokens), self.runner.device)
            self.runner.forward(
                ForwardInputs(chunk.slots, tokens, np.array([len(chunk.slots) - 1]), prompt_tokens=len(tokens))
            )

    def drafts(self, streams: list[Stream], limits: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in streams]
        rows = [r for r, k in enumerate(limits) if k > 0]
        if not rows:
            return drafts
        new = [streams[r].tokens[streams[r].seen :] for r in rows]  # what it has not seen
        slots = np.concatenate([streams[r].slots[streams[r].seen : len(streams[r].tokens)] for r in rows])
        ids = [t for tokens in new for t in tokens]
        keep = np.cumsum([len(tokens) for tokens in new]) - 1
        for r in rows:
            streams[r].seen = len(streams[r].tokens)
        for step in range(max(limits[r] for r in rows)):
            tokens = upload(torch.tensor(ids, dtype=torch.long), self.runner.device)
            chosen = self.runner.forward(ForwardInputs(slots, tokens, keep)).argmax(-1).tolist()
            going = []
            for r, token in zip(rows, chosen):
                if token in self.eos or token >= self.vocab:  # the draft ends before it
                    continue
                drafts[r].append(token)
                if len(drafts[r]) < limits[r]:
                    going.append((r, token))
            if not going:
                break
            rows = [r for r, _ in going]
            slots = np.array([streams[r].slots[len(streams[r].tokens) + step] for r in rows], dtype=np.int64)
            ids, keep = [token for _, token in going], None
        return drafts

    def accepted(self, accepted: Accepted) -> None:
        """Nothing: the next round feeds the stream's accepted tokens again (its drafted ones over their own K/V)."""
