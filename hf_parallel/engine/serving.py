"""A live row that requests join while it decodes: the engine behind `hf-parallel serve` and `hf-parallel batch`.

`Engine` runs one model's packed row on a thread of its own.  `submit` queues a request (a prompt,
generate's options for it, n streams) from any thread.  At the next round the engine checks it,
and admits its streams once they fit (`Arrivals`): whatever of its prompt is resident is reused,
whether another live request holds it or a finished one left it behind, and its streams decode
beside all the others, each with the processors, sampler and token limit of its own request.  Each
round hands every request its new tokens (`Request.on_event`).  A cancelled request (a client gone)
leaves the row at the next round.  An error in one request's token choice fails that request alone;
an error in a forward fails the requests in the row, the row starts afresh, and the engine goes on.

The rounds are `engine.live.ServingLoop`'s.  While it has work the engine holds the model (`model_lock`);
while idle it lets it go, so another call on the model runs between bursts, and `model.generate` runs as
if hf_parallel were absent (`wait_idle` waits for that).
"""

from __future__ import annotations

import threading
import traceback
from collections import deque

import torch
from transformers import PreTrainedModel

from ..attention import resolve_backend
from ..decoding.options import GenerationOptions
from ..models.checks import check_model
from ..models.placement import loop_device
from ..row.forest import Forest
from .admission import Arrivals
from .budget import free_memory, row_budget
from .live import Counters, Request, ServingLoop, refuse_speculation
from .probe import check_support
from .runner import Runner

MAX_QUEUE = 1024  # requests waiting for the engine's thread or for room, by default
GPU_FRACTION = 0.5  # of a GPU's free memory, the row's unless max_memory says: the rest for forwards and graphs
CPU_MEMORY = "512MiB"  # a CPU row unless max_memory says: the reference path's dense mask spans its used slots


class QueueFull(RuntimeError):
    """The engine holds as many waiting requests as it takes; try again later."""


class Closed(RuntimeError):
    """The engine is closing or closed: it takes no more requests."""


class Engine:
    """One model's live row on a thread of its own (module docstring).

    options: hf_parallel's own options for the row (`attn`, `prefill_chunk`, `cuda_graphs`, `compile`);
    max_memory: the row's memory (None: `GPU_FRACTION` of what a GPU has free, on a CPU `CPU_MEMORY`);
    max_streams: most live streams; max_queue: most waiting requests (`submit` raises `QueueFull` past it);
    retain: keep finished prompts' prefixes while room allows.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        max_memory=None,
        max_streams: int = 256,
        max_queue: int = MAX_QUEUE,
        retain: bool = True,
        **options,
    ):
        check_model(model)
        self.model, self.max_queue = model, max_queue
        if max_memory is None:  # the row is allocated whole at start: not all the memory the device has free
            device = loop_device(model)
            max_memory = CPU_MEMORY if device.type == "cpu" else int(free_memory(device) * GPU_FRACTION)
        self.opts = GenerationOptions.resolve(model, **options)
        refuse_speculation(self.opts)
        self.support = check_support(model)
        if self.support.recurrent:
            raise NotImplementedError(
                "the serving engine does not serve models with recurrent layers (their per-stream state does not "
                "join a live row); generate_tokens answers them in waves of rows"
            )
        self.backend = resolve_backend(self.opts.attn, model.device)
        chunk = self.opts.prefill_chunk_for(self.backend)
        self.budget = row_budget(model, self.support, chunk, max_memory, max_streams)
        self.counters = Counters(capacity=self.budget.capacity, max_streams=self.budget.streams)
        self.retain = retain
        self._inbox: deque[Request] = deque()
        self._wake = threading.Condition()
        self._closing = False
        self._holding = False  # the engine's thread holds the model
        self.failure: BaseException | None = None
        self.loop: ServingLoop | None = None
        self._thread = threading.Thread(target=self._serve, name="hf-parallel-engine", daemon=True)
        self._thread.start()

    # -- any thread --

    def submit(self, prompt: list[int], options: dict, n: int = 1, on_event=None) -> Request:
        """Queue a request (class `Request`); `QueueFull` when `max_queue` wait already, `Closed` when closing."""
        request = Request(prompt, options, n, on_event or _ignore)
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
                for request in self._inbox:
                    request.cancel()
                if self.loop is not None:
                    for request in list(self.loop.requests.values()):
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
            for request in waiting + (list(self.loop.requests.values()) if self.loop is not None else []):
                request.on_event("error", RuntimeError(f"the engine stopped: {type(err).__name__}: {err}"))

    def _rounds(self) -> None:
        runner = Runner(self.model, Forest(self.budget.capacity).snapshot(1), self.opts, self.backend, self.support)
        self.loop = loop = ServingLoop(runner, Arrivals(self.budget, self.retain), self.counters)
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._inbox or self._closing)
                if not self._inbox and self._closing:
                    return
            with self._wake:
                self._holding = True
            try:
                with runner.using_model(), torch.inference_mode():  # the model is the engine's until the row empties
                    while True:
                        with self._wake:
                            arrived, self._inbox = list(self._inbox), deque()
                        for request in arrived:
                            loop.arrive(request)
                        if not loop.busy():
                            break
                        loop.round()
            finally:
                with self._wake:
                    self._holding = False
                    self._wake.notify_all()


def _ignore(kind: str, value) -> None:
    pass
