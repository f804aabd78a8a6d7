"""What the engine core tracks, each in one place: requests, their streams, and what one round hands to the next.

A `Request` is what a front end submits: a prompt, generate's options for it and `n` streams answering it; a
`ScoreRequest` asks for log-probabilities at a prompt's last positions instead, and generates nothing.  Each
`Stream` is one answer in the making, and holds everything that is the stream's: its request, its tokens, its
slots, its status, its draft and its processors, under one key (how many tokens its group has chosen for it, the
group keeps, and the stream reads).  A round's
stages hand each other typed records: `Feed` (a group's tokens for the forward), a group's device record
(`Chosen`, `Scored`), and per stream `Accepted` (on the host, a round late).
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
LIVE = (Status.PREFILL, Status.DECODE)


def _ignore(kind: str, value) -> None:
    pass


@dataclass(eq=False)
class Request:
    """A prompt, generate's options for it (checked: `GenerationOptions`), and `n` streams answering it.

    status:          WAITING until placed, PREFILL once placed, then DONE, CANCELLED or FAILED (with `error`).
    max_new_tokens:  each stream's most new tokens (generate's, for this prompt).
    document:        the requests of one document share a number (admission keeps them together).
    priority:        lower goes first where the admission policy orders by it (`Priority`).
    on_event(kind, value), on the engine's thread:
        "start", cached      its streams entered the row; `cached` of the prompt's tokens were resident
        "tokens", [(j, id)]  this round's new tokens of its streams j
        "finish", j          stream j stopped (its tokens so far are its answer)
        "done", None         every stream stopped
        "error", exception   the request failed; nothing follows
    """

    prompt: list[int]
    opts: GenerationOptions
    n: int = 1
    max_new_tokens: int = 1
    on_event: Callable[[str, object], None] = _ignore
    document: int = 0
    priority: int = 0
    sampler: Sampler | None = None
    options: dict = field(default_factory=dict)  # generate's options as a client gave them, until checked into opts
    status: Status = Status.WAITING
    streams: list[Stream] = field(default_factory=list)
    error: Exception | None = None
    cached: int = 0
    cancelling: bool = False  # asked to leave (any thread); the engine ends it at its next round

    room = property(lambda self: self.max_new_tokens)  # the answer slots each of its keys takes in the row

    def cancel(self) -> None:
        """Take the request out of the queue or the row at the next round (any thread)."""
        self.cancelling = True

    def make_streams(self, keys) -> None:
        self.streams = [Stream(next(keys), self, j, limit=self.max_new_tokens) for j in range(self.n)]

    def holders(self) -> list:
        """What holds its keys in the row: its streams."""
        return self.streams

    def keys(self) -> list[int]:
        return [h.key for h in self.holders()]

    def started(self, scheduler, slots: list[np.ndarray]) -> None:
        """Placed: its streams wait for their prompt's last logits (`slots`: each one's answer slots)."""
        self.status = Status.PREFILL
        for stream, answer in zip(self.streams, slots):
            stream.status, stream.slots = Status.PREFILL, answer
            scheduler.starting.append(stream)

    def end(self, status: Status, error: Exception | None = None) -> None:
        """Every stream not ended ends with `status` (cancelled or failed), and so does the request."""
        for stream in self.streams:
            if stream.status not in ENDED:
                stream.status = status
        self.status, self.error = status, error

    @property
    def open(self) -> int:
        """Streams not ended."""
        return sum(s.status not in ENDED for s in self.streams)


@dataclass(eq=False)
class ScoreRequest(Request):
    """Log-probabilities at the prompt's last `len(targets)` positions: position i's of token `targets[i]` and whether
    it is that row's argmax (`Scores`), and with `full` its whole log-softmax row.  It generates nothing (no opts, no
    streams): its prompt takes one key in the row, with no answer room, and it ends once every position is read."""

    n: int = 0
    max_new_tokens: int = 0
    targets: list[int] = field(default_factory=list)
    full: bool = False
    key: int = -1
    lane: int = -1
    scores: Scores | None = None
    left: int = 0  # positions not read yet

    request = property(lambda self: self)

    def make_streams(self, keys) -> None:
        self.key = next(keys)

    def holders(self) -> list:
        return [self]

    def started(self, scheduler, slots: list[np.ndarray]) -> None:
        self.status, n = Status.PREFILL, len(self.targets)
        self.left = n
        self.scores = Scores(np.zeros(n, dtype=np.float32), np.zeros(n, dtype=bool), [None] * n if self.full else None)
        scheduler.scores.add(self, scheduler.memory.tail_slots(self.key, n))

    @property
    def open(self) -> int:
        return int(self.status not in ENDED)


@dataclass
class Scores:
    """A `ScoreRequest`'s answer: per position, the target's log-probability and whether it was the argmax; with
    `full`, the whole rows [positions, V]."""

    logprobs: np.ndarray
    greedy: np.ndarray
    rows: list[np.ndarray] | None = None


@dataclass(eq=False, slots=True)
class Stream:
    """One answer of a request, and all that is its own (the row, the groups and the drafters keep nothing of it).

    key:         its key in the row (its prompt and answer room are found by it); index: the caller's number.
    limit:       its most new tokens (its request's `max_new_tokens`, as checked).
    tokens:      its accepted tokens (host, read a round late).
    chosen:      tokens its group has chosen for it on the device: `len(tokens)` once read, a round ahead before
                 (kept by its group, `ChoiceGroup.count`, where it is `group`'s stream `row`).
    slots:       [limit] the slot of each of its new tokens, once placed.
    lane:        its recurrent state's row, for models with recurrent layers.
    draft:       the draft it fed this round; draft_limit: its most draft tokens (adaptive).
    lookup:      its row in its group's prompt lookup; seen: its answer tokens an assistant's row holds.
    processors:  generate's processors and criteria for its prompt (`Prepared`), which its group runs batched.
    """

    key: int
    request: Request
    answer: int  # which of its request's n answers it is
    index: int = -1
    limit: int = 0
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)
    group: object = None
    row: int = -1
    slots: np.ndarray | None = None
    lane: int = -1
    draft: list[int] = field(default_factory=list)
    draft_limit: int = 0
    lookup: int = -1
    seen: int = 0
    processors: object = None

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt

    @property
    def chosen(self) -> int:
        return int(self.group.count[self.row]) if self.group is not None else len(self.tokens)


@dataclass
class Feed:
    """A group's part of a round's forward: its streams' tokens at their slots (`rows[i]` tokens of stream i)."""

    slots: np.ndarray  # [T] int64 host
    tokens: torch.Tensor  # [T] int64 device
    rows: np.ndarray  # [n] int64, tokens per stream (1, or 1 + its draft)


@dataclass
class Chosen:
    """A choice group's choices in one round, on the device: for each of its streams, `tokens` [n, J] of which the
    first `counts` [n] are accepted, and whether the stream stops within them (`stops` [n] bool).  Read on the host
    as the same record of arrays."""

    tokens: torch.Tensor
    counts: torch.Tensor
    stops: torch.Tensor


@dataclass
class Scored:
    """A score group's values in one round, on the device: the log-probability and the argmax flag of each
    (request, position) read (`logprobs` [R], `greedy` [R]), and the whole rows [F, V] of the full ones."""

    logprobs: torch.Tensor
    greedy: torch.Tensor
    rows: torch.Tensor


@dataclass
class Accepted:
    """A group's tokens of a round, on the host: for each of `streams`, its `tokens` accepted and whether it
    stopped with them (`stopped`)."""

    streams: list[Stream]
    tokens: list[list[int]]
    stopped: list[bool]
