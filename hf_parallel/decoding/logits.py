"""generate's logits processors and stopping criteria over all live streams, each stream with its own history.

A stream's history is what `generate` hands its processors for that prompt alone: the full prompt, then the
answer so far.  Streams decoding one token a step are all at the same step, so streams of one prompt length
have histories of one length; speculative decoding (`set_lengths`) moves each stream at its own pace, and
then the views below that depend on a history's length or tail run per length or on right-aligned histories.
Each processor (then each criterion) of generate's list runs in list order, on the view of the histories its
exact class allows (a stage's `view`); subclasses and unknown classes take the last, exact by construction:

    length     reads at most the history's length (the sampling warpers, SuppressTokens, and length processors
               whose limit is relative to the prompt): one call on all live streams, with a content-free
               [N, P + t] view for the prompt length P its instance was built for.
    newest     reads only the newest token (EosTokenCriteria, MaxTimeCriteria): one call on the new tokens.
    set        RepetitionPenalty (and NoRepeatNGram of 1-grams) reads the history as a set: one call on the
               right-aligned [N, Pmax + t] history, left-padded with each stream's own first token (which adds
               nothing to the set).
    padded     NoRepeatNGram, SequenceBias, NoBadWords, StopString match n-grams and tails: one call on the
               history left-padded with an id no vocabulary has, which no pattern matches.
    per_group  anything else, user and unknown classes included: per group of streams of one prompt length
               (of one prompt, where a processor holds it), that group's own instance on its exact history
               (where one group holds every live stream, on the scores themselves: no gather and scatter).

The padded views give each stream exactly the scores of its prompt alone (tests/decoding/test_generation_options.py
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

# LENGTH_LIMIT: the classes that read only the history's length, by where each keeps its (absolute) length limit
from ..compat.transformers_internals import LENGTH_LIMIT, banned_ngram_size, length_limit
from ..row.plan import upload
from .generate_args import Prepared
from .options import GenerationOptions

PAD = 2**31 - 1  # the left pad of the "padded" history: clamped to a dummy row by StopString, matched by no n-gram
_LENGTH_ONLY = (
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
VIEWS = {
    **{getattr(lp, name): "length" for name in _LENGTH_ONLY if hasattr(lp, name)},
    lp.RepetitionPenaltyLogitsProcessor: "set",
    lp.NoRepeatNGramLogitsProcessor: "padded",
    lp.SequenceBiasLogitsProcessor: "padded",
    lp.NoBadWordsLogitsProcessor: "padded",
    sc.StopStringCriteria: "padded",
    sc.EosTokenCriteria: "newest",
    sc.MaxTimeCriteria: "newest",
}


class Stage(NamedTuple):
    view: str  # length, newest, set, padded or per_group (module docstring)
    index: list[int]  # positions in every group's list (a per_group stage runs consecutive ones together)
    width: int  # length: the prompt length of the first group, whose instance runs


def stages(lists: list[list], lens: list[int]) -> list[Stage]:
    """The stages running the groups' lists (one per group, prompts of length `lens`) in list order."""
    if any([type(p) for p in other] != [type(p) for p in lists[0]] for other in lists):
        raise RuntimeError("generate built different processor lists for different prompt lengths")
    stages = []
    for k, first in enumerate(lists[0]):
        view = _view(type(first), [(other[k], n) for other, n in zip(lists, lens)])
        if view == "per_group" and stages and stages[-1].view == "per_group":
            stages[-1].index.append(k)
        else:
            stages.append(Stage(view, [k], lens[0]))
    return stages


def _view(cls: type, instances: list[tuple]) -> str:
    if cls in LENGTH_LIMIT:  # relative to the prompt in every group: one instance serves all streams
        offsets = {length_limit(p) - n for p, n in instances}
        return "length" if len(offsets) == 1 else "per_group"
    if cls is lp.NoRepeatNGramLogitsProcessor and banned_ngram_size(instances[0][0]) == 1:
        return "set"  # bans every token of the history, a set: a pad would be banned too (5.17 raises on it)
    return VIEWS.get(cls, "per_group")


class StreamProcessors:
    """generate's processors and criteria over live streams [N]: `scores`, then `append`, then `stopped`.

    groups:       one `Prepared` per group of streams (one prompt length, or one prompt).
    stream_group: [S] each stream's group; prompts: [S] each stream's prompt tokens; max_new_tokens: most new
                  tokens of any stream.
    Row i of `scores`' logits is stream i of those still kept; `keep` drops streams.  Every stream's history
    grows by one token per `append`; `set_lengths` sets each stream's answer length (speculative decoding: a
    stream keeps the tokens it accepted), after which streams may differ in length.
    """

    def __init__(self, groups: list[Prepared], stream_group: list[int], prompts: list, max_new_tokens: int, device):
        self.groups, self.lens = groups, [g.prompt_len for g in groups]
        self.process = stages([g.processors for g in groups], self.lens)
        stop = stages([g.criteria for g in groups], self.lens)
        self.stop = [s for s in stop if not _loop_bound(groups[0], s, max_new_tokens)]
        views = {s.view for s in self.process + self.stop}
        self.row_group = list(stream_group)  # host: the group of each live row
        self.prepared = [groups[g] for g in stream_group]  # each stream's own processors and criteria, as given
        self.rows = _rows(self.row_group, len(groups), device) if "per_group" in views else None
        self.whole = whole_group(self.rows)
        self.lmax = max(self.lens)  # prompt columns of the history
        self.length = 0  # the longest row's answer tokens so far
        self.lengths: np.ndarray | None = None  # each row's, where rows differ (None: every row has `length`)
        self.history = _history(prompts, self.lmax, max_new_tokens, views, device)
        self.zero = torch.zeros(1, 1, dtype=torch.long, device=device)
        self._aligned = None  # the padded history right-aligned at `length`, while rows differ (built when read)

    @classmethod
    def for_prompts(cls, model: PreTrainedModel, opts: GenerationOptions, prompts: list, max_new_tokens: int, device):
        """generate's lists for streams of these `prompts` (token arrays), at most `max_new_tokens` new tokens
        each."""
        groups, index, stream_group = [], {}, []
        for prompt in prompts:
            prepared = opts.generate.prepare(model, prompt)
            if id(prepared) not in index:
                index[id(prepared)] = len(groups)
                groups.append(prepared)
            stream_group.append(index[id(prepared)])
        return cls(groups, stream_group, [np.asarray(p, dtype=np.int64) for p in prompts], max_new_tokens, device)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """generate's processed scores [N, V] (float32) from the live rows' next-token logits [N, V]."""
        for stage in self.process:
            if stage.view == "per_group":
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
        if "set" in self.history:  # columns past a row's answer hold its first token again, which adds nothing
            history = self.history["set"]
            columns = torch.arange(history.shape[1], device=history.device)[None]
            ends = torch.as_tensor(self.lmax + lengths, device=history.device)[:, None]
            self.history["set"] = torch.where(columns < ends, history, history[:, :1])

    def stopped(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N] bool: which live rows any criterion stops after their new `tokens` [N] (appended)."""
        done = None
        for stage in self.stop:
            if stage.view == "per_group":
                hit = self._per_group_stop(stage.index, tokens)
            elif self._per_length(stage, stop=True):
                hit = self._by_length(self.groups[0].criteria[stage.index[0]], stage, None, tokens)
            else:
                hit = self.groups[0].criteria[stage.index[0]](self._ids(stage, len(tokens), tokens), None)
            done = hit if done is None else done | hit
        return done if done is not None else torch.zeros(len(tokens), dtype=torch.bool, device=tokens.device)

    def keep(self, kept: np.ndarray) -> None:
        """Keep only the streams where `kept` [N] bool (host) is set."""
        rows = upload(torch.from_numpy(np.flatnonzero(kept)), self.zero.device)
        for view, history in self.history.items():
            self.history[view] = history.index_select(0, rows)
        if self.lengths is not None:
            self.set_lengths(self.lengths[kept])
        if self.rows is not None:
            self.row_group = [g for g, k in zip(self.row_group, kept.tolist()) if k]
            self.rows = _rows(self.row_group, len(self.groups), self.zero.device)
            self.whole = whole_group(self.rows)

    def _ids(self, stage: Stage, n: int, tokens: torch.Tensor | None = None) -> torch.Tensor:
        if stage.view == "length":
            return self.zero.expand(n, stage.width + self.length)
        if stage.view == "newest":
            return tokens[:, None]
        if stage.view == "padded":
            return self._padded()
        return self.history["set"][:, : self.lmax + self.length]  # columns past a row's end add nothing

    def _padded(self) -> torch.Tensor:
        """The padded histories [N, Pmax + length], each right-aligned at its row's end (left-padded with PAD)."""
        history = self.history["padded"]
        if self.lengths is None:
            return history[:, : self.lmax + self.length]
        if self._aligned is None:
            width = self.lmax + self.length
            shift = torch.as_tensor(self.length - self.lengths, device=history.device)[:, None]
            columns = torch.arange(width, device=history.device)[None] - shift
            aligned = history.gather(1, columns.clamp(0, history.shape[1] - 1))  # past the end: rows being dropped
            self._aligned = aligned.masked_fill(columns < 0, PAD)
        return self._aligned

    def _per_length(self, stage: Stage, stop: bool = False) -> bool:
        """Whether a length stage runs once per row length: rows differ in length and its class reads the length."""
        first = (self.groups[0].criteria if stop else self.groups[0].processors)[stage.index[0]]
        return self.lengths is not None and stage.view == "length" and type(first) in LENGTH_LIMIT

    def _by_length(self, call, stage: Stage, scores: torch.Tensor | None, tokens: torch.Tensor | None = None):
        """A length stage's processor (scores given: new scores) or criterion (tokens given: stop flags) `call`, once
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
        padded = self._padded()
        return padded[:, columns].contiguous() if rows is None else padded[rows, columns]

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


def _loop_bound(prepared: Prepared, stage: Stage, max_new_tokens: int) -> bool:
    """A relative MaxLengthCriteria allowing `max_new_tokens` or more: the loop stops the stream there first."""
    criterion = prepared.criteria[stage.index[0]]
    return (
        stage.view == "length" and type(criterion) is sc.MaxLengthCriteria and prepared.max_new_tokens >= max_new_tokens
    )


def eos_only(prepared: Prepared) -> tuple[int, ...] | None:
    """The EOS ids, where generate's lists for a prompt do nothing but stop at EOS (no processor, no criterion but
    EOS and the prompt's own length limit, which the loop keeps): argmax and an EOS test then choose and stop
    exactly.  Else None."""
    stops = stages([prepared.criteria], [prepared.prompt_len])
    criteria = [prepared.criteria[s.index[0]] for s in stops if not _loop_bound(prepared, s, prepared.max_new_tokens)]
    if prepared.processors or any(type(c) is not sc.EosTokenCriteria for c in criteria):
        return None
    return prepared.eos


def _rows(row_group: list[int], n_groups: int, device) -> list[torch.Tensor | None]:
    """Each group's live rows (None for a group with none)."""
    members = [[] for _ in range(n_groups)]
    for row, g in enumerate(row_group):
        members[g].append(row)
    return [upload(torch.tensor(m), device) if m else None for m in members]


def whole_group(rows: list[torch.Tensor | None] | None) -> int | None:
    """The group holding every live row, where only one does (its rows are then all rows, in order)."""
    present = [g for g, r in enumerate(rows or []) if r is not None]
    return present[0] if len(present) == 1 else None


def _history(prompts: list, lmax: int, max_new_tokens: int, views: set, device) -> dict[str, torch.Tensor]:
    """The histories [S, Pmax + max_new_tokens] the stages read, prompts right-aligned at column Pmax, by left pad."""
    if not views & {"set", "padded", "per_group"}:
        return {}
    padded = np.full((len(prompts), lmax + max_new_tokens), PAD, dtype=np.int64)
    for i, prompt in enumerate(prompts):
        padded[i, lmax - len(prompt) : lmax] = prompt
    padded = upload(torch.from_numpy(padded), device)
    history = {"padded": padded} if views & {"padded", "per_group"} else {}
    if "set" in views:  # answer columns too until written: they are never read before
        first = upload(torch.tensor([int(p[0]) for p in prompts]), device)[:, None]
        history["set"] = torch.where(padded == PAD, first, padded)
    return history
