"""OpenAI request parsing and response/chunk formatting for the server (no I/O here).

Errors are ``RequestError(message, param, code)``; the server answers them with HTTP 400 and
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid

from arbor.engine.sampling_params import SamplingParams
from arbor.engine.sequence import Completion

KNOBS = {"n": int, "temperature": float, "top_k": int, "top_p": float, "min_p": float, "seed": int,
         "max_tokens": int, "ignore_eos": bool, "stop_token_ids": list}


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


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
        kw[name] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("'stop' must be a string or a list of non-empty strings", "stop")
        kw["stop"] = stop
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
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or (isinstance(p, list) and p and all(
            isinstance(t, int) for t in p)) for p in prompt):
        return prompt
    raise RequestError("'prompt' must be a string, a list of token ids, or a non-empty list of those", "prompt")


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
        raise RequestError("'messages' must be a non-empty list of {role, content} strings", "messages")
    return msgs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def _logprobs(c: Completion, start: int, tokenizer, chat: bool):
    ids, lps = c.token_ids[start:], c.logprobs[start:]
    tops = (c.top_logprobs or [None] * len(c.token_ids))[start:]
    name = (lambda t: tokenizer.decode([t])) if tokenizer is not None else str
    if chat:
        return {"content": [{"token": name(t), "logprob": lp, "top_logprobs": [
            {"token": name(k), "logprob": v} for k, v in (top or {}).items()]} for t, lp, top in zip(ids, lps, tops)]}
    return {"tokens": [name(t) for t in ids], "token_logprobs": lps,
            "top_logprobs": None if c.top_logprobs is None else [{name(k): v for k, v in top.items()} for top in tops]}


def choice(c: Completion, index: int, chat: bool, tokenizer, want_logprobs: bool) -> dict:
    out = {"index": index, "finish_reason": c.finish_reason, "token_ids": c.token_ids,
           "logprobs": _logprobs(c, 0, tokenizer, chat) if want_logprobs else None}
    if chat:
        out["message"] = {"role": "assistant", "content": c.text or ""}
    else:
        out["text"] = c.text or ""
    return out


def response(rid: str, model: str, chat: bool, choices: list[dict], usage: dict) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage}


def chunk(rid: str, model: str, chat: bool, index: int, text: str, new_ids: list[int], finish: str | None,
          logprobs=None, role: bool = False) -> dict:
    if chat:
        delta = {"role": "assistant", "content": text} if role else ({"content": text} if text or not finish else {})
        c = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    else:
        c = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    c["token_ids"] = new_ids
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [c]}
