"""The refill loop over requests that arrive while it runs: each with its own prompt, options and n streams.

`ServingLoop` is `RefillLoop` with its prompts coming and going: `arrive` checks a `Request` and queues
its streams (`Arrivals` admits them where they fit, reusing whatever of the prompt is resident); each
round hands every request its streams' new tokens and tells it when they stop, through
`Request.on_event`.  Each request's streams choose their tokens with the processors, sampler and token
limit of that request (a `Cohort` each).  A cancelled request leaves the row at the next round; a
request whose token choice raises fails alone; a forward that raises fails the requests in the row,
and the row starts empty.  `engine.serving.Engine` runs it on a thread of its own.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..decoding.inputs import check_length, check_tokens
from ..decoding.options import GenerationOptions
from ..decoding.sampling import Sampler
from ..row.forest import Node
from .admission import Arrivals
from .refill import Cohort, RefillLoop
from .runner import Runner


class Request:
    """One request: a prompt, generate's options for it, and `n` streams answering it.

    on_event(kind, value) is called on the engine's thread, in this order:
        "accepted", None     the request was checked and waits for room
        "start", cached      the streams entered the row; `cached` of the prompt's tokens were resident
        "tokens", [(j, id)]  this round's new token of each of its live streams j
        "finish", j          stream j stopped (its tokens so far are its answer)
        "done", None         every stream stopped
        "error", exception   the request failed (a ValueError or TypeError: the request is at fault); nothing
                             follows
    `cancel()` (any thread) takes it out of the queue or the row at the next round; nothing follows.
    """

    def __init__(self, prompt: list[int], options: dict, n: int, on_event: Callable[[str, object], None]):
        self.prompt, self.options, self.n, self.on_event = list(prompt), dict(options), n, on_event
        self.cancelled = False
        self.opts: GenerationOptions | None = None
        self.room = 0  # new tokens each stream may get
        self.streams: list[int] = []  # engine stream indices, one per answer j
        self.running = n
        self.cached = 0
        self.failed: Exception | None = None  # raised while choosing its tokens: it fails once its rows stop
        self.sampler: Sampler | None = None

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Counters:
    """What the engine has done since it started, and what it holds now."""

    requests: int = 0
    failed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0  # the prompt tokens of every admitted request, as if each were alone
    computed_tokens: int = 0  # ... of which the row computed (the rest were resident)
    generated_tokens: int = 0
    rounds: int = 0
    live_streams: int = 0
    queued: int = 0  # requests waiting for the engine's thread or for room
    resident_slots: int = 0
    retained_slots: int = 0  # of which prefixes no live stream uses, kept for later requests
    capacity: int = 0
    max_streams: int = 0


class GreedyPool:
    """The live streams, of any number of requests, whose token is the argmax of their logits and which stop only at
    one set of EOS ids or their own token limit (`Processing.eos_only`): all of them choose in one pass.

    It stands in the loop's cohorts as one: rows of `streams`, their newest tokens `last`, `slots()`, `choose`
    and `drop`; each row has its own step, answer start and token limit.
    """

    def __init__(self, eos: tuple[int, ...], device: torch.device):
        self.eos_ids = eos
        self.eos = torch.tensor(eos, dtype=torch.long, device=device)
        self.streams: list[int] = []
        self.steps = torch.zeros(0, dtype=torch.long, device=device)
        self.starts, self.rooms = self.steps.clone(), self.steps.clone()
        self.last: torch.Tensor | None = self.steps.clone()

    def join(self, cohort: Cohort) -> None:
        """Take over a cohort's rows (after its first choice)."""
        self.streams = self.streams + cohort.streams
        n = len(cohort.streams)
        step = torch.full((n,), cohort.step, dtype=torch.long, device=self.steps.device)
        self.steps = torch.cat([self.steps, step])
        self.starts = torch.cat([self.starts, cohort.starts])
        self.rooms = torch.cat([self.rooms, torch.full_like(step, cohort.room)])
        self.last = torch.cat([self.last, cohort.last])

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Every row's next token from its logits [n, V]; [n] bool, which rows stop with it."""
        self.last = logits.argmax(dim=-1)
        self.steps += 1
        return torch.isin(self.last, self.eos) | (self.steps == self.rooms)

    def slots(self) -> torch.Tensor:
        return self.starts + (self.steps - 1)

    def drop(self, keep: torch.Tensor, keep_list: list[bool]) -> None:
        self.streams = [s for s, k in zip(self.streams, keep_list) if k]
        self.steps, self.starts, self.rooms = self.steps[keep], self.starts[keep], self.rooms[keep]
        self.last = self.last[keep]


class ServingLoop(RefillLoop):
    """The refill loop over requests that arrive while it runs (`Engine`), each stream with its request's options."""

    def __init__(self, runner: Runner, arrivals: Arrivals, counters: Counters):
        super().__init__(runner, {}, arrivals, 1)
        self.counters = counters
        self.requests: dict[int, Request] = {}  # by stream index, while queued or live
        self.answer: dict[int, int] = {}  # by stream index: which of its request's answers it is
        self.next_stream = 0

    def arrive(self, request: Request) -> None:
        """Check a request and queue its streams; a request at fault gets its "error" now."""
        self.counters.queued -= 1
        if request.cancelled:
            self.counters.cancelled += 1
            return
        try:
            self._check(request)
        except Exception as err:  # noqa: BLE001 - a request that cannot run fails alone
            self._fail(request, err)
            return
        streams = []
        for _ in range(request.n):
            index, self.next_stream = self.next_stream, self.next_stream + 1
            self.prompts[index] = request.prompt
            self.requests[index] = request
            self.answer[index] = len(request.streams)
            request.streams.append(index)
            streams.append((index, request.prompt, request.room))
        request.sampler = Sampler(request.opts, self.runner.device)
        self.admission.add(streams)
        self.counters.queued += 1
        self.counters.requests += 1
        request.on_event("accepted", None)

    def _check(self, request: Request) -> None:
        model, budget = self.runner.model, self.admission.budget
        if not request.prompt:
            raise ValueError("the prompt is empty")
        check_tokens(model, "the prompt", request.prompt)
        opts = GenerationOptions.resolve(model, **request.options)
        refuse_speculation(opts)
        room = opts.request.prepare(model, request.prompt).budget
        check_length(model, "the prompt", request.prompt, room)
        slots = len(request.prompt) + room * request.n
        if slots > budget.capacity:
            raise ValueError(
                f"the prompt's {len(request.prompt)} tokens and {request.n} x {room} new tokens need {slots} "
                f"slots; the server's row holds {budget.capacity}"
            )
        if request.n > budget.streams:
            raise ValueError(f"n={request.n} streams; the server decodes at most {budget.streams} at once")
        request.opts, request.room = opts, room

    def busy(self) -> bool:
        return bool(self.admission.waiting or self.starting or self.cohorts)

    def round(self) -> None:
        """Drop cancelled requests, admit waiting ones, run one forward and hand out its tokens."""
        self._cancel()
        try:
            self._admit()
            if self.starting or self.cohorts:
                logits = self._forward()
                for _ in self._choose(logits):  # `_finish` tells each request as its streams stop
                    pass
                self._pool()
                self.counters.rounds += 1
        except Exception as err:  # noqa: BLE001 - a failed forward fails the row's requests, not the engine
            self._reset(err)
        self._count()

    # -- admission and leaving --

    def _admit(self) -> None:
        queued = self._queued()
        super()._admit()
        waiting = {id(r) for r in self._queued()}
        for request in queued:
            if id(request) not in waiting:  # admitted now
                request.cached = self.admission.matched.pop(request.streams[0], 0)
                self.counters.queued -= 1
                self.counters.prompt_tokens += len(request.prompt)
                self.counters.computed_tokens += len(request.prompt) - request.cached
                request.on_event("start", request.cached)

    def _queued(self) -> list[Request]:
        return [self.requests[streams[0][0]] for streams in self.admission.waiting]

    def _snapshot(self) -> None:
        room = max((a.room for a in self.forest.answers.values()), default=1)
        self.runner.relayout(self.forest.snapshot(room))

    def _cancel(self) -> None:
        gone = {i for i, r in self.requests.items() if r.cancelled}
        if not gone:
            return
        self.counters.queued -= sum(r.cancelled for r in self._queued())
        self.admission.remove(gone)
        for index, _ in self.starting:
            if index in gone:
                self.admission.release(index)
        self.starting = [(i, a) for i, a in self.starting if i not in gone]
        for cohort in self.cohorts:
            keep = [s not in gone for s in cohort.streams]
            if not all(keep):
                for index in cohort.streams:
                    if index in gone:
                        self.admission.release(index)
                self._drop(cohort, keep)
        self.cohorts = [c for c in self.cohorts if c.streams]
        for request in {id(r): r for i, r in self.requests.items() if i in gone}.values():
            self.counters.cancelled += 1
            self._forget(request)
        self.changed = True

    def _forget(self, request: Request) -> None:
        for index in request.streams:
            self.requests.pop(index, None)
            self.prompts.pop(index, None)
            self.answer.pop(index, None)

    def _reset(self, err: Exception) -> None:
        """A forward failed: every request in the row fails with it, and the row starts empty."""
        streams = [i for i, _ in self.starting] + [i for i, _, _ in self.started]
        failed = {id(self.requests[i]): self.requests[i] for i in streams}
        for cohort in self.cohorts:
            failed.update({id(self.requests[s]): self.requests[s] for s in cohort.streams})
        for request in failed.values():
            self._fail(request, RuntimeError(f"the engine failed: {type(err).__name__}: {err}"))
            self._forget(request)
        traceback.print_exception(err)
        waiting = list(self.admission.waiting)
        self.admission = Arrivals(self.admission.budget, self.admission.retain)
        self.admission.waiting.extend(waiting)
        self.forest = self.admission.forest
        self.starting, self.cohorts, self.started = [], [], []
        self.changed = self.live_changed = True
        self._snapshot()

    def _fail(self, request: Request, err: Exception) -> None:
        self.counters.failed += 1
        request.on_event("error", err)

    # -- choosing and finishing --

    def _start(self, started: list[tuple[int, Node, int]]) -> list[Cohort]:
        """One cohort per request (its streams start together, consecutive in `started`)."""
        cohorts, run = [], []
        for item in started:
            if run and self.requests[run[0][0]] is not self.requests[item[0]]:
                cohorts.append(self._cohort(run))
                run = []
            run.append(item)
        if run:
            cohorts.append(self._cohort(run))
        return cohorts

    def _cohort(self, run: list[tuple[int, Node, int]]) -> Cohort:
        request = self.requests[run[0][0]]
        streams, starts = [i for i, _, _ in run], [a.slot for _, a, _ in run]
        return Cohort(
            self.runner,
            streams,
            [request.prompt] * len(run),
            starts,
            request.room,
            request.sampler,
            request.opts,
        )

    def _choose_rows(self, cohort: Cohort, logits: torch.Tensor) -> torch.Tensor:
        """The cohort's tokens; where its request's processors raise, the request fails and its rows stop."""
        try:
            return cohort.choose(logits)
        except Exception as err:  # noqa: BLE001 - one request's fault is its own
            self.requests[cohort.streams[0]].failed = err
            if cohort.last is None:
                cohort.last = torch.zeros(len(cohort.streams), dtype=torch.long, device=logits.device)
            return torch.ones(len(cohort.streams), dtype=torch.bool, device=logits.device)

    def _chosen(self, live: list[Cohort], tokens: list[int]) -> None:
        streams = [s for cohort in live for s in cohort.streams]
        news: dict[int, tuple[Request, list]] = {}
        for index, token in zip(streams, tokens):
            request = self.requests[index]
            if request.failed is None:
                j = self.answer[index]
                news.setdefault(id(request), (request, []))[1].append((j, token))
        for request, pairs in news.values():
            self.counters.generated_tokens += len(pairs)
            request.on_event("tokens", pairs)

    def _pool(self) -> None:
        """The cohorts that chose their first token in this round and need only argmax and EOS join their pool."""
        for cohort in [c for c in self.cohorts if isinstance(c, Cohort) and c.step == 1 and c.streams]:
            eos = cohort.processing.eos_only() if not cohort.sampler.do_sample else None
            if eos is None:
                continue
            pool = next((c for c in self.cohorts if isinstance(c, GreedyPool) and c.eos_ids == eos), None)
            if pool is None:
                pool = GreedyPool(eos, self.runner.device)
                self.cohorts.append(pool)
            pool.join(cohort)
            cohort.streams = []
            self.live_changed = True
        self.cohorts = [c for c in self.cohorts if c.streams]

    def _finish(self, cohort: Cohort, flags: list[bool]):
        done = {}
        for row in [i for i, f in enumerate(flags) if f]:
            index = cohort.streams[row]
            request = self.requests[index]
            self.admission.release(index)
            request.running -= 1
            if request.failed is None:
                request.on_event("finish", self.answer[index])
            if not request.running:
                done[id(request)] = request
        for request in done.values():
            if request.failed is not None:
                self._fail(request, request.failed)
            else:
                request.on_event("done", None)
            self._forget(request)
        self._drop(cohort, [not f for f in flags])
        return iter(())

    def _count(self) -> None:
        counters, forest = self.counters, self.forest
        counters.live_streams = self.live
        counters.resident_slots = forest.used()
        counters.retained_slots = forest.retained()


def refuse_speculation(opts: GenerationOptions) -> None:
    """NotImplementedError for drafts (prompt lookup, an assistant model): the serving engine decodes one token a
    stream a round."""
    if opts.speculation is not None:
        raise NotImplementedError(
            "the serving engine decodes one token a stream a round: prompt_lookup_num_tokens and assistant_model "
            "are for generate_tokens"
        )
