"""OpenAI-compatible HTTP server over one ``AsyncLLMEngine`` (FastAPI + uvicorn).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` → SSE lines
``data: {json}`` ending with ``data: [DONE]``; chat chunks carry ``delta``; with
``stream_options.include_usage`` every chunk has ``usage: null`` and a last chunk with no choices
carries the usage), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``,
``POST /update_weights`` ``{"path": safetensors file or HF folder}`` (off unless enabled, and then
only inside the allowed root). ``ServerConfig`` holds the limits; ``serve`` runs it all.

Invariants:
- Any client input gets a 4xx with an OpenAI error body, never a 500, and the engine keeps serving.
  A request is checked whole — every prompt tokenized and checked, the limits on n, prompts and
  tokens — before any part of it is queued.
- A request lives in the engine only while its client waits for it: a disconnect, streaming or
  not (a client's timeout included), aborts it at once.
- The event loop runs nothing long: ``serve`` steps the engine on its own thread
  (``ThreadedAsyncLLMEngine``), long prompts are tokenized and big bodies parsed on worker threads
  with the GIL released or passed around, and a text that cannot fit the context is refused before
  it is tokenized.
- Once shutdown has begun (``app.state.draining``) new requests get 503.
Choices also carry Arbor's ``token_ids``. Streamed text withholds the last ``max(len(stop)) − 1``
characters until the sample ends, so a stop string is never sent.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response

from arbor.serve import openai_protocol as oai
from arbor.engine.async_engine import AsyncLLMEngine
from arbor.serve.http_io import BearerAuth, JSONOut, SSEResponse, error_response, first_or_disconnect, read_json
from arbor.serve.openai_protocol import RequestError
from arbor.serve.config import ServerConfig

OFF_LOOP_CHARS = 4096       # prompts at least this long are checked and tokenized on a worker thread


def load_named_tensors(path: str, model) -> dict:
    """A safetensors file or an HF folder → the model's own parameter names."""
    from arbor.models.checkpoint import from_hf_tensors, read_tensors
    p = Path(path)
    if p.is_dir():
        tensors = read_tensors(p)
    elif p.is_file():
        from safetensors.torch import load_file
        tensors = load_file(str(p))
    else:
        raise RequestError(f"no such file or folder: {path}", "path")
    return from_hf_tensors(tensors, model)


def _param(e: ValueError) -> str | None:
    text = str(e)
    return "stop_token_ids" if "stop_token_ids" in text else "stop" if text.startswith("stop") else "prompt"


def base_app(model_name: str, card: dict, cfg: ServerConfig) -> tuple[FastAPI, object]:
    """What every Arbor server shares (the autoregressive one here, the block-diffusion one in
    ``diffusion_server``): the API-key check, the OpenAI error body for ``RequestError``, ``/health``,
    ``/v1/models`` and ``/v1/models/{id}`` (``card``) → (app, ``read_body``: the request's JSON body,
    503 while draining, 400 for another model's name)."""
    app = FastAPI(title="Arbor", default_response_class=JSONOut)
    app.state.draining = False
    if cfg.api_key:
        app.add_middleware(BearerAuth, api_key=cfg.api_key)

    @app.exception_handler(RequestError)
    async def request_error(_, e: RequestError):
        return error_response(e)

    async def read_body(request: Request) -> dict:
        if app.state.draining:
            raise RequestError("the server is shutting down", None, "shutting_down", 503)
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

    return app, read_body


def build_app(engine: AsyncLLMEngine, model_name: str, config: ServerConfig | None = None) -> FastAPI:
    cfg = config or ServerConfig()
    tok = engine.tokenizer
    engine.max_prompt_chars         # measured now (a pass over the vocabulary), not inside a request
    card = {"id": model_name, "object": "model", "owned_by": "arbor", "max_model_len": engine.engine.max_model_len}
    app, read_body = base_app(model_name, card, cfg)

    @app.post("/update_weights")
    async def update_weights(request: Request):
        body = await read_body(request)
        target = cfg.weights_path(body.get("path"))
        try:
            tensors = await asyncio.to_thread(load_named_tensors, str(target), engine.engine.model)
            seconds = await engine.run_between_steps(lambda: engine.engine.update_weights(tensors))
        except RequestError:
            raise
        except Exception as e:      # unreadable, not safetensors, wrong names or shapes: the client's path
            raise RequestError(f"cannot update the weights from '{body['path']}': {e}", "path") from None
        return {"status": "ok", "seconds": seconds, "num_tensors": len(tensors)}

    def check_all(prompts, params, what: str = "prompt") -> list[list[int]]:
        """Every prompt's token ids, or RequestError naming the first bad one (nothing is queued)."""
        out = []
        for i, p in enumerate(prompts):
            try:
                out.append(engine.check_request(p, params))
            except ValueError as e:
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                param = _param(e)
                raise RequestError(where + str(e), what if param == "prompt" else param) from None
        return out

    def render_chat(messages, params) -> list[list[int]]:
        limit = engine.max_prompt_chars
        chars = sum(len(m["content"]) + len(m["role"]) for m in messages)
        if limit is not None and chars > limit:
            raise RequestError(f"the messages hold {chars} characters, more than the {engine.engine.max_model_len}-"
                               f"token context can hold (at most {limit})", "messages")
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:      # the template refused these messages (roles, order, …)
            raise RequestError(f"the chat template cannot render these messages: {e}", "messages") from None
        return check_all([text], params, "messages")

    async def prepare(body: dict, chat: bool):
        """→ (SamplingParams, prompts' token ids, stream, include_usage, want log-probs)."""
        oai.check_fields(body, chat)
        stream, include_usage = oai.stream_flags(body)
        params = oai.sampling_params(body, chat)
        if chat:
            if tok is None:
                raise RequestError("chat needs a tokenizer; this model folder has none", "messages")
            messages = oai.chat_messages(body)
            cfg.check_size(params, 1, engine.engine.max_model_len)
            size, work = sum(len(m["content"]) for m in messages), lambda: render_chat(messages, params)
        else:
            prompts = oai.completion_prompts(body)
            cfg.check_size(params, len(prompts), engine.engine.max_model_len)
            size, work = sum(len(p) for p in prompts), lambda: check_all(prompts, params)
        if params.stop and tok is None:
            raise RequestError("stop strings need a tokenizer; this model folder has none", "stop")
        ids = await asyncio.to_thread(work) if size >= OFF_LOOP_CHARS else work()
        want_lp = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        return params, ids, stream, include_usage, want_lp

    async def handle(request: Request, chat: bool):
        body = await read_body(request)
        params, prompt_ids, stream, include_usage, want_lp = await prepare(body, chat)
        if app.state.draining:
            raise RequestError("the server is shutting down", None, "shutting_down", 503)
        rids = [engine.add_request(ids, params) for ids in prompt_ids]
        abort = lambda: [engine.abort(r) for r in rids]      # a no-op for finished requests
        rid = oai.new_id("chatcmpl" if chat else "cmpl")
        if stream:
            return SSEResponse(sse(rids, rid, chat, params, want_lp, include_usage), on_close=abort)
        try:
            result = await first_or_disconnect(collect(rids, rid, chat, params, want_lp), request.receive)
        finally:
            abort()
        return Response(status_code=499) if result is None else result

    async def collect(rids, rid, chat, params, want_lp) -> dict:
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        for i, r in enumerate(rids):
            last = {}
            async for out in engine.stream(r):
                last[out.index] = out
            for j in sorted(last):
                choices.append(oai.choice(last[j], i * params.n + j, chat, tok, want_lp))
                usage["completion_tokens"] += len(last[j].token_ids)
            usage["prompt_tokens"] += len(last[0].prompt_token_ids)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return oai.response(rid, model_name, chat, choices, usage)

    def visible_text(out, hold: int) -> str:
        if out.finished and out.text is not None:
            return out.text
        text = tok.decode(out.token_ids) if tok is not None else ""
        return text[:max(0, len(text) - hold)]

    async def sse(rids, rid, chat, params, want_lp, include_usage):
        hold = max((len(s) for s in params.stop), default=1) - 1
        line = (lambda obj: _line({**obj, "usage": None})) if include_usage else _line
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        for i, r in enumerate(rids):
            sent_ids, sent_text, counted = {}, {}, False
            if chat:
                for j in range(params.n):
                    yield line(oai.chunk(rid, model_name, chat, i * params.n + j, "", [], None, role=True))
            async for out in engine.stream(r):
                j, index = out.index, i * params.n + out.index
                start = sent_ids.get(j, 0)
                text = visible_text(out, hold)
                delta = text[len(sent_text.get(j, "")):]
                lp = oai._logprobs(out, start, tok, chat) if want_lp else None
                yield line(oai.chunk(rid, model_name, chat, index, delta, out.token_ids[start:], out.finish_reason, lp))
                sent_ids[j], sent_text[j] = len(out.token_ids), text
                if out.finished:
                    usage["completion_tokens"] += len(out.token_ids)
                if not counted:
                    usage["prompt_tokens"] += len(out.prompt_token_ids)
                    counted = True
        if include_usage:
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            yield _line(oai.usage_chunk(rid, model_name, chat, usage))
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def _line(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8000, config=None, model_name: str | None = None,
          server_config: ServerConfig | None = None) -> None:
    """Serve ``model_dir`` until SIGTERM / SIGINT (see ``arbor.serve.shutdown``); a block-diffusion
    model is served by ``diffusion_server`` (its diffusion decoder), any other by the engine."""
    from arbor.serve.shutdown import run_server
    from arbor.engine.threaded_engine import ThreadedAsyncLLMEngine
    from arbor.models import ModelConfig
    server_config = server_config or ServerConfig()
    if ModelConfig.from_file(model_dir).is_block_diffusion:
        from arbor.dllm.server import serve_diffusion
        return serve_diffusion(model_dir, host, port, config, model_name, server_config)
    engine = ThreadedAsyncLLMEngine(model_dir, config)
    app = build_app(engine, model_name or Path(model_dir).name, server_config)
    run_server(app, engine, host, port, server_config.shutdown_grace_s)
