"""The engine core: one packed row's rounds, each schedule -> forward -> choose -> update.

    schedule  the admission policy places waiting requests' streams (`engine.policies`); the round feeds
              every decoding stream's newest token (a drafting stream's draft too) and a chunk of prompt
              tokens not yet computed, at most `chunk` of them; a stream whose prompt is then complete joins
              a choice group with its prompt's last logits
    forward   one forward of the model runner over all of it (a captured CUDA graph where its bucket of
              tokens allows, `runner.graphs`)
    choose    each choice group chooses (or verifies) its rows' tokens on the device (`engine.groups`)
    update    the round's tokens are read on the host a round late (the next round is queued first, so the
              GPU never waits for the host): streams take their tokens, stopped ones end, ended ones leave the
              row and free their room; a round with drafts is read at once (the next drafts need it)

A stream that stopped is fed once more before the host knows (a token into its own answer room, never read);
where rounds replay captured graphs and nothing waits for room, stopped streams go on being fed until the
live ones fit a smaller bucket, so the captured plan is rewritten once per bucket, not once per stream.
Every round reads the device once.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from ..decoding.logits import eos_only
from ..models.recurrent import SegmentRuns
from ..row.plan import upload
from ..runner.graphs import bucket
from ..runner.model_runner import ForwardInputs, ModelRunner
from .drafts import AssistantDrafter, LookupDrafter
from .groups import ChoiceGroup, GreedyGroup, ProcessedGroup, ScoreGroup
from .policies import AdmissionPolicy
from .streams import ENDED, Chosen, Request, Status, Stream


@dataclass
class Stats:
    """What a core has done: rounds (forwards of the model), streams fed over all forwards, prompt tokens
    computed, tokens accepted, CUDA graphs it captured (a kept row's earlier ones not counted), requests cancelled
    and failed."""

    rounds: int = 0
    stream_forwards: int = 0
    prompt_tokens: int = 0
    tokens: int = 0
    captures: int = 0
    cancelled: int = 0
    failed: int = 0


@dataclass
class Round:
    """A round's schedule: each group fed or joined, with its logits rows (its fed tokens', then its joining
    streams'); the prompt slots scored; the forward's inputs."""

    parts: list[tuple[ChoiceGroup, int]]
    inputs: ForwardInputs
    scored: np.ndarray


@dataclass
class Output:
    """A round's choices, copied to the host behind the round's kernels (`event`), read a round late: per group its
    tokens, counts and stops in `ints`; the scored pairs' log-probabilities in `floats`, their greedy flags last in
    `ints`."""

    chosen: list[tuple[ChoiceGroup, Chosen]]
    scored: list
    ints: torch.Tensor
    floats: torch.Tensor
    event: torch.cuda.Event | None


class EngineCore:
    """One model's packed row (its `ModelRunner`) and the streams of the requests its `policy` admits.

    chunk: most prompt tokens a round computes.  lanes: most streams at once (the recurrent states' pool).
    assistant: an `AssistantDrafter` whose row follows this one.  isolate: a request whose tokens cannot be
    chosen fails alone, and a forward that fails fails the requests in the row (`reset`), not the caller.
    prebuild: on a GPU, the first round's kernels, and those of a captured round decoding this many streams, are
    built on threads beside the first round's host work (`ModelRunner.prebuild`).
    """

    read_late = True  # rounds are read a round late (False: each at once, the host waiting for it: an ablation)

    def __init__(
        self,
        model: PreTrainedModel,
        runner: ModelRunner,
        policy: AdmissionPolicy,
        chunk: int,
        lanes: int = 1,
        assistant: AssistantDrafter | None = None,
        isolate: bool = False,
        prebuild: int = 0,
    ):
        self.model, self.runner, self.policy, self.chunk = model, runner, policy, chunk
        self.device, self.assistant, self.isolate = runner.device, assistant, isolate
        self.groups: list[ChoiceGroup] = []
        self.pools: dict[tuple, GreedyGroup] = {}
        self.scores = ScoreGroup(self.device)
        self.live: dict[int, Stream] = {}  # placed streams that have not left the row
        self.starting: list[Stream] = []  # placed, their first logits not computed yet
        self.lagged: Output | None = None
        self.stats = Stats()
        self.lane_count = lanes
        self.lanes = list(range(lanes - 1, -1, -1)) if runner.profile.recurrent else []
        self.start_states: list[tuple[int, int]] = []  # (lane, state key) to copy after the next forward
        self.version, self.mixed = 0, 0  # the decode queries' version; rounds of other queries, counted down
        self.prebuild_streams = prebuild if runner.device.type == "cuda" else 0
        self.captured_before = self._captures()  # a kept row's captures before this core

    # -- the loop --

    def add(self, request: Request) -> None:
        self.policy.add(request)

    def busy(self) -> bool:
        return bool(self.policy.waiting() or self.live or self.lagged)

    def run(self) -> Iterator[Stream]:
        """Rounds until no work is left; each stream as it ends."""
        while self.busy():
            yield from self.step()

    def step(self) -> list[Stream]:
        """One round; the streams that ended, as read in it."""
        self._cancel()
        work = self._schedule()
        if work is None:
            return self._read()
        try:
            logits = self._forward(work.inputs)
            output = self._choose(work, logits)
        except Exception as err:
            if not self.isolate:
                raise
            return self._read() + self.reset(err)
        ended = self._read()
        self.lagged = output
        self.stats.rounds += 1
        self.stats.captures = self._captures() - self.captured_before
        if not self.read_late or any(g.drafts for g, _ in output.chosen):
            ended += self._read()
        return ended

    def _captures(self) -> int:
        return self.runner.static.graphs.captures if self.runner.static is not None else 0

    def _forward(self, inputs: ForwardInputs) -> torch.Tensor:
        if not self.prebuild_streams:
            return self.runner.forward(inputs)
        from ..kernels.prebuild import awaiting  # a GPU's: Triton, an optional package

        futures, self.prebuild_streams = self.runner.prebuild(inputs, self.prebuild_streams), 0
        with awaiting(futures):  # the first launch waits for its kernels
            logits = self.runner.forward(inputs)
        concurrent.futures.wait(futures)  # one that failed fails again at its launch
        return logits

    # -- schedule --

    def _schedule(self) -> Round | None:
        self._retire()
        placed = sum(s.status in (Status.PREFILL, Status.DECODE) for s in self.live.values())
        for stream in self.policy.admit(placed):
            self._placed(stream)
        contents = self.policy.contents
        if contents.dirty:
            layout = contents.snapshot()
            self.runner.relayout(layout)
            if self.assistant is not None:
                self.assistant.relayout(layout)
            self.version += 1
        chunk = contents.prefill(self.chunk)
        if self.assistant is not None:
            self.assistant.prefill(chunk)
        prompt_slots, prompt_tokens, joining = self._joining(contents, chunk)
        feeds = {id(g): g.feed() for g in self.groups}
        fed = [f for f in feeds.values() if f is not None]
        if not fed and not len(prompt_slots):
            return None
        n_fed = sum(len(f.slots) for f in fed)
        scored = self.scores.rows(prompt_slots) if self.scores.want else np.zeros(0, dtype=np.int64)
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
        self.stats.stream_forwards += sum(len(f.rows) for f in fed)
        self.stats.prompt_tokens += len(chunk.slots)
        decode_only = not len(prompt_slots) and not any(g.drafts for g in self.groups if feeds[id(g)] is not None)
        if not decode_only:
            self.mixed -= 1
        inputs = ForwardInputs(
            slots,
            torch.cat(ids) if len(ids) > 1 else ids[0],
            None if len(keep) == len(slots) and (keep == np.arange(len(slots))).all() else keep,
            self.version if decode_only else self.mixed,
            len(prompt_slots),
            self._segment_runs(fed, chunk, n_fed) if self.runner.profile.recurrent else None,
        )
        return Round(parts, inputs, prompt_slots[scored])

    def _placed(self, stream: Stream) -> None:
        self.live[stream.key] = stream
        request = stream.request
        if stream.answer == 0:
            request.on_event("start", request.cached)
        if request.score:
            self.scores.add(request, self.policy.contents.tail_slots(stream.key, request.score))
        else:
            self.starting.append(stream)

    def _joining(self, contents, chunk) -> tuple[np.ndarray, np.ndarray, dict[int, list[int]]]:
        """The round's prompt part (the chunk, and the last prompt token of a joining stream written in an earlier
        round, fed again: the same K/V to the same slot), and by group the prompt part's rows of the starting
        streams whose prompt is now complete, each put in its group."""
        joining, ends, still = [], [], []
        for stream in self.starting:
            end = contents.prompt_end(stream.key)
            (still if end is None else joining).append(stream)
            if end is not None:
                ends.append(end)
        self.starting = still
        slots, tokens = chunk.slots, chunk.tokens
        if not joining:
            return slots, tokens, {}
        last = np.array([e[0] for e in ends], dtype=np.int64)
        order = np.argsort(slots, kind="stable")
        at = np.searchsorted(slots[order], last).clip(max=max(len(slots) - 1, 0))
        found = (slots[order[at]] == last) if len(slots) else np.zeros(len(last), dtype=bool)
        rows = np.where(found, order[at] if len(slots) else 0, -1)
        again = {}
        for i in np.flatnonzero(~found).tolist():
            rows[i] = again.setdefault(int(last[i]), len(slots) + len(again))
        if again:
            token = {e[0]: e[1] for e in ends}
            slots = np.concatenate([slots, np.array(list(again), dtype=np.int64)])
            tokens = np.concatenate([tokens, np.array([token[s] for s in again], dtype=np.int64)])
        by_group: dict[int, list[int]] = {}
        cohorts: dict[int, list[tuple[Stream, int]]] = {}
        for stream, row, (_, _, key) in zip(joining, rows.tolist(), ends):
            stream.status = Status.DECODE
            if self.lanes:
                stream.lane = self.lanes.pop()
                self.start_states.append((stream.lane, key))
            pool = self._pool(stream.request)
            if pool is not None:
                pool.join([stream])
                by_group.setdefault(id(pool), []).append(row)
            else:
                cohorts.setdefault(id(stream.request.opts), []).append((stream, row))
        for members in cohorts.values():
            group = self._cohort([s for s, _ in members])
            by_group[id(group)] = [r for _, r in members]
        return slots, tokens, by_group

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
        spec, drafter = request.opts.speculation, None
        if spec is not None:
            drafter = self.assistant if spec.assistant else LookupDrafter(spec, streams, request.opts.eos_ids)
        group = ProcessedGroup(self.model, streams, request.sampler, self.device, drafter)
        self.groups.append(group)
        return group

    def _segment_runs(self, fed, chunk, n_fed: int) -> SegmentRuns:
        lanes = [s.lane for g in self.groups if g.streams and not g.drafts for s in g.streams]
        runs = [(key, parent, n_fed + a, n_fed + b) for key, parent, a, b in chunk.runs]
        start, self.start_states = self.start_states, []
        lanes = upload(torch.tensor(lanes, dtype=torch.long), self.device) if lanes else None
        return SegmentRuns(lanes, runs, start, self.policy.contents.freed(), self.lane_count)

    # -- choose --

    def _choose(self, work: Round, logits: torch.Tensor) -> Output:
        chosen, at = [], 0
        for group, n in work.parts:
            rows = logits[at : at + n]
            at += n
            try:
                chosen.append((group, group.choose(rows)))
            except Exception as err:
                if not self.isolate:
                    raise
                self._fail_group(group, err)
        ints = [t for _, c in chosen for t in (c.tokens.flatten(), c.counts, c.stops.long())]
        pairs, floats = [], torch.zeros(0, device=self.device)
        if len(work.scored):
            pairs, floats, greedy = self.scores.choose(logits[at:], work.scored)
            ints.append(greedy.long())
        ints = torch.cat(ints) if ints else torch.zeros(0, dtype=torch.long, device=self.device)
        event = None
        if self.device.type == "cuda":  # to pinned memory behind the round's kernels; read a round late
            ints, floats = _to_host(ints), _to_host(floats)
            event = torch.cuda.Event()
            event.record()
        return Output(chosen, pairs, ints, floats, event)

    def _fail_group(self, group: ChoiceGroup, err: Exception) -> None:
        """A group's choice raised: its requests fail (a request's own processors are its fault)."""
        for request in {id(s.request): s.request for s in group.streams + group.joining}.values():
            self.fail(request, err)

    # -- update --

    def _read(self) -> list[Stream]:
        output, self.lagged = self.lagged, None
        if output is None:
            return []
        if output.event is not None:
            output.event.synchronize()
        host, at, ended, news = output.ints.numpy(), 0, [], {}
        for group, c in output.chosen:
            n, width = c.tokens.shape
            tokens = host[at : at + n * width].reshape(n, width)
            counts, stops = host[at + n * width : at + n * width + n], host[at + n * width + n : at + n * width + 2 * n]
            at += n * width + 2 * n
            for stream, row, count, stop in zip(c.streams, tokens, counts.tolist(), stops.tolist()):
                if stream.status is not Status.DECODE:
                    continue  # ended before this round was read (fed once more, or gone)
                new = row[: min(count, stream.max_new_tokens - len(stream.tokens))].tolist()
                stream.tokens += new
                self.stats.tokens += len(new)
                news.setdefault(id(stream.request), (stream.request, []))[1].extend((stream.answer, t) for t in new)
                if stop or len(stream.tokens) >= stream.max_new_tokens:
                    ended.append(stream)
            group.accept(counts)
        for (request, i), value, greedy in zip(output.scored, output.floats.tolist(), host[at:].tolist()):
            request.scores[0][i], request.scores[1][i] = value, bool(greedy)
            request.left -= 1
            if not request.left:
                ended.append(request.streams[0])
        for request, pairs in news.values():
            request.on_event("tokens", pairs)
        for stream in ended:
            self._end(stream, Status.DONE)
        return ended

    def _end(self, stream: Stream, status: Status) -> None:
        """`stream` ended: its request told; it leaves the row at the next round (`_retire`)."""
        stream.status = status
        request = stream.request
        request.on_event("finish", stream.answer)
        if not request.open:
            request.on_event("done", None)

    def _retire(self) -> None:
        """Ended streams leave their groups and the row; where rounds are captured and nothing waits for room,
        stopped streams stay fed until the live ones fit a smaller bucket (module docstring), but never past their
        most tokens."""
        ended = {id(g): np.array([s.status in ENDED for s in g.streams], dtype=bool) for g in self.groups}
        full = {id(g): g.count >= g.limit for g in self.groups}
        fed = sum(len(g.streams) for g in self.groups)
        live = fed - sum(int((ended[id(g)] | full[id(g)]).sum()) for g in self.groups)
        keep_fed = (
            self.runner.captures
            and not self.policy.waiting()
            and not any(g.drafts for g in self.groups)
            and live > 0
            and bucket(live) == bucket(fed)
        )
        for group in self.groups:
            gone = full[id(group)] | (ended[id(group)] & (not keep_fed))
            if gone.any():
                group.drop(~gone)
                self.version += 1
        self.groups = [g for g in self.groups if g.streams or g.joining or isinstance(g, GreedyGroup)]
        still_fed = {s.key for g in self.groups for s in g.streams}
        for stream in [s for s in self.live.values() if s.status in ENDED and s.key not in still_fed]:
            self._leave(stream)

    def _leave(self, stream: Stream) -> None:
        del self.live[stream.key]
        self.policy.release(stream)
        if stream.lane >= 0:
            self.lanes.append(stream.lane)
            stream.lane = -1
        if self.assistant is not None:
            self.assistant.forget(stream)

    # -- requests leaving early --

    def _cancel(self) -> None:
        """Cancelled requests leave the queue now and the row at the next round; nothing more is told them."""
        gone = {id(s.request): s.request for s in self.live.values() if s.request.cancelled}
        for request in self.policy.remove_cancelled() + list(gone.values()):
            self.stats.cancelled += 1
            for stream in request.streams:
                if stream.status not in ENDED:
                    stream.status = Status.CANCELLED
        if gone:
            self.starting = [s for s in self.starting if s.status is not Status.CANCELLED]

    def fail(self, request: Request, err: Exception) -> None:
        """`request` fails: its streams end, and it is told once."""
        if request.error is not None:
            return
        request.error = err
        self.stats.failed += 1
        for stream in request.streams:
            if stream.status not in ENDED:
                stream.status = Status.FAILED
        self.starting = [s for s in self.starting if s.request is not request]
        request.on_event("error", err)

    def reset(self, err: Exception) -> list[Stream]:
        """A forward failed: every request in the row fails with it, and the row starts empty (waiting requests
        stay queued)."""
        for request in {id(s.request): s.request for s in self.live.values()}.values():
            self.fail(request, RuntimeError(f"the engine failed: {type(err).__name__}: {err}"))
        self.live, self.groups, self.pools, self.starting, self.lagged = {}, [], {}, [], None
        self.scores = ScoreGroup(self.device)
        self.lanes = list(range(self.lane_count - 1, -1, -1)) if self.runner.profile.recurrent else []
        self.start_states = []
        self.policy.reset()
        self.runner.reset_states()
        self.version += 1
        return []


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in pinned host memory, made behind the queued work (read once an event says so)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
