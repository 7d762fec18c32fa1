"""The one OpenAI-compatible app and the backend interface it serves.

``make_app(backend, model_name, config)`` builds what every Arbor server shares — the API-key check
(``ServerConfig.api_key``), the OpenAI error body for ``RequestError``, ``GET /health``,
``GET /v1/models`` and ``GET /v1/models/{id}`` (the model card: id, ``max_model_len`` and the backend's
``card()`` fields), 503 for new requests once shutdown began (``app.state.draining``), 400 for a body
naming another model — then lets the backend add its generation routes (``install``).

A ``Backend`` is one way of generating: ``arbor.serve.server.EngineBackend`` (an autoregressive
engine: one process, or rank 0's front over N ranks) or ``arbor.dllm.server.DiffusionBackend`` (the
block-diffusion decoder). The caller picks it (``arbor serve``'s command). ``serve`` runs the app
until SIGTERM / SIGINT (``arbor.serve.shutdown``), which asks the backend how many requests are in
flight and aborts them after the grace period.

Backend routes share ``read_body`` (the request's JSON body with the checks above), ``sse_line``
(one SSE event) and ``OFF_LOOP_CHARS`` (prompts at least this long are checked and tokenized on a
worker thread, so the event loop never runs a long tokenization).
"""

from __future__ import annotations

import json
from typing import Awaitable, Callable, Protocol, runtime_checkable

from fastapi import FastAPI, Request

from arbor.serve.config import ServerConfig
from arbor.serve.http_io import BearerAuth, JSONOut, error_response, read_json
from arbor.serve.openai_protocol import RequestError

OFF_LOOP_CHARS = 4096       # prompts at least this long are checked and tokenized on a worker thread

ReadBody = Callable[[Request], Awaitable[dict]]


@runtime_checkable
class Backend(Protocol):
    """What a server backend provides to ``make_app`` and to graceful shutdown."""

    @property
    def max_model_len(self) -> int:
        """The longest prompt + completion a request may ask for (the model card's ``max_model_len``)."""

    def card(self) -> dict:
        """Fields the model card adds for this backend (may be empty)."""

    def install(self, app: FastAPI, read_body: ReadBody, model_name: str, config: ServerConfig) -> None:
        """Add the generation routes (``POST /v1/completions``, ``POST /v1/chat/completions``, …)."""

    def abort_all(self) -> None:
        """Abort every request in flight (shutdown); streams still read end with ``finish_reason: "abort"``."""

    def num_requests(self) -> int:
        """Requests in flight."""


def sse_line(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


def generation_routes(app: FastAPI, handle: Callable[[Request, bool], Awaitable]) -> None:
    """``POST /v1/completions`` and ``POST /v1/chat/completions``, each answered by ``handle(request, chat)``."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, True)


def draining_error() -> RequestError:
    return RequestError("the server is shutting down", None, "shutting_down", 503)


def make_app(backend: Backend, model_name: str, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``backend`` as ``model_name`` (module docstring); ``app.state.backend``."""
    cfg = config or ServerConfig()
    card = {"id": model_name, "object": "model", "owned_by": "arbor", "max_model_len": backend.max_model_len,
            **backend.card()}
    app = FastAPI(title="Arbor", default_response_class=JSONOut)
    app.state.draining = False
    app.state.backend = backend
    if cfg.api_key:
        app.add_middleware(BearerAuth, api_key=cfg.api_key)

    @app.exception_handler(RequestError)
    async def request_error(_, e: RequestError):
        return error_response(e)

    async def read_body(request: Request) -> dict:
        if app.state.draining:
            raise draining_error()
        body = await read_json(request, cfg.max_body_bytes)
        if body.get("model", model_name) != model_name:
            raise RequestError(f"the model '{body.get('model')}' does not exist; this server serves '{model_name}'",
                               "model", "model_not_found")
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise RequestError(f"the model '{model_id}' does not exist; this server serves '{model_name}'",
                               "model", "model_not_found", 404)
        return card

    backend.install(app, read_body, model_name, cfg)
    return app


def serve(backend: Backend, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          config: ServerConfig | None = None) -> None:
    """Serve ``backend`` as ``model_name`` on ``host:port`` until SIGTERM / SIGINT (``arbor.serve.shutdown``)."""
    from arbor.serve.shutdown import run_server
    cfg = config or ServerConfig()
    run_server(make_app(backend, model_name, cfg), backend, host, port, cfg.shutdown_grace_s)


__all__ = ["Backend", "OFF_LOOP_CHARS", "ReadBody", "draining_error", "make_app", "serve", "sse_line"]
