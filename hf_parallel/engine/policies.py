"""Admission policies: which waiting requests' streams join the row, and when.

Every policy is an `AdmissionPolicy`: requests are `add`ed, and at each round `admit` places the streams that
join now in the row's contents (`row.contents`), returning them.  Four ship:

    AllAtOnce  one call's prompts laid out once (`FixedRow`): every stream joins at the first round.
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
               streams fit; the ones behind it wait, so none is passed over for ever.  With `retain`, the
               prefixes of finished streams stay for later requests, the least recently used going first
               when a request needs their room.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from ..row.contents import FixedRow, RowContents
from ..row.prefix_tree import PrefixTree
from ..runner.sizing import RowSize, too_large
from .stats import Stats
from .streams import Request, Status, Stream

REFILL_FRACTION = 8  # admit once 1/8 of the row's slots (or, stream-bound, its streams) are free
SHARE = 2  # a document starts only where the answer room of this many of its prompts stays free too


class AdmissionPolicy(ABC):
    """Which waiting requests' streams join the row held in `contents`, and when (module docstring).

    Streams get keys in the order their requests are added (a `FixedRow`'s prompt order).  `stats`: the row's
    `Stats` (a fresh one unless given), which the policy counts its placements and refills in, and the engine core
    running it its rounds."""

    contents: RowContents

    def __init__(self, contents: RowContents, stats: Stats | None = None):
        self.contents = contents
        self.keys = 0
        self.stats = stats if stats is not None else Stats()

    def add(self, request: Request) -> None:
        """Queue `request`, its streams made (and keyed)."""
        for j in range(max(request.n, 1)):
            request.streams.append(Stream(self.keys, request, j))
            self.keys += 1
        self.queue(request)

    @abstractmethod
    def queue(self, request: Request) -> None:
        """Keep `request` waiting."""

    @abstractmethod
    def admit(self, live: int) -> list[Stream]:
        """The streams placed now, with `live` streams in the row (their request's whole, together).  ValueError
        where the row is empty and the next request does not fit it."""

    @abstractmethod
    def queued(self) -> list[Request]:
        """The requests waiting."""

    def waiting(self) -> int:
        """How many requests wait."""
        return len(self.queued())

    def remove_cancelled(self) -> list[Request]:
        """Take the cancelled requests out of the queue; those taken."""
        return []

    def reset(self) -> None:
        """Empty the row (a failed forward left its contents unknown); waiting requests stay."""
        raise NotImplementedError(f"{type(self).__name__} does not outlive a failed forward")

    def release(self, stream: Stream) -> None:
        """`stream` left the row: its answer room is free (its prompt once no stream uses it)."""
        self.contents.release(stream.key)

    def placed(self, request: Request, matched: int) -> list[Stream]:
        for stream in request.streams:
            stream.status, stream.slots = Status.PREFILL, self.contents.answer_slots(stream.key)
        request.cached = matched
        return request.streams


class AllAtOnce(AdmissionPolicy):
    """Every stream of one call joins at the first round, in a `FixedRow` laid out for them all."""

    def __init__(self, contents: FixedRow, stats: Stats | None = None):
        super().__init__(contents, stats)
        self.requests: list[Request] = []

    def queue(self, request: Request) -> None:
        self.requests.append(request)

    def admit(self, live: int) -> list[Stream]:
        admitted = [s for r in self.requests for s in self.placed(r, 0)]
        self.requests = []
        return admitted

    def queued(self) -> list[Request]:
        return self.requests


class Refill(AdmissionPolicy):
    """Documents in input order, admitted as room frees up (module docstring); `size`: the row's slots and most
    live streams.  Requests of one document share their `group` number, consecutive."""

    def __init__(self, contents: PrefixTree, size: RowSize, stats: Stats | None = None):
        super().__init__(contents, stats)
        self.tree, self.size = contents, size
        self.documents: deque[deque[Request]] = deque()
        self.stream_bound = False  # the last admission stopped at the row's stream limit

    def queue(self, request: Request) -> None:
        if not self.documents or self.documents[-1][-1].group != request.group:
            self.documents.append(deque())
        self.documents[-1].append(request)

    def queued(self) -> list[Request]:
        return [r for d in self.documents for r in d]

    def waiting(self) -> int:
        return sum(len(d) for d in self.documents)

    def due(self, live: int) -> bool:
        """Whether waiting documents may join a row of `live` streams (an empty row takes them always)."""
        free_slots = self.size.capacity - self.tree.used()
        due = free_slots * REFILL_FRACTION >= self.size.capacity
        free_streams = self.size.streams - live
        return due or (self.stream_bound and free_streams * REFILL_FRACTION >= self.size.streams)

    def admit(self, live: int) -> list[Stream]:
        if not self.documents or (live and not self.due(live)):
            return []
        admitted, collected, blocked, starts_fail = [], False, False, False
        for document in self.documents:
            resident = self.tree.resident(document[0].prompt)
            if starts_fail and not resident:  # one document could not start: later ones wait (no scan of them all)
                continue
            while document and live + len(admitted) + document[0].n <= self.size.streams:
                matched = self._place(document, live + len(admitted))
                if matched is None and not collected:  # free the unused prefixes (reused while resident), retry
                    self.tree.collect()
                    collected, matched = True, self._place(document, live + len(admitted))
                if matched is None:
                    break
                admitted += self.placed(document.popleft(), matched)
            blocked = bool(document) and live + len(admitted) + document[0].n > self.size.streams
            if blocked or (document and not live and not admitted):
                break
            starts_fail |= bool(document) and not resident
        self.stream_bound = blocked
        self.stats.refills += bool(live and admitted)
        self.documents = deque(d for d in self.documents if d)
        self.tree.collect()
        if not live and not admitted and self.documents:
            request = self.documents[0][0]
            raise too_large(request.streams[0].key, len(request.prompt) + request.max_new_tokens, self.size)
        return admitted

    def _place(self, document: deque[Request], live: int) -> int | None:
        """The document's next request placed (each of its streams); the prompt tokens resident, or None."""
        request, tree = document[0], self.tree
        if not live and not tree.root.children:  # an empty row: anything that fits
            spare = 0
        elif tree.resident(request.prompt):
            spare = 0
        else:
            spare = min(len(document) - 1, SHARE - 1) * request.max_new_tokens
        self.stats.placements += 1
        return _place_all(tree, request, spare)


class Waves(Refill):
    """`Refill` that admits only into an empty row: static waves."""

    def due(self, live: int) -> bool:
        return False


class Arrivals(AdmissionPolicy):
    """A server's requests, first come first served (module docstring)."""

    def __init__(self, contents: PrefixTree, max_streams: int, retain: bool = True, stats: Stats | None = None):
        super().__init__(contents, stats)
        self.tree, self.max_streams, self.retain = contents, max_streams, retain
        self.requests: deque[Request] = deque()

    def queue(self, request: Request) -> None:
        self.requests.append(request)

    def queued(self) -> list[Request]:
        return list(self.requests)

    def waiting(self) -> int:
        return len(self.requests)

    def remove_cancelled(self) -> list[Request]:
        gone = [r for r in self.requests if r.cancelled]
        if gone:
            self.requests = deque(r for r in self.requests if not r.cancelled)
        return gone

    def reset(self) -> None:
        self.contents = self.tree = PrefixTree(self.tree.capacity, self.tree.split_written)

    def admit(self, live: int) -> list[Stream]:
        self.tree.collect_unwritten()
        admitted = []
        while self.requests and live + len(admitted) + self.requests[0].n <= self.max_streams:
            request = self.requests[0]
            matched = self._place(request)
            if matched is None:
                break
            admitted += self.placed(request, matched)
            self.requests.popleft()
        return admitted

    def release(self, stream: Stream) -> None:
        super().release(stream)
        if not self.retain:
            self.tree.collect()

    def _place(self, request: Request) -> int | None:
        """Every stream of the request placed, evicting retained prefixes least recently used first as needed;
        None (nothing placed) where they do not fit even then."""
        while True:
            self.stats.placements += 1
            matched = _place_all(self.tree, request, 0)
            if matched is not None:
                return matched
            self.tree.collect_unwritten()  # the new tokens of the streams just taken back
            if not self.tree.evict():
                return None


def _place_all(tree: PrefixTree, request: Request, spare: int) -> int | None:
    """Every stream of `request` placed (the first with `spare` slots left free), or none of them: the prompt
    tokens resident before, or None."""
    matched = tree.matched(request.prompt)
    for i, stream in enumerate(request.streams):
        if tree.place(stream.key, request.prompt, request.max_new_tokens, spare if i == 0 else 0) is None:
            for placed in request.streams[:i]:
                tree.release(placed.key)
            return None
    return matched
