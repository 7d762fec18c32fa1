"""OpenAI-compatible HTTP server over one ``AsyncLLMEngine`` (FastAPI + uvicorn).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` → SSE lines
``data: {json}`` ending with ``data: [DONE]``; chat chunks carry ``delta``), ``GET /v1/models``,
``GET /health``, ``POST /update_weights`` ``{"path": safetensors file or HF folder}``.
Every invalid request gets HTTP 400 with an OpenAI error body; the engine keeps serving.
Choices also carry Arbor's ``token_ids``. Streamed text withholds the last ``max(len(stop)) − 1``
characters until the sample ends, so a stop string is never sent.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from arbor.engine import openai_protocol as oai
from arbor.engine.async_engine import AsyncLLMEngine
from arbor.engine.openai_protocol import RequestError


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


def build_app(engine: AsyncLLMEngine, model_name: str) -> FastAPI:
    app = FastAPI(title="Arbor")
    tok = engine.tokenizer

    @app.exception_handler(RequestError)
    async def bad_request(_, e: RequestError):
        return JSONResponse(e.body(), status_code=400)

    async def read_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        if body.get("model", model_name) != model_name:
            raise RequestError(f"the model '{body.get('model')}' does not exist; this server serves '{model_name}'",
                               "model", "model_not_found")
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "arbor",
                                            "max_model_len": engine.engine.max_model_len}]}

    @app.post("/update_weights")
    async def update_weights(request: Request):
        body = await read_body(request)
        if not isinstance(body.get("path"), str):
            raise RequestError("'path' (a safetensors file or HF folder) is required", "path")
        try:
            tensors = load_named_tensors(body["path"], engine.engine.model)
            seconds = engine.update_weights(tensors)
        except (ValueError, KeyError) as e:
            raise RequestError(str(e), "path") from None
        return {"status": "ok", "seconds": seconds, "num_tensors": len(tensors)}

    def submit(prompts, params) -> list[str]:
        rids = []
        try:
            for p in prompts:
                rids.append(engine.add_request(p, params))
        except ValueError as e:
            for rid in rids:
                engine.abort(rid)
            raise RequestError(str(e), "prompt" if "prompt" in str(e) or "token" in str(e) else None) from None
        return rids

    async def handle(body: dict, chat: bool):
        params = oai.sampling_params(body, chat)
        if chat:
            if tok is None:
                raise RequestError("chat needs a tokenizer; this model folder has none", "messages")
            prompts = [tok.apply_chat_template(oai.chat_messages(body), add_generation_prompt=True)]
        else:
            prompts = oai.completion_prompts(body)
        if params.stop and tok is None:
            raise RequestError("stop strings need a tokenizer; this model folder has none", "stop")
        want_lp = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        rids = submit(prompts, params)
        rid = oai.new_id("chatcmpl" if chat else "cmpl")
        if body.get("stream"):
            return StreamingResponse(sse(rids, rid, chat, params, want_lp), media_type="text/event-stream")
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

    async def sse(rids, rid, chat, params, want_lp):
        hold = max((len(s) for s in params.stop), default=1) - 1
        try:
            for i, r in enumerate(rids):
                sent_ids, sent_text = {}, {}
                if chat:
                    for j in range(params.n):
                        yield _line(oai.chunk(rid, model_name, chat, i * params.n + j, "", [], None, role=True))
                async for out in engine.stream(r):
                    j, index = out.index, i * params.n + out.index
                    start = sent_ids.get(j, 0)
                    text = visible_text(out, hold)
                    delta = text[len(sent_text.get(j, "")):]
                    lp = oai._logprobs(out, start, tok, chat) if want_lp else None
                    yield _line(oai.chunk(rid, model_name, chat, index, delta, out.token_ids[start:],
                                          out.finish_reason, lp))
                    sent_ids[j], sent_text[j] = len(out.token_ids), text
            yield "data: [DONE]\n\n"
        finally:
            for r in rids:
                if r in engine.engine.requests:
                    engine.abort(r)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(await read_body(request), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(await read_body(request), chat=True)

    return app


def _line(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8000, config=None, model_name: str | None = None):
    import uvicorn
    engine = AsyncLLMEngine(model_dir, config)
    uvicorn.run(build_app(engine, model_name or Path(model_dir).name), host=host, port=port)
