"""The engine core: one packed row's rounds, each schedule -> forward -> choose -> update.

    schedule  the scheduler (`engine.scheduler`) retires ended streams, lets the admission policy pick waiting
              requests for the row's memory to place (`engine.policies`, `row.contents`), and feeds every
              decoding stream's newest token (a drafting stream's draft too) and a chunk of prompt tokens not yet
              computed; a stream whose prompt is then complete joins a group with its prompt's last logits
    forward   one forward of the model runner over all of it (a captured CUDA graph where its bucket of tokens
              allows, `runner.graphs`); an assistant model's row, where one drafts, computes the chunk too
    choose    each group chooses (or verifies, or scores) on the device (`engine.groups`); the round's records
              are copied to the host behind its kernels, in one copy (`Output`)
    update    the copy is read a round late (the next round is queued first, so the GPU never waits for the
              host): `Output.read` decodes it into each group's records, groups turn them into each stream's
              `Accepted` tokens, and streams that stopped end and leave at the next round's retire; a round whose
              group reads at once (drafts) is read at once

The lag is explicit: `step` queues round t, then reads round t - 1 (`lagged`), then keeps round t for the next step.
A stream that stopped is fed once more before the host knows (a token into its own answer room, never read).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..row.contents import RowContents
from ..runner.model_runner import ForwardInputs, ModelRunner
from .drafts import AssistantDrafter
from .policies import AdmissionPolicy
from .scheduler import Round, Scheduler
from .stats import Stats
from .streams import Status, Stream


@dataclass
class Output:
    """A round's records, on the device, then in one pinned host copy of each dtype behind the round's kernels
    (`event`): `records` [(group, its streams or pairs, record)], each record's tensor fields packed in order."""

    records: list[tuple[object, list, object]]
    ints: torch.Tensor
    floats: torch.Tensor
    event: torch.cuda.Event | None

    @classmethod
    def pack(cls, records: list, device: torch.device) -> Output:
        tensors = [t for _, _, r in records for t in _fields(r)]
        ints = [t.flatten().long() for t in tensors if not t.is_floating_point()]
        floats = [t.flatten().float() for t in tensors if t.is_floating_point()]
        ints = torch.cat(ints) if ints else torch.zeros(0, dtype=torch.long, device=device)
        floats = torch.cat(floats) if floats else torch.zeros(0, device=device)
        event = None
        if device.type == "cuda":  # to pinned memory behind the round's kernels; read a round late
            ints, floats = _to_host(ints), _to_host(floats)
            event = torch.cuda.Event()
            event.record()
        return cls(records, ints, floats, event)

    def read(self) -> list[tuple[object, list, object]]:
        """Each group's record with its fields as host arrays, once the copy is done: the one place the packed copy
        is decoded."""
        if self.event is not None:
            self.event.synchronize()
        host = {False: self.ints.numpy(), True: self.floats.numpy()}
        at = {False: 0, True: 0}
        out = []
        for group, who, record in self.records:
            values = {}
            for name, t in zip(_names(record), _fields(record)):
                kind, n = t.is_floating_point(), t.numel()
                values[name] = host[kind][at[kind] : at[kind] + n].reshape(t.shape)
                at[kind] += n
            out.append((group, who, dataclasses.replace(record, **values)))
        return out


class EngineCore:
    """One model's packed row (its `ModelRunner`; `memory`, what it holds) and the requests its `policy` admits.

    chunk: most prompt tokens a round computes.  lanes: most streams at once (the recurrent states' pool).
    assistant: an `AssistantDrafter` whose row follows this one.  isolate: a request whose tokens cannot be chosen
    fails alone, and a forward that fails fails the requests in the row (`reset`), not the caller.  prebuild: on a
    GPU, the first round's kernels, and those of a captured round decoding this many streams, are built on threads
    beside the first round's host work (`ModelRunner.prebuild`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        runner: ModelRunner,
        policy: AdmissionPolicy,
        memory: RowContents,
        chunk: int,
        lanes: int = 1,
        assistant: AssistantDrafter | None = None,
        isolate: bool = False,
        prebuild: int = 0,
    ):
        self.runner, self.assistant, self.isolate, self.device = runner, assistant, isolate, runner.device
        self.read_late = runner.opts.tuning.read_late  # False: each round read at once (`Tuning.read_late`)
        recurrent = runner.profile.recurrent
        self.scheduler = Scheduler(model, policy, memory, chunk, runner.device, recurrent, lanes, assistant)
        self.lagged: Output | None = None
        self.stats: Stats = policy.stats  # one Stats per row: the policy counts its admissions in it
        self.keys = itertools.count()
        self.prebuild_streams = prebuild if runner.device.type == "cuda" else 0
        self.captured_before = self._captures()  # a kept row's captures before this core

    def add(self, request) -> None:
        """Queue a checked request (`engine.requests`), its streams made and keyed."""
        request.make_streams(self.keys)
        self.scheduler.policy.add(request)

    def busy(self) -> bool:
        return bool(self.scheduler.policy.waiting() or self.scheduler.placed or self.lagged)

    def run(self) -> Iterator[Stream]:
        """Rounds until no work is left; each stream (or score request) as it ends."""
        while self.busy():
            yield from self.run_round()

    def run_round(self) -> list[Stream]:
        """One round: queue it, read the one before (or this one, where it must be read at once); what ended."""
        self.stats.cancelled += self.scheduler.cancel()
        try:
            work = self.scheduler.schedule(keep_stopped=self.runner.captures)
            if work is None:
                return self._update()
            self._relayout(work)
            output = self._choose(work, self._forward(work.inputs))
        except Exception as err:
            if not self.isolate:
                raise
            return self._update() + self.reset(err)
        ended = self._update()
        self.lagged = output
        self.stats.rounds += 1
        self.stats.stream_forwards += work.fed
        self.stats.prompt_tokens += len(work.chunk.slots)
        self.stats.captures = self._captures() - self.captured_before
        if not self.read_late or any(g.reads_at_once for g, _, _ in output.records):
            ended += self._update()
        return ended

    def _relayout(self, work: Round) -> None:
        if work.layout is not None:
            self.runner.relayout(work.layout)
            if self.assistant is not None:
                self.assistant.relayout(work.layout)
        if self.assistant is not None:
            self.assistant.prefill(work.chunk)

    def _captures(self) -> int:
        return self.runner.static.graphs.captures if self.runner.static is not None else 0

    def _forward(self, inputs: ForwardInputs) -> torch.Tensor:
        if not self.prebuild_streams:
            return self.runner.forward(inputs)
        from ..kernels.prebuild import announce, awaiting  # a GPU's: Triton, an optional package

        futures, self.prebuild_streams = self.runner.prebuild(inputs, self.prebuild_streams), 0
        announce(futures)  # a line on stderr where the builds take long: a machine's first start
        with awaiting(futures):  # the first launch waits for its kernels
            logits = self.runner.forward(inputs)
        concurrent.futures.wait(futures)  # one that failed fails again at its launch
        return logits

    def _choose(self, work: Round, logits: torch.Tensor) -> Output:
        records, at = [], 0
        for group, n in work.parts:
            rows = logits[at : at + n]
            at += n
            try:
                records.append((group, *group.choose(rows)))
            except Exception as err:
                if not self.isolate:
                    raise
                for request in {id(s.request): s.request for s in group.streams + group.joining}.values():
                    self.fail(request, err)  # a request's own processors are its fault
        if len(work.scored):
            records.append((self.scheduler.scores, *self.scheduler.scores.choose(logits[at:], work.scored)))
        return Output.pack(records, self.device)

    def _update(self) -> list[Stream]:
        """The lagged round read: its streams take their tokens and score requests their values (each told through
        `on_event`); what ended."""
        output, self.lagged = self.lagged, None
        if output is None:
            return []
        ended, news = [], {}
        for group, who, record in output.read():
            accepted, done = group.accept(who, record)
            ended += done
            for stream, tokens, stopped in zip(accepted.streams, accepted.tokens, accepted.stopped):
                if stream.status is not Status.DECODE:
                    continue  # ended before this round was read (fed once more, or gone)
                new = tokens[: stream.limit - len(stream.tokens)]  # none past its limit
                stream.tokens += new
                self.stats.tokens += len(new)
                news.setdefault(id(stream.request), (stream.request, []))[1].extend((stream.answer, t) for t in new)
                if stopped or len(stream.tokens) >= stream.limit:
                    ended.append(stream)
        for request, pairs in news.values():
            request.on_event("tokens", pairs)
        for holder in ended:
            holder.status, request = Status.DONE, holder.request
            if request.n:
                request.on_event("finish", holder.answer)
            if not request.open:
                request.status = Status.DONE
                request.on_event("done", None)
        return ended

    def fail(self, request, err: Exception) -> None:
        """`request` fails: its streams end, and it is told once."""
        if request.error is not None:
            return
        self.stats.failed += 1
        self.scheduler.fail(request, err)
        request.on_event("error", err)

    def reset(self, err: Exception) -> list[Stream]:
        """A forward failed: every request in the row fails with it, and the row starts empty (waiting requests
        stay queued)."""
        for request in self.scheduler.requests(queued=False):
            self.fail(request, RuntimeError(f"the engine failed: {type(err).__name__}: {err}"))
        self.lagged = None
        self.scheduler.clear()
        self.runner.reset_states()
        return []


def _fields(record) -> list[torch.Tensor]:
    return [getattr(record, f.name) for f in dataclasses.fields(record)]


def _names(record) -> list[str]:
    return [f.name for f in dataclasses.fields(record)]


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in pinned host memory, made behind the queued work (read once an event says so)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
