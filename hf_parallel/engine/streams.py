"""What the engine core tracks: requests, their streams, and what one round hands to the next stage.

A `Request` is what a front end submits: a prompt, generate's options for it and `n` streams answering it
(or, to score, how many of the prompt's last tokens to score).  Each `Stream` is one answer in the making,
one object with a `Status` from the moment it waits until it is done.  A round's stages hand each other
typed records: `Feed` (a group's tokens for the forward), `Chosen` (its choices, on the device) and
`Accepted` (on the host, a round late).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..decoding.options import GenerationOptions
from ..decoding.sampling import Sampler


class Status(enum.Enum):
    WAITING = "waiting"  # queued, not placed in the row
    PREFILL = "prefill"  # placed: its prompt's tokens being computed
    DECODE = "decode"  # choosing its tokens, one or a verified draft each round
    DONE = "done"  # stopped: its tokens are its answer
    CANCELLED = "cancelled"  # left before it was done
    FAILED = "failed"  # its request failed


ENDED = (Status.DONE, Status.CANCELLED, Status.FAILED)


def _ignore(kind: str, value) -> None:
    pass


@dataclass(eq=False)
class Request:
    """A prompt, generate's options for it (resolved: `GenerationOptions`), and `n` streams answering it.

    max_new_tokens: each stream's most new tokens (generate's, for this prompt).
    options:        the options as a client gave them, which a server's engine checks into `opts`.
    score:          score the prompt's last `score` tokens instead (each row's log-probability of the token
                    after it, `targets`); no stream generates.
    on_event(kind, value), on the engine's thread:
        "start", cached      its streams entered the row; `cached` of the prompt's tokens were resident
        "tokens", [(j, id)]  this round's new tokens of its streams j
        "finish", j          stream j stopped (its tokens so far are its answer)
        "done", None         every stream stopped
        "error", exception   the request failed; nothing follows
    """

    prompt: list[int]
    opts: GenerationOptions | None  # None until the engine has checked `options`
    n: int = 1
    max_new_tokens: int = 1
    on_event: Callable[[str, object], None] = _ignore
    options: dict = field(default_factory=dict)  # generate's options as given, where the engine checks them
    score: int = 0
    targets: list[int] = field(default_factory=list)
    group: int = 0  # the requests of one document share a number (admission keeps them together)
    streams: list[Stream] = field(default_factory=list)
    sampler: Sampler | None = None
    cancelled: bool = False
    error: Exception | None = None
    cached: int = 0
    scores: tuple[np.ndarray, np.ndarray] | None = None  # scoring: log-probabilities and greedy flags, when done
    left: int = 0  # scoring: positions not read yet

    def cancel(self) -> None:
        """Take the request out of the queue or the row at the next round (any thread)."""
        self.cancelled = True

    @property
    def open(self) -> int:
        """Streams not ended."""
        return sum(s.status not in ENDED for s in self.streams)


@dataclass(eq=False)
class Stream:
    """One answer of a request: where it stands (`status`), and its tokens so far (host, read a round late).

    key:   the engine's number for it (its place in the row is looked up by it); index: the caller's.
    slots: [max_new_tokens] the slot of each of its new tokens, once placed.
    lane:  its recurrent state's row, for models with recurrent layers.
    """

    key: int
    request: Request
    answer: int  # which of its request's n answers it is
    index: int = -1
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)
    slots: np.ndarray | None = None
    lane: int = -1

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt

    @property
    def max_new_tokens(self) -> int:
        return self.request.max_new_tokens


@dataclass
class Feed:
    """A group's part of a round's forward: its streams' tokens at their slots (`rows[i]` tokens of stream i)."""

    slots: np.ndarray  # [T] int64 host
    tokens: torch.Tensor  # [T] int64 device
    rows: np.ndarray  # [n] int64, tokens per stream (1, or 1 + its draft)


@dataclass
class Chosen:
    """A group's choices in one round, on the device: for each of `streams`, `tokens` [n, J] of which the first
    `counts` [n] are accepted, and whether the stream stops within them (`stops` [n] bool)."""

    streams: list[Stream]
    tokens: torch.Tensor
    counts: torch.Tensor
    stops: torch.Tensor


@dataclass
class Accepted:
    """One stream's tokens of a round, on the host: `tokens` accepted, and whether it stopped with them."""

    stream: Stream
    tokens: list[int]
    stopped: bool
