"""Keeping a model's packed row between calls, on request.

A call's memory belongs to the call: its KV buffers, slot ids and captured decode steps are
freed when it returns.  Calls that repeat (a server, a benchmark) can keep them in a
`Session`, so the captured steps replay instead of being captured again:

    with hf_parallel.Session(model) as session:
        for document, questions in corpus:
            answers = session.generate_parallel(tokenizer, document, questions)
    # the row is freed here (or by session.release())
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .graphs import StaticRow
from .layout import Layout


class Session:
    """Holds one model's packed row (CUDA only: the row that captured decode steps replay over) between calls."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.row: StaticRow | None = None

    def generate_tokens(self, prompts, **options) -> list[list[int]]:
        """`hf_parallel.generate_tokens` on the session's model, keeping its row."""
        from .generation import generate_tokens

        return generate_tokens(self.model, prompts, session=self, **options)

    def generate_parallel(self, tokenizer, document: str, questions: list[str], **options) -> list[str]:
        """`hf_parallel.generate_parallel` on the session's model, keeping its row."""
        from .prompting import generate_parallel

        return generate_parallel(self.model, tokenizer, document, questions, session=self, **options)

    def row_for(self, layout: Layout, support) -> StaticRow:
        """The kept row if `layout` fits it, else a larger one (the old one freed first)."""
        if self.row is None or not self.row.fits(self.model, layout):
            self.release()
            self.row = StaticRow.for_layout(self.model, layout, support)
        return self.row

    def row_bytes(self) -> int:
        """Device bytes the kept row's cache holds (0 without one): a call may reuse or free them."""
        return self.row.cache.stored_bytes() if self.row is not None else 0

    def release(self) -> None:
        """Free the kept row and its captured steps' memory pool."""
        if self.row is not None:
            self.row = None  # nothing else refers to it: its buffers and graph pool go now
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
