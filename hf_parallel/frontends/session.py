"""`Session`: a model's packed row kept between calls, on request.

A call's memory belongs to the call: its KV buffers, slot ids and captured decode steps are freed when it
returns.  Calls that repeat (a server, a benchmark) can keep them in a session, so that the captured steps
replay instead of being captured again:

    with hf_parallel.Session(model) as session:
        for document, questions in corpus:
            answers = session.generate_parallel(tokenizer, document, questions)
    # the row is freed here (or by session.release())
"""

from __future__ import annotations

from ..runner.rows import RowKeeper
from .generate import generate_tokens
from .prompting import generate_parallel


class Session(RowKeeper):
    """One model's packed row (CUDA only: the row captured decode steps replay over), kept between calls made
    through the session; `release()` or leaving the `with` block frees it."""

    def generate_tokens(self, prompts, **options) -> list[list[int]]:
        """`hf_parallel.generate_tokens` on the session's model, keeping its row."""
        return generate_tokens(self.model, prompts, session=self, **options)

    def generate_parallel(self, tokenizer, document: str, questions: list[str], **options) -> list[str]:
        """`hf_parallel.generate_parallel` on the session's model, keeping its row."""
        return generate_parallel(self.model, tokenizer, document, questions, session=self, **options)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
