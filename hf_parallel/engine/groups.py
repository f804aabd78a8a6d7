"""Choice groups: streams that choose their tokens together, each group in one pass over its logits.

    GreedyGroup     streams of any number of requests whose token is the argmax of their logits and which stop
                    only at one set of EOS ids or their own token limit (`eos_only`): one pass for all of them.
    ProcessedGroup  streams of one request's options (generate_tokens: of the call's) that started in the same
                    round: generate's processors on each stream's history (`StreamProcessors`), then argmax or
                    a draw (`Sampler`).  With drafts (`Drafter`) each stream feeds its newest token and a draft,
                    and the group verifies the draft position by position (module `engine.drafts`).
    ScoreGroup      no stream decodes: the log-probability of the token after each of some prompt positions.

A group's row i is stream i of `streams`; every row feeds each round (its newest token, or a draft), and
streams that start this round join at the end with the logits of their prompt's last token.  A group keeps
on the host what the next round's feed needs without reading the device (each stream's token count, one more
a round), except where it drafts: the next drafts need the tokens accepted, so that round is read at once.
"""

from __future__ import annotations

import numpy as np
import torch

from ..decoding.logits import StreamProcessors
from ..decoding.sampling import Sampler
from ..row.plan import upload
from .streams import Chosen, Feed, Stream


class ChoiceGroup:
    """Rows of streams on `device`: each one's answer slots (arithmetic: `first` + `stride` * t), its tokens chosen
    so far (`count`, host), its most (`limit`, host) and its newest token (`last`, device).  A row is never fed
    once it has its most tokens (its answer room ends there)."""

    drafts = False  # its rounds are read at once (the next drafts need them)

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

    def choose(self, logits: torch.Tensor) -> Chosen:
        """Every row's token from its logits [n, V] (the fed rows', then the joining streams'), on the device."""
        self._take_joining()
        new, stops = self.pick(logits)
        self.last, self.count = new, self.count + 1
        return Chosen(list(self.streams), new[:, None], torch.ones_like(new), stops)

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token [n] and whether a criterion stops it [n] bool."""
        raise NotImplementedError

    def accept(self, counts: np.ndarray) -> None:
        """The rows' accepted token counts of the round just read (host; the streams hold the tokens), before any
        row leaves."""

    def drop(self, kept: np.ndarray) -> None:
        """Keep the rows where `kept` [n] bool (host) is set."""
        self.streams = [s for s, k in zip(self.streams, kept.tolist()) if k]
        self.first, self.stride, self.count = self.first[kept], self.stride[kept], self.count[kept]
        self.limit = self.limit[kept]
        if len(self.last) == len(kept):  # a drafting group feeds from the host: no `last`
            self.last = self.last.index_select(0, upload(torch.from_numpy(np.flatnonzero(kept)), self.device))

    def _take_joining(self) -> None:
        if not self.joining:
            return
        new, self.joining = self.joining, []
        self.streams = self.streams + new
        slots = [s.slots for s in new]
        first = np.array([s[0] for s in slots], dtype=np.int64)
        stride = np.array([s[1] - s[0] if len(s) > 1 else 1 for s in slots], dtype=np.int64)
        self.first, self.stride = np.concatenate([self.first, first]), np.concatenate([self.stride, stride])
        self.count = np.concatenate([self.count, np.zeros(len(new), dtype=np.int64)])
        self.limit = np.concatenate([self.limit, np.array([s.max_new_tokens for s in new], dtype=np.int64)])


class GreedyGroup(ChoiceGroup):
    """Argmax and an EOS test for every row (module docstring); `eos`: the EOS ids its streams stop at."""

    def __init__(self, eos: tuple[int, ...], device: torch.device):
        super().__init__(device)
        self.eos = upload(torch.tensor(eos, dtype=torch.long), device)

    def pick(self, logits):
        new = logits.argmax(dim=-1)
        return new, torch.isin(new, self.eos)


class ProcessedGroup(ChoiceGroup):
    """Streams of one options object that start together: generate's processors and a choice per row; with a
    `drafter`, drafts fed and verified (module docstring)."""

    def __init__(self, model, streams: list[Stream], sampler: Sampler, device: torch.device, drafter=None):
        super().__init__(device)
        opts = streams[0].request.opts
        limit = max(s.max_new_tokens for s in streams)
        self.processors = StreamProcessors.for_prompts(model, opts, [s.prompt for s in streams], limit, self.device)
        self.sampler, self.drafter = sampler, drafter
        self.drafts = drafter is not None
        self.pending: list[list[int]] = []  # each row's draft fed this round (the joining streams': none)
        self.draft_limit = np.zeros(0, dtype=np.int64)  # each row's most draft tokens (adaptive)
        self.join(streams)

    def feed(self) -> Feed | None:
        if not self.drafts or not self.streams:
            return super().feed()
        room = np.array([s.max_new_tokens - 1 - len(s.tokens) for s in self.streams])
        self.pending = self.drafter.drafts(self.streams, np.minimum(self.draft_limit, room).tolist())
        rows = np.array([1 + len(d) for d in self.pending], dtype=np.int64)
        steps = np.concatenate([np.arange(n) for n in rows]) + np.repeat(self.count - 1, rows)
        slots = np.repeat(self.first, rows) + np.repeat(self.stride, rows) * steps
        ids = [t for s, d in zip(self.streams, self.pending) for t in [s.tokens[-1], *d]]
        return Feed(slots, upload(torch.tensor(ids, dtype=torch.long), self.device), rows)

    def choose(self, logits: torch.Tensor) -> Chosen:
        if not self.drafts:
            return super().choose(logits)
        joining = len(self.joining)
        self._take_joining()
        self.pending += [[] for _ in range(joining)]
        self.draft_limit = np.concatenate([self.draft_limit, np.full(joining, self.drafter.num_tokens)])
        tokens, counts, stops = self.verify(logits, self.pending)
        return Chosen(list(self.streams), tokens, counts, stops)

    def pick(self, logits):
        new = self.sampler(self.processors.scores(logits))
        self.processors.append(new)
        return new, self.processors.stopped(new)

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
        draft, has = (
            upload(torch.from_numpy(draft[:, :width]), self.device),
            upload(torch.from_numpy(lengths), self.device),
        )
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

    def accept(self, counts: np.ndarray) -> None:
        if not self.drafts:
            return
        self.count = self.count + counts
        self.processors.set_lengths(self.count)
        self.drafter.accepted(self.streams, counts)
        if self.drafter.adaptive:  # a stream's limit grows after a draft accepted whole, shrinks after one not
            drafted = np.array([len(d) for d in self.pending], dtype=np.int64)
            limit = self.draft_limit
            grow, shrink = np.minimum(limit + 2, self.drafter.num_tokens), np.maximum(limit - 1, 1)
            self.draft_limit = np.where(drafted == 0, limit, np.where(counts == drafted + 1, grow, shrink))
        self.pending = []

    def drop(self, kept: np.ndarray) -> None:
        super().drop(kept)
        self.processors.keep(kept)
        if self.drafts:
            self.draft_limit = self.draft_limit[kept]


class ScoreGroup:
    """Scoring requests: for each, the log-probability of its target tokens at its last prompt positions and
    whether each is its row's argmax.  `want` maps a slot to the (request, position) pairs that read it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.want: dict[int, list] = {}

    def add(self, request, slots: np.ndarray) -> None:
        request.scores = (np.zeros(request.score, dtype=np.float32), np.zeros(request.score, dtype=bool))
        request.left = request.score
        for i, slot in enumerate(slots.tolist()):
            self.want.setdefault(slot, []).append((request, i))

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """Which of a prompt chunk's `slots` a scoring request reads."""
        return np.array([i for i, s in enumerate(slots.tolist()) if s in self.want], dtype=np.int64)

    def choose(self, logits: torch.Tensor, slots: np.ndarray):
        """Log-probabilities and greedy flags of every pair reading these rows' logits [R, V] (the rows at `slots`),
        on the device, with the pairs."""
        pairs, rows, targets = [], [], []
        for r, slot in enumerate(slots.tolist()):
            for request, i in self.want.pop(slot):
                pairs.append((request, i))
                rows.append(r)
                targets.append(request.targets[i])
        rows = upload(torch.tensor(rows), self.device)
        targets = upload(torch.tensor(targets), self.device)
        # log_softmax, as a plain forward's scorer (lm-eval's HF backend among them) takes it: on the CPU,
        # logits - logsumexp rounds differently (SmolLM2: up to 1.6e-5 a token, 5e-4 over a 60-token passage)
        chosen = logits[rows]
        logprobs = torch.log_softmax(chosen, dim=-1).gather(1, targets[:, None])[:, 0]
        return pairs, logprobs, chosen.argmax(dim=-1) == targets
