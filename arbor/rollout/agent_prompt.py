"""Prompt ids of an agent's chat call that continues an earlier call of its episode, without
re-tokenising what the model wrote.

An agent sends the whole conversation with every call. When the request's messages are an earlier
call's messages, then that call's reply (the assistant message the endpoint returned, as the agent
echoes it back), then new messages (tool results, a user turn), the prompt is laid out as the
collector lays out a built-in environment's turns (``arbor.rollout.chat.ChatLayout``):

    earlier prompt ids · earlier sampled ids · env turn ids (the template's text after that turn's
    end-of-turn token, the new messages and the next generation prompt) · the forced tool-call text

so the prompt extends the earlier prompt + completion token for token and the two calls form one
trajectory. A completion cut at ``max_tokens`` has no end-of-turn token; the template's one is then
the first id of the env turn. Anything else — history rewritten, other tools, a template that
renders earlier turns differently once a message is added — is rendered and tokenised afresh, like
``arbor serve`` does (the calls then form a tree or separate samples: ``arbor.rollout.agent_record``).

Messages are compared normalized (``normalize``): role, text content, tool calls as (name, arguments
parsed from JSON), ``tool_call_id`` and ``name``; so an agent that echoes the reply as a dict or as
the ``openai`` message object matches.
"""

from __future__ import annotations

import json

from arbor.rollout.chat import ChatLayout


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, list):       # content parts: their text, in order
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _args(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def normalize(message: dict) -> str:
    """One message as canonical JSON (module docstring)."""
    calls = [(c.get("function", {}).get("name"), _args(c.get("function", {}).get("arguments")))
             for c in message.get("tool_calls") or []]
    key = {"role": message.get("role"), "content": _text(message.get("content")), "tool_calls": calls,
           "tool_call_id": message.get("tool_call_id"), "name": message.get("name")}
    return json.dumps(key, sort_keys=True, default=str)


def tools_key(tools) -> str:
    return json.dumps(tools, sort_keys=True) if tools else ""


def continued_prompt(calls, messages: list[dict], tools, forced: str, tok, template_kwargs=None) -> list[int] | None:
    """The prompt ids of a chat call with ``messages`` (checked, as the template takes them), ``tools``
    and ``forced`` text that continues one of ``calls`` (the episode's finished chat calls, latest
    tried first), or None when none continues (module docstring)."""
    norm = [normalize(m) for m in messages]
    key = tools_key(tools)
    for call in reversed(calls):
        if not call.chat or not call.done or call.reply is None or call.tools_key != key:
            continue
        k = len(call.messages)
        if len(norm) <= k or norm[:k] != call.messages or norm[k] != call.reply:
            continue
        layout = ChatLayout(tok, tools, template_kwargs)
        try:
            env = layout.env_turn_ids(messages[:k + 1], messages[k + 1:])
        except ValueError:              # the template rewrites earlier turns: render afresh
            return None
        eos = [] if call.token_ids[-1:] == [tok.eos_token_id] else [tok.eos_token_id]
        return call.prompt_ids + call.token_ids + eos + env + (tok.encode(forced) if forced else [])
    return None
