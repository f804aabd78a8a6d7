"""Prefix tree -> segments -> slots of one packed row (pure torch, CPU).

Every prompt is split into segments by the common token prefixes of all prompts:
a segment is a maximal run of tokens shared by the same set of prompts.  Each prompt
also gets an *answer* segment (room for its generated tokens) as a child of the
segment where the prompt ends.  Segments are numbered in pre-order, so segment ``a``
is an ancestor of (or equal to) segment ``b`` iff ``a <= b < end[a]``; a query of
segment ``b`` may attend to a key of segment ``a`` exactly then (its own segment's keys
causally by slot).
For a document with questions this is DESIGN.md's rule with ``-1`` = the document.

Positions: a token's position is its index in its own full prompt (prompt length +
t for the t-th generated token), exactly what it would have alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STRIDED_STOP = 2**31 - 1  # `Layout.seg_stop` of an interleaved answer: no slot lies past it


@dataclass
class Segment:
    """A run of slots: prompt tokens shared by a set of prompts, or one stream's answer."""

    parent: int  # segment id of the parent, -1 for a root
    depth: int  # tokens before this segment in any prompt through it (= position of its first token)
    tokens: list[int]  # prompt tokens ([] for an answer segment)
    max_new_tokens: int = 0  # slots reserved for generated tokens (answer segments only)
    end: int = 0  # 1 + last segment id of this subtree (pre-order interval)
    slot_start: int = 0  # first slot (stream-major) or -1 (interleaved answers)

    @property
    def length(self) -> int:
        return len(self.tokens) + self.max_new_tokens


@dataclass
class Layout:
    """Where every token of every prompt and answer lives in the packed row.

    segments:      pre-order list of `Segment`.
    prompt_ends:   [P] segment id where prompt p ends.
    answer_segs:   [P] segment id of prompt p's answer.
    prompt_lens:   [P] token count of prompt p.
    num_slots:     total slots S (prompt tokens, each shared token once, plus answer room).
    slot_seg:      [S] int32 segment id per slot.
    slot_pos:      [S] int32 position per slot.
    seg_end:       [num_segments] int32 pre-order interval end per segment.
    seg_stop:      [num_segments] int32 one past each segment's last slot (a strided answer's: 2**31 - 1, so
                   that its own causality is by slot alone).
    answer_slots:  [P, max_new_tokens] int64 slot of the t-th generated token of prompt p.
    """

    segments: list[Segment]
    prompt_ends: list[int]
    answer_segs: list[int]
    prompt_lens: list[int]
    max_new_tokens: int
    interleaved: bool
    num_slots: int = 0
    slot_seg: torch.Tensor = field(default=None, repr=False)
    slot_pos: torch.Tensor = field(default=None, repr=False)
    seg_end: torch.Tensor = field(default=None, repr=False)
    seg_stop: torch.Tensor = field(default=None, repr=False)
    answer_slots: torch.Tensor = field(default=None, repr=False)
    # keys a forward may see: None where every segment's ancestors lie before it (up to the last query's slot);
    # a refilled row's ancestors may lie past its queries, so its snapshot gives the slots it occupies
    kv_extent: int | None = None
    # an attention backend's planning memo, filled as asked (the Triton tile planner's: segment -> its ancestor
    # chain's extents, and under "table" every segment's chain and slots as arrays)
    chains: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_ends)

    def prompt_slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots [T], token ids [T], positions [T]) of every prompt token once, in slot order."""
        slots, ids, pos = [], [], []
        for seg in self.segments:
            if seg.tokens:
                slots.append(torch.arange(seg.slot_start, seg.slot_start + len(seg.tokens)))
                ids.append(torch.tensor(seg.tokens))
                pos.append(torch.arange(seg.depth, seg.depth + len(seg.tokens)))
        return torch.cat(slots), torch.cat(ids), torch.cat(pos)

    def last_prompt_slots(self) -> torch.Tensor:
        """[P] slot of the last token of each prompt: its logits give the first new token."""
        return torch.tensor([self.segments[s].slot_start + len(self.segments[s].tokens) - 1 for s in self.prompt_ends])

    def ancestors(self, seg_id: int) -> list[int]:
        """Segment ids from the root down to `seg_id` (inclusive)."""
        chain = []
        while seg_id >= 0:
            chain.append(seg_id)
            seg_id = self.segments[seg_id].parent
        return chain[::-1]


def _common_prefix_len(sequences: list[list[int]], start: int) -> int:
    """Length of the common prefix of `sequences` (all equal on [:start]).  What the lexicographic least and
    greatest share, every sequence shares; list comparisons and slices run in C, a bisection finds the first
    difference of the two.  Below the root the sequences are compared from `start` on, as slices, where those are
    shorter than what they share: each comparison of whole sequences would walk their shared `start` tokens again
    (a document's, once per level of the tree below it)."""
    if len(sequences) == 1:
        return len(sequences[0])
    if start and max(map(len, sequences)) - start <= start:
        return start + _common_prefix_len([s[start:] for s in sequences], 0)
    lo, hi = min(sequences), max(sequences)
    same, differ = start, min(len(lo), len(hi))  # lo[:same] == hi[:same]; below, lo[:differ] != hi[:differ]
    if lo[same:differ] == hi[same:differ]:
        return differ
    while differ - same > 1:
        mid = (same + differ) // 2
        if lo[same:mid] == hi[same:mid]:
            same = mid
        else:
            differ = mid
    return same


def _grow(prompts, members, start, parent, depth, segments, prompt_ends, answer_segs, max_new_tokens):
    """Append the segment shared by `members` from token `start` and recurse into its children."""
    end = _common_prefix_len([prompts[m] for m in members], start)
    seg_id = len(segments)
    segments.append(Segment(parent, depth, prompts[members[0]][start:end]))
    for m in members:
        if len(prompts[m]) == end:  # prompt m ends here: its answer is a child of this segment
            prompt_ends[m] = seg_id
            answer_segs[m] = len(segments)
            segments.append(Segment(seg_id, end, [], max_new_tokens=max_new_tokens))
    for group in _group_by_token(prompts, [m for m in members if len(prompts[m]) > end], end):
        _grow(prompts, group, end, seg_id, end, segments, prompt_ends, answer_segs, max_new_tokens)


def _group_by_token(prompts, members, index) -> list[list[int]]:
    """Split `members` by their token at `index`, keeping first-seen order."""
    groups: dict[int, list[int]] = {}
    for m in members:
        groups.setdefault(int(prompts[m][index]), []).append(m)
    return list(groups.values())


def build_layout(prompts: list[list[int]], max_new_tokens: int, interleaved: bool = False) -> Layout:
    """Build the prefix tree of `prompts` and assign every token a slot.

    Stream-major (default): segments take consecutive slots in pre-order, so each
    answer region directly follows its question.  Interleaved (the reference paper's
    layout, kept as an ablation): prompt segments first, then the t-th answer token
    of every stream side by side.  ValueError for no prompts or an empty prompt.
    """
    if not prompts:
        raise ValueError("build_layout needs at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must have at least one token")
    lists = [[int(t) for t in p] if type(p) is not list else p for p in prompts]
    segments: list[Segment] = []
    prompt_ends, answer_segs = [-1] * len(prompts), [-1] * len(prompts)
    for group in _group_by_token(lists, list(range(len(lists))), 0):
        _grow(lists, group, 0, -1, 0, segments, prompt_ends, answer_segs, max_new_tokens)
    layout = Layout(segments, prompt_ends, answer_segs, [len(p) for p in prompts], max_new_tokens, interleaved)
    _set_intervals(layout)
    _assign_slots(layout)
    return layout


def _set_intervals(layout: Layout) -> None:
    segs = layout.segments
    for i in range(len(segs) - 1, -1, -1):
        segs[i].end = max(segs[i].end, i + 1)
        if segs[i].parent >= 0:
            segs[segs[i].parent].end = max(segs[segs[i].parent].end, segs[i].end)


def _assign_slots(layout: Layout) -> None:
    segs, n_new = layout.segments, layout.max_new_tokens
    answers = set(layout.answer_segs)
    slot = 0
    for i, seg in enumerate(segs):
        if layout.interleaved and i in answers:
            continue
        seg.slot_start = slot
        slot += seg.length
    steps = torch.arange(n_new)
    if layout.interleaved:
        for a in layout.answer_segs:
            segs[a].slot_start = -1
        answer_slots = slot + torch.arange(layout.num_prompts)[:, None] + layout.num_prompts * steps
    else:
        answer_slots = torch.tensor([segs[a].slot_start for a in layout.answer_segs])[:, None] + steps
    layout.num_slots = slot + (layout.num_prompts * n_new if layout.interleaved else 0)
    _fill_slot_ids(layout, answer_slots)


def _fill_slot_ids(layout: Layout, answer_slots: torch.Tensor) -> None:
    """Each slot's segment and position: a prompt segment's tokens from its depth on, an answer's from its prompt's
    length on (whole tensors, not one op per segment: a call may hold thousands)."""
    slot_seg = torch.full((layout.num_slots,), -1, dtype=torch.int32)
    slot_pos = torch.zeros(layout.num_slots, dtype=torch.int32)
    prompt_segs = [(i, seg) for i, seg in enumerate(layout.segments) if seg.tokens]
    lengths = torch.tensor([len(seg.tokens) for _, seg in prompt_segs], dtype=torch.int64)
    firsts = torch.tensor([[seg.slot_start, seg.depth, i] for i, seg in prompt_segs], dtype=torch.int64)
    firsts = firsts.reshape(-1, 3).repeat_interleave(lengths, dim=0)  # per prompt token: its segment's
    offsets = torch.arange(len(firsts)) - (lengths.cumsum(0) - lengths).repeat_interleave(lengths)
    slot_seg[firsts[:, 0] + offsets] = firsts[:, 2].to(torch.int32)
    slot_pos[firsts[:, 0] + offsets] = (firsts[:, 1] + offsets).to(torch.int32)
    steps = torch.arange(layout.max_new_tokens)
    slot_seg[answer_slots] = torch.tensor(layout.answer_segs, dtype=torch.int32)[:, None].expand_as(answer_slots)
    slot_pos[answer_slots] = (torch.tensor(layout.prompt_lens)[:, None] + steps).to(torch.int32)
    layout.slot_seg, layout.slot_pos, layout.answer_slots = slot_seg, slot_pos, answer_slots
    layout.seg_end = torch.tensor([s.end for s in layout.segments], dtype=torch.int32)
    layout.seg_stop = segment_stops(layout.segments)


def segment_stops(segments: list[Segment]) -> torch.Tensor:
    """[G] int32 one past each segment's last slot; a strided (interleaved) answer's: the largest int32."""
    stops = [s.slot_start + s.length if s.slot_start >= 0 else STRIDED_STOP for s in segments]
    return torch.tensor(stops or [0], dtype=torch.int32)


def layout_prompts(layout: Layout) -> list[list[int]]:
    """Every prompt of `layout`, from the segments it runs through."""
    return [[t for s in layout.ancestors(end) for t in layout.segments[s].tokens] for end in layout.prompt_ends]
