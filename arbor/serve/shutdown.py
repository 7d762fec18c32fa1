"""Graceful shutdown of ``arbor serve`` (one process, uvicorn).

First SIGTERM or SIGINT: the listening socket closes, new requests on open connections get 503
(``app.state.draining``), requests in flight keep generating for ``grace`` seconds and are then
aborted — a stream ends with ``finish_reason: "abort"`` and ``[DONE]``, a plain request returns
what it has — and the process exits once every response has ended (uvicorn cancels any handler
left ``grace + 10`` s after the signal, time enough for the abort to reach a busy engine thread,
which aborts its request too). A second signal aborts every request at once and exits without
waiting.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import uvicorn


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app, backend, grace: float):
        super().__init__(config)
        self.app, self.backend, self.grace = app, backend, grace
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """Runs as the signal handler, on the loop's thread between two of its callbacks."""
        loop, name = self._loop, signal.Signals(sig).name
        if self.should_exit:
            self.force_exit = True
            print(f"arbor serve: {name} again: aborting every request and exiting now", file=sys.stderr, flush=True)
            if loop is not None:
                loop.call_soon_threadsafe(self.backend.abort_all)
            return
        self.should_exit = True
        self.app.state.draining = True
        print(f"arbor serve: {name}: taking no new requests; the {self.backend.num_requests()} in flight are aborted "
              f"in {self.grace:g} s ({name} again to exit now)", file=sys.stderr, flush=True)
        if loop is not None:
            loop.call_soon_threadsafe(loop.call_later, self.grace, self.backend.abort_all)


def run_server(app, backend, host: str, port: int, grace: float, log_level: str = "info") -> None:
    """Serve ``app`` until a signal ends it, as above; ``backend`` (``arbor.serve.app.Backend``) counts
    and aborts the requests in flight."""
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=grace + 10, log_level=log_level)
    GracefulServer(config, app, backend, grace).run()
