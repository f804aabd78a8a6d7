"""The scheduler: which streams a round feeds, and which prompt tokens it computes.

Before each round the streams that ended leave their groups and the row (`retire`); the admission policy picks
waiting requests and the row's memory places them (`engine.policies`, `row.contents`); then the round feeds every
group's streams (`engine.groups`: each one's newest token, or its draft) and up to `chunk` prompt tokens not yet
written, and a stream whose prompt is complete joins a group with its prompt's last logits.  `schedule` hands the
engine core a `Round`: the forward's inputs, the logits rows of each group, the row's new layout if it changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from ..decoding.logits import eos_only
from ..models.recurrent import SegmentRuns
from ..row.contents import PromptChunk, RowContents
from ..row.layout import Layout
from ..row.plan import upload
from ..runner.graphs import bucket
from ..runner.model_runner import ForwardInputs, next_signature
from .drafts import LookupDrafter
from .groups import ChoiceGroup, DraftingGroup, GreedyGroup, ProcessedGroup, ScoreGroup
from .policies import AdmissionPolicy
from .streams import ENDED, LIVE, Request, Status, Stream


@dataclass
class Round:
    """A round's schedule: each group fed or joined with its logits rows (its fed tokens', then its joining
    streams'), the prompt slots scored, the forward's inputs, the prompt chunk, the row's layout where it changed
    (None: as it was), and how many streams it feeds."""

    parts: list[tuple[ChoiceGroup, int]]
    inputs: ForwardInputs
    scored: np.ndarray
    chunk: PromptChunk
    layout: Layout | None
    fed: int


class Scheduler:
    """The requests of one row: `policy` picks them, `memory` (the row's contents) places them, their streams choose
    in groups (module docstring).  chunk: most prompt tokens a round computes; recurrent: the model has recurrent
    layers (their decoding streams take a lane each of `lanes`); drafter: the assistant's `AssistantDrafter`, where
    a request drafts with one."""

    def __init__(
        self,
        model: PreTrainedModel,
        policy: AdmissionPolicy,
        memory: RowContents,
        chunk: int,
        device: torch.device,
        recurrent: bool = False,
        lanes: int = 1,
        drafter=None,
    ):
        self.model, self.policy, self.memory, self.chunk, self.device = model, policy, memory, chunk, device
        self.recurrent, self.drafter, self.lane_count = recurrent, drafter, lanes
        self.lanes = list(range(lanes - 1, -1, -1)) if recurrent else []  # recurrent states' rows not in use
        self.groups: list[ChoiceGroup] = []
        self.pools: dict[tuple, GreedyGroup] = {}
        self.scores = ScoreGroup(device)
        self.placed: dict[int, Stream] = {}  # what holds each key of the row: a stream, or a score request
        self.starting: list[Stream] = []  # placed, their first logits not computed yet
        self.version = next_signature()  # the decode queries' signature, new whenever they change

    def live(self) -> int:
        """Keys placed and not ended: streams (and score requests, one each)."""
        return sum(h.status in LIVE for h in self.placed.values())

    def schedule(self, keep_stopped: bool) -> Round | None:
        """The next round, None where there is nothing to feed; `keep_stopped`: stopped streams may stay fed (`retire`).
        ValueError (the policy's) where the row is empty and the next request does not fit it."""
        self.retire(keep_stopped)
        for request in self.policy.admit(self.memory, self.live()):
            self.placed.update((h.key, h) for h in request.holders())
            request.on_event("start", request.cached)
            request.started(self, [self.memory.answer_slots(k) for k in request.keys()])
        layout = self.memory.snapshot() if self.memory.dirty else None
        if layout is not None:
            self.version = next_signature()
        chunk = self.memory.prefill(self.chunk)
        prompt_slots, prompt_tokens, joining, lanes = self._joining(chunk)
        feeds = {id(g): g.feed() for g in self.groups}
        fed = [f for f in feeds.values() if f is not None]
        if not fed and not len(prompt_slots):
            return None
        n_fed = sum(len(f.slots) for f in fed)
        scored = self.scores.rows(prompt_slots)
        parts, keep, at = [], [], 0
        for group in self.groups:
            f, new = feeds[id(group)], joining.get(id(group), [])
            n = len(f.slots) if f is not None else 0
            keep += [np.arange(at, at + n), n_fed + np.array(new, dtype=np.int64)]
            at += n
            if n or new:
                parts.append((group, n + len(new)))
        keep = np.concatenate([*keep, n_fed + scored]).astype(np.int64)
        slots = np.concatenate([f.slots for f in fed] + [prompt_slots])
        ids = [f.tokens for f in fed]
        if len(prompt_slots):
            ids.append(upload(torch.from_numpy(prompt_tokens), self.device))
        decode_only = not len(prompt_slots) and not any(g.reads_at_once for g in self.groups if feeds[id(g)])
        inputs = ForwardInputs(
            slots,
            torch.cat(ids) if len(ids) > 1 else ids[0],
            None if len(keep) == len(slots) and (keep == np.arange(len(slots))).all() else keep,
            self.version if decode_only else None,  # other queries: a plan of their own each round
            len(prompt_slots),
            self._segment_runs(chunk, n_fed, lanes) if self.recurrent else None,
        )
        return Round(parts, inputs, prompt_slots[scored], chunk, layout, sum(len(f.rows) for f in fed))

    def _joining(self, chunk: PromptChunk):
        """The round's prompt part (the chunk, and the last prompt token of a joining stream written in an earlier
        round, fed again: the same K/V to the same slot); by group, the prompt part's rows of the starting streams
        whose prompt is now complete, each put in its group; and the (lane, state key) pairs of their recurrent
        states, to copy after the forward."""
        joining, ends, still = [], [], []
        for stream in self.starting:
            end = self.memory.prompt_end(stream.key)
            (still if end is None else joining).append(stream)
            if end is not None:
                ends.append(end)
        self.starting = still
        slots, tokens = chunk.slots, chunk.tokens
        if not joining:
            return slots, tokens, {}, []
        last = np.array([e[0] for e in ends], dtype=np.int64)
        rows = np.full(len(last), -1, dtype=np.int64)
        if len(slots):
            order = np.argsort(slots, kind="stable")
            at = order[np.searchsorted(slots[order], last).clip(max=len(slots) - 1)]
            rows = np.where(slots[at] == last, at, -1)
        again: dict[int, int] = {}
        for i in np.flatnonzero(rows < 0).tolist():
            rows[i] = again.setdefault(int(last[i]), len(slots) + len(again))
        if again:
            token = {e[0]: e[1] for e in ends}
            slots = np.concatenate([slots, np.array(list(again), dtype=np.int64)])
            tokens = np.concatenate([tokens, np.array([token[s] for s in again], dtype=np.int64)])
        by_group: dict[int, list[int]] = {}
        cohorts: dict[int, list[tuple[Stream, int]]] = {}
        lanes = []
        for stream, row, (_, _, key) in zip(joining, rows.tolist(), ends):
            stream.status = Status.DECODE
            if self.recurrent:
                stream.lane = self.lanes.pop()
                lanes.append((stream.lane, key))
            pool = self._pool(stream.request)
            if pool is not None:
                pool.join([stream])
                by_group.setdefault(id(pool), []).append(row)
            else:
                cohorts.setdefault(id(stream.request.opts), []).append((stream, row))
        for members in cohorts.values():
            group = self._cohort([s for s, _ in members])
            by_group[id(group)] = [r for _, r in members]
        return slots, tokens, by_group, lanes

    def _pool(self, request: Request) -> GreedyGroup | None:
        """The greedy group for `request`'s streams, where argmax and EOS choose them (`eos_only`)."""
        opts = request.opts
        if opts.do_sample or opts.speculation is not None:
            return None
        eos = eos_only(opts.generate.prepare(self.model, request.prompt))
        if eos is None:
            return None
        if eos not in self.pools:
            self.pools[eos] = GreedyGroup(eos, self.device)
            self.groups.append(self.pools[eos])
        return self.pools[eos]

    def _cohort(self, streams: list[Stream]) -> ProcessedGroup:
        request = streams[0].request
        spec = request.opts.speculation
        if spec is None:
            group = ProcessedGroup(self.model, streams, request.sampler, self.device)
        else:
            drafter = self.drafter if spec.assistant else LookupDrafter(spec, streams, request.opts.eos_ids)
            group = DraftingGroup(self.model, streams, request.sampler, self.device, drafter)
        self.groups.append(group)
        return group

    def _segment_runs(self, chunk: PromptChunk, n_fed: int, start: list[tuple[int, int]]) -> SegmentRuns:
        lanes = [s.lane for g in self.groups for s in g.streams]
        runs = [(key, parent, n_fed + a, n_fed + b) for key, parent, a, b in chunk.runs]
        lanes = upload(torch.tensor(lanes, dtype=torch.long), self.device) if lanes else None
        return SegmentRuns(lanes, runs, start, self.memory.freed(), self.lane_count)

    # -- leaving --

    def retire(self, keep_stopped: bool) -> None:
        """Ended streams leave their groups and the row; with `keep_stopped` (captured rounds, nothing waiting for
        room) stopped streams stay fed until the live ones fit a smaller bucket, so a captured plan is rewritten once
        per bucket, not once per stream; a stream is never fed past its most tokens."""
        ended = {id(g): np.array([s.status in ENDED for s in g.streams], dtype=bool) for g in self.groups}
        full = {id(g): g.full() for g in self.groups}
        fed = sum(len(g.streams) for g in self.groups)
        live = fed - sum(int((ended[id(g)] | full[id(g)]).sum()) for g in self.groups)
        keep_stopped = (
            keep_stopped
            and not self.policy.waiting()
            and not any(g.reads_at_once for g in self.groups)
            and live > 0
            and bucket(live) == bucket(fed)
        )
        for group in self.groups:
            gone = full[id(group)] | (ended[id(group)] & (not keep_stopped))
            if gone.any():
                group.drop(~gone)
                self.version = next_signature()
        self.groups = [g for g in self.groups if g.streams or g.joining or g.pooled]
        still_fed = {s.key for g in self.groups for s in g.streams}
        for key, holder in list(self.placed.items()):
            if holder.status in ENDED and key not in still_fed:
                self._leave(key, holder)

    def _leave(self, key: int, holder) -> None:
        del self.placed[key]
        self.memory.leave(key)
        if holder.lane >= 0:
            self.lanes.append(holder.lane)
            holder.lane = -1
        if not any(k in self.placed for k in holder.request.keys()):
            _let_go(holder.request)

    def cancel(self) -> int:
        """Cancelled requests leave the queue now and the row at the next round; how many there were."""
        gone = {id(h.request): h.request for h in self.placed.values() if h.request.cancelling}
        gone = {k: r for k, r in gone.items() if r.status not in ENDED}
        queued = self.policy.remove_cancelled()
        for request in queued + list(gone.values()):
            request.end(Status.CANCELLED)
        for request in queued:  # never placed: nothing of the row holds them
            _let_go(request)
        if gone:
            self.starting = [s for s in self.starting if s.status is not Status.CANCELLED]
        return len(queued) + len(gone)

    def fail(self, request, err: Exception) -> None:
        """`request`'s streams end, failed."""
        request.end(Status.FAILED, err)
        self.starting = [s for s in self.starting if s.request is not request]

    def requests(self, queued: bool = True) -> list:
        """The requests in the row (and, with `queued`, those waiting first)."""
        live = list({id(h.request): h.request for h in self.placed.values()}.values())
        return (self.policy.queued() if queued else []) + live

    def clear(self) -> None:
        """Forget every request in the row (a failed forward left it unknown); the row starts empty."""
        for request in self.requests(queued=False):
            _let_go(request)
        self.placed, self.groups, self.pools, self.starting = {}, [], {}, []
        self.scores, self.memory = ScoreGroup(self.device), self.memory.emptied()
        self.lanes = list(range(self.lane_count - 1, -1, -1)) if self.recurrent else []
        self.version = next_signature()


def _let_go(request) -> None:
    """`request` has no key in the row: it lets go of its streams, which refer back to it (no reference cycle
    keeps it, its options and their tensors alive after a call)."""
    request.streams = []
