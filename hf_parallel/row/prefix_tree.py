"""A packed row whose prompts come and go: the prefix tree of the resident prompts over a slot allocator.

`FixedRow` (`row.contents`) lays a fixed set of prompts out once.  Where streams leave the row and waiting
prompts take their room while the others decode, the row is a forest of resident nodes (runs of prompt
tokens, and answer regions) over a `SlotAllocator`:

    place    a prompt walks the forest from its root: the tokens already resident (a
             document its earlier questions brought in) are reused, splitting a node
             where the prompt branches off; its new tokens and answer room take the
             smallest free region that holds them all, anywhere; where none does, the
             answer room takes one and the new tokens several, largest first, each a
             node of the chain down its prompt
    release  a stream's answer region is freed; so are the nodes no placed stream goes
             through any more (`collect`, after a round's admissions, so a waiting prompt
             can still reuse the prefix its predecessors brought in), or, where prefixes
             are retained for later prompts, the least recently used of them once room
             is needed (`evict`)
    snapshot the forest as a `Layout` (segments in pre-order, ids over the row's
             capacity), which the attention paths plan from

Slot order need not follow the tree: a query sees every slot of its segment's ancestors
wherever they lie, and its own segment's slots up to its own (the stream rule), so a
freed region anywhere in the row can take any waiting prompt's tokens.

With `split_written=False` (models with recurrent layers, whose state is kept only at the end of a
computed run) a prompt never branches off inside a node's written tokens: it shares whole nodes only.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from .contents import Eviction, PromptChunk, RowContents
from .layout import Layout, Segment, segment_stops
from .slots import SlotAllocator

_KEYS = itertools.count()  # node keys, unique in the process (a recurrent state is kept under its node's)


@dataclass(eq=False)
class Node:
    """Resident tokens of one run of a prefix tree (stream >= 0: a stream's answer region of `max_new_tokens`
    slots)."""

    tokens: list[int]
    parent: Node | None
    depth: int  # position of the first token
    slot: int  # first slot
    max_new_tokens: int = 0
    children: list[Node] = field(default_factory=list)  # by slot
    by_token: dict = field(default_factory=dict)  # the children a prompt may run into, by first token
    users: int = 0  # placed streams whose prompt goes through this node
    written: int = 0  # leading tokens whose K/V is in the cache
    stream: int = -1  # answer regions: the stream's key
    segment: int = -1  # its segment id in the latest snapshot
    used: int = 0  # the tree's placement count when a prompt last went through it (least recently used first)
    key: int = field(default_factory=lambda: next(_KEYS))

    @property
    def length(self) -> int:
        return len(self.tokens) + self.max_new_tokens

    @property
    def end(self) -> int:
        return self.slot + self.length


class PrefixTree(RowContents):
    """The resident prompts of a row of `capacity` slots (module docstring)."""

    def __init__(self, capacity: int, split_written: bool = True, eviction: Eviction | None = None):
        self.capacity, self.split_written = capacity, split_written
        self.eviction = eviction or Eviction()
        self.slots = SlotAllocator(capacity)
        self.root = Node([], None, 0, 0)  # holds the roots as its children (never a segment itself)
        self.answers: dict[int, Node] = {}  # stream key -> its answer region
        self.unwritten: list[Node] = []  # prompt nodes with tokens not yet written, parents before children
        self.split_from: dict[int, list[Node]] = {}  # tails split off pending nodes, by id, to follow them there
        self.placements = 0
        self.dirty = True
        self.gone: list[int] = []  # keys of the nodes freed since `freed`

    # -- RowContents --

    def place(self, key: int, prompt: list[int], max_new_tokens: int, spare: int = 0) -> int | None:
        parent, matched = self._match(prompt)
        new = prompt[matched:]
        if self.slots.free_slots() < len(new) + max_new_tokens + spare:
            return None
        whole = self.slots.allocate(len(new) + max_new_tokens)  # new tokens and room in one region where one holds
        if whole is not None:
            pieces, answer_at = [(whole, len(new))] if new else [], whole + len(new)
        else:
            answer_at = self.slots.allocate(max_new_tokens)
            if answer_at is None:
                return None
            pieces = self.slots.allocate_pieces(len(new))  # the free slots hold them: checked above
        done = 0
        for start, size in pieces:  # a chain of nodes, one per free region the new tokens took
            parent = self._attach(Node(new[done : done + size], parent, matched + done, start))
            self.unwritten.append(parent)
            done += size
        answer = self._attach(Node([], parent, len(prompt), answer_at, max_new_tokens, stream=key))
        self.placements += 1
        node = answer
        while node is not self.root:
            node.users += 1
            node.used = self.placements
            node = node.parent
        self.answers[key] = answer
        self.dirty = True
        return matched

    def release(self, key: int) -> None:
        node = self.answers.pop(key)
        self._detach(node)
        while node is not self.root:
            node.users -= 1
            node = node.parent

    def prefill(self, limit: int) -> PromptChunk:
        slots, tokens, runs = [], [], []
        for node in self.pending():
            take = min(len(node.tokens) - node.written, limit - len(slots))
            if take <= 0:
                break
            first = node.slot + node.written
            runs.append((node.key, _state_key(node.parent), len(slots), len(slots) + take))
            slots += range(first, first + take)
            tokens += node.tokens[node.written : node.written + take]
            node.written += take
        return PromptChunk(np.array(slots, dtype=np.int64), np.array(tokens, dtype=np.int64), runs)

    def prompt_end(self, key: int) -> tuple[int, int, int] | None:
        end = self.answers[key].parent
        if end is self.root or not _complete(end):
            return None
        return end.slot + len(end.tokens) - 1, end.tokens[-1], end.key

    def answer_slots(self, key: int) -> np.ndarray:
        node = self.answers[key]
        return np.arange(node.slot, node.end, dtype=np.int64)

    def tail_slots(self, key: int, n: int) -> np.ndarray:
        parts, node = [], self.answers[key].parent
        while n > 0 and node is not self.root:
            take = min(n, len(node.tokens))
            parts.append(np.arange(node.slot + len(node.tokens) - take, node.slot + len(node.tokens)))
            n, node = n - take, node.parent
        return np.concatenate(parts[::-1]) if parts else np.zeros(0, dtype=np.int64)

    def snapshot(self) -> Layout:
        """The resident forest as a `Layout` over the whole capacity; its prompts are the placed streams in
        pre-order (`streams`: their keys)."""
        nodes = self.nodes()
        for i, n in enumerate(nodes):
            n.segment = i
        segments = [Segment(_index(n.parent), n.depth, n.tokens, n.max_new_tokens, slot_start=n.slot) for n in nodes]
        for i in range(len(nodes) - 1, -1, -1):  # pre-order interval ends
            segments[i].end = max(segments[i].end, i + 1)
            if segments[i].parent >= 0:
                segments[segments[i].parent].end = max(segments[segments[i].parent].end, segments[i].end)
        answers = [n for n in nodes if n.stream >= 0]
        most = max((a.max_new_tokens for a in answers), default=1)
        layout = Layout(
            segments,
            [_index(a.parent) for a in answers],
            [a.segment for a in answers],
            [a.depth for a in answers],
            most,
            False,
            self.capacity,
        )
        layout.streams = [a.stream for a in answers]
        layout.kv_extent = self.slots.extent()
        _fill_ids(layout, nodes)
        self.dirty = False
        return layout

    def freed(self) -> list[int]:
        keys, self.gone = self.gone, []
        return keys

    def used(self) -> int:
        return self.slots.used()

    def retained(self) -> int:
        return sum(n.length for n in self.nodes() if n.users == 0)

    # -- admission's questions --

    def resident(self, prompt: list[int]) -> bool:
        """Whether some of the prompt's leading tokens are in the row."""
        return bool(prompt) and prompt[0] in self.root.by_token

    def matched(self, prompt: list[int]) -> int:
        """How many of the prompt's leading tokens are resident (written or about to be), changing nothing."""
        pos, node = 0, self.root
        while pos < len(prompt):
            child = node.by_token.get(prompt[pos])
            if child is None:
                break
            n = _common(child.tokens, prompt[pos:])
            if n < len(child.tokens) and not self._splits(child, n):
                break
            pos += n
            if n < len(child.tokens):
                break
            node = child
        return pos

    def empty(self) -> bool:
        return not self.root.children

    def emptied(self) -> PrefixTree:
        return PrefixTree(self.capacity, self.split_written, self.eviction)

    def free_slots(self) -> int:
        return self.slots.free_slots()

    def collect(self) -> None:
        """Free every node no placed stream goes through."""
        for node in [n for n in self.nodes() if n.users == 0]:
            self._detach(node)

    def collect_unwritten(self) -> None:
        """Free the nodes no placed stream goes through whose tokens are not all written (a prompt left before
        its prefill ended): a retained prefix must be whole to be reused."""
        for node in list(self.unwritten):  # every node not fully written is there (`pending` keeps it so)
            if node.users == 0 and node.written < len(node.tokens) and self._attached(node):
                self._detach_tree(node)

    def evict(self) -> bool:
        """Free the least recently used node that no placed stream goes through and that has no children (a
        retained prefix's last run); False where there is none."""
        leaves = [n for n in self.nodes() if n.users == 0 and not n.children]
        if not leaves:
            return False
        self._detach(min(leaves, key=_last_use))
        return True

    def nodes(self) -> list[Node]:
        """Every resident node in pre-order (roots, and each node's children, by slot: they are kept sorted)."""
        out, stack = [], self.root.children[::-1]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children))
        return out

    def pending(self) -> list[Node]:
        """Prompt nodes whose tokens are not all written yet, parents before children."""
        if self.split_from:  # the tails split off since the last call, each right after the node it was cut from
            order, placed = [], set()

            def put(node: Node) -> None:
                order.append(node)
                placed.add(id(node))
                for rest in self.split_from.pop(id(node), ()):
                    put(rest)

            for node in self.unwritten:
                put(node)
            for rests in list(self.split_from.values()):  # cut from nodes no longer pending: after the rest
                for rest in rests:
                    if id(rest) not in placed:
                        put(rest)
            self.split_from.clear()
            self.unwritten = order
        self.unwritten = [n for n in self.unwritten if n.written < len(n.tokens) and n.users > 0]
        return self.unwritten

    # -- internals --

    def _match(self, prompt: list[int]) -> tuple[Node, int]:
        """The deepest resident prompt node the prompt runs through (split where the prompt leaves it), and how
        many of the prompt's tokens it covers."""
        node, pos = self.root, 0
        while pos < len(prompt):
            child = node.by_token.get(prompt[pos])
            if child is None:
                break
            n = _common(child.tokens, prompt[pos:])
            if n < len(child.tokens):
                if not self._splits(child, n):
                    break
                rest = _split(child, n)
                self.dirty = True
                if rest.written < len(rest.tokens):  # right after its parent (`pending`): parents come first
                    self.split_from.setdefault(id(child), []).insert(0, rest)
            node, pos = child, pos + n
        if not self.split_written and pos == len(prompt) and node is not self.root and node.written == len(node.tokens):
            # its last token's logits are gone, and a recurrent state cannot run a token twice: compute it again
            node, pos = node.parent, pos - len(node.tokens)
        return node, pos

    def _splits(self, node: Node, at: int) -> bool:
        return at > 0 and (self.split_written or at >= node.written)

    def _attach(self, node: Node) -> Node:
        parent = node.parent or self.root
        node.parent = parent
        bisect.insort(parent.children, node, key=_slot)
        if node.tokens and node.tokens[0] not in parent.by_token:
            parent.by_token[node.tokens[0]] = node
        self.dirty = True
        return node

    def _detach(self, node: Node) -> None:
        parent = node.parent
        parent.children.remove(node)
        if node.tokens and parent.by_token.get(node.tokens[0]) is node:
            del parent.by_token[node.tokens[0]]
        self.slots.release(node.slot, node.end)
        self.gone.append(node.key)
        self.dirty = True

    def _attached(self, node: Node) -> bool:
        while node is not self.root:
            if node not in node.parent.children:
                return False
            node = node.parent
        return True

    def _detach_tree(self, node: Node) -> None:
        for child in list(node.children):
            self._detach_tree(child)
        self._detach(node)


def _index(node: Node | None) -> int:
    """A node's segment id, -1 for the tree's root holder."""
    return node.segment if node is not None and node.parent is not None else -1


def _state_key(node: Node) -> int | None:
    return node.key if node.parent is not None else None


def _slot(node: Node) -> int:
    return node.slot


def _last_use(node: Node) -> int:
    return node.used


def _complete(node: Node) -> bool:
    """Whether every token of `node` and of its ancestors is written."""
    while node.parent is not None:
        if node.written < len(node.tokens):
            return False
        node = node.parent
    return True


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0])


def _split(node: Node, at: int) -> Node:
    """Cut `node` after its first `at` tokens; the rest becomes its only child (same slots, same users)."""
    rest = Node(
        node.tokens[at:],
        node,
        node.depth + at,
        node.slot + at,
        0,
        node.children,
        node.by_token,
        node.users,
        max(0, node.written - at),
        used=node.used,
    )
    for child in rest.children:
        child.parent = rest
    node.tokens, node.written = node.tokens[:at], min(node.written, at)
    node.children, node.by_token = [rest], {rest.tokens[0]: rest}
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
