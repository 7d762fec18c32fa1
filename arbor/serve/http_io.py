"""HTTP plumbing of the OpenAI server that FastAPI does not provide.

- ``read_json``: a body of at most ``limit`` bytes (a larger Content-Length is refused before any
  byte is read) parsed into a JSON object; a big body is parsed on a worker thread with Python-level
  number and object hooks, so the GIL passes back to the event loop while it parses. Malformed
  JSON, nesting too deep for the parser, NaN / Infinity → ``RequestError`` (400).
- ``JSONOut``: JSON rendered ASCII-only, so a lone surrogate echoed from a request cannot fail the
  response; ``error_response`` renders a ``RequestError``.
- ``first_or_disconnect(coro, receive)``: the coroutine's result, or None when the client went away
  first (the coroutine is then cancelled at once). Call it once the request body has been read.
- ``SSEResponse``: streams an async generator of text chunks; when the client disconnects the
  stream stops at once, and however the response ends the generator is closed and ``on_close`` runs.
- ``BearerAuth``: ASGI middleware answering 401 to any HTTP request without ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from arbor.serve.openai_protocol import RequestError

BIG_BODY = 1 << 20      # bytes above which the body is parsed on a worker thread


class JSONOut(JSONResponse):
    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=True, separators=(",", ":")).encode()


def error_response(e: RequestError) -> JSONOut:
    headers = {"connection": "close"} if e.code == "request_too_large" else None
    if e.status == 401:
        headers = {"www-authenticate": "Bearer"}
    return JSONOut(e.body(), status_code=e.status, headers=headers)


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _loads_yielding(raw: bytes):
    """``json.loads`` whose per-value hooks run Python code, so other threads get the GIL meanwhile."""
    return json.loads(raw, parse_int=lambda s: int(s), parse_float=lambda s: float(s), parse_constant=_no_constant,
                      object_pairs_hook=lambda pairs: dict(pairs))


async def read_json(request, limit: int) -> dict:
    """The request's JSON object body; RequestError for a body over ``limit`` bytes or not a JSON object."""
    too_large = RequestError(f"the request body is larger than this server accepts ({limit} bytes, "
                             "server.max_body_bytes)", None, "request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise RequestError("the client left before sending the whole body", None, "client_disconnected", 499) from None
    raw = b"".join(chunks)
    try:
        if len(raw) > BIG_BODY:
            body = await asyncio.to_thread(_loads_yielding, raw)
        else:
            body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:       # JSONDecodeError and UnicodeDecodeError are ValueErrors
        why = "it nests too deeply" if isinstance(e, RecursionError) else str(e)
        raise RequestError(f"the request body is not valid JSON: {why}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


async def _until_disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def first_or_disconnect(coro, receive):
    """``await coro`` unless the client disconnects first (→ None, ``coro`` cancelled). Cancelling
    the caller cancels ``coro`` too."""
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_until_disconnected(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, gone, return_exceptions=True)
    if work.cancelled():
        return None
    return work.result()


class SSEResponse(Response):
    """``text/event-stream`` of the chunks of ``body`` (an async generator of str)."""

    media_type = "text/event-stream"

    def __init__(self, body, on_close):
        self.body_iterator, self.on_close = body, on_close
        self.status_code, self.background = 200, None
        self.init_headers({"cache-control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        async def pump():
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await first_or_disconnect(pump(), receive)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self.on_close()


class BearerAuth:
    """Every HTTP request must carry ``Authorization: Bearer <api_key>`` (compared in constant time)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                error = RequestError("a valid API key is required (header 'Authorization: Bearer KEY')", None,
                                     "invalid_api_key", 401)
                return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)
