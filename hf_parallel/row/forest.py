"""A packed row whose prompts come and go: the prefix forest of the resident prompts and their slots.

`build_layout` lays out a fixed set of prompts once.  With continuous refill, finished
streams leave the row and waiting prompts take their room while the others decode, so
the row is a forest of resident nodes (runs of prompt tokens, and answer regions) over a
slot allocator:

    admit    a prompt walks the forest from its root: the tokens already resident (a
             document its earlier questions brought in) are reused, splitting a node
             where the prompt branches off; its new tokens and answer room take the
             smallest free region that holds them all, anywhere; where none does, the
             answer room takes one and the new tokens several, largest first, each a
             node of the chain down its prompt
    release  a finished stream's answer region is freed; so are the nodes no admitted
             stream goes through any more (`collect`, after the round's admissions, so a
             waiting prompt can still reuse the prefix its predecessors brought in), or,
             where prefixes are retained for later prompts, the least recently used of
             them once room is needed (`evict`)
    snapshot the forest as a `Layout` (segments in pre-order, ids over the row's
             capacity), which the attention backends plan from

Slot order need not follow the tree: a query sees every slot of its segment's ancestors
wherever they lie, and its own segment's slots up to its own (the stream rule), so a
freed region anywhere in the row can take any waiting prompt's tokens.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
import torch

from .layout import Layout, Segment, segment_stops


@dataclass(eq=False)
class Node:
    """Resident tokens of one run of a prefix tree (room > 0: a stream's answer region)."""

    tokens: list[int]
    parent: Node | None
    depth: int  # position of the first token
    slot: int  # first slot
    room: int = 0
    children: list[Node] = field(default_factory=list)
    users: int = 0  # admitted streams whose prompt goes through this node
    written: int = 0  # leading tokens whose K/V is in the cache
    stream: int = -1  # answer regions: the prompt index
    index: int = -1  # segment id in the latest snapshot
    used: int = 0  # the forest's admission count when a prompt last went through it (least recently used first)

    @property
    def length(self) -> int:
        return len(self.tokens) + self.room

    @property
    def end(self) -> int:
        return self.slot + self.length


class Forest:
    """The resident prompts of a row of `capacity` slots (module docstring)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.roots: list[Node] = []
        self.free: list[list[int]] = [[0, capacity]]  # sorted, disjoint [start, end)
        self.answers: dict[int, Node] = {}  # prompt index -> its answer region
        self.unwritten: list[Node] = []  # prompt nodes with tokens not yet written, parents before children
        self.split_from: dict[int, list[Node]] = {}  # tails split off pending nodes, by id, to follow them there
        self.admissions = 0

    def admit(self, index: int, prompt: list[int], room: int, spare: int = 0) -> Node | None:
        """Place prompt `index` with `room` answer slots; its answer node, or None when the free slots cannot hold
        it with `spare` more left free (room for the prompts that will share its new tokens)."""
        parent, matched = self._match(prompt)
        new = prompt[matched:]
        if self.free_slots() < len(new) + room + spare:
            return None
        whole = self._allocate(len(new) + room)  # new tokens and answer room in one region where one holds them
        if whole is not None:
            pieces, answer_at = [(whole, len(new))] if new else [], whole + len(new)
        else:
            answer_at = self._allocate(room)
            if answer_at is None:
                return None
            pieces = self._allocate_pieces(len(new))  # the free slots hold them: checked above
        done = 0
        for start, size in pieces:  # a chain of nodes, one per free region the new tokens took
            parent = self._attach(Node(new[done : done + size], parent, matched + done, start))
            self.unwritten.append(parent)
            done += size
        answer = self._attach(Node([], parent, len(prompt), answer_at, room, stream=index))
        self.admissions += 1
        node = answer
        while node is not None:
            node.users += 1
            node.used = self.admissions
            node = node.parent
        self.answers[index] = answer
        return answer

    def resident(self, prompt: list[int]) -> bool:
        """Whether some of the prompt's leading tokens are in the row."""
        return any(r.tokens and r.tokens[0] == prompt[0] for r in self.roots)

    def release(self, index: int) -> None:
        """Stream `index` finished: its answer region goes, the rest waits for `collect`."""
        node = self.answers.pop(index)
        self._detach(node)
        while node is not None:
            node.users -= 1
            node = node.parent

    def collect(self) -> None:
        """Free every node no admitted stream goes through."""
        for node in [n for n in self.nodes() if n.users == 0]:
            self._detach(node)

    def matched(self, prompt: list[int]) -> int:
        """How many of the prompt's leading tokens are resident (written or about to be), changing nothing."""
        pos, candidates = 0, self.roots
        while pos < len(prompt):
            child = next((c for c in candidates if c.tokens and c.tokens[0] == prompt[pos]), None)
            if child is None:
                break
            n = _common(child.tokens, prompt[pos:])
            pos += n
            if n < len(child.tokens):
                break
            candidates = child.children
        return pos

    def collect_unwritten(self) -> None:
        """Free the nodes no admitted stream goes through whose tokens are not all written (a prompt left before
        its prefill ended): a retained prefix must be whole to be reused."""
        for node in self.nodes():
            if node.users == 0 and node.written < len(node.tokens) and self._attached(node):
                self._detach_tree(node)

    def evict(self) -> bool:
        """Free the least recently used node that no admitted stream goes through and that has no children (a
        retained prefix's last run); False where there is none."""
        leaves = [n for n in self.nodes() if n.users == 0 and not n.children]
        if not leaves:
            return False
        self._detach(min(leaves, key=_last_use))
        return True

    def retained(self) -> int:
        """Slots held by nodes no admitted stream goes through (prefixes kept for later prompts)."""
        return sum(n.length for n in self.nodes() if n.users == 0)

    def nodes(self) -> list[Node]:
        """Every resident node in pre-order (roots, and each node's children, by slot: they are kept sorted)."""
        out, stack = [], self.roots[::-1]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children))
        return out

    def pending(self) -> list[Node]:
        """Prompt nodes whose tokens are not all written yet, parents before children."""
        if self.split_from:  # the tails split off since the last call, each right after the node it was cut from
            order, placed = [], set()

            def place(node: Node) -> None:
                order.append(node)
                placed.add(id(node))
                for rest in self.split_from.pop(id(node), ()):
                    place(rest)

            for node in self.unwritten:
                place(node)
            for rests in list(self.split_from.values()):  # cut from nodes no longer pending: after the rest
                for rest in rests:
                    if id(rest) not in placed:
                        place(rest)
            self.split_from.clear()
            self.unwritten = order
        self.unwritten = [n for n in self.unwritten if n.written < len(n.tokens) and n.users > 0]
        return self.unwritten

    def snapshot(self, max_new_tokens: int) -> Layout:
        """The resident forest as a `Layout` over the whole capacity; its prompts are the admitted streams,
        in pre-order (`streams` maps them back to prompt indices)."""
        nodes = self.nodes()
        for i, n in enumerate(nodes):
            n.index = i
        segments = [
            Segment(n.parent.index if n.parent is not None else -1, n.depth, n.tokens, n.room, slot_start=n.slot)
            for n in nodes
        ]
        for i in range(len(nodes) - 1, -1, -1):  # pre-order interval ends
            segments[i].end = max(segments[i].end, i + 1)
            if segments[i].parent >= 0:
                segments[segments[i].parent].end = max(segments[segments[i].parent].end, segments[i].end)
        answers = [n for n in nodes if n.room]
        parents = [a.parent.index if a.parent else -1 for a in answers]
        layout = Layout(
            segments,
            parents,
            [a.index for a in answers],
            [a.depth for a in answers],
            max_new_tokens,
            False,
            self.capacity,
        )
        layout.streams = [a.stream for a in answers]
        layout.kv_extent = self.extent()
        _fill_ids(layout, nodes)
        return layout

    # -- internals --

    def _match(self, prompt: list[int]) -> tuple[Node | None, int]:
        """The deepest resident prompt node the prompt runs through (split where the prompt leaves it), and how
        many of the prompt's tokens it covers."""
        parent, pos, candidates = None, 0, self.roots
        while pos < len(prompt):
            child = next((c for c in candidates if c.tokens and c.tokens[0] == prompt[pos]), None)
            if child is None:
                break
            n = _common(child.tokens, prompt[pos:])
            if n < len(child.tokens):
                rest = _split(child, n)
                if rest.written < len(rest.tokens):  # right after its parent (`pending`): parents come first
                    self.split_from.setdefault(id(child), []).insert(0, rest)
            parent, pos, candidates = child, pos + n, child.children
        return parent, pos

    def _attach(self, node: Node) -> Node:
        bisect.insort(node.parent.children if node.parent is not None else self.roots, node, key=_slot)
        return node

    def _detach(self, node: Node) -> None:
        siblings = node.parent.children if node.parent is not None else self.roots
        siblings.remove(node)
        self._free(node.slot, node.end)

    def _attached(self, node: Node) -> bool:
        while node.parent is not None:
            if node not in node.parent.children:
                return False
            node = node.parent
        return node in self.roots

    def _detach_tree(self, node: Node) -> None:
        for child in list(node.children):
            self._detach_tree(child)
        self._detach(node)

    def _allocate(self, size: int) -> int | None:
        """The start of `size` free slots at the start of the smallest free interval holding them (best fit: the
        large intervals stay whole for documents), or None."""
        fits = [i for i, (start, end) in enumerate(self.free) if end - start >= size]
        if not fits:
            return None
        return self._allocate_at(min(fits, key=lambda i: self.free[i][1] - self.free[i][0]), size)

    def _allocate_pieces(self, size: int) -> list[tuple[int, int]]:
        """(start, size) of free regions holding `size` slots (the free slots add up to at least that): one where an
        interval holds them all, else the largest intervals first (the fewest pieces)."""
        if size == 0:
            return []
        start = self._allocate(size)
        if start is not None:
            return [(start, size)]
        pieces = []
        while size:
            i = max(range(len(self.free)), key=lambda j: self.free[j][1] - self.free[j][0])
            take = min(size, self.free[i][1] - self.free[i][0])
            pieces.append((self._allocate_at(i, take), take))
            size -= take
        return pieces

    def _allocate_at(self, i: int, size: int) -> int:
        interval = self.free[i]
        start = interval[0]
        interval[0] += size
        if interval[0] == interval[1]:
            del self.free[i]
        return start

    def _free(self, start: int, end: int) -> None:
        """Return [start, end) to the sorted, disjoint free list, merged with the intervals it touches."""
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

    def used(self) -> int:
        return self.capacity - self.free_slots()

    def extent(self) -> int:
        """One past the last slot a resident node holds (at least 1: a forward's keys)."""
        last = self.free[-1] if self.free else None
        return max(1, last[0] if last is not None and last[1] == self.capacity else self.capacity)

    def free_slots(self) -> int:
        return sum(e - s for s, e in self.free)


def _slot(node: Node) -> int:
    return node.slot


def _last_use(node: Node) -> int:
    return node.used


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def _split(node: Node, at: int) -> Node:
    """Cut `node` after its first `at` tokens; the rest becomes its only child (same slots, same users)."""
    rest = Node(
        node.tokens[at:], node, node.depth + at, node.slot + at, 0, node.children, node.users, max(0, node.written - at)
    )
    for child in rest.children:
        child.parent = rest
    node.tokens, node.children, node.written = node.tokens[:at], [rest], min(node.written, at)
    return rest


def _fill_ids(layout: Layout, nodes: list[Node]) -> None:
    """slot_seg, slot_pos (capacity), seg_end, seg_stop and answer_slots of a snapshot; free slots see nothing (-1)."""
    slot_seg = np.full(layout.num_slots, -1, dtype=np.int32)
    slot_pos = np.zeros(layout.num_slots, dtype=np.int32)
    if nodes:
        starts, depths, lengths = (
            np.array(v, dtype=np.int64) for v in zip(*((n.slot, n.depth, n.length) for n in nodes))
        )
        offset = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # 0.. within each node
        slots = np.repeat(starts, lengths) + offset
        slot_seg[slots] = np.repeat(np.arange(len(nodes)), lengths)
        slot_pos[slots] = np.repeat(depths, lengths) + offset
    layout.slot_seg, layout.slot_pos = torch.from_numpy(slot_seg), torch.from_numpy(slot_pos)
    layout.seg_end = torch.tensor([s.end for s in layout.segments] or [0], dtype=torch.int32)  # one, if none
    layout.seg_stop = segment_stops(layout.segments)
    starts = [layout.segments[a].slot_start for a in layout.answer_segs]
    steps = torch.arange(layout.max_new_tokens)
    layout.answer_slots = torch.tensor(starts, dtype=torch.int64)[:, None] + steps[None] if starts else None
