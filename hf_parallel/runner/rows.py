"""The packed row a call's captured rounds replay over, and keeping it between calls.

A call's memory belongs to the call: its KV buffers, slot ids and captured rounds are freed
when it returns.  Calls that repeat (a server, a benchmark) can keep them in a `RowKeeper` (the
public `hf_parallel.Session` is one), so that captured rounds replay instead of being captured again.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..row.cache import PackedCache
from ..row.layout import Layout
from ..row.plan import SlotIds, upload
from .graphs import RoundGraphs

ROW_ROUNDING = 2048  # slots: a row grows in these steps, so similar calls share captured graphs


class StaticRow:
    """A packed row of fixed capacity (cache + slot-id buffers) and its captured rounds.

    A call makes one, or takes a `RowKeeper`'s, which keeps it for later calls while it is large
    enough.  Slots past the current layout carry segment -1, so no query sees them.
    """

    def __init__(self, model: PreTrainedModel, capacity: int, cache: PackedCache):
        """A row of `capacity` slots over `cache` (of as many slots) for `model`."""
        self.capacity, self.dtype = capacity, model.dtype
        self.cache = cache
        self.ids = SlotIds(
            torch.full((capacity,), -1, dtype=torch.int32, device=model.device),
            torch.zeros(capacity, dtype=torch.int32, device=model.device),
            torch.zeros(capacity, dtype=torch.int32, device=model.device),
            torch.zeros(capacity, dtype=torch.int32, device=model.device),
        )
        self.graphs = RoundGraphs()

    def fits(self, model: PreTrainedModel, slots: int) -> bool:
        return self.capacity >= slots and self.dtype == model.dtype

    @classmethod
    def for_slots(cls, model: PreTrainedModel, slots: int, new_cache) -> StaticRow:
        """A row of at least `slots` slots, rounded up so that later, similar calls fit it too; `new_cache(slots)`
        makes its cache (`ModelProfile.cache`)."""
        capacity = -(-slots // ROW_ROUNDING) * ROW_ROUNDING
        return cls(model, capacity, new_cache(capacity))

    def load(self, layout: Layout) -> SlotIds:
        """Write `layout`'s ids into the static buffers (behind the queued work, without waiting for it); ids of the
        full capacity."""
        n, g = layout.num_slots, len(layout.segments)
        self.ids.slot_seg[n:].fill_(-1)
        for buffer, values in (
            (self.ids.slot_seg[:n], layout.slot_seg),
            (self.ids.slot_pos[:n], layout.slot_pos),
            (self.ids.seg_end[:g], layout.seg_end[:g]),
            (self.ids.seg_stop[:g], layout.seg_stop[:g]),
        ):
            buffer.copy_(upload(values, buffer.device))
        return self.ids


class RowKeeper:
    """Holds one model's `StaticRow` between calls (CUDA only: the row that captured rounds replay over)."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.row: StaticRow | None = None

    def row_for(self, slots: int, new_cache) -> StaticRow:
        """The kept row if it holds `slots` slots, else a larger one (the old one freed first); `new_cache`: as for
        `StaticRow.for_slots`."""
        if self.row is None or not self.row.fits(self.model, slots):
            self.release()
            self.row = StaticRow.for_slots(self.model, slots, new_cache)
        return self.row

    def row_bytes(self) -> int:
        """Device bytes the kept row's cache holds (0 without one): a call may reuse or free them."""
        return self.row.cache.stored_bytes() if self.row is not None else 0

    def release(self) -> None:
        """Free the kept row and its captured rounds' memory pool."""
        if self.row is not None:
            self.row = None  # nothing else refers to it: its buffers and graph pool go now
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
