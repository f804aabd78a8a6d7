"""uvicorn's server with a start-up line and a drain before its shutdown: what `hf-parallel serve` runs.

On the first SIGTERM or Ctrl-C the app's `state.draining` is set: /health answers 503, so that a load
balancer takes the server out of rotation, and new requests get 503, while the server still listens and
the requests in flight finish.  Once none is left, or `grace` seconds on, uvicorn's own shutdown runs, and
what is still in flight then is cancelled.  A second signal skips the rest of the drain; uvicorn's own
handling takes over from there (another Ctrl-C forces the exit).
"""

from __future__ import annotations

import logging
import time

import uvicorn

SLACK = 1.0  # seconds uvicorn's shutdown gets past the grace period, to close idle connections
logger = logging.getLogger("uvicorn.error")  # where uvicorn writes its own start-up and shutdown lines


class DrainingServer(uvicorn.Server):
    """`uvicorn.Server` over `config.app` (an app of `create_app`) that drains for up to `grace` seconds on the
    first signal (module docstring) and logs `banner` with the address it listens on once it does."""

    def __init__(self, config: uvicorn.Config, grace: float, banner: str):
        super().__init__(config)
        self.grace, self.banner = grace, banner
        self.drain_ends: float | None = None  # time.monotonic() when the drain gives way to the shutdown

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            logger.info("%s at http://%s:%d", self.banner, f"[{host}]" if ":" in host else host, port)

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain_ends is None and not self.should_exit:
            self.drain_ends = time.monotonic() + self.grace
            self.config.app.state.draining = True
            logger.info("Draining: /health and new requests answer 503 while those in flight finish (%g s)", self.grace)
            return
        super().handle_exit(sig, frame)
        self._shutdown_within_grace()

    async def on_tick(self, counter: int) -> bool:
        if self.drain_ends is not None and not self.should_exit:
            if not self.server_state.tasks or time.monotonic() >= self.drain_ends:
                self.should_exit = True
                self._shutdown_within_grace()
        return await super().on_tick(counter)

    def _shutdown_within_grace(self) -> None:
        """uvicorn's shutdown waits for the requests in flight only for what is left of the grace period."""
        if self.drain_ends is not None:
            self.config.timeout_graceful_shutdown = max(self.drain_ends - time.monotonic(), 0) + SLACK
