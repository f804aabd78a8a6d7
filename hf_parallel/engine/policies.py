"""Admission policies: which waiting requests join the row, and when.  A policy orders and picks; the row's memory,
its contents (`row.contents`: a `FixedRow` or a `PrefixTree`), places what it picks and says whether it fits.

Every policy is an `AdmissionPolicy`: requests are `add`ed, and at each round `admit` returns those placed now.
Five ship:

    AllAtOnce  one call's prompts, laid out at once (a `FixedRow`): every request joins at the first round.
    Waves      prompts wait by document (the root of their prefix tree), in input order, and join only an
               empty row, as many documents as fit: static waves, the baseline.
    Refill     as Waves, and once enough of the row is free (an eighth of its slots, or of its streams where
               the stream limit stopped the last admission: admitting for every finished stream would make
               every round a prefill round) waiting documents take the room finished streams left, each for
               as long as its prompts fit: continuous refill.  A document continues after its resident prefix;
               one that is not resident starts only where the answer room of `SHARE` of its prompts stays
               free too, so that it is not left with room for one question; once one document cannot start,
               the documents after it wait (only resident ones go on), so a round does not try every waiting
               document of a large corpus.
    Arrivals   a server's requests, first come first served: each joins at the next round where all its
               streams fit (retained prefixes freed as the row's `Eviction` says); the ones behind it wait,
               so none is passed over for ever.
    Priority   Arrivals in the order of each request's `priority` (lower first, as vLLM's), then of arrival.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import deque

from ..row.contents import RowContents
from ..runner.sizing import RowSize, too_large
from .stats import Stats

REFILL_FRACTION = 8  # admit once 1/8 of the row's slots (or, stream-bound, its streams) are free
SHARE = 2  # a document starts only where the answer room of this many of its prompts stays free too


class AdmissionPolicy(ABC):
    """Which waiting requests join the row, and when (module docstring).  `stats`: the row's `Stats`, which the
    policy counts its refills in."""

    def __init__(self, stats: Stats | None = None):
        self.stats = stats if stats is not None else Stats()

    @abstractmethod
    def add(self, request) -> None:
        """Keep `request` waiting."""

    @abstractmethod
    def admit(self, memory: RowContents, live: int) -> list:
        """The requests placed in `memory` now, with `live` streams in the row.  ValueError where the row is empty
        and the next request does not fit it."""

    @abstractmethod
    def queued(self) -> list:
        """The requests waiting, in the order they would join."""

    def waiting(self) -> int:
        """How many requests wait."""
        return len(self.queued())

    def remove_cancelled(self) -> list:
        """Take the cancelled requests out of the queue; those taken."""
        return []

    def place(self, memory: RowContents, request, spare: int = 0, evict: bool = False) -> bool:
        """Every key of `request` placed in `memory` (the first leaving `spare` slots free), or none: whether they
        were (each try counted in `stats.placements`); with `evict`, retained prefixes go until it fits."""
        while True:
            self.stats.placements += 1
            matched = memory.place_all(request.keys(), request.prompt, request.room, spare)
            if matched is not None:
                request.cached = matched
                return True
            if not (evict and memory.free_retained()):
                return False


class AllAtOnce(AdmissionPolicy):
    """Every request of one call joins at the first round, in a `FixedRow` laid out for them all."""

    def __init__(self, stats: Stats | None = None):
        super().__init__(stats)
        self.requests: list = []

    def add(self, request) -> None:
        self.requests.append(request)

    def admit(self, memory: RowContents, live: int) -> list:
        admitted, self.requests = [r for r in self.requests if self.place(memory, r)], []
        return admitted

    def queued(self) -> list:
        return self.requests


class Refill(AdmissionPolicy):
    """Documents in input order, admitted as room frees up (module docstring); `size`: the row's slots and most
    live streams.  Requests of one document share their `document` number, consecutive."""

    def __init__(self, size: RowSize, stats: Stats | None = None):
        super().__init__(stats)
        self.size = size
        self.documents: deque[deque] = deque()
        self.stream_bound = False  # the last admission stopped at the row's stream limit

    def add(self, request) -> None:
        if not self.documents or self.documents[-1][-1].document != request.document:
            self.documents.append(deque())
        self.documents[-1].append(request)

    def queued(self) -> list:
        return [r for d in self.documents for r in d]

    def waiting(self) -> int:
        return sum(len(d) for d in self.documents)

    def due(self, memory: RowContents, live: int) -> bool:
        """Whether waiting documents may join a row of `live` streams (an empty row takes them always)."""
        due = (self.size.capacity - memory.used()) * REFILL_FRACTION >= self.size.capacity
        free_streams = self.size.streams - live
        return due or (self.stream_bound and free_streams * REFILL_FRACTION >= self.size.streams)

    def admit(self, memory: RowContents, live: int) -> list:
        if not self.documents or (live and not self.due(memory, live)):
            return []
        admitted, streams, collected, blocked, starts_fail = [], live, False, False, False
        for document in self.documents:
            resident = memory.resident(document[0].prompt)
            if starts_fail and not resident:  # one document could not start: later ones wait (no scan of them all)
                continue
            while document and streams + document[0].n <= self.size.streams:
                placed = self._place(memory, document, streams)
                if not placed and not collected:  # free the unused prefixes (reused while resident), retry
                    memory.collect()
                    collected, placed = True, self._place(memory, document, streams)
                if not placed:
                    break
                admitted.append(document.popleft())
                streams += admitted[-1].n
            blocked = bool(document) and streams + document[0].n > self.size.streams
            if blocked or (document and not live and not admitted):
                break
            starts_fail |= bool(document) and not resident
        self.stream_bound = blocked
        self.stats.refills += bool(live and admitted)
        self.documents = deque(d for d in self.documents if d)
        memory.collect()
        if not live and not admitted and self.documents:
            request = self.documents[0][0]
            raise too_large(request.streams[0].index // request.n, len(request.prompt) + request.room, self.size)
        return admitted

    def _place(self, memory: RowContents, document: deque, live: int) -> bool:
        """The document's next request placed; whether it was."""
        request = document[0]
        empty = not live and memory.empty()  # an empty row: anything that fits
        spare = 0 if empty or memory.resident(request.prompt) else min(len(document) - 1, SHARE - 1) * request.room
        return self.place(memory, request, spare)


class Waves(Refill):
    """`Refill` that admits only into an empty row: static waves."""

    def due(self, memory: RowContents, live: int) -> bool:
        return False


class Arrivals(AdmissionPolicy):
    """A server's requests, first come first served (module docstring); `max_streams`: most live streams."""

    def __init__(self, max_streams: int, stats: Stats | None = None):
        super().__init__(stats)
        self.max_streams = max_streams
        self.requests: list = []

    def add(self, request) -> None:
        self.requests.append(request)

    def queued(self) -> list:
        return list(self.requests)

    def waiting(self) -> int:
        return len(self.requests)

    def remove_cancelled(self) -> list:
        gone = [r for r in self.requests if r.cancelling]
        if gone:
            self.requests = [r for r in self.requests if not r.cancelling]
        return gone

    def admit(self, memory: RowContents, live: int) -> list:
        memory.collect_unwritten()
        taken = 0
        for request in self.requests:
            if live + request.n > self.max_streams or not self.place(memory, request, evict=True):
                break
            live, taken = live + request.n, taken + 1
        admitted, self.requests = self.requests[:taken], self.requests[taken:]
        return admitted


class Priority(Arrivals):
    """`Arrivals` by each request's `priority`, lower first, then by arrival (module docstring)."""

    def add(self, request) -> None:
        bisect.insort(self.requests, request, key=lambda r: r.priority)
