"""The autoregressive backend of the OpenAI server (``arbor.serve.app``): ``EngineBackend`` over a
streaming engine (``ThreadedAsyncLLMEngine`` in one process; ``AsyncLLMEngine`` over rank 0's
``RankFront``, ``arbor.serve.ranks``).

Routes (with ``app``'s): ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` → SSE lines
``data: {json}`` ending with ``data: [DONE]``; chat chunks carry ``delta``; with
``stream_options.include_usage`` every chunk has ``usage: null`` and a last chunk with no choices
carries the usage), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``,
``POST /update_weights`` ``{"path": safetensors file or HF folder}`` (off unless enabled, and then
only inside the allowed root). ``ServerConfig`` holds the limits; ``serve`` runs it all.

The engine is an ``EngineClient`` (``arbor.engine.client``) that also queues before it streams, so a
request is checked whole before any part of it is queued (``ServedEngine``).

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
Chat requests may carry ``tools`` and ``tool_choice`` (``tool_calling.ToolPlan``: the template
renders the tools, a forced call's beginning ends the prompt, calls are read back with the template's
parser); a streamed choice sends content until a call begins and its ``tool_calls`` in one last delta.
Choices also carry Arbor's ``token_ids``. Streamed text withholds the last ``max(len(stop)) − 1``
characters until the sample ends, so a stop string is never sent.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import AsyncIterator, Protocol, runtime_checkable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from arbor.engine.client import EngineClient
from arbor.engine.sampling_params import SamplingParams
from arbor.engine.sequence import Completion
from arbor.serve import openai_protocol as oai
from arbor.serve import tool_calling
from arbor.serve.app import (OFF_LOOP_CHARS, Backend, ReadBody, draining_error, generation_routes, make_app,
                             sse_line)
from arbor.serve.config import ServerConfig
from arbor.serve.http_io import SSEResponse, first_or_disconnect
from arbor.serve.openai_protocol import RequestError


@runtime_checkable
class ServedEngine(EngineClient, Protocol):
    """An ``EngineClient`` the server can queue into before it streams (``AsyncLLMEngine`` and
    ``ThreadedAsyncLLMEngine``); it also has ``tokenizer``, ``model``, ``max_model_len`` and
    ``max_prompt_chars``."""

    def check_request(self, prompt, params: SamplingParams) -> list[int]: ...

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str: ...

    def stream(self, request_id: str) -> AsyncIterator[Completion]: ...

    async def update_weights_between_steps(self, named_tensors) -> float: ...


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


def engine_routes(engine: ServedEngine, app: FastAPI, read_body: ReadBody, model_name: str, cfg: ServerConfig,
                  chat_ids=None) -> None:
    """``EngineBackend.install``: the generation and weight-update routes over ``engine``. ``chat_ids(messages,
    plan)`` → a chat prompt's ids, or None to render it with the template (``arbor.rollout.agent_prompt``)."""
    tok = engine.tokenizer

    @app.post("/update_weights")
    async def update_weights(request: Request):
        body = await read_body(request)
        target = cfg.weights_path(body.get("path"))
        try:
            tensors = await asyncio.to_thread(load_named_tensors, str(target), engine.model)
            seconds = await engine.update_weights_between_steps(tensors)
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

    def render_chat(messages, params, plan: tool_calling.ToolPlan, chars: int) -> list[list[int]]:
        limit = engine.max_prompt_chars
        if limit is not None and chars > limit:
            raise RequestError(f"the messages hold {chars} characters, more than the {engine.max_model_len}-"
                               f"token context can hold (at most {limit})", "messages")
        ids = chat_ids(messages, plan) if chat_ids is not None else None
        if ids is not None:
            return check_all([ids], params, "messages")
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, tools=plan.tools)
        except Exception as e:      # the template refused these messages (roles, order, …)
            raise RequestError(f"the chat template cannot render these messages: {e}", "messages") from None
        return check_all([text + plan.forced], params, "messages")

    async def prepare(body: dict, chat: bool):
        """→ (SamplingParams, prompts' token ids, stream, include_usage, want log-probs, ToolPlan or None)."""
        oai.check_fields(body, chat, tools=True)
        stream, include_usage = oai.stream_flags(body)
        params = oai.sampling_params(body, chat)
        plan = None
        if chat:
            if tok is None:
                raise RequestError("chat needs a tokenizer; this model folder has none", "messages")
            messages = oai.chat_messages(body, tools=True)
            plan = tool_calling.tool_plan(body, tok)
            cfg.check_size(params, 1, engine.max_model_len)
            size = sum(oai.message_chars(m) for m in messages) + len(json.dumps(plan.tools) if plan.tools else "")
            work = lambda: render_chat(messages, params, plan, size)
        else:
            prompts = oai.completion_prompts(body)
            cfg.check_size(params, len(prompts), engine.max_model_len)
            size, work = sum(len(p) for p in prompts), lambda: check_all(prompts, params)
        if params.stop and tok is None:
            raise RequestError("stop strings need a tokenizer; this model folder has none", "stop")
        ids = await asyncio.to_thread(work) if size >= OFF_LOOP_CHARS else work()
        want_lp = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        return params, ids, stream, include_usage, want_lp, plan

    async def handle(request: Request, chat: bool):
        body = await read_body(request)
        params, prompt_ids, stream, include_usage, want_lp, plan = await prepare(body, chat)
        if app.state.draining:
            raise draining_error()
        rids = [engine.add_request(ids, params) for ids in prompt_ids]
        abort = lambda: [engine.abort(r) for r in rids]      # a no-op for finished requests
        rid = oai.new_id("chatcmpl" if chat else "cmpl")
        if stream:
            return SSEResponse(sse(rids, rid, chat, params, want_lp, include_usage, plan), on_close=abort)
        try:
            result = await first_or_disconnect(collect(rids, rid, chat, params, want_lp, plan), request.receive)
        finally:
            abort()
        return Response(status_code=499) if result is None else result

    async def collect(rids, rid, chat, params, want_lp, plan) -> dict:
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        for i, r in enumerate(rids):
            last = {}
            async for out in engine.stream(r):
                last[out.index] = out
            for j in sorted(last):
                choices.append(oai.choice(last[j], i * params.n + j, chat, tok, want_lp, plan))
                usage["completion_tokens"] += len(last[j].token_ids)
            usage["prompt_tokens"] += len(last[0].prompt_token_ids)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return oai.response(rid, model_name, chat, choices, usage)

    def visible_text(out, hold: int) -> str:
        if out.finished and out.text is not None:
            return out.text
        text = tok.decode(out.token_ids) if tok is not None else ""
        return text[:max(0, len(text) - hold)]

    async def sse(rids, rid, chat, params, want_lp, include_usage, plan):
        hold = max((len(s) for s in params.stop), default=1) - 1
        line = (lambda obj: sse_line({**obj, "usage": None})) if include_usage else sse_line
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        for i, r in enumerate(rids):
            sent_ids, sent_text, counted, tools = {}, {}, False, {}
            if chat:
                for j in range(params.n):
                    yield line(oai.chunk(rid, model_name, chat, i * params.n + j, "", [], None, role=True))
            async for out in engine.stream(r):
                j, index = out.index, i * params.n + out.index
                start = sent_ids.get(j, 0)
                text = visible_text(out, hold)
                delta = text[len(sent_text.get(j, "")):]
                lp = oai._logprobs(out, start, tok, chat) if want_lp else None
                new_ids = out.token_ids[start:]
                if plan is not None and plan.parser is not None:     # content until a call begins; calls at the end
                    ts = tools.setdefault(j, tool_calling.ToolStream(plan))
                    deltas, finish = ts.last(text, out.finish_reason) if out.finished else ([None], None)
                    for k, d in enumerate(deltas):
                        end = k == len(deltas) - 1
                        yield line(oai.chunk(rid, model_name, chat, index, "" if d else ts.step(text),
                                             new_ids if end else [], finish if end else None, lp if end else None,
                                             delta=d))
                else:
                    yield line(oai.chunk(rid, model_name, chat, index, delta, new_ids, out.finish_reason, lp))
                sent_ids[j], sent_text[j] = len(out.token_ids), text
                if out.finished:
                    usage["completion_tokens"] += len(out.token_ids)
                if not counted:
                    usage["prompt_tokens"] += len(out.prompt_token_ids)
                    counted = True
        if include_usage:
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            yield sse_line(oai.usage_chunk(rid, model_name, chat, usage))
        yield "data: [DONE]\n\n"

    generation_routes(app, handle)


class EngineBackend:
    """The autoregressive ``Backend``: the OpenAI routes over a ``ServedEngine``. Graceful shutdown
    (``abort_all``, ``num_requests``) needs a ``ThreadedAsyncLLMEngine``."""

    def __init__(self, engine: ServedEngine):
        self.engine = engine
        engine.max_prompt_chars         # measured now (a pass over the vocabulary), not inside a request

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def card(self) -> dict:
        return {}

    def install(self, app: FastAPI, read_body: ReadBody, model_name: str, config: ServerConfig) -> None:
        engine_routes(self.engine, app, read_body, model_name, config)

    def abort_all(self) -> None:
        self.engine.abort_all()

    def num_requests(self) -> int:
        return self.engine.num_requests()


def build_app(engine: ServedEngine, model_name: str, config: ServerConfig | None = None) -> FastAPI:
    """The app serving ``engine`` (``make_app`` over its ``EngineBackend``)."""
    return make_app(EngineBackend(engine), model_name, config)


def engine_backend(model_dir: str, config=None) -> EngineBackend:
    """The backend of an autoregressive model folder: its engine stepping on a thread of its own
    (``ThreadedAsyncLLMEngine``, so the event loop answers while a step runs)."""
    from arbor.engine.threaded_engine import ThreadedAsyncLLMEngine
    return EngineBackend(ThreadedAsyncLLMEngine(model_dir, config))


def serve(backend: Backend | ServedEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          server_config: ServerConfig | None = None) -> None:
    """Serve ``backend`` (an engine is served through its ``EngineBackend``) as ``model_name`` until
    SIGTERM / SIGINT (``arbor.serve.shutdown``)."""
    from arbor.serve import app
    app.serve(backend if isinstance(backend, Backend) else EngineBackend(backend), model_name, host, port,
              server_config)
