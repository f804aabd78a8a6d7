"""The serving engine's events for one request, gathered as a test reads them."""

from __future__ import annotations

import threading

TIMEOUT = 120  # seconds a request may take on a loaded CPU


class Collector:
    """A request's events, gathered as the engine hands them out."""

    def __init__(self):
        self.events, self.tokens, self.done = [], {}, threading.Event()
        self.error = None

    def __call__(self, kind, value):
        self.events.append(kind)
        if kind == "tokens":
            for j, t in value:
                self.tokens.setdefault(j, []).append(t)
        elif kind == "start":
            self.cached = value
        elif kind == "error":
            self.error = value
            self.done.set()
        elif kind == "done":
            self.done.set()

    def wait(self) -> Collector:
        assert self.done.wait(TIMEOUT), "the request never finished"
        return self
