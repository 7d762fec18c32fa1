"""The trainer's OpenAI-compatible endpoint for agent episodes: ``arbor serve``'s app
(``arbor.serve.app.make_app`` + ``arbor.serve.server.engine_routes``) over the rollout engine, bound to
127.0.0.1 on a free port with a fresh random API key, served on the event loop that rolls out.

Each episode has its own base URL, ``http://127.0.0.1:PORT/episodes/EPISODE_ID/v1``; a request under
another path (or an episode that has ended) gets a 404 with an OpenAI error body. Every generation
request of an episode is recorded (``arbor.rollout.agent_record.CallRecord``) by ``RecordingEngine``,
the engine the routes see: the prompt ids the engine was given, the sampled ids, log-probs, the policy
version of each token, MoE expert ids, and the sampling parameters.

Sampling inside an episode is the trainer's, not the request's, so the trainer's log-probs are those of
the distribution sampled from: ``temperature`` and ``top_p`` are ``rollout.temperature`` /
``rollout.top_p`` (0 / 1 in evaluation), ``top_k``, ``min_p`` off, the seed derived from
(``rollout.seed``, group, sample, call); ``max_tokens`` is the request's, at most
``rollout.max_turn_tokens`` and the room left in ``rollout.max_context``; the end-of-sequence token
stops unless the request sets ``ignore_eos`` (which leaves the distribution as it is). What the request
asked for is recorded beside (``CallRecord.requested``). ``n`` must be 1; the ``model`` a request names
is not checked (an agent written for another model runs unchanged).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import secrets
import socket
import zlib

from arbor.rollout.agent_prompt import continued_prompt, normalize, tools_key
from arbor.rollout.agent_record import CallRecord
from arbor.serve.openai_protocol import RequestError

KEEP_ALIVE_S = 600.0   # the server's idle-connection timeout; the agents' client drops idle ones after a tenth
GATHER_S = 0.05     # longest a request waits for the other episodes' next calls while the engine is idle
REQUEST: contextvars.ContextVar[dict | None] = contextvars.ContextVar("arbor_agent_request", default=None)
PREFIX = "/episodes/"


def require_openai() -> None:
    """ImportError saying what to install when the ``openai`` package (the agent's client) is missing."""
    try:
        import httpx  # noqa: F401
        import openai  # noqa: F401
    except ImportError:
        raise ImportError("agent=…: training an OpenAI-client agent needs the `openai` package "
                          "(pip install 'arbor[agent]')") from None


class EpisodeHandle:
    """What an agent sees of its episode as ``client.episode``: ``id``, ``row``, ``calls`` (the
    ``CallRecord`` of each request so far) and the reward setters. ``reward(value)`` sets the episode's
    reward (used when ``run`` returns None); ``reward_call(value, call=-1)`` the reward of one call
    (index into ``calls``): the trajectory ending at that call's completion gets it instead."""

    def __init__(self, eid: str, row, group: int, sample: int, settings: dict):
        self.id, self.row, self.group, self.sample, self.settings = eid, row, group, sample, settings
        self.calls: list[CallRecord] = []
        self.episode_reward: float | None = None
        self.call_rewards: dict[int, float] = {}
        self.open = True

    def reward(self, value: float) -> None:
        self.episode_reward = _number(value, "episode.reward")

    def reward_call(self, value: float, call: int = -1) -> None:
        if not self.calls:
            raise ValueError("episode.reward_call: this episode has made no call yet")
        index = range(len(self.calls))[call]        # IndexError for a call that does not exist
        self.call_rewards[index] = _number(value, "episode.reward_call")


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise ValueError(f"{what}: a reward must be a finite number, got {value!r}")
    return float(value)


class RecordingEngine:
    """The ``ServedEngine`` the routes serve from: the rollout engine, with each request bound to the
    episode of its URL, its sampling set by the trainer and its result recorded (module docstring)."""

    def __init__(self, engine, tok, eos: int, moe: bool, template_kwargs=None):
        self.engine, self.tokenizer, self.eos, self.moe = engine, tok, eos, moe
        self.template_kwargs = dict(template_kwargs or {})
        self.model, self.max_model_len = engine.model, engine.max_model_len
        self.max_prompt_chars = engine.max_prompt_chars
        self.version = 0
        self.live: dict[str, tuple[EpisodeHandle, CallRecord]] = {}    # requests not yet finished
        self.held: dict[str, tuple[list[int], object]] = {}             # … of which not yet in the engine
        self.queued: set[str] = set()                                   # … of which in the engine
        self.open_episodes = lambda: 0
        self.count = 0
        self.changed = asyncio.Event()

    def _episode(self) -> EpisodeHandle:
        req = REQUEST.get()
        if req is None or not req["episode"].open:
            raise RequestError("this request belongs to no running episode", None, "episode_not_found", 404)
        return req["episode"]

    def params_for(self, ep: EpisodeHandle, params, prompt_len: int):
        s, body = ep.settings, (REQUEST.get() or {}).get("body", {})
        if params.n != 1:
            raise RequestError("inside a training episode 'n' must be 1 (one trajectory per call)", "n")
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or s["max_turn_tokens"]
        room = s["max_context"] - prompt_len
        if room < 1:
            raise RequestError(f"the prompt has {prompt_len} tokens; an episode's context is rollout.max_context="
                               f"{s['max_context']} tokens", "messages", "context_length_exceeded")
        seed = zlib.crc32(f"{s['seed']}/{ep.group}/{ep.sample}/{len(ep.calls)}".encode())
        return dataclasses.replace(params, temperature=s["temperature"], top_p=s["top_p"], top_k=-1, min_p=0.0,
                                   seed=seed, max_tokens=max(1, min(asked, s["max_turn_tokens"], room)),
                                   stop_token_ids=list(params.stop_token_ids) if params.ignore_eos else
                                   sorted({*params.stop_token_ids, self.eos}), return_routed_experts=self.moe)

    def check_request(self, prompt, params) -> list[int]:
        ids = self.engine.check_request(prompt, params)
        self.params_for(self._episode(), params, len(ids))
        return ids

    def chat_ids(self, messages, plan) -> list[int]:
        """The prompt ids of a chat call (``arbor.rollout.agent_prompt``); remembers what the call asked."""
        req, ep = REQUEST.get(), self._episode()
        req.update(messages=[normalize(m) for m in messages], plan=plan, tools_key=tools_key(plan.tools))
        ids = continued_prompt(ep.calls, messages, plan.tools, plan.forced, self.tokenizer, self.template_kwargs)
        if ids is None:
            from arbor.rollout.chat import ChatLayout
            try:
                text = ChatLayout(self.tokenizer, plan.tools, self.template_kwargs).render(messages, True)
            except Exception as e:      # the template refused these messages (roles, order, …)
                raise RequestError(f"the chat template cannot render these messages: {e}", "messages") from None
            ids = self.tokenizer.encode(text + plan.forced)
        return ids

    def add_request(self, prompt, params=None, request_id=None) -> str:
        """Record the call and hold it for ``stream`` (which queues it in the engine; see ``_gather``)."""
        ep, req = self._episode(), REQUEST.get()
        ids = self.engine.check_request(prompt, params)
        run = self.params_for(ep, params, len(ids))
        self.count += 1
        rid = request_id or f"agent-{self.count}"
        asked = {k: v for k, v in dataclasses.asdict(params).items() if k != "return_routed_experts"}
        call = CallRecord(list(ids), id=str(len(ep.calls)), params=dataclasses.asdict(run), requested=asked,
                          chat="messages" in req, messages=req.get("messages"), tools_key=req.get("tools_key", ""),
                          plan=req.get("plan"))
        ep.calls.append(call)
        self.live[rid] = (ep, call)
        self.held[rid] = (list(ids), run)
        self.notify()
        return rid

    def notify(self) -> None:
        """Wake the requests ``_gather`` holds (a request arrived or was queued, an episode ended)."""
        self.changed.set()
        self.changed = asyncio.Event()

    async def _gather(self) -> None:
        """Hold a request while the engine has no request of the endpoint running and some open episode
        has none held yet, for at most ``GATHER_S``: episodes whose calls ended at the same step then
        start their next calls in one batch, as a built-in environment's turns do, instead of one by one
        as their HTTP requests arrive. With requests running, a new one joins the batch at once."""
        loop = asyncio.get_running_loop()
        end = loop.time() + GATHER_S
        while not self.queued and len(self.held) < self.open_episodes():
            left = end - loop.time()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                return

    async def stream(self, rid: str):
        ep, call = self.live[rid]
        try:
            await self._gather()
            ids, run = self.held.pop(rid)
            self.engine.add_request(ids, run, rid)
            self.queued.add(rid)
            self.notify()
            async for out in self.engine.stream(rid):
                fresh = len(out.token_ids) - len(call.token_ids)
                call.token_ids = list(out.token_ids)
                call.logprobs = list(out.logprobs[:len(out.token_ids)])
                call.versions += [self.version] * fresh
                if getattr(out, "routed_experts", None) is not None:
                    call.routed_experts = out.routed_experts
                if out.finished:
                    self._finish(call, out)
                yield out
        finally:
            self.live.pop(rid, None)
            self.held.pop(rid, None)
            self.queued.discard(rid)

    def _finish(self, call: CallRecord, out) -> None:
        from arbor.serve.tool_calling import assistant_message
        call.text = out.text or ""
        message, _ = assistant_message(call.text, call.plan)
        call.reply = normalize(message)
        call.finish_reason = out.finish_reason

    def abort(self, rid: str) -> None:
        self.live.pop(rid, None)
        self.held.pop(rid, None)
        if rid in self.queued:
            self.queued.discard(rid)
            self.engine.abort(rid)

    def abort_episode(self, ep: EpisodeHandle) -> None:
        for rid, (owner, _) in list(self.live.items()):
            if owner is ep:
                self.abort(rid)

    def num_requests(self) -> int:
        return len(self.live)

    async def update_weights_between_steps(self, named_tensors) -> float:
        raise RequestError("weights move only between training steps", None, "not_allowed", 403)


class EpisodePaths:
    """ASGI middleware: ``/episodes/ID/v1/…`` → ``/v1/…`` with the episode bound to the request
    (``REQUEST``); anything else but ``/health`` → 404."""

    def __init__(self, app, episodes: dict):
        self.app, self.episodes = app, episodes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        from arbor.serve.http_io import error_response
        path = scope["path"]
        eid, _, rest = path[len(PREFIX):].partition("/") if path.startswith(PREFIX) else ("", "", "")
        ep = self.episodes.get(eid)
        if ep is None or not ep.open:
            error = RequestError(f"no running episode at {path}; an agent calls the base_url of the client it "
                                 "was given", None, "episode_not_found", 404)
            return await error_response(error)(scope, receive, send)
        token = REQUEST.set({"episode": ep})
        try:
            await self.app({**scope, "path": "/" + rest, "raw_path": ("/" + rest).encode()}, receive, send)
        finally:
            REQUEST.reset(token)


class AgentEndpoint:
    """The endpoint (module docstring) on the running event loop; ``ensure()`` (re)starts it when the
    loop changed (an overlapped rollout runs each iteration on a loop of its own)."""

    def __init__(self, engine, tok, moe: bool, template_kwargs=None, model_name: str = "arbor-policy"):
        self.recorder = RecordingEngine(engine, tok, tok.eos_token_id, moe, template_kwargs)
        self.recorder.open_episodes = lambda: len(self.episodes)
        self.model_name, self.key = model_name, secrets.token_urlsafe(24)
        self.episodes: dict[str, EpisodeHandle] = {}
        self.loop = self.server = self.task = self.sock = self.http = None
        self.base = ""

    def app(self):
        from arbor.serve.app import make_app
        from arbor.serve.config import ServerConfig
        from arbor.serve.server import engine_routes
        recorder = self.recorder

        class Backend:
            max_model_len = recorder.max_model_len

            def card(self):
                return {}

            def install(self, app, read_body, model_name, cfg):
                async def reading(request):      # ``read_body`` without its model check: an agent names any model
                    from arbor.serve.app import draining_error
                    from arbor.serve.http_io import read_json
                    if app.state.draining:
                        raise draining_error()
                    body = await read_json(request, cfg.max_body_bytes)
                    req = REQUEST.get()
                    if req is not None:
                        req["body"] = body
                    return {k: v for k, v in body.items() if k != "model"}
                engine_routes(recorder, app, reading, model_name, cfg, chat_ids=recorder.chat_ids)

            def abort_all(self):
                for rid in list(recorder.live):
                    recorder.abort(rid)

            def num_requests(self):
                return recorder.num_requests()

        return EpisodePaths(make_app(Backend(), self.model_name, ServerConfig(api_key=self.key)), self.episodes)

    async def ensure(self) -> None:
        loop = asyncio.get_running_loop()
        if self.loop is loop and self.task is not None and not self.task.done():
            return
        self._drop()
        require_openai()
        import httpx
        import uvicorn
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        # the server keeps idle connections far longer than the client does, so the client never reuses one
        # the server is closing (an APIConnectionError in the agent)
        self.server = uvicorn.Server(uvicorn.Config(self.app(), log_level="warning", access_log=False, lifespan="off",
                                                    timeout_graceful_shutdown=1, timeout_keep_alive=KEEP_ALIVE_S))
        self.server.capture_signals = contextlib.nullcontext    # Ctrl-C stops training, not just this server
        self.loop, self.task = loop, loop.create_task(self.server.serve(sockets=[self.sock]))
        self.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                                          keepalive_expiry=KEEP_ALIVE_S / 10), timeout=None)
        while not self.server.started:
            if self.task.done():
                self.task.result()       # raises what stopped the server
            await asyncio.sleep(0.002)

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.loop = self.server = self.task = self.sock = self.http = None

    async def aclose(self) -> None:
        """Stop the server (on its own loop); the endpoint may be started again."""
        if self.task is not None and self.loop is asyncio.get_running_loop():
            self.server.should_exit = True
            await self.http.aclose()
            await asyncio.wait_for(asyncio.shield(self.task), 5)
        self._drop()

    def open(self, eid: str, row, group: int, sample: int, settings: dict):
        """A new episode → (its ``EpisodeHandle``, an ``openai.AsyncOpenAI`` bound to it, ``.episode`` set)."""
        import openai
        ep = EpisodeHandle(eid, row, group, sample, settings)
        self.episodes[eid] = ep
        client = openai.AsyncOpenAI(base_url=f"{self.base}{PREFIX}{eid}/v1", api_key=self.key,
                                    http_client=self.http, max_retries=0, timeout=settings["timeout_s"])
        client.episode = ep
        return ep, client

    def close(self, ep: EpisodeHandle) -> None:
        """End ``ep``: later requests get 404, requests in flight are aborted."""
        ep.open = False
        self.recorder.abort_episode(ep)
        self.episodes.pop(ep.id, None)
        self.recorder.notify()
