"""Tile plan of the Triton stream-id kernel: row tiles and the KV slot ranges each may see.

Plan once, run per layer: `build_tile_plan` groups the forward's queries into row
tiles (queries of nearby segments together, so one document tile serves many
streams) and lists per tile the KV slot ranges its queries may see: the slot range of
every ancestor segment and of each query's own segment.  In the stream-major layout
those are the only slots visited, so nothing is scanned and thrown away.  An own range
is clipped in-kernel to its query's slot, so one plan over whole answer regions stays
valid for every decode step while the set of live streams is unchanged (what a
captured CUDA graph needs: `TilePlan.allocate` once, `fill_` when streams leave).

A prefill forward's long runs of one segment whose ancestors lie in the slots just before it
(a document's tokens) see an ordinary causal prefix: `causal_runs` finds them, so that any
fast causal kernel can serve them, and the tile plan leaves them out (`queries`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton

from ..row.layout import Layout
from ..row.plan import upload

MAX_BLOCK_M = 128  # rows per tile: registers for q and acc bound it
MIN_DOT_ROWS = 16  # tl.dot's fewest rows
MIN_CAUSAL_RUN = 256  # queries: a shorter run of one segment stays in the tile plan (one more SDPA call not worth it)


@dataclass(frozen=True)
class CausalRun:
    """Queries [first, stop) of a forward at slots [key_stop - (stop - first), key_stop), one segment's tokens whose
    ancestors fill the slots from `key_start` up to it: each query sees keys key_start .. its own slot (causal,
    aligned at the bottom right)."""

    first: int
    stop: int
    key_start: int
    key_stop: int


def causal_runs(layout: Layout, q_slot: torch.Tensor, min_len: int = MIN_CAUSAL_RUN) -> tuple[CausalRun, ...]:
    """The runs of at least `min_len` consecutive queries at consecutive slots of one segment whose ancestor chain
    fills the slots just before it (stream-major only: interleaved answers are strided)."""
    q = q_slot.cpu().numpy().astype(np.int64)
    if len(q) < min_len:
        return ()
    seg = layout.slot_seg.numpy()[q]
    breaks = np.flatnonzero((np.diff(q) != 1) | (np.diff(seg) != 0)) + 1
    runs = []
    for first, stop in zip(np.r_[0, breaks], np.r_[breaks, len(q)]):
        if stop - first < min_len:
            continue
        chain = [layout.segments[s] for s in layout.ancestors(int(seg[first]))]
        if any(c.slot_start < 0 for c in chain) or any(
            a.slot_start + a.length != b.slot_start for a, b in zip(chain[:-1], chain[1:])
        ):
            continue
        runs.append(CausalRun(int(first), int(stop), chain[0].slot_start, int(q[stop - 1]) + 1))
    return tuple(runs)


@dataclass
class TilePlan:
    """Row tiles of one forward and the KV slot ranges each may see (int32 tensors on the device).

    tile_query: [R, Q] query index n of each tile member (Q = block_m // group), -1 = empty.
    range_ptr:  [R + 1] tile r's ranges are rows range_ptr[r] .. range_ptr[r + 1] - 1 of `ranges`.
    ranges:     [T, 4] (start, end, clip, by_ids): slots [start, end), the end also bounded by
                q_slot[clip] + 1 when clip >= 0; by_ids = 1 where visibility is strided
                (interleaved answers) and decided from the slot ids, else by `limits`.
    limits:     [T, Q] member q of the tile sees slots [start, limits[t, q]) of range t (then causally).
    block_m:    rows per tile, each a (query, head of the GQA group) pair; group: query heads per KV head.
    max_tile_ranges: most ranges of one tile (a bound; the kernel reads that many at once).
    """

    tile_query: torch.Tensor
    range_ptr: torch.Tensor
    ranges: torch.Tensor
    limits: torch.Tensor
    block_m: int
    group: int
    max_tile_ranges: int

    @property
    def num_tiles(self) -> int:
        return self.tile_query.shape[0]

    @classmethod
    def allocate(
        cls,
        layout: Layout,
        max_queries: int,
        group: int,
        block_m: int | None = None,
        streams_per_tile: int | None = None,
        device: torch.device | str = "cuda",
    ) -> TilePlan:
        """An empty plan with room for any forward of up to `max_queries` queries over `layout` (a decode
        bucket); block_m defaults to what `build_tile_plan` picks for one query per stream."""
        rows = group * min(max_queries, streams_per_tile or max_queries)
        block_m = _block_m(group, block_m or min(max(64, triton.next_power_of_2(group)), _dot_rows(rows)))
        members = block_m // group
        per_tile = min(members, streams_per_tile or members)
        tiles, depth = -(-max_queries // per_tile), max(len(layout.ancestors(s)) for s in range(len(layout.segments)))
        ranges = max_queries * depth  # each query adds at most its segment and its ancestors
        plan = cls(
            torch.full((tiles, members), -1, dtype=torch.int32),
            torch.zeros(tiles + 1, dtype=torch.int32),
            torch.zeros(ranges, 4, dtype=torch.int32),
            torch.zeros(ranges, members, dtype=torch.int32),
            block_m,
            group,
            members * depth,
        )
        return plan.to(device)

    def fill_(self, plan: TilePlan) -> TilePlan:
        """Overwrite these buffers in place with `plan` (same block_m and group, no more tiles or ranges)."""
        if (plan.block_m, plan.group) != (self.block_m, self.group):
            raise ValueError(
                f"plan has block_m={plan.block_m}, group={plan.group}; the buffers {self.block_m}, {self.group}"
            )
        tiles, ranges = plan.num_tiles, plan.ranges.shape[0]
        if tiles > self.num_tiles or ranges > self.ranges.shape[0] or plan.max_tile_ranges > self.max_tile_ranges:
            raise ValueError(
                f"plan needs {tiles} tiles and {ranges} ranges, {plan.max_tile_ranges} a tile; the buffers hold "
                f"{self.num_tiles} and {self.ranges.shape[0]}, {self.max_tile_ranges} a tile"
            )
        plan = plan.to(self.tile_query.device)
        self.tile_query[:tiles].copy_(plan.tile_query)
        self.tile_query[tiles:].fill_(-1)
        self.range_ptr[: tiles + 1].copy_(plan.range_ptr)
        self.range_ptr[tiles + 1 :].fill_(ranges)  # tiles past the plan's own have no ranges
        self.ranges[:ranges].copy_(plan.ranges)
        self.limits[:ranges].copy_(plan.limits)
        return self

    def to(self, device) -> TilePlan:
        tensors = (self.tile_query, self.range_ptr, self.ranges, self.limits)
        return TilePlan(*(upload(t, device) for t in tensors), self.block_m, self.group, self.max_tile_ranges)


def build_tile_plan(
    layout: Layout,
    q_slot: torch.Tensor,
    group: int,
    block_m: int | None = None,
    streams_per_tile: int | None = None,
    device: torch.device | str | None = None,
    skip: tuple[CausalRun, ...] = (),
    part: str = "all",
) -> TilePlan:
    """Plan the row tiles of a forward over the queries written at `q_slot` ([N] int, any device).

    group: query heads per KV head.  block_m: rows per tile (default: 64, or the smallest
    power of two >= 16 holding the fullest tile; pass it to match preallocated buffers).
    streams_per_tile: most distinct segments (streams) per tile; None = as many as fit.
    skip: runs of queries another kernel computes (no tile holds them).
    part: "all" the segments the queries see; "shared" only those seen by queries of more than one
        segment (a document); "own" only the others (a stream's question and answer), in tiles of
        `streams_per_tile` queries.  The two parts' partial outputs merge as KV splits do (stream-major
        layouts: every segment a slot range).
    Raises ValueError for an unknown `part`, a shared or own part of a layout with strided segments, or a
    `block_m` that is not a power of two in [max(16, group), MAX_BLOCK_M].
    """
    if part not in ("all", "shared", "own"):
        raise ValueError(f"part must be 'all', 'shared' or 'own', got {part!r}")
    q_slot = q_slot.cpu().numpy().astype(np.int64)
    q_seg = layout.slot_seg.numpy()[q_slot]
    rows = _block_m(group, block_m)
    planned = np.ones(len(q_slot), dtype=bool)
    for run in skip:
        planned[run.first : run.stop] = False
    table = segment_table(layout)
    if part != "all" and table is None:
        raise ValueError("a plan of shared or own segments needs every segment a slot range (stream-major layout)")
    if (streams_per_tile is None or part != "all") and table is not None:  # segments are slot ranges: whole arrays
        order = np.argsort(q_seg, kind="stable")
        order, per_tile = order[planned[order]], min(rows // group, streams_per_tile or rows)
        if block_m is None:  # the fullest tile's rows, as below
            rows = _block_m(group, _dot_rows(group * min(max(len(order), 1), per_tile)))
        plan = _plan_arrays(table, order, q_slot, q_seg, per_tile, rows, group, part)
    else:
        tiles = _group_queries(q_seg, rows // group, streams_per_tile, planned)
        if block_m is None:  # shrink sparse tiles (one stream per tile, decode) to the smallest dot shape
            rows = _block_m(group, _dot_rows(group * max((len(t) for t in tiles), default=1)))
        ranges = [_tile_ranges(layout, members, q_slot, q_seg, rows // group) for members in tiles]
        plan = _pack(tiles, ranges, rows, group)
    return plan if device is None else plan.to(device)


@dataclass(frozen=True)
class SegmentTable:
    """A layout's segments as arrays: chains[s] = s, its parent, ... (-1 padded), and each one's slots."""

    chains: np.ndarray  # [num_segments, depth]
    start: np.ndarray  # [num_segments] first slot
    stop: np.ndarray  # [num_segments] one past the last slot
    parent: np.ndarray  # [num_segments]


def segment_table(layout: Layout) -> SegmentTable | None:
    """The layout's `SegmentTable` (kept on it), or None where a segment is strided (interleaved answers) or
    empty, which the per-tile planner handles."""
    got = layout.chains.get("table", False)
    if got is False:
        segments = layout.segments
        start = np.array([s.slot_start for s in segments], dtype=np.int64)
        stop = start + np.array([s.length for s in segments], dtype=np.int64)
        got = None
        if segments and (start >= 0).all() and (stop > start).all():
            parent = np.array([s.parent for s in segments], dtype=np.int64)
            chains = [np.arange(len(segments))]
            while (chains[-1] >= 0).any():
                up = chains[-1]
                chains.append(np.where(up >= 0, parent[np.maximum(up, 0)], -1))
            got = SegmentTable(np.stack(chains[:-1], axis=1), start, stop, parent)
        layout.chains["table"] = got
    return got


def _plan_arrays(
    table: SegmentTable,
    order: np.ndarray,
    q_slot: np.ndarray,
    q_seg: np.ndarray,
    per_tile: int,
    block_m: int,
    group: int,
    part: str = "all",
) -> TilePlan:
    """`_group_queries` and `_tile_ranges` over whole arrays, for layouts whose segments are slot ranges: the
    queries `order` cut into tiles of `per_tile`; per tile the ranges of its members' chains, a segment clipped
    at its last member's slot unless a member sees it whole, chains down the tree merged, and each member's
    limit in each range the end of the last segment of its chain there."""
    width = block_m // group
    n_tiles = -(-len(order) // per_tile)
    tile, local = np.divmod(np.arange(len(order)), per_tile)
    chain = table.chains[q_seg[order]]  # [M, depth]: each member's segment and its ancestors
    valid = chain >= 0
    if part != "all":  # a segment is shared when queries of two or more segments see it
        pairs = np.unique(np.stack([chain[valid], np.broadcast_to(q_seg[order][:, None], chain.shape)[valid]]), axis=1)
        shared = np.bincount(pairs[0], minlength=len(table.start)) > 1
        valid &= shared[np.maximum(chain, 0)] == (part == "shared")
    m_idx, k_idx = np.nonzero(valid)
    seg, own = chain[m_idx, k_idx], k_idx == 0
    key = tile[m_idx] * len(table.start) + seg  # one range per (tile, segment)
    keys, inverse = np.unique(key, return_inverse=True)
    seen_whole = np.zeros(len(keys), dtype=bool)
    seen_whole[inverse[~own]] = True
    clip = np.full(len(keys), -1, dtype=np.int64)  # the own segment: clipped at its latest member's slot
    owner, owner_key = order[m_idx[own]], inverse[own]
    by_slot = np.lexsort((-m_idx[own], q_slot[owner], owner_key))  # per key: latest slot (first member of ties) last
    last = np.r_[owner_key[by_slot][1:] != owner_key[by_slot][:-1], True] if len(by_slot) else by_slot.astype(bool)
    clip[owner_key[by_slot][last]] = owner[by_slot][last]
    clip[seen_whole] = -1
    k_tile, k_seg = keys // len(table.start), keys % len(table.start)
    start, stop = table.start[k_seg], table.stop[k_seg]
    srt = np.lexsort((start, k_tile))
    k_tile, k_seg, start, stop, clip = k_tile[srt], k_seg[srt], start[srt], stop[srt], clip[srt]
    joins = np.zeros(len(srt), dtype=bool)  # the next segment down the chain, right after the range before it
    joins[1:] = (
        (k_tile[1:] == k_tile[:-1])
        & (clip[:-1] == -1)
        & (start[1:] == stop[:-1])
        & (table.parent[k_seg[1:]] == k_seg[:-1])
    )
    merged = np.cumsum(~joins) - 1
    firsts = np.flatnonzero(~joins)
    lasts = np.r_[firsts, len(srt)][1:] - 1
    ranges = np.stack([start[firsts], stop[lasts], clip[lasts], np.zeros(len(firsts), dtype=np.int64)], axis=1)
    range_of_key = np.empty(len(keys), dtype=np.int64)
    range_of_key[srt] = merged
    limits = np.repeat(ranges[:, :1], width, axis=1)
    np.maximum.at(limits, (range_of_key[inverse], local[m_idx]), table.stop[seg])
    counts = np.bincount(k_tile[firsts], minlength=n_tiles)
    tile_query = np.full((n_tiles, width), -1, dtype=np.int64)
    tile_query[tile, local] = order
    as_int32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
    return TilePlan(
        as_int32(tile_query),
        as_int32(np.r_[0, np.cumsum(counts)]),
        as_int32(ranges),
        as_int32(limits),
        block_m,
        group,
        max(int(counts.max(initial=0)), 1),
    )


def _block_m(group: int, block_m: int | None) -> int:
    """`block_m`, or the default for `group` (64, or the group's power of two); ValueError where it cannot serve."""
    block_m = block_m or max(64, triton.next_power_of_2(group))
    if group > MAX_BLOCK_M:
        raise ValueError(f"{group} query heads per KV head exceed the kernel's {MAX_BLOCK_M} rows per tile")
    if block_m < group or block_m < 16 or block_m > MAX_BLOCK_M or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two in [max(16, group={group}), {MAX_BLOCK_M}], got {block_m}")
    return block_m


def _dot_rows(rows: int) -> int:
    return max(MIN_DOT_ROWS, triton.next_power_of_2(rows))


def _group_queries(
    q_seg: np.ndarray, per_tile: int, streams_per_tile: int | None, planned: np.ndarray
) -> list[list[int]]:
    """The planned queries in pre-order of their segment (so one subtree's streams share tiles), cut into tiles."""
    tiles, members, segs = [], [], set()
    order = np.argsort(q_seg, kind="stable")
    for n in order[planned[order]].tolist():
        new_stream = q_seg[n] not in segs
        if len(members) == per_tile or (new_stream and streams_per_tile and len(segs) == streams_per_tile):
            tiles.append(members)
            members, segs = [], set()
        members.append(n)
        segs.add(q_seg[n])
    return tiles + [members] if members else tiles


def _tile_ranges(layout: Layout, members: list[int], q_slot: np.ndarray, q_seg: np.ndarray, width: int):
    """The tile's merged ranges [T, 4] and each member's visible limit in each [T, width].

    A segment joins the range before it only if it is the child of that range's last segment and
    some member sees that one whole, so a range is a chain down the tree and what any member sees
    of it is a prefix (interleaved answer ranges, strided, never join: the ids decide there).
    """
    found: dict[tuple[int, int], list[int]] = {}  # (start, end) -> [clip, by_ids, segment]
    ends: dict[int, list[int]] = {}  # member -> end slots of the segments it sees
    by_seg: dict[int, list[int]] = {}  # segment -> its members' positions in the tile
    for j, seg in enumerate(q_seg[members].tolist()):
        by_seg.setdefault(seg, []).append(j)
    for seg in sorted(by_seg):
        own = by_seg[seg]
        clip = members[max(own, key=lambda j: q_slot[members[j]])]  # the own segment is seen up to its last query
        chain, extents, seen = _chain(layout, seg)
        for a, extent in zip(chain[:-1], extents[:-1]):
            _add_range(found, extent, a, -1, q_slot)
        _add_range(found, extents[-1], seg, clip, q_slot)
        for j in own:
            ends[j] = seen
    merged: list[list[int]] = []  # [start, end, clip, by_ids, last segment]
    for (start, end), (clip, by_ids, seg) in sorted(found.items()):
        prev = merged[-1] if merged else None
        if prev and prev[2] == -1 and start == prev[1] and layout.segments[seg].parent == prev[4] and not by_ids:
            prev[1], prev[2], prev[4] = end, clip, seg  # the next segment down the chain
        else:
            merged.append([start, end, clip, by_ids, seg])
    ranges = np.array([m[:4] for m in merged], dtype=np.int64).reshape(-1, 4)
    seen = np.full((width, max(map(len, ends.values()))), -1, dtype=np.int64)
    for j, e in ends.items():
        seen[j, : len(e)] = e
    inside = (seen[None] > ranges[:, None, None, 0]) & (seen[None] <= ranges[:, None, None, 1])
    limits = np.where(inside, seen[None], ranges[:, None, None, 0]).max(-1)  # [T, width]
    limits = np.where(ranges[:, 3:4] == 1, ranges[:, 1:2], limits)  # by ids: the ids decide
    return ranges, limits


def _chain(layout: Layout, seg: int) -> tuple[list[int], list[tuple[int, int, int]], list[int]]:
    """`seg`'s ancestors root first, each one's (start, end, by_ids) extent, and the end slots of those laid out
    stream-major (what a query of `seg` sees of them); once per segment of a layout, kept on it."""
    got = layout.chains.get(seg)
    if got is None:
        chain = layout.ancestors(seg)
        segments = [layout.segments[a] for a in chain]
        extents = [_extent(layout, s) for s in segments]
        got = layout.chains[seg] = (chain, extents, [s.slot_start + s.length for s in segments if s.slot_start >= 0])
    return got


def _extent(layout: Layout, s) -> tuple[int, int, int]:
    if s.slot_start >= 0:
        return s.slot_start, s.slot_start + s.length, 0
    # interleaved answers are strided: scan every answer slot so far (the paper's layout)
    return int(layout.answer_slots.min()), layout.num_slots, 1


def _add_range(found: dict, extent: tuple[int, int, int], seg: int, clip: int, q_slot: np.ndarray) -> None:
    start, end, by_ids = extent
    if (start, end) in found:  # one query sees all of it, or keep the later clipping query
        other = found[(start, end)][0]
        clip = -1 if -1 in (clip, other) else max(clip, other, key=lambda n: q_slot[n])
    found[(start, end)] = [clip, by_ids, seg]


def _pack(tiles: list[list[int]], ranges: list[tuple], block_m: int, group: int) -> TilePlan:
    width = block_m // group
    tile_query = torch.full((len(tiles), width), -1, dtype=torch.int32)
    for r, members in enumerate(tiles):
        tile_query[r, : len(members)] = torch.tensor(members, dtype=torch.int32)
    counts = torch.tensor([0] + [len(r) for r, _ in ranges], dtype=torch.int32)
    flat = np.concatenate([r for r, _ in ranges]) if ranges else np.zeros((0, 4))
    limits = np.concatenate([lim for _, lim in ranges]) if ranges else np.zeros((0, width))
    as_int32 = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(torch.int32)  # noqa: E731
    return TilePlan(
        tile_query,
        counts.cumsum(0).to(torch.int32),
        as_int32(flat),
        as_int32(limits),
        block_m,
        group,
        max(int(counts.max()), 1),
    )
