"""What a packed row holds, as the engine asks it: where each stream's prompt and answer lie, which prompt tokens
are still to compute, and the `Layout` the attention paths plan from.

Two kinds of row hold prompts: `FixedRow`, laid out once by `build_layout` (every prompt placed at the start,
none leaving: one call's row, in any layout, the paper's interleaved one included), and `row.prefix_tree`'s
`PrefixTree`, whose prompts come and go over a slot allocator.  A stream is known by a key (an int the engine
gives it); a prompt token's K/V is *written* once a forward has computed it.  The row's contents are its memory's
one owner: the engine's admission policies ask them to place a request's keys (`place_all`), and what stays
resident once no stream uses it is an `Eviction` policy's to say.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from .layout import Layout


@dataclass
class PromptChunk:
    """Prompt tokens to compute in one forward, parents before children.

    slots, tokens: [T] int64 (host).
    runs:          (state key, parent's state key or None, first, end): the tokens [first, end) of one run of a
                   segment, for layers with a recurrent state (a segment continues from its own state if it has
                   one, else from its parent's).
    """

    slots: np.ndarray
    tokens: np.ndarray
    runs: list[tuple[int, int | None, int, int]]


class Eviction:
    """Prompts no stream uses stay resident for later streams; where room is needed, the least recently used go
    first (`RowContents.evict`)."""

    def released(self, contents: RowContents) -> None:
        """A stream left `contents`."""
        return None

    def free_one(self, contents: RowContents) -> bool:
        """Free a retained prompt; whether there was one."""
        return contents.evict()


class KeepNothing(Eviction):
    """A prompt is freed as soon as no stream uses it (models whose recurrent states would stay with it)."""

    def released(self, contents: RowContents) -> None:
        contents.collect()

    def free_one(self, contents: RowContents) -> bool:
        return False


class RowContents(ABC):
    """The prompts a row holds and where (module docstring).  `dirty`: the layout changed since `snapshot`;
    `eviction`: what stays of prompts no stream uses."""

    capacity: int
    dirty: bool = True
    eviction: Eviction = Eviction()

    def place_all(self, keys: list[int], prompt: list[int], max_new_tokens: int, spare: int = 0) -> int | None:
        """Place every key with `prompt` and answer room (the first leaving `spare` slots free), or none: how many of
        the prompt's tokens were resident, or None."""
        matched = self.matched(prompt)
        for i, key in enumerate(keys):
            if self.place(key, prompt, max_new_tokens, spare if i == 0 else 0) is None:
                for placed in keys[:i]:
                    self.release(placed)
                return None
        return matched

    def leave(self, key: int) -> None:
        """Key `key` left: `release`, then what `eviction` does."""
        self.release(key)
        self.eviction.released(self)

    def free_retained(self) -> bool:
        """Free what a placement that failed may take: unwritten prompts no stream uses, then what `eviction` gives
        up; whether a placement may try again."""
        self.collect_unwritten()
        return self.eviction.free_one(self)

    @abstractmethod
    def place(self, key: int, prompt: list[int], max_new_tokens: int, spare: int = 0) -> int | None:
        """Place stream `key`'s prompt and answer room; how many of its prompt tokens were resident already, or
        None where it does not fit with `spare` slots left free."""

    @abstractmethod
    def release(self, key: int) -> None:
        """Stream `key` left: its answer room is free (its prompt once no stream uses it)."""

    @abstractmethod
    def prefill(self, limit: int) -> PromptChunk:
        """Up to `limit` prompt tokens not yet written, parents first, now counted as written."""

    @abstractmethod
    def prompt_end(self, key: int) -> tuple[int, int, int] | None:
        """(slot, token id, state key) of stream `key`'s last prompt token once all of its prompt is written."""

    @abstractmethod
    def answer_slots(self, key: int) -> np.ndarray:
        """[max_new_tokens] int64, the slot of each of stream `key`'s new tokens."""

    @abstractmethod
    def tail_slots(self, key: int, n: int) -> np.ndarray:
        """[n] int64, the slots of the last `n` tokens of stream `key`'s prompt (scoring reads their outputs)."""

    @abstractmethod
    def snapshot(self) -> Layout:
        """The row as a `Layout` over its whole capacity."""

    def freed(self) -> list[int]:
        """The state keys of segments no later forward continues from, since the last call (models with recurrent
        layers keep a state per segment until then)."""
        return []

    def used(self) -> int:
        """Slots the resident prompts and answers hold."""
        return self.capacity

    def retained(self) -> int:
        """Of which prompts no stream uses any more, kept for later streams."""
        return 0

    def matched(self, prompt: list[int]) -> int:
        """How many of the prompt's leading tokens are resident (written or about to be), changing nothing."""
        return 0

    def resident(self, prompt: list[int]) -> bool:
        """Whether some of the prompt's leading tokens are in the row."""
        return False

    def empty(self) -> bool:
        """Whether no prompt is resident."""
        return False

    def collect(self) -> None:
        """Free every prompt no placed stream goes through."""
        return None

    def collect_unwritten(self) -> None:
        """Free the prompts no placed stream goes through whose tokens are not all written."""
        return None

    def evict(self) -> bool:
        """Free one retained prompt; whether there was one."""
        return False

    def emptied(self) -> RowContents:
        """An empty row of the same kind and capacity."""
        raise NotImplementedError(f"{type(self).__name__} does not outlive a failed forward")


class FixedRow(RowContents):
    """A row laid out once (`build_layout`): stream p is the layout's prompt p, placed from the start."""

    def __init__(self, layout: Layout):
        self.layout, self.capacity = layout, layout.num_slots
        self.slots, self.tokens, _ = (t.numpy() for t in layout.prompt_slots())  # in slot order: prefill's
        self.seg = layout.slot_seg.numpy()
        self.last = layout.last_prompt_slots().numpy()
        self.written = 0  # prompt tokens written, in slot order
        # each prompt segment's subtree's last prompt token, in prefill order: past it, no forward needs its state
        done = np.full(len(layout.segments), -1, dtype=np.int64)
        index = np.full(layout.num_slots, -1, dtype=np.int64)
        index[self.slots] = np.arange(len(self.slots))
        for i in range(len(layout.segments) - 1, -1, -1):
            seg = layout.segments[i]
            if seg.tokens:
                done[i] = max(done[i], index[seg.slot_start + len(seg.tokens) - 1])
            if seg.parent >= 0:
                done[seg.parent] = max(done[seg.parent], done[i])
        prompt = np.flatnonzero(done >= 0)
        self.done_order = prompt[np.argsort(done[prompt], kind="stable")]
        self.done_at = np.sort(done[prompt])
        self.gone = 0  # segments of done_order freed

    def place(self, key: int, prompt: list[int], max_new_tokens: int, spare: int = 0) -> int | None:
        return 0

    def release(self, key: int) -> None:
        pass

    def prefill(self, limit: int) -> PromptChunk:
        lo, hi = self.written, min(self.written + limit, len(self.slots))
        self.written = hi
        slots, tokens = self.slots[lo:hi], self.tokens[lo:hi]
        if not len(slots):
            return PromptChunk(slots, tokens, [])
        seg = self.seg[slots]
        bounds = np.flatnonzero(np.diff(seg)) + 1
        firsts, ends = np.r_[0, bounds], np.r_[bounds, len(slots)]
        parents = [self.layout.segments[s].parent for s in seg[firsts].tolist()]
        runs = [
            (int(s), p if p >= 0 else None, int(a), int(b)) for s, p, a, b in zip(seg[firsts], parents, firsts, ends)
        ]
        return PromptChunk(slots, tokens, runs)

    def freed(self) -> list[int]:
        upto = int(np.searchsorted(self.done_at, self.written))  # subtrees written whole: their streams started
        keys, self.gone = self.done_order[self.gone : upto].tolist(), max(self.gone, upto)
        return keys

    def prompt_end(self, key: int) -> tuple[int, int, int] | None:
        slot = int(self.last[key])
        index = int(np.searchsorted(self.slots, slot))  # prompt slots are sorted: prefill order is slot order
        if index >= self.written:
            return None
        return slot, int(self.tokens[index]), self.layout.prompt_ends[key]

    def answer_slots(self, key: int) -> np.ndarray:
        return self.layout.answer_slots[key].numpy()

    def tail_slots(self, key: int, n: int) -> np.ndarray:
        parts, seg_id = [], self.layout.prompt_ends[key]
        while n > 0:
            seg = self.layout.segments[seg_id]
            take = min(n, len(seg.tokens))
            stop = seg.slot_start + len(seg.tokens)
            parts.append(np.arange(stop - take, stop))
            n, seg_id = n - take, seg.parent
        return np.concatenate(parts[::-1]) if parts else np.zeros(0, dtype=np.int64)

    def snapshot(self) -> Layout:
        self.dirty = False
        return self.layout
