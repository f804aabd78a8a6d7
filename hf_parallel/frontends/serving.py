"""A live row that requests join while it decodes: the engine behind `hf-parallel serve` and `hf-parallel batch`.

`Engine` runs one model's engine core (`engine.core`) on a thread of its own, with the `Arrivals` policy.
`submit` queues a request (a prompt, generate's options for it, n streams) from any thread.  At the next
round the engine checks it, and admits its streams once they fit: whatever of its prompt is resident is
reused, whether another live request holds it or a finished one left it behind, and its streams decode
beside all the others, each with the processors, sampler, token limit and drafts of its own request.  Each
round hands every request its new tokens (`Request.on_event`).  A cancelled request (a client gone) leaves
the row at the next round.  An error in one request's token choice fails that request alone; an error in a
forward fails the requests in the row, the row starts afresh, and the engine goes on.

While it has work the engine holds the model (`model_lock`); while idle it lets it go, so another call on the
model runs between bursts, and `model.generate` runs as if hf_parallel were absent (`wait_idle` waits for that).
"""

from __future__ import annotations

import threading
import traceback
from collections import deque
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..attention import resolve_backend
from ..decoding.options import GenerationOptions
from ..decoding.sampling import Sampler
from ..engine.core import EngineCore
from ..engine.policies import Arrivals, Priority
from ..engine.requests import check_drafts, check_request
from ..engine.streams import Request
from ..models.checks import check_model
from ..models.placement import loop_device
from ..row.contents import Eviction, KeepNothing
from ..row.prefix_tree import PrefixTree
from ..runner.model_runner import ModelRunner
from ..runner.sizing import free_memory, size, size_row
from .probe import check_support

MAX_QUEUE = 1024  # requests waiting for the engine's thread or for room, by default
GPU_FRACTION = 0.5  # of a GPU's free memory, the row's unless max_memory says: the rest for forwards and graphs
CPU_MEMORY = "512MiB"  # a CPU row unless max_memory says (or more, to hold one request of the model's context)


class QueueFull(RuntimeError):
    """The engine holds as many waiting requests as it takes; try again later."""


class Closed(RuntimeError):
    """The engine is closing or closed: it takes no more requests."""


class RowTooSmall(ValueError):
    """A request needs more slots than the engine's row holds (`code`: the error's name in an API response)."""

    code = "row_too_small"


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


class Engine:
    """One model's live row on a thread of its own (module docstring).

    options: hf_parallel's own options for the row (`attn`, `prefill_chunk`, `cuda_graphs`, `compile`);
    prompt_lookup_num_tokens: every request's prompt-lookup drafts unless it sets its own (None: none);
    max_memory: the row's memory (None: `GPU_FRACTION` of what a GPU has free, on a CPU `CPU_MEMORY`, either
    grown where it would not hold one request of the model's whole context);
    max_streams: most live streams; max_queue: most waiting requests (`submit` raises `QueueFull` past it);
    retain: keep finished prompts' prefixes while room allows, least recently used evicted first (not for models
    with recurrent layers, whose states would stay with them);
    scheduling: "fcfs", first come first served, or "priority", by each request's `priority` (lower first), then
    first come first served (as vLLM's --scheduling-policy).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        max_memory=None,
        max_streams: int = 256,
        max_queue: int = MAX_QUEUE,
        retain: bool = True,
        prompt_lookup_num_tokens: int | None = None,
        scheduling: str = "fcfs",
        **options,
    ):
        check_model(model)
        self.model, self.max_queue = model, max_queue
        self.opts = GenerationOptions.resolve(model, prompt_lookup_num_tokens=prompt_lookup_num_tokens, **options)
        self.defaults = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens} if prompt_lookup_num_tokens else {}
        if scheduling not in ("fcfs", "priority"):
            raise ValueError(f"scheduling must be 'fcfs' or 'priority', got {scheduling!r}")
        self.scheduling = scheduling
        self.profile = check_support(model)
        check_drafts(model, self.profile, self.opts)
        self.backend = resolve_backend(self.opts.attn, model.device)
        chunk = self.opts.prefill_chunk_for(self.backend)
        self.size = self._size(chunk, max_memory, max_streams)
        self.counters = Counters(capacity=self.size.capacity, max_streams=self.size.streams)
        recurrent = self.profile.recurrent
        runner = ModelRunner(model, self.profile, self.opts, self.backend, self.size.capacity)
        policy = (Priority if scheduling == "priority" else Arrivals)(self.size.streams)
        eviction = Eviction() if retain and not recurrent else KeepNothing()
        memory = PrefixTree(self.size.capacity, split_written=not recurrent, eviction=eviction)
        self.core = EngineCore(model, runner, policy, memory, chunk, self.size.streams, isolate=True)
        self._inbox: deque[Request] = deque()
        self._refused = self._dropped = 0  # requests failed by their checks, cancelled before them
        self._wake = threading.Condition()
        self._closing = False
        self._holding = False  # the engine's thread holds the model
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="hf-parallel-engine", daemon=True)
        self._thread.start()

    def _size(self, chunk: int, max_memory, max_streams: int):
        """The row: `max_memory`'s, or the default (class docstring), grown to one request of the whole context."""
        if max_memory is not None:
            return size_row(self.model, self.profile, chunk, max_memory, max_streams)
        device = loop_device(self.model)
        memory = CPU_MEMORY if device.type == "cpu" else int(free_memory(device) * GPU_FRACTION)
        row = size_row(self.model, self.profile, chunk, memory, max_streams)
        context = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if context is not None and row.capacity < context:
            memory = row.bytes + (context - row.capacity) * self.profile.slot_bytes
            row = size_row(self.model, self.profile, chunk, memory, max_streams)
        return row

    # -- any thread --

    def submit(self, prompt: list[int], options: dict, n: int = 1, on_event=None, priority: int = 0) -> Request:
        """Queue a request; `QueueFull` when `max_queue` wait already, `Closed` when closing.  Its `on_event` is
        told "accepted" once the engine has checked it (`Request` says what follows), or "error".  `priority`: its
        place in the queue where the engine schedules by priority (lower first)."""
        request = Request(list(prompt), None, n, options=dict(options), priority=priority)
        if on_event is not None:
            request.on_event = on_event
        with self._wake:
            if self._closing:
                raise Closed("the engine has stopped" if self.failure is not None else "the server is shutting down")
            if self.counters.queued >= self.max_queue:
                raise QueueFull(f"{self.counters.queued} requests are waiting (max_queue={self.max_queue})")
            self.counters.queued += 1
            self._inbox.append(request)
            self._wake.notify()
        return request

    def wake(self) -> None:
        """Make the engine look at its requests now (after a `cancel`, while it is idle)."""
        with self._wake:
            self._wake.notify()

    def close(self, timeout: float | None = None) -> bool:
        """Take no more requests, let those queued or in the row finish, and stop; after `timeout` seconds those
        left are cancelled.  Whether the engine's thread ended."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._wake:
                for request in list(self._inbox) + self._requests():
                    request.cancel()
                self._wake.notify()
            self._thread.join(30)
        return not self._thread.is_alive()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the engine has no request and has let the model go; whether it has."""
        with self._wake:
            return self._wake.wait_for(lambda: not (self._holding or self._inbox), timeout)

    # -- the engine's thread --

    def _serve(self) -> None:
        try:
            self._rounds()
        except BaseException as err:  # the engine cannot go on: every request fails, and later ones at once
            self.failure = err
            traceback.print_exception(err)
            with self._wake:
                self._closing = True
                waiting, self._inbox = list(self._inbox), deque()
            for request in waiting + self._requests():
                request.on_event("error", RuntimeError(f"the engine stopped: {type(err).__name__}: {err}"))

    def _rounds(self) -> None:
        core = self.core
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._inbox or self._closing)
                if not self._inbox and self._closing:
                    return
                self._holding = True
            try:
                with core.runner.using_model(), torch.inference_mode():  # the model is the engine's until idle
                    while True:
                        with self._wake:
                            arrived, self._inbox = list(self._inbox), deque()
                        for request in arrived:
                            self._arrive(request)
                        self._count()
                        if not core.busy():
                            break
                        core.run_round()
                        self._count()
            finally:
                with self._wake:
                    self._holding = False
                    self._wake.notify_all()

    def _arrive(self, request: Request) -> None:
        """Check a request and queue it in the core; a request at fault gets its "error" now."""
        if request.cancelling:
            self._dropped += 1
            self._count_queued(-1)
            return
        try:
            self._check(request)
        except Exception as err:  # noqa: BLE001 - a request that cannot run fails alone
            self._refused += 1
            self._count_queued(-1)
            request.on_event("error", err)
            return
        told = request.on_event

        def counted(kind: str, value) -> None:
            if kind == "start":
                self._count_queued(-1)
                self.counters.prompt_tokens += len(request.prompt)
                self.counters.computed_tokens += len(request.prompt) - value
            elif kind == "tokens":
                self.counters.generated_tokens += len(value)
            told(kind, value)

        request.on_event = counted
        self.core.add(request)
        self.counters.requests += 1
        told("accepted", None)

    def _check(self, request: Request) -> None:
        """The one door (`engine.requests`), then what this engine's row takes."""
        opts = GenerationOptions.resolve(self.model, **{**self.defaults, **request.options})
        limit = check_request(self.model, self.profile, request.prompt, opts)
        if request.priority and self.scheduling != "priority":
            raise ValueError(
                f"priority={request.priority}: this engine admits requests first come first served; start it with "
                "scheduling='priority' (hf-parallel serve --scheduling-policy priority)"
            )
        if opts.assistant_model is not None:
            raise ValueError("assistant_model: the server drafts by prompt lookup (prompt_lookup_num_tokens)")
        slots = len(request.prompt) + limit * request.n
        if slots > self.size.capacity:
            raise RowTooSmall(
                f"the prompt's {len(request.prompt)} tokens and {request.n} x {limit} new tokens need {slots} "
                f"slots; the server's row holds {self.size.capacity} ({size(self.size.bytes)}): start it with "
                "more memory (max_memory, hf-parallel serve --max-memory) or ask for fewer tokens"
            )
        if request.n > self.size.streams:
            raise ValueError(f"n={request.n} streams; the server decodes at most {self.size.streams} at once")
        request.opts, request.max_new_tokens = opts, limit
        request.sampler = Sampler(opts, self.core.device)

    def _count_queued(self, change: int) -> None:
        with self._wake:
            self.counters.queued += change

    def _requests(self) -> list[Request]:
        """The requests queued in the core or in its row."""
        return self.core.scheduler.requests()

    def _count(self) -> None:
        counters, stats, scheduler = self.counters, self.core.stats, self.core.scheduler
        counters.rounds = stats.rounds
        counters.cancelled, counters.failed = stats.cancelled + self._dropped, stats.failed + self._refused
        with self._wake:  # the queue also counts what `submit` added meanwhile
            counters.queued = len(self._inbox) + scheduler.policy.waiting()
        counters.live_streams = scheduler.live()
        counters.resident_slots, counters.retained_slots = scheduler.memory.used(), scheduler.memory.retained()
