"""OpenAI request parsing and response/chunk formatting for the server (no I/O here).

Errors are ``RequestError(message, param, code, status=400)``; the server answers them with that
status and ``{"error": {"message", "type", "param", "code"}}``.

A request field is either implemented (``FIELDS``), accepted without effect (``IGNORED``), accepted
only at its no-op value (``NO_OP``: ``echo: false``, ``logit_bias: {}``, ``best_of`` = n, …), or
refused with a 400 naming it, so that a client never silently gets something else than it asked for.

Tool calling's request checks and response reading are ``arbor.serve.tool_calling``'s.
"""

from __future__ import annotations

import json
import math
import time
import uuid

from arbor.engine.sampling_params import SamplingParams
from arbor.engine.sequence import Completion
from arbor.models.tool_calls import new_call_id

KNOBS = {"n": int, "temperature": float, "top_k": int, "top_p": float, "min_p": float, "seed": int,
         "max_tokens": int, "ignore_eos": bool, "stop_token_ids": list}
_COMMON = {"model", "stop", "logprobs", "stream", "stream_options", *KNOBS}
FIELDS = {False: _COMMON | {"prompt"}, True: _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}}
TOOL_FIELDS = {"tools", "tool_choice"}       # chat fields of a backend that takes tools (``check_fields(tools=True)``)
IGNORED = {"user", "store", "metadata", "service_tier", "parallel_tool_calls"}
NO_OP = {"echo": lambda v, b: v is False, "best_of": lambda v, b: v == (b.get("n") or 1),
         "presence_penalty": lambda v, b: v == 0, "frequency_penalty": lambda v, b: v == 0,
         "repetition_penalty": lambda v, b: v == 1, "logit_bias": lambda v, b: v == {},
         "suffix": lambda v, b: v == "", "tools": lambda v, b: v == [], "functions": lambda v, b: v == [],
         "tool_choice": lambda v, b: v == "none", "function_call": lambda v, b: v == "none",
         "response_format": lambda v, b: v == {"type": "text"}}
_INT64 = 1 << 63            # integer knobs end up in int64 tensors and generators (seed + sample index)
LOGPROB_FLOOR = -9999.0     # JSON has no -inf: a token outside the sampled support reads as this


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def check_fields(body: dict, chat: bool, tools: bool = False) -> None:
    """400 for a field this server does not implement (at a value that would change the result);
    ``tools``: the backend takes ``tools``/``tool_choice`` in chat (else they are no-op-only)."""
    for name, value in body.items():
        if value is None or name in FIELDS[chat] or name in IGNORED or (tools and chat and name in TOOL_FIELDS):
            continue
        no_op = NO_OP.get(name)
        if no_op is not None:
            try:
                if no_op(value, body):
                    continue
            except TypeError:
                pass
        hint = " (only at its default value)" if no_op is not None else ""
        raise RequestError(f"'{name}' is not supported by this server{hint}", name, "unsupported_parameter")


def stream_flags(body: dict) -> tuple[bool, bool]:
    """→ (stream, include_usage); ``stream`` must be a boolean, ``stream_options`` needs ``stream``."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", "stream")
    opts = body.get("stream_options")
    if opts is None:
        return bool(stream), False
    if not stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(opts, dict) or not set(opts) <= {"include_usage"} or not isinstance(
            opts.get("include_usage", False), bool):
        raise RequestError("'stream_options' must be {\"include_usage\": bool}", "stream_options")
    return True, opts.get("include_usage", False)


def sampling_params(body: dict, chat: bool) -> SamplingParams:
    kw = {}
    for name, kind in KNOBS.items():
        value = body.get(name)
        if name == "max_tokens" and chat and body.get("max_completion_tokens") is not None:
            value = body["max_completion_tokens"]
        if value is None:
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise RequestError(f"'{name}' must be of type {kind.__name__}", name)
        if (kind is float and not math.isfinite(value)) or (kind is int and not -_INT64 <= value < _INT64 - 1024):
            raise RequestError(f"'{name}' is out of range", name)
        kw[name] = value
    if kw.get("stop_token_ids") is not None and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in kw["stop_token_ids"]):
        raise RequestError("'stop_token_ids' must be a list of integers", "stop_token_ids")
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("'stop' must be a string or a list of non-empty strings", "stop")
        kw["stop"] = stop
    if chat and not isinstance(body.get("logprobs", False) or False, bool):
        raise RequestError("'logprobs' must be a boolean", "logprobs")
    lp = body.get("top_logprobs" if chat else "logprobs")
    if chat and not body.get("logprobs"):
        lp = None
    if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= 20):
        raise RequestError("log-probs count must be an integer in [0, 20]", "logprobs")
    kw["logprobs"] = lp or 0
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise RequestError(str(e), str(e).split()[0]) from None


def completion_prompts(body: dict) -> list:
    """→ a list of prompts, each text or token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        return prompt
    raise RequestError("'prompt' must be a string, a list of token ids, or a non-empty list of those", "prompt")


def _is_ids(p) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def chat_messages(body: dict, tools: bool = False) -> list[dict]:
    """→ [{role, content}] with ``content`` a string (a list of text parts is joined with newlines). With
    ``tools`` (the backend takes them), a ``tool`` message keeps its ``tool_call_id`` and an assistant
    message with ``tool_calls`` keeps them as ``{"id", "type": "function", "function": {"name", "arguments":
    dict}}`` and may have ``content`` None; without, ``tool_calls`` are refused (never dropped)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                         for m in msgs):
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
    return [_message(m, i, tools) for i, m in enumerate(msgs)]


def _message(m: dict, i: int, tools: bool) -> dict:
    calls = m.get("tool_calls")
    if calls is not None and not tools:
        raise RequestError(f"messages[{i}]: 'tool_calls' are not supported by this server's backend", "messages",
                           "unsupported_parameter")
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise RequestError(f"messages[{i}]: 'tool_calls' must be a list, on an assistant message", "messages")
        content = None if m.get("content") is None else _content(m["content"])
        return {"role": "assistant", "content": content, "tool_calls": [_tool_call(c, i) for c in calls]}
    out = {"role": m["role"], "content": _content(m.get("content"))}
    if tools and m["role"] == "tool" and m.get("tool_call_id") is not None:
        if not isinstance(m["tool_call_id"], str):
            raise RequestError(f"messages[{i}]: 'tool_call_id' must be a string", "messages")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _tool_call(c, i: int) -> dict:
    shape = ('{"id": "call_...", "type": "function", "function": {"name": "...", "arguments": "<JSON object '
             'as a string>"}}')
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or c.get("type", "function") != "function" or not isinstance(f.get("name"), str) \
            or not isinstance(c.get("id", ""), str):
        raise RequestError(f"messages[{i}]: each tool call must be {shape}", "messages")
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise RequestError(f"messages[{i}]: the arguments of the call of {f['name']!r} are not JSON ({e}); "
                               f"expected {shape}", "messages") from None
    if not isinstance(args, dict):
        raise RequestError(f"messages[{i}]: the arguments of the call of {f['name']!r} must be a JSON object, "
                           f"got {type(args).__name__}", "messages")
    return {"id": c.get("id") or new_call_id(), "type": "function", "function": {"name": f["name"], "arguments": args}}


def message_chars(m: dict) -> int:
    """A parsed message's size in characters (role, content and tool calls), for the context check."""
    calls = m.get("tool_calls")
    return len(m["role"]) + len(m.get("content") or "") + (len(json.dumps(calls)) if calls else 0)


def _content(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        for part in content:
            if part.get("type") != "text":
                raise RequestError(f"only text content parts are supported, got type {part.get('type')!r}",
                                   "messages")
            if not isinstance(part.get("text"), str):
                raise RequestError("a text content part needs a string 'text'", "messages")
        return "\n".join(p["text"] for p in content)
    raise RequestError("a message's 'content' must be a string or a list of text parts", "messages")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def _logprobs(c: Completion, start: int, tokenizer, chat: bool):
    ids, lps = c.token_ids[start:], [_finite(v) for v in c.logprobs[start:]]
    tops = (c.top_logprobs or [None] * len(c.token_ids))[start:]
    name = (lambda t: tokenizer.decode([t])) if tokenizer is not None else str
    if chat:
        return {"content": [{"token": name(t), "logprob": lp, "top_logprobs": [
            {"token": name(k), "logprob": _finite(v)} for k, v in (top or {}).items()]}
            for t, lp, top in zip(ids, lps, tops)]}
    return {"tokens": [name(t) for t in ids], "token_logprobs": lps,
            "top_logprobs": None if c.top_logprobs is None else [{name(k): _finite(v) for k, v in top.items()}
                                                                 for top in tops]}


def _finite(v: float) -> float:
    return v if math.isfinite(v) else LOGPROB_FLOOR


def choice(c: Completion, index: int, chat: bool, tokenizer, want_logprobs: bool, plan=None) -> dict:
    """One choice; a chat choice's message is ``plan.message(text)`` when a ``ToolPlan`` is given
    (``arbor.serve.tool_calling``: tool calls read out of the text)."""
    out = {"index": index, "finish_reason": c.finish_reason, "token_ids": c.token_ids,
           "logprobs": _logprobs(c, 0, tokenizer, chat) if want_logprobs else None}
    if chat:
        message, reason = plan.message(c.text or "") if plan is not None else \
            ({"role": "assistant", "content": c.text or ""}, None)
        out["message"], out["finish_reason"] = message, reason or c.finish_reason
    else:
        out["text"] = c.text or ""
    return out


def response(rid: str, model: str, chat: bool, choices: list[dict], usage: dict) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage}


def usage_chunk(rid: str, model: str, chat: bool, usage: dict) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [], "usage": usage}


def chunk(rid: str, model: str, chat: bool, index: int, text: str, new_ids: list[int], finish: str | None,
          logprobs=None, role: bool = False, delta: dict | None = None) -> dict:
    """One stream chunk; a chat chunk's ``delta`` is ``{"content": text}`` unless given."""
    if chat:
        if delta is None:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text or not finish
                                                                         else {})
        c = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    else:
        c = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    c["token_ids"] = new_ids
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [c]}
