"""``arbor serve`` for a block-diffusion model (dLLM): ``DiffusionBackend``, the OpenAI routes over the
diffusion decoder, a backend of the one server (``arbor.serve.app``).

The app is ``make_app``'s (API key, ``/health``, ``/v1/models``, the OpenAI error body, 503
while draining) plus ``POST /v1/completions`` and ``POST /v1/chat/completions``. A request is decoded
by ``DiffusionDecoder`` in the mode it names — ``"mode"``: ``quality`` | ``speed`` | ``threshold``
(``diffusion.mode_config``, at the model's block size), default ``ServerConfig.diffusion_mode`` —
with ``max_tokens`` response positions (gen_length, default ``GEN_LENGTH``), ``temperature``
(default 0: the modes' argmax) and ``seed`` (default 0) sampling x̂ as EBPO rollouts do, ``n`` copies
of each prompt, and decoding ends after the block holding the model's EOS (unless ``ignore_eos``) or
a ``stop_token_ids`` id. So a request's ``token_ids`` are the tokens ``arbor generate --diffusion
--mode M`` (``generate_text``) prints for the same prompt. Fields the decoder has no meaning for —
``stop`` strings, ``logprobs``, ``top_k`` / ``top_p`` / ``min_p`` at other than their defaults — get a
400 naming them; everything else is checked as the autoregressive server checks it.

Invariants:
- ``DiffusionWorker`` decodes one request at a time (its prompts × n as one batch) on a thread of its
  own; the event loop only queues requests and reads their events. At most ``max_queued_requests``
  requests wait or decode; one more gets 429.
- A client that leaves frees its slot: its request is dropped if it still waits, and stops at its
  next block boundary if it decodes.
- Streaming: every committed block of every choice is one SSE chunk (its new tokens and text; the
  block that ends the choice carries ``finish_reason``; in chat, a choice's first chunk carries the
  role), then a usage chunk if asked for, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response

from arbor.dllm.decoding import MODES, DecodeConfig, DiffusionDecoder, mode_config
from arbor.engine.sequence import Completion
from arbor.engine.threaded_engine import EngineThread
from arbor.serve import openai_protocol as oai
from arbor.serve.app import OFF_LOOP_CHARS, ReadBody, draining_error, generation_routes, make_app, sse_line
from arbor.serve.config import ServerConfig
from arbor.serve.http_io import SSEResponse, first_or_disconnect
from arbor.serve.openai_protocol import RequestError

GEN_LENGTH = 32             # response positions when a request sets no max_tokens (arbor generate's default)
_END = object()


class _Aborted(Exception):
    """Raised inside a decode whose client has left (or that shutdown aborted)."""


class Job:
    """One request on the worker. ``events`` gets ``(choice, tokens so far, finish_reason or None)``
    per committed block, then ``_END``; ``cancel()`` drops or stops it (idempotent)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.events = loop, asyncio.Queue()
        self.cancelled = threading.Event()
        self.future = None

    def cancel(self) -> None:
        self.cancelled.set()
        if self.future is not None:
            self.future.cancel()            # a job still waiting never runs

    @property
    def aborted(self) -> bool:
        """After ``_END``: True when the job was cancelled; the decode's own error is raised."""
        if self.future.cancelled():
            return True
        error = self.future.exception()
        if error is not None and not isinstance(error, _Aborted):
            raise error
        return error is not None


class DiffusionWorker:
    """Runs ``DiffusionDecoder`` on one thread, one request at a time; call it from the event loop."""

    def __init__(self, model, max_queued: int):
        self.model, self.max_queued = model, max_queued
        self.jobs: set[Job] = set()
        self._thread = EngineThread()

    def submit(self, prompts: list[list[int]], cfg: DecodeConfig, stop_ids: list[int]) -> Job:
        if len(self.jobs) >= self.max_queued:
            raise RequestError(f"{len(self.jobs)} requests are already waiting or decoding, the most this server "
                               "holds (max_queued_requests); retry later", None, "server_busy", 429)
        job = Job(asyncio.get_running_loop())

        def on_block(i: int, tokens: list[int], done: bool) -> None:
            if job.cancelled.is_set():
                raise _Aborted
            finish = None if not done else "stop" if len(tokens) < cfg.gen_length else "length"
            job.loop.call_soon_threadsafe(job.events.put_nowait, (i, tokens, finish))

        decoder = DiffusionDecoder(self.model, cfg, stop_ids)
        job.future = self._thread.submit(lambda: decoder.generate(prompts, on_block))
        self.jobs.add(job)
        job.future.add_done_callback(lambda _: job.loop.call_soon_threadsafe(self._finished, job))
        return job

    def _finished(self, job: Job) -> None:
        self.jobs.discard(job)
        job.events.put_nowait(_END)

    def abort_all(self) -> None:
        for job in list(self.jobs):
            job.cancel()

    def num_requests(self) -> int:
        return len(self.jobs)


async def choice_events(job: Job, count: int):
    """``job``'s block events; once it ends, ``(choice, tokens, "abort")`` for each of the ``count``
    choices an abort cut short."""
    last, left = {}, set(range(count))
    while (event := await job.events.get()) is not _END:
        last[event[0]] = event[1]
        if event[2] is not None:
            left.discard(event[0])
        yield event
    if job.aborted:
        for i in sorted(left):
            yield i, last.get(i, []), "abort"


def decode_params(body: dict, chat: bool, default_mode: str) -> tuple:
    """→ (DecodeConfig, SamplingParams with max_tokens = gen_length, stream, include_usage)."""
    mode = body.get("mode")
    if mode is not None and mode not in MODES:
        raise RequestError(f"'mode' must be one of {', '.join(repr(m) for m in MODES)} (LLaDA2.1 Quality, Speed, or "
                           f"Fast-dLLM threshold decoding), got {mode!r}", "mode")
    oai.check_fields({k: v for k, v in body.items() if k != "mode"}, chat)
    stream, include_usage = oai.stream_flags(body)
    params = oai.sampling_params(body, chat)
    refused = {"stop": bool(params.stop), "top_k": params.top_k != -1, "top_p": params.top_p != 1,
               "min_p": params.min_p != 0,
               "logprobs": bool(body.get("logprobs")) if chat else body.get("logprobs") is not None}
    for name, bad in refused.items():
        if bad:
            why = ("a block-diffusion model has no token log-likelihood to report" if name == "logprobs" else
                   "use 'stop_token_ids'" if name == "stop" else "the decoder picks tokens by confidence; see 'mode'")
            raise RequestError(f"'{name}' is not supported for a block-diffusion model ({why})", name,
                               "unsupported_parameter")
    given = body.get("max_tokens") is not None or (chat and body.get("max_completion_tokens") is not None)
    params = replace(params, max_tokens=params.max_tokens if given else GEN_LENGTH)
    cfg = mode_config(mode or default_mode, gen_length=params.max_tokens,
                      temperature=params.temperature if body.get("temperature") is not None else 0.0,
                      seed=params.seed if params.seed is not None else 0)
    return cfg, params, stream, include_usage


def check_prompt(ids: list[int], gen_length: int, config, context: int) -> list[int]:
    """ValueError unless ``ids`` is a prompt the decoder can extend by ``gen_length`` positions."""
    if not ids:
        raise ValueError("the prompt is empty")
    if min(ids) < 0 or max(ids) >= config.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {config.vocab_size}), got one out of range")
    if config.mask_token_id in ids:
        raise ValueError(f"the prompt holds the mask token ({config.mask_token_id}), which the decoder would fill in")
    if len(ids) + gen_length > context:
        raise ValueError(f"the prompt has {len(ids)} tokens; with max_tokens = {gen_length} that is more than the "
                         f"context length {context}")
    return ids


class DiffusionBackend:
    """The block-diffusion ``Backend`` (``arbor.serve.app``): ``model`` decoded by one
    ``DiffusionWorker``; ``context``: the longest prompt + response (default and cap: the model's
    ``max_position_embeddings``). ``config`` gives the default mode and the queue bound."""

    def __init__(self, model, tokenizer, config: ServerConfig | None = None, context: int | None = None):
        cfg, mc = config or ServerConfig(), model.config
        if cfg.diffusion_mode not in MODES:
            raise ValueError(f"server diffusion_mode must be one of {MODES}, got {cfg.diffusion_mode!r}")
        self.model, self.tokenizer, self.default_mode = model, tokenizer, cfg.diffusion_mode
        self.max_model_len = min(context or mc.max_position_embeddings, mc.max_position_embeddings)
        self.worker = DiffusionWorker(model, cfg.max_queued_requests)

    def card(self) -> dict:
        return {"block_size": self.model.config.block_size, "modes": list(MODES), "default_mode": self.default_mode}

    def install(self, app: FastAPI, read_body: ReadBody, model_name: str, config: ServerConfig) -> None:
        app.state.worker = self.worker
        diffusion_routes(self, app, read_body, model_name, config)

    def abort_all(self) -> None:
        self.worker.abort_all()

    def num_requests(self) -> int:
        return self.worker.num_requests()


def build_diffusion_app(model, tokenizer, model_name: str, config: ServerConfig | None = None,
                        context: int | None = None) -> FastAPI:
    """The FastAPI app serving a block-diffusion ``model`` (``make_app`` over its ``DiffusionBackend``);
    ``app.state.worker`` is the backend's ``DiffusionWorker``."""
    return make_app(DiffusionBackend(model, tokenizer, config, context), model_name, config)


def diffusion_backend(model_dir: str, config=None, server_config: ServerConfig | None = None) -> DiffusionBackend:
    """The backend of the block-diffusion folder ``model_dir``; ``config``: the ``EngineConfig`` whose
    device, dtype and max_model_len apply."""
    from arbor.engine.config import EngineConfig
    from arbor.models import load_model
    from arbor.models.tokenizer import Tokenizer
    config = config or EngineConfig()
    config.validate()
    config.check_device()
    model = load_model(model_dir, dtype=config.torch_dtype, device=config.device).eval()
    tok = Tokenizer.load(model_dir) if (Path(model_dir) / "tokenizer.json").exists() else None
    return DiffusionBackend(model, tok, server_config, config.max_model_len)


def diffusion_routes(b: DiffusionBackend, app: FastAPI, read_body: ReadBody, model_name: str,
                     cfg: ServerConfig) -> None:
    """``DiffusionBackend.install``: the completion routes over ``b``'s decoder."""
    mc, tok, context, worker = b.model.config, b.tokenizer, b.max_model_len, b.worker

    def prompt_ids(prompts: list, gen_length: int, what: str) -> list[list[int]]:
        out = []
        for i, p in enumerate(prompts):
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            if isinstance(p, str) and tok is None:
                raise RequestError(f"{where}a text prompt needs a tokenizer; this model folder has none (send token "
                                   "ids)", what)
            try:
                out.append(check_prompt(tok.encode(p) if isinstance(p, str) else list(p), gen_length, mc, context))
            except ValueError as e:
                raise RequestError(where + str(e), what) from None
        return out

    def render_chat(messages: list[dict], gen_length: int) -> list[list[int]]:
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:      # the template refused these messages (roles, order, …)
            raise RequestError(f"the chat template cannot render these messages: {e}", "messages") from None
        return prompt_ids([text], gen_length, "messages")

    async def handle(request: Request, chat: bool):
        body = await read_body(request)
        dcfg, params, stream, include_usage = decode_params(body, chat, b.default_mode)
        if chat:
            if tok is None:
                raise RequestError("chat needs a tokenizer; this model folder has none", "messages")
            messages = oai.chat_messages(body)
            cfg.check_size(params, 1, context)
            size, work = sum(len(m["content"]) for m in messages), lambda: render_chat(messages, dcfg.gen_length)
        else:
            prompts = oai.completion_prompts(body)
            cfg.check_size(params, len(prompts), context)
            size = sum(len(p) for p in prompts)
            work = lambda: prompt_ids(prompts, dcfg.gen_length, "prompt")
        if any(not 0 <= t < mc.vocab_size for t in params.stop_token_ids):
            raise RequestError(f"'stop_token_ids' must be in [0, {mc.vocab_size})", "stop_token_ids")
        ids = await asyncio.to_thread(work) if size >= OFF_LOOP_CHARS else work()
        if app.state.draining:
            raise draining_error()
        stop_ids = ([] if params.ignore_eos else mc.stop_token_ids) + list(params.stop_token_ids)
        job = worker.submit([p for p in ids for _ in range(params.n)], dcfg, stop_ids)
        rid = oai.new_id("chatcmpl" if chat else "cmpl")
        usage = {"prompt_tokens": sum(len(p) for p in ids), "completion_tokens": 0}
        count = len(ids) * params.n
        if stream:
            return SSEResponse(sse(job, count, rid, chat, usage, include_usage), on_close=job.cancel)
        try:
            result = await first_or_disconnect(collect(job, count, rid, chat, ids, params.n, usage), request.receive)
        finally:
            job.cancel()
        return Response(status_code=499) if result is None else result

    def text_of(tokens: list[int]) -> str | None:
        return tok.decode(tokens) if tok is not None else None

    async def collect(job, count, rid, chat, ids, n, usage) -> dict:
        final = {}
        async for i, tokens, finish in choice_events(job, count):
            final[i] = (tokens, finish)
        choices = []
        for i in range(count):
            tokens, finish = final[i]
            c = Completion(rid, i, ids[i // n], tokens, logprobs=[], finish_reason=finish, text=text_of(tokens))
            choices.append(oai.choice(c, i, chat, tok, False))
            usage["completion_tokens"] += len(tokens)
        return oai.response(rid, model_name, chat, choices, {**usage, "total_tokens": sum(usage.values())})

    async def sse(job, count, rid, chat, usage, include_usage):
        line = (lambda obj: sse_line({**obj, "usage": None})) if include_usage else sse_line
        sent_ids, sent_text = {}, {}
        async for i, tokens, finish in choice_events(job, count):
            text = text_of(tokens) or ""
            start, first = sent_ids.get(i, 0), i not in sent_ids
            yield line(oai.chunk(rid, model_name, chat, i, text[len(sent_text.get(i, "")):], tokens[start:], finish,
                                 role=chat and first))
            sent_ids[i], sent_text[i] = len(tokens), text
            if finish is not None:
                usage["completion_tokens"] += len(tokens)
        if include_usage:
            yield sse_line(oai.usage_chunk(rid, model_name, chat, {**usage, "total_tokens": sum(usage.values())}))
        yield "data: [DONE]\n\n"

    generation_routes(app, handle)
