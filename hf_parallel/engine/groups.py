"""Groups: streams that choose their tokens together, each group in one pass over its logits.

    GreedyGroup     streams of any number of requests whose token is the argmax of their logits and which stop
                    only at one set of EOS ids or their own token limit (`eos_only`): one pass for all of them.
    ProcessedGroup  streams of one request's options (generate_tokens: of the call's) that started in the same
                    round: generate's processors on each stream's history (`StreamProcessors`), then argmax or
                    a draw (`Sampler`).
    DraftingGroup   a ProcessedGroup whose streams feed their newest token and a draft (`engine.drafts`), and
                    which verifies each draft position by position; its rounds are read at once (the next
                    drafts need the tokens accepted).
    ScoreGroup      no stream decodes: the log-probabilities read at some prompt positions (`ScoreRequest`).

A group's streams are in order: stream i takes its logits row i.  Every stream feeds each round (its newest token,
or a draft), and streams that start this round join at the end with the logits of their prompt's last token.  The
one home of each stream's chosen count is its group's `count` (the stream reads it as `Stream.chosen`); the feed's
slots follow from it and each stream's answer slots (`first`, `stride`, copied when it joins and never changed).
"""

from __future__ import annotations

import numpy as np
import torch

from ..decoding.logits import StreamProcessors
from ..decoding.sampling import Sampler
from ..row.plan import upload
from .streams import Accepted, Chosen, Feed, Scored, ScoreRequest, Stream


class ChoiceGroup:
    """Streams on `device`: each one's tokens chosen so far (`count`, host; a round ahead of its tokens read), its
    answer slots (`first` + `stride` * t) and most tokens (`limit`), and its newest token (`last`, device).  A
    stream is never fed once it has its most tokens (its answer room ends there)."""

    reads_at_once = False  # the next round needs this one's tokens on the host
    pooled = False  # kept while empty, for later streams (a greedy group of one set of EOS ids)

    def __init__(self, device: torch.device):
        self.device = device
        self.streams: list[Stream] = []
        self.first = self.stride = self.count = self.limit = np.zeros(0, dtype=np.int64)
        self.last = torch.zeros(0, dtype=torch.long, device=device)
        self.joining: list[Stream] = []

    def join(self, streams: list[Stream]) -> None:
        """Streams that choose their first token this round, from their prompt's last logits (after the feed's)."""
        self.joining += streams

    def feed(self) -> Feed | None:
        """This round's tokens of the rows (each row's newest token at the slot after its answer so far)."""
        if not self.streams:
            return None
        slots = self.first + self.stride * (self.count - 1)
        return Feed(slots, self.last, np.ones(len(self.streams), dtype=np.int64))

    def choose(self, logits: torch.Tensor) -> tuple[list[Stream], Chosen]:
        """Every row's token from its logits [n, V] (the fed rows', then the joining streams'), on the device."""
        self._take_joining()
        new, stops = self.pick(logits)
        self.last, self.count = new, self.count + 1
        return list(self.streams), Chosen(new[:, None], torch.ones_like(new), stops)

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token [n] and whether a criterion stops it [n] bool."""
        raise NotImplementedError

    def full(self) -> np.ndarray:
        """[n] bool: the streams that have their most tokens."""
        return self.count >= self.limit

    def accept(self, streams: list[Stream], chosen: Chosen) -> tuple[Accepted, list]:
        """The round's choices, read on the host (`chosen`: arrays): its streams' accepted tokens (what ends with them
        is the core's to say)."""
        rows, counts = chosen.tokens.tolist(), chosen.counts.tolist()
        tokens = [row[:n] for row, n in zip(rows, counts)] if chosen.tokens.shape[1] > 1 else rows
        return Accepted(streams, tokens, chosen.stops.tolist()), []

    def drop(self, kept: np.ndarray) -> None:
        """Keep the streams where `kept` [n] bool (host) is set; the others leave the group."""
        for stream, k in zip(self.streams, kept.tolist()):
            stream.group = None if not k else self
        self.streams = [s for s, k in zip(self.streams, kept.tolist()) if k]
        for row, stream in enumerate(self.streams):
            stream.row = row
        self.first, self.stride, self.count = self.first[kept], self.stride[kept], self.count[kept]
        self.limit = self.limit[kept]
        if len(self.last) == len(kept):
            self.last = self.last.index_select(0, upload(torch.from_numpy(np.flatnonzero(kept)), self.device))

    def _take_joining(self) -> list[Stream]:
        new, self.joining = self.joining, []
        for row, stream in enumerate(new, len(self.streams)):
            stream.group, stream.row = self, row
        self.streams = self.streams + new
        slots = [s.slots for s in new]
        first = np.array([a[0] for a in slots], dtype=np.int64)
        stride = np.array([a[1] - a[0] if len(a) > 1 else 1 for a in slots], dtype=np.int64)
        self.first, self.stride = np.concatenate([self.first, first]), np.concatenate([self.stride, stride])
        self.count = np.concatenate([self.count, np.zeros(len(new), dtype=np.int64)])
        self.limit = np.concatenate([self.limit, np.array([s.limit for s in new], dtype=np.int64)])
        return new


class GreedyGroup(ChoiceGroup):
    """Argmax and an EOS test for every row (module docstring); `eos`: the EOS ids its streams stop at."""

    pooled = True

    def __init__(self, eos: tuple[int, ...], device: torch.device):
        super().__init__(device)
        self.eos = upload(torch.tensor(eos, dtype=torch.long), device)

    def pick(self, logits):
        new = logits.argmax(dim=-1)
        return new, torch.isin(new, self.eos)


class ProcessedGroup(ChoiceGroup):
    """Streams of one options object that start together: generate's processors and a choice per row (module
    docstring)."""

    def __init__(self, model, streams: list[Stream], sampler: Sampler, device: torch.device):
        super().__init__(device)
        opts = streams[0].request.opts
        limit = max(s.limit for s in streams)
        self.processors = StreamProcessors.for_prompts(model, opts, [s.prompt for s in streams], limit, self.device)
        for stream, prepared in zip(streams, self.processors.prepared):
            stream.processors = prepared
        self.sampler = sampler
        self.join(streams)

    def pick(self, logits):
        new = self.sampler(self.processors.scores(logits))
        self.processors.append(new)
        return new, self.processors.stopped(new)

    def drop(self, kept: np.ndarray) -> None:
        super().drop(kept)
        self.processors.keep(kept)


class DraftingGroup(ProcessedGroup):
    """A `ProcessedGroup` whose streams draft (`drafter`: an `engine.drafts` drafter) and verify (module docstring)."""

    reads_at_once = True

    def __init__(self, model, streams: list[Stream], sampler: Sampler, device: torch.device, drafter):
        super().__init__(model, streams, sampler, device)
        self.drafter = drafter
        for stream in streams:
            stream.draft_limit = drafter.num_tokens

    def feed(self) -> Feed | None:
        if not self.streams:
            return None
        limits = [min(s.draft_limit, s.limit - 1 - len(s.tokens)) for s in self.streams]
        for stream, draft in zip(self.streams, self.drafter.drafts(self.streams, limits)):
            stream.draft = draft
        rows = np.array([1 + len(s.draft) for s in self.streams], dtype=np.int64)
        steps = np.concatenate([np.arange(n) for n in rows]) + np.repeat(self.count - 1, rows)
        slots = np.repeat(self.first, rows) + np.repeat(self.stride, rows) * steps
        ids = [t for s in self.streams for t in [s.tokens[-1], *s.draft]]
        return Feed(slots, upload(torch.tensor(ids, dtype=torch.long), self.device), rows)

    def choose(self, logits: torch.Tensor) -> tuple[list[Stream], Chosen]:
        for stream in self._take_joining():
            stream.draft = []
        tokens, counts, stops = self.verify(logits, [s.draft for s in self.streams])
        return list(self.streams), Chosen(tokens, counts, stops)

    def verify(self, logits: torch.Tensor, drafts: list[list[int]]):
        """Each row's chosen token at every position of its draft and one past it [n, J+1], how many of them it
        accepts (every earlier position chose its draft token and did not stop) [n], and whether it stops within
        them [n]."""
        lengths = np.array([len(d) for d in drafts], dtype=np.int64)
        width = int(lengths.max(initial=0))
        starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]])
        draft = np.full((len(drafts), max(width, 1)), -1, dtype=np.int64)
        for r, d in enumerate(drafts):
            draft[r, : len(d)] = d
        rows = upload(torch.from_numpy(starts[:, None] + np.minimum(np.arange(width + 1)[None], lengths[:, None])),
                      self.device)  # fmt: skip
        draft, has = (upload(torch.from_numpy(a), self.device) for a in (draft[:, :width], lengths))
        processors = self.processors
        accepting = torch.ones(len(drafts), dtype=torch.bool, device=self.device)
        chosen, stopped, alive = [], [], []
        for j in range(width + 1):  # generate's processors on each row's history with its draft so far
            new = self.sampler(processors.scores(logits[rows[:, j]]))
            processors.append(new)
            stop = processors.stopped(new)
            chosen.append(new), stopped.append(stop), alive.append(accepting)
            if j < width:
                accepting = accepting & ~stop & (has > j) & (new == draft[:, j])
        chosen, stopped, alive = torch.stack(chosen, 1), torch.stack(stopped, 1), torch.stack(alive, 1)
        return chosen, alive.sum(1), (stopped & alive).any(1)

    def accept(self, streams: list[Stream], chosen: Chosen) -> tuple[Accepted, list]:
        """Read at once, before any stream leaves: each stream's count moves on by what it accepted, its processors'
        history keeps just that, and its draft limit adapts (grows after a draft accepted whole, shrinks after one
        not)."""
        accepted, _ = super().accept(streams, chosen)
        self.count = self.count + chosen.counts
        self.processors.set_lengths(self.count)
        for stream, n in zip(streams, chosen.counts.tolist()):
            if self.drafter.adaptive and stream.draft:
                grown, shrunk = min(stream.draft_limit + 2, self.drafter.num_tokens), max(stream.draft_limit - 1, 1)
                stream.draft_limit = grown if n == len(stream.draft) + 1 else shrunk
            stream.draft = []
        self.drafter.accepted(accepted)
        return accepted, []


class ScoreGroup:
    """Score requests' positions not read yet: `want` maps a slot to the (request, position) pairs that read it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.want: dict[int, list[tuple[ScoreRequest, int]]] = {}

    def add(self, request: ScoreRequest, slots: np.ndarray) -> None:
        for i, slot in enumerate(slots.tolist()):
            self.want.setdefault(slot, []).append((request, i))

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """Which of a prompt chunk's `slots` a score request reads."""
        if not self.want:
            return np.zeros(0, dtype=np.int64)
        return np.array([i for i, s in enumerate(slots.tolist()) if s in self.want], dtype=np.int64)

    def choose(self, logits: torch.Tensor, slots: np.ndarray) -> tuple[list, Scored]:
        """The pairs reading these rows' logits [R, V] (the rows at `slots`) and their values, on the device."""
        pairs, rows, targets, full = [], [], [], []
        for r, slot in enumerate(slots.tolist()):
            for request, i in self.want.pop(slot):
                pairs.append((request, i))
                rows.append(r)
                targets.append(request.targets[i])
                full.append(request.full)
        rows, targets = upload(torch.tensor(rows), self.device), upload(torch.tensor(targets), self.device)
        # log_softmax, as a plain forward's scorer (lm-eval's HF backend among them) takes it: on the CPU,
        # logits - logsumexp rounds differently (SmolLM2: up to 1.6e-5 a token, 5e-4 over a 60-token passage)
        chosen = logits[rows]
        logprobs = torch.log_softmax(chosen.float(), dim=-1)
        whole = logprobs[upload(torch.tensor(full, dtype=torch.bool), self.device)] if any(full) else logprobs[:0]
        return pairs, Scored(logprobs.gather(1, targets[:, None])[:, 0], chosen.argmax(dim=-1) == targets, whole)

    reads_at_once = False

    def accept(self, pairs: list, scored: Scored) -> tuple[Accepted, list[ScoreRequest]]:
        """The values read on the host, each into its request's `scores`; no stream's tokens, and the requests now
        complete."""
        done, full = [], iter(scored.rows)
        for (request, i), value, greedy in zip(pairs, scored.logprobs.tolist(), scored.greedy.tolist()):
            request.scores.logprobs[i], request.scores.greedy[i] = value, greedy
            if request.full:
                request.scores.rows[i] = next(full)
            request.left -= 1
            if not request.left:
                done.append(request)
        return Accepted([], [], []), done
