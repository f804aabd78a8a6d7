"""The free slots of a packed row: a sorted list of disjoint free intervals, best-fit allocation.

A row whose prompts come and go (`row.prefix_tree`) asks for a run of slots for each piece it places and gives
it back when the piece leaves; freed intervals merge with their neighbours.
"""

from __future__ import annotations

import bisect


class SlotAllocator:
    """The free slots of a row of `capacity` slots, as sorted, disjoint [start, end) intervals."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free: list[list[int]] = [[0, capacity]] if capacity else []

    def allocate(self, size: int) -> int | None:
        """The start of `size` free slots at the start of the smallest free interval holding them (best fit: the
        large intervals stay whole for documents), or None.  No slots (size 0): slot 0, nothing taken."""
        if size == 0:
            return 0
        fits = [i for i, (start, end) in enumerate(self.free) if end - start >= size]
        if not fits:
            return None
        return self._take(min(fits, key=lambda i: self.free[i][1] - self.free[i][0]), size)

    def allocate_pieces(self, size: int) -> list[tuple[int, int]]:
        """(start, size) of free regions holding `size` slots, which the free slots must add up to: one where an
        interval holds them all, else the largest intervals first (the fewest pieces)."""
        if size == 0:
            return []
        start = self.allocate(size)
        if start is not None:
            return [(start, size)]
        pieces = []
        while size:
            i = max(range(len(self.free)), key=lambda j: self.free[j][1] - self.free[j][0])
            take = min(size, self.free[i][1] - self.free[i][0])
            pieces.append((self._take(i, take), take))
            size -= take
        return pieces

    def release(self, start: int, end: int) -> None:
        """Give back [start, end), merged with the free intervals it touches."""
        if end <= start:
            return
        free = self.free
        i = bisect.bisect_left(free, [start, end])
        lo, hi = i, i  # free[lo:hi] merge with the new interval
        if lo > 0 and free[lo - 1][1] >= start:
            lo -= 1
        while hi < len(free) and free[hi][0] <= end:
            hi += 1
        if lo < hi:
            start, end = min(start, free[lo][0]), max(end, free[hi - 1][1])
        free[lo:hi] = [[start, end]]

    def free_slots(self) -> int:
        return sum(e - s for s, e in self.free)

    def used(self) -> int:
        return self.capacity - self.free_slots()

    def extent(self) -> int:
        """One past the last slot in use (at least 1: a forward's keys)."""
        last = self.free[-1] if self.free else None
        return max(1, last[0] if last is not None and last[1] == self.capacity else self.capacity)

    def _take(self, i: int, size: int) -> int:
        interval = self.free[i]
        start = interval[0]
        interval[0] += size
        if interval[0] == interval[1]:
            del self.free[i]
        return start
