"""Which waiting prompts enter a row whose streams come and go (continuous refill's policy).

Prompts wait by document (the root of their prefix tree), in input order.  Admission runs
once enough of the row is free (an eighth of its slots, or of its streams where the stream
limit stopped the last admission: admitting for every finished stream would make every
round a prefill round).  It then takes documents in order, each for as long as its prompts
fit: a document continues after its resident prefix, its next prompt's question and answer
room taking any free region (the row places them, `row.forest.Forest`); a document that is
not resident starts only where the answer room of `SHARE` of its prompts stays free too,
so that it is not left with room for one question; once one document cannot start, the
documents after it wait (only resident ones go on), so a round does not try every waiting
document of a large corpus.  An empty row takes any prompt that fits it.  With
`refill=False` prompts are admitted only into an empty row (static waves).

A server's requests arrive while the row decodes (`Arrivals`): each is admitted at the next round
where its streams fit, first come first served, and finished prompts' prefixes stay resident for
later requests until their room is needed.
"""

from __future__ import annotations

from collections import deque

from ..row.forest import Forest, Node
from .budget import RowBudget, too_large

REFILL_FRACTION = 8  # admit once 1/8 of the row's slots (or, stream-bound, its streams) are free
SHARE = 2  # a document starts only where the answer room of this many of its prompts stays free too


class Admission:
    """The row's resident prompts (`forest`) and the waiting ones, by document.

    prompts: every prompt's tokens; groups: prompt indices by document, in input order; room: answer slots
    of each prompt; budget: the row's slots and most live streams.
    """

    def __init__(
        self, prompts: list[list[int]], groups: list[list[int]], room: int, budget: RowBudget, refill: bool = True
    ):
        self.prompts, self.room, self.budget, self.refill = prompts, room, budget, refill
        self.forest = Forest(budget.capacity)
        self.waiting = deque(deque(g) for g in groups if g)
        self.stream_bound = False  # the last admission stopped at the row's stream limit

    def admit(self, live: int) -> list[tuple[int, Node]]:
        """(prompt index, answer node) of the prompts admitted now, with `live` streams in the row.

        Raises ValueError when the row is empty and the next prompt does not fit it.
        """
        if not self.waiting or (live and not self._due(live)):
            return []
        admitted, collected, blocked, starts_fail = [], False, False, False
        for group in self.waiting:
            resident = self.forest.resident(self.prompts[group[0]])
            if starts_fail and not resident:  # one document could not start: later ones wait (no scan of them all)
                continue
            while group and live + len(admitted) < self.budget.streams:
                answer = self._place(group, live + len(admitted))
                if answer is None and not collected:  # free the unused prefixes (reused while resident) and retry
                    self.forest.collect()
                    collected, answer = True, self._place(group, live + len(admitted))
                if answer is None:
                    break
                admitted.append((group.popleft(), answer))
            blocked = live + len(admitted) == self.budget.streams
            if blocked or (group and not live and not admitted):
                break
            starts_fail |= bool(group) and not resident
        self.stream_bound = blocked
        self.waiting = deque(g for g in self.waiting if g)
        self.forest.collect()
        if not live and not admitted and self.waiting:
            index = self.waiting[0][0]
            raise too_large(index, len(self.prompts[index]) + self.room, self.budget)
        return admitted

    def release(self, index: int) -> None:
        """Stream `index` finished: its answer region is free (its prefix once no stream uses it)."""
        self.forest.release(index)

    def _place(self, group: deque[int], live: int) -> Node | None:
        """The answer node of the group's next prompt placed in the row, or None."""
        index, forest, room = group[0], self.forest, self.room
        prompt = self.prompts[index]
        if not live and not forest.roots:  # an empty row: anything that fits
            return forest.admit(index, prompt, room)
        if forest.resident(prompt):
            return forest.admit(index, prompt, room)
        return forest.admit(index, prompt, room, spare=min(len(group) - 1, SHARE - 1) * room)

    def _due(self, live: int) -> bool:
        if not self.refill:
            return False
        free_slots = self.budget.capacity - self.forest.used()
        free_streams = self.budget.streams - live
        due = free_slots * REFILL_FRACTION >= self.budget.capacity
        return due or (self.stream_bound and free_streams * REFILL_FRACTION >= self.budget.streams)


class Arrivals:
    """Requests arriving over time, each a set of streams admitted together, first come first served.

    A request enters once its streams fit the row (`Forest.admit` reuses whatever of its prompt is resident);
    the ones behind it wait, so none is passed over for ever.  With `retain`, the prefixes of finished streams
    stay in the row for later requests, and the least recently used go when a request needs their room.
    """

    def __init__(self, budget: RowBudget, retain: bool = True):
        self.budget, self.retain = budget, retain
        self.forest = Forest(budget.capacity)
        self.waiting: deque[list[tuple[int, list[int], int]]] = deque()
        self.matched: dict[int, int] = {}  # a request's first stream -> its prompt tokens resident when admitted

    def add(self, streams: list[tuple[int, list[int], int]]) -> None:
        """Queue one request's streams: (index, prompt tokens, answer room) each."""
        self.waiting.append(streams)

    def remove(self, indices: set[int]) -> None:
        """Take the requests with any of these stream indices out of the queue."""
        self.waiting = deque(r for r in self.waiting if not any(i in indices for i, _, _ in r))

    def admit(self, live: int) -> list[tuple[int, Node]]:
        """(stream index, answer node) of the streams admitted now, with `live` streams in the row."""
        self.forest.collect_unwritten()
        admitted = []
        while self.waiting and live + len(admitted) + len(self.waiting[0]) <= self.budget.streams:
            placed = self._place(self.waiting[0])
            if placed is None:
                break
            admitted += placed
            self.waiting.popleft()
        return admitted

    def release(self, index: int) -> None:
        """Stream `index` finished or left: its answer region is free, its prefix retained or collected."""
        self.forest.release(index)
        if not self.retain:
            self.forest.collect()

    def _place(self, streams: list[tuple[int, list[int], int]]) -> list[tuple[int, Node]] | None:
        """Every stream of one request placed, evicting retained prefixes least recently used first as needed;
        None (nothing placed) where they do not fit even then."""
        forest = self.forest
        while True:
            matched, placed = forest.matched(streams[0][1]), []
            for index, prompt, room in streams:
                answer = forest.admit(index, prompt, room)
                if answer is None:
                    break
                placed.append((index, answer))
            if len(placed) == len(streams):
                self.matched[streams[0][0]] = matched
                return placed
            for index, _ in placed:
                forest.release(index)
            forest.collect_unwritten()  # the new tokens of the streams just taken back
            if not forest.evict():
                return None
