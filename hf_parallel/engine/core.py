"""The engine core: one packed row's rounds, each schedule -> forward -> choose -> update.

    schedule  the scheduler (`engine.scheduler`) retires ended streams, lets the admission policy place waiting
              requests' streams (`engine.policies`), and feeds every decoding stream's newest token (a drafting
              stream's draft too) and a chunk of prompt tokens not yet computed; a stream whose prompt is then
              complete joins a choice group with its prompt's last logits
    forward   one forward of the model runner over all of it (a captured CUDA graph where its bucket of tokens
              allows, `runner.graphs`); an assistant model's row, where one drafts, computes the chunk too
    choose    each choice group chooses (or verifies) its rows' tokens on the device (`engine.groups`)
    update    the round's tokens are read on the host a round late (the next round is queued first, so the
              GPU never waits for the host): streams take their tokens, and stopped ones end and leave at the
              next round; a round with drafts is read at once (the next drafts need it)

A stream that stopped is fed once more before the host knows (a token into its own answer room, never read).
Every round reads the device once, through one event.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..runner.model_runner import ForwardInputs, ModelRunner
from .drafts import AssistantDrafter
from .groups import ChoiceGroup
from .policies import AdmissionPolicy
from .scheduler import Round, Scheduler
from .stats import Stats
from .streams import Chosen, Request, Status, Stream


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
        self.runner, self.assistant, self.isolate, self.device = runner, assistant, isolate, runner.device
        self.read_late = runner.opts.tuning.read_late  # False: each round read at once (`Tuning.read_late`)
        self.scheduler = Scheduler(model, policy, chunk, runner.device, runner.profile.recurrent, lanes, assistant)
        self.lagged: Output | None = None
        self.stats: Stats = policy.stats  # one Stats per row: the policy counts its admissions in it
        self.prebuild_streams = prebuild if runner.device.type == "cuda" else 0
        self.captured_before = self._captures()  # a kept row's captures before this core

    def add(self, request: Request) -> None:
        self.scheduler.policy.add(request)

    def busy(self) -> bool:
        return bool(self.scheduler.policy.waiting() or self.scheduler.live or self.lagged)

    def run(self) -> Iterator[Stream]:
        """Rounds until no work is left; each stream as it ends."""
        while self.busy():
            yield from self.step()

    def step(self) -> list[Stream]:
        """One round; the streams that ended, as read in it."""
        self.stats.cancelled += self.scheduler.cancel()
        try:
            work = self.scheduler.schedule(keep_stopped=self.runner.captures)
            if work is None:
                return self._read()
            self._relayout(work)
            logits = self._forward(work.inputs)
            output = self._choose(work, logits)
        except Exception as err:
            if not self.isolate:
                raise
            return self._read() + self.reset(err)
        ended = self._read()
        self.lagged = output
        self.stats.rounds += 1
        self.stats.stream_forwards += work.fed
        self.stats.prompt_tokens += len(work.chunk.slots)
        self.stats.captures = self._captures() - self.captured_before
        if not self.read_late or any(g.drafts for g, _ in output.chosen):
            ended += self._read()
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
        chosen, at = [], 0
        for group, n in work.parts:
            rows = logits[at : at + n]
            at += n
            try:
                chosen.append((group, group.choose(rows)))
            except Exception as err:
                if not self.isolate:
                    raise
                for request in {id(s.request): s.request for s in group.streams + group.joining}.values():
                    self.fail(request, err)  # a request's own processors are its fault
        ints = [t for _, c in chosen for t in (c.tokens.flatten(), c.counts, c.stops.long())]
        pairs, floats = [], torch.zeros(0, device=self.device)
        if len(work.scored):
            pairs, floats, greedy = self.scheduler.scores.choose(logits[at:], work.scored)
            ints.append(greedy.long())
        ints = torch.cat(ints) if ints else torch.zeros(0, dtype=torch.long, device=self.device)
        event = None
        if self.device.type == "cuda":  # to pinned memory behind the round's kernels; read a round late
            ints, floats = _to_host(ints), _to_host(floats)
            event = torch.cuda.Event()
            event.record()
        return Output(chosen, pairs, ints, floats, event)

    def _read(self) -> list[Stream]:
        """The lagged round's tokens taken by their streams (told through `on_event`); the streams that ended."""
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
            for stream, row, count, stop in zip(c.streams, tokens.tolist(), counts.tolist(), stops.tolist()):
                if stream.status is not Status.DECODE:
                    continue  # ended before this round was read (fed once more, or gone)
                new = row[: min(count, stream.max_new_tokens - len(stream.tokens))]
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
            stream.status = Status.DONE
            stream.request.on_event("finish", stream.answer)
            if not stream.request.open:
                stream.request.on_event("done", None)
        return ended

    def fail(self, request: Request, err: Exception) -> None:
        """`request` fails: its streams end, and it is told once."""
        if request.error is not None:
            return
        request.error = err
        self.stats.failed += 1
        self.scheduler.fail(request)
        request.on_event("error", err)

    def reset(self, err: Exception) -> list[Stream]:
        """A forward failed: every request in the row fails with it, and the row starts empty (waiting requests
        stay queued)."""
        for request in {id(s.request): s.request for s in self.scheduler.live.values()}.values():
            self.fail(request, RuntimeError(f"the engine failed: {type(err).__name__}: {err}"))
        self.lagged = None
        self.scheduler.clear()
        self.runner.reset_states()
        return []


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in pinned host memory, made behind the queued work (read once an event says so)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
