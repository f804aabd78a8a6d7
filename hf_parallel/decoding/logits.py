"""generate's logits processors and stopping criteria over all live streams, each stream with its own history.

A stream's history is what `generate` hands its processors for that prompt alone: the full prompt, then the
answer so far.  Streams decoding one token a step are all at the same step, so streams of one prompt length
have histories of one length; speculative decoding (`set_lengths`) moves each stream at its own pace, and
then the ways below that depend on a history's length or tail run per length or on right-aligned histories.
Each processor (then each criterion) of generate's list runs in list order, in the way its exact
class allows; subclasses and unknown classes take the last way, exact by construction:

    shape  reads at most the history's length (the sampling warpers, SuppressTokens, and length processors
           whose limit is relative to the prompt): one call on all live rows, with a content-free
           [N, P + t] view for the prompt length P its instance was built for.
    last   reads only the newest token (EosTokenCriteria, MaxTimeCriteria): one call on the new tokens.
    self   RepetitionPenalty (and NoRepeatNGram of 1-grams) reads the history as a set: one call on the
           right-aligned [N, Pmax + t] history, left-padded with each row's own first token (which adds
           nothing to the set).
    big    NoRepeatNGram, SequenceBias, NoBadWords, StopString match n-grams and tails: one call on the
           history left-padded with an id no vocabulary has, which no pattern matches.
    group  anything else, user and unknown classes included: per group of streams of one prompt length
           (of one prompt, where a processor holds it), that group's own instance on its exact history
           (where one group holds every live row, on the scores themselves: no gather and scatter).

The padded ways give each row exactly the scores of its prompt alone (tests/test_generation_options.py
checks them against `model.generate`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.generation import logits_process as lp
from transformers.generation import stopping_criteria as sc

from ..row.layout import Layout
from .generate_request import Prepared
from .options import GenerationOptions

BIG = 2**31 - 1  # the left pad of the "big" history: clamped to a dummy row by StopString, matched by no n-gram
_SHAPE = (
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "TopHLogitsWarper",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    "SuppressTokensLogitsProcessor",
    "InfNanRemoveLogitsProcessor",
    "LogitNormalization",
)
WAYS = {
    **{getattr(lp, name): "shape" for name in _SHAPE if hasattr(lp, name)},
    lp.RepetitionPenaltyLogitsProcessor: "self",
    lp.NoRepeatNGramLogitsProcessor: "big",
    lp.SequenceBiasLogitsProcessor: "big",
    lp.NoBadWordsLogitsProcessor: "big",
    sc.StopStringCriteria: "big",
    sc.EosTokenCriteria: "last",
    sc.MaxTimeCriteria: "last",
}
# classes that read only the history's length: the attribute holding their (absolute) length limit
LENGTH_LIMIT = {
    lp.MinLengthLogitsProcessor: "min_length",
    lp.MinNewTokensLengthLogitsProcessor: "prompt_length_to_skip",
    lp.SuppressTokensAtBeginLogitsProcessor: "begin_index",
    lp.ExponentialDecayLengthPenalty: "regulation_start",
    lp.ForcedEOSTokenLogitsProcessor: "max_length",
    sc.MaxLengthCriteria: "max_length",
}


class Stage(NamedTuple):
    way: str  # shape, last, self, big or group
    index: list[int]  # positions in every group's list (a group stage runs consecutive ones together)
    width: int  # shape: the prompt length of the first group, whose instance runs


def stages(lists: list[list], lens: list[int]) -> list[Stage]:
    """The stages running the groups' lists (one per group, prompts of length `lens`) in list order."""
    if any([type(p) for p in other] != [type(p) for p in lists[0]] for other in lists):
        raise RuntimeError("generate built different processor lists for different prompt lengths")
    stages = []
    for k, first in enumerate(lists[0]):
        way = _way(type(first), [(other[k], n) for other, n in zip(lists, lens)])
        if way == "group" and stages and stages[-1].way == "group":
            stages[-1].index.append(k)
        else:
            stages.append(Stage(way, [k], lens[0]))
    return stages


def _way(cls: type, instances: list[tuple]) -> str:
    if cls in LENGTH_LIMIT:  # relative to the prompt in every group: one instance serves all rows
        offsets = {getattr(p, LENGTH_LIMIT[cls]) - n for p, n in instances}
        return "shape" if len(offsets) == 1 else "group"
    if cls is lp.NoRepeatNGramLogitsProcessor and instances[0][0].ngram_size == 1:
        return "self"  # bans every token of the history, a set: a big pad would be banned too (5.17 raises on it)
    return WAYS.get(cls, "group")


class Processing:
    """generate's processors and criteria over the live rows [N]: `scores`, then `append`, then `stopped`.

    groups:       one `Prepared` per group of streams (one prompt length, or one prompt).
    stream_group: [S] each stream's group; prompts: [S] each stream's prompt tokens; room: most new tokens.
    Rows follow the runner's live streams; `keep` drops rows when the live streams change.  Every row's
    history grows by one token per `append`; `set_lengths` sets each row's answer length (speculative
    decoding: a row keeps the tokens it accepted), after which rows may differ in length.
    """

    def __init__(self, groups: list[Prepared], stream_group: list[int], prompts: list, room: int, device):
        self.groups, self.lens = groups, [g.prompt_len for g in groups]
        self.process = stages([g.processors for g in groups], self.lens)
        stop = stages([g.criteria for g in groups], self.lens)
        self.stop = [s for s in stop if not self._loop_bound(s, room)]
        ways = {s.way for s in self.process + self.stop}
        self.row_group = list(stream_group)  # host: the group of each live row
        self.rows = _rows(self.row_group, len(groups), device) if "group" in ways else None
        self.whole = whole_group(self.rows)
        self.lmax = max(self.lens)  # prompt columns of the history
        self.length = 0  # the longest row's answer tokens so far
        self.lengths: np.ndarray | None = None  # each row's, where rows differ (None: every row has `length`)
        self.history = _history(prompts, self.lmax, room, ways, device)
        self.zero = torch.zeros(1, 1, dtype=torch.long, device=device)
        self._aligned = None  # the big history right-aligned at `length`, while rows differ (built when read)

    @classmethod
    def for_layout(cls, model: PreTrainedModel, opts: GenerationOptions, layout: Layout, device) -> Processing:
        """generate's lists for every stream of `layout` (captured once per prompt length)."""
        return cls.for_prompts(model, opts, layout_prompts(layout), layout.max_new_tokens, device)

    @classmethod
    def for_prompts(cls, model: PreTrainedModel, opts: GenerationOptions, prompts: list, room: int, device):
        """generate's lists for streams of these `prompts` (token arrays), at most `room` new tokens each."""
        groups, index, stream_group = [], {}, []
        for prompt in prompts:
            prepared = opts.request.prepare(model, prompt)
            if id(prepared) not in index:
                index[id(prepared)] = len(groups)
                groups.append(prepared)
            stream_group.append(index[id(prepared)])
        return cls(groups, stream_group, [np.asarray(p, dtype=np.int64) for p in prompts], room, device)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """generate's processed scores [N, V] (float32) from the live rows' next-token logits [N, V]."""
        for stage in self.process:
            if stage.way == "group":
                logits = self._per_group(stage.index, logits)
            elif self._per_length(stage):
                logits = self._by_length(self.groups[0].processors[stage.index[0]], stage, logits)
            else:
                logits = self.groups[0].processors[stage.index[0]](self._ids(stage, len(logits)), logits)
        return logits

    def append(self, tokens: torch.Tensor) -> None:
        """Write the live rows' new tokens [N] into their histories."""
        if self.lengths is None:
            for history in self.history.values():
                history[:, self.lmax + self.length] = tokens
        else:
            for history in self.history.values():  # a row past its room writes its last column: it stops there
                columns = torch.as_tensor(np.minimum(self.lmax + self.lengths, history.shape[1] - 1))
                history.scatter_(1, columns.to(tokens.device)[:, None], tokens[:, None])
            self.lengths = self.lengths + 1
            self._aligned = None
        self.length += 1

    def set_lengths(self, lengths) -> None:
        """Set each live row's answer length [N] (host ints): a row keeps the tokens it has up to there, and what
        was appended past it is gone (speculative decoding's rejected tokens)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        self.length = int(lengths.max(initial=0))
        self.lengths = None if (lengths == self.length).all() else lengths
        self._aligned = None
        if "self" in self.history:  # columns past a row's answer hold its first token again, which adds nothing
            history = self.history["self"]
            columns = torch.arange(history.shape[1], device=history.device)[None]
            ends = torch.as_tensor(self.lmax + lengths, device=history.device)[:, None]
            self.history["self"] = torch.where(columns < ends, history, history[:, :1])

    def stopped(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N] bool: which live rows any criterion stops after their new `tokens` [N] (appended)."""
        done = None
        for stage in self.stop:
            if stage.way == "group":
                hit = self._per_group_stop(stage.index, tokens)
            elif self._per_length(stage, stop=True):
                hit = self._by_length(self.groups[0].criteria[stage.index[0]], stage, None, tokens)
            else:
                hit = self.groups[0].criteria[stage.index[0]](self._ids(stage, len(tokens), tokens), None)
            done = hit if done is None else done | hit
        return done if done is not None else torch.zeros(len(tokens), dtype=torch.bool, device=tokens.device)

    def keep(self, running: torch.Tensor) -> None:
        """Keep only the rows where `running` [N] bool is set (the runner drops the others)."""
        for way, history in self.history.items():
            self.history[way] = history[running]
        if self.lengths is not None:
            self.set_lengths(self.lengths[running.cpu().numpy()])
        if self.rows is not None:  # one host read, only when the live streams change
            self.row_group = [g for g, kept in zip(self.row_group, running.tolist()) if kept]
            self.rows = _rows(self.row_group, len(self.groups), running.device)
            self.whole = whole_group(self.rows)

    def eos_only(self) -> tuple[int, ...] | None:
        """The EOS ids, where generate's lists do nothing but stop at EOS (no processor, no other criterion but the
        length the decode loop bounds): argmax and an EOS test then choose and stop exactly.  Else None."""
        criteria = [self.groups[0].criteria[s.index[0]] for s in self.stop]
        if self.process or any(type(c) is not sc.EosTokenCriteria for c in criteria):
            return None
        ids = {int(t) for c in criteria for t in c.eos_token_id.flatten().tolist()}
        return tuple(sorted(ids))

    def _ids(self, stage: Stage, n: int, tokens: torch.Tensor | None = None) -> torch.Tensor:
        if stage.way == "shape":
            return self.zero.expand(n, stage.width + self.length)
        if stage.way == "last":
            return tokens[:, None]
        if stage.way == "big":
            return self._big()
        return self.history[stage.way][:, : self.lmax + self.length]  # "self": columns past a row's end add nothing

    def _big(self) -> torch.Tensor:
        """The big histories [N, Pmax + length], each right-aligned at its row's end (left-padded with BIG)."""
        history = self.history["big"]
        if self.lengths is None:
            return history[:, : self.lmax + self.length]
        if self._aligned is None:
            width = self.lmax + self.length
            shift = torch.as_tensor(self.length - self.lengths, device=history.device)[:, None]
            columns = torch.arange(width, device=history.device)[None] - shift
            aligned = history.gather(1, columns.clamp(0, history.shape[1] - 1))  # past the end: rows being dropped
            self._aligned = aligned.masked_fill(columns < 0, BIG)
        return self._aligned

    def _per_length(self, stage: Stage, stop: bool = False) -> bool:
        """Whether a shape stage runs once per row length: rows differ in length and its class reads the length."""
        first = (self.groups[0].criteria if stop else self.groups[0].processors)[stage.index[0]]
        return self.lengths is not None and stage.way == "shape" and type(first) in LENGTH_LIMIT

    def _by_length(self, call, stage: Stage, scores: torch.Tensor | None, tokens: torch.Tensor | None = None):
        """A shape stage's processor (scores given: new scores) or criterion (tokens given: stop flags) `call`, once
        per row length, each on the rows of that length."""
        if scores is not None:
            out = scores.clone()
        else:
            out = torch.zeros(len(tokens), dtype=torch.bool, device=tokens.device)
        for length in np.unique(self.lengths):
            rows = torch.as_tensor(np.flatnonzero(self.lengths == length), device=out.device)
            ids = self.zero.expand(len(rows), stage.width + int(length))
            out[rows] = call(ids, scores[rows]) if scores is not None else call(ids, None).to(out.device)
        return out

    def _group_subsets(self):
        """(group, its live rows, their answer length) for every group with live rows, split by length where rows
        differ in length."""
        for g, rows in enumerate(self.rows):
            if rows is None:
                continue
            if self.lengths is None:
                yield g, rows, self.length
                continue
            members = rows.cpu().numpy()
            for length in np.unique(self.lengths[members]):
                yield g, torch.as_tensor(members[self.lengths[members] == length], device=rows.device), int(length)

    def group_ids(self, g: int, rows: torch.Tensor | None, length: int | None = None) -> torch.Tensor:
        """Group g's exact histories [n_g, P_g + t] (rows None: every live row's, contiguous as generate's), rows
        of answer length t (`length`, by default every row's)."""
        length = self.length if length is None else length
        end = self.lmax + self.length
        columns = slice(end - length - self.lens[g], end)
        big = self._big()
        return big[:, columns].contiguous() if rows is None else big[rows, columns]

    def _per_group(self, index: list[int], scores: torch.Tensor) -> torch.Tensor:
        if self.lengths is None and self.whole is not None:  # one group holds every row: its processors on the
            ids = self.group_ids(self.whole, None)  # scores, as generate runs them
            for k in index:
                scores = self.groups[self.whole].processors[k](ids, scores)
            return scores
        out = scores.clone()
        for g, rows, length in self._group_subsets():
            ids, group_scores = self.group_ids(g, rows, length), scores[rows]
            for k in index:
                group_scores = self.groups[g].processors[k](ids, group_scores)
            out[rows] = group_scores
        return out

    def _per_group_stop(self, index: list[int], tokens: torch.Tensor) -> torch.Tensor:
        if self.lengths is None and self.whole is not None:
            ids, criteria = self.group_ids(self.whole, None), self.groups[self.whole].criteria
            hits = [criteria[k](ids, None).to(tokens.device) for k in index]
            return functools.reduce(torch.logical_or, hits)
        done = torch.zeros(len(tokens), dtype=torch.bool, device=tokens.device)
        for g, rows, length in self._group_subsets():
            ids = self.group_ids(g, rows, length)
            for k in index:
                done[rows] |= self.groups[g].criteria[k](ids, None).to(done.device)
        return done

    def _loop_bound(self, stage: Stage, room: int) -> bool:
        """A relative MaxLengthCriteria allowing `room` new tokens or more: the decode loop stops there first."""
        criterion = self.groups[0].criteria[stage.index[0]]
        return stage.way == "shape" and type(criterion) is sc.MaxLengthCriteria and self.groups[0].budget >= room


def layout_prompts(layout: Layout) -> list[np.ndarray]:
    """[S] every stream's full prompt, from the segments it runs through."""
    tokens = [np.asarray(s.tokens, dtype=np.int64) for s in layout.segments]
    return [np.concatenate([tokens[s] for s in layout.ancestors(end)]) for end in layout.prompt_ends]


def _rows(row_group: list[int], n_groups: int, device) -> list[torch.Tensor | None]:
    """Each group's live rows (None for a group with none)."""
    members = [[] for _ in range(n_groups)]
    for row, g in enumerate(row_group):
        members[g].append(row)
    return [torch.tensor(m, device=device) if m else None for m in members]


def whole_group(rows: list[torch.Tensor | None] | None) -> int | None:
    """The group holding every live row, where only one does (its rows are then all rows, in order)."""
    present = [g for g, r in enumerate(rows or []) if r is not None]
    return present[0] if len(present) == 1 else None


def _history(prompts: list, lmax: int, room: int, ways: set, device) -> dict[str, torch.Tensor]:
    """The histories [S, Pmax + room] the stages read, prompts right-aligned at column Pmax, by left pad."""
    if not ways & {"self", "big", "group"}:
        return {}
    big = np.full((len(prompts), lmax + room), BIG, dtype=np.int64)
    for i, prompt in enumerate(prompts):
        big[i, lmax - len(prompt) : lmax] = prompt
    big = torch.from_numpy(big).to(device)
    history = {"big": big} if ways & {"big", "group"} else {}
    if "self" in ways:  # answer columns too until written: they are never read before
        first = torch.as_tensor([int(p[0]) for p in prompts], device=device)[:, None]
        history["self"] = torch.where(big == BIG, first, big)
    return history
