"""A dataset row → the chat messages of its prompt, or (``arbor sft``) of its whole conversation.

A prompt column holds text (one user message) or OpenAI-format messages (``[{"role", "content"}]``,
a system message optional); ``system`` (``data.system``) is put first where the prompt has no
system message. A conversation is ``messages_key`` (messages ending with an assistant turn) or
``prompt_key`` + ``completion_key`` (the completion text, or assistant messages). Every other column
stays in the row: rewards and environments receive it. Errors name the row index, the column and
what is accepted. ``keep_rows`` drops (and counts) the rows a job cannot use, never truncating one.
"""

from __future__ import annotations

ROLES = ("system", "user", "assistant", "tool")


def _messages(value, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        out = []
        for m in value:
            if m.get("role") not in ROLES:
                raise ValueError(f"{where}: a message's role must be one of {ROLES}, got {m.get('role')!r}")
            if not isinstance(m.get("content"), str) and not m.get("tool_calls"):
                raise ValueError(f"{where}: a {m['role']} message needs a string 'content', got {m.get('content')!r}")
            out.append({k: v for k, v in m.items() if v is not None})
        return out
    raise ValueError(f"{where}: expected text or a non-empty list of {{role, content}} messages, "
                     f"got {type(value).__name__} {str(value)[:80]!r}")


def with_system(messages: list[dict], system: str) -> list[dict]:
    if system and messages[0]["role"] != "system":
        return [{"role": "system", "content": system}] + messages
    return messages


def prompt_messages(row: dict, key: str = "prompt", system: str = "", index: int | None = None) -> list[dict]:
    """The prompt of ``row`` as messages (module docstring)."""
    where = f"row {index}, column {key!r}" if index is not None else f"column {key!r}"
    if key not in row:
        raise ValueError(f"{where}: the row has no such column; its columns are {sorted(row)}")
    return with_system(_messages(row[key], where), system)


def conversation(row: dict, messages_key: str = "messages", prompt_key: str = "prompt",
                 completion_key: str = "completion", system: str = "", index: int | None = None) -> list[dict]:
    """The whole conversation of an SFT row: ``messages_key``, else ``prompt_key`` + ``completion_key``."""
    if messages_key in row and row[messages_key] is not None:
        msgs = with_system(_messages(row[messages_key], f"row {index}, column {messages_key!r}"), system)
    elif prompt_key in row and completion_key in row:
        done = row[completion_key]
        where = f"row {index}, column {completion_key!r}"
        tail = [{"role": "assistant", "content": done}] if isinstance(done, str) else _messages(done, where)
        msgs = prompt_messages(row, prompt_key, system, index) + tail
    else:
        raise ValueError(f"row {index}: an SFT row needs a {messages_key!r} column (data.messages_key) or "
                         f"{prompt_key!r} + {completion_key!r} columns (data.prompt_key, data.completion_key); "
                         f"its columns are {sorted(row)}")
    if msgs[-1]["role"] != "assistant":
        raise ValueError(f"row {index}: the conversation must end with an assistant message, "
                         f"it ends with {msgs[-1]['role']!r}")
    return msgs


def keep_rows(rows: list[dict], build, max_tokens: int, what: str):
    """``build(index, row) -> (value, prompt_tokens)`` for every row; a row whose ``build`` raises
    ValueError (unreadable) or whose prompt is longer than ``max_tokens`` (> 0) is dropped and counted.
    A chat-template error is the template's, not the row's: it propagates. → (the values kept,
    {"invalid": n, "too_long": n}, a note for the log or None); no row left is a ValueError."""
    kept, invalid, long, first = [], 0, 0, None
    for i, row in enumerate(rows):
        try:
            value, n = build(i, row)
        except ValueError as e:
            if "chat template" in str(e):
                raise
            invalid, first = invalid + 1, first or str(e)
            continue
        if max_tokens and n > max_tokens:
            long, first = long + 1, first or f"row {i}: prompt of {n} tokens > data.max_prompt_tokens={max_tokens}"
            continue
        kept.append(value)
    if not kept:
        raise ValueError(f"{what}: no rows left after dropping {long} too long (data.max_prompt_tokens="
                         f"{max_tokens}) and {invalid} unreadable ({first})")
    note = None
    if invalid or long:
        note = (f"{what}: dropped {invalid + long} of {len(rows)} rows ({long} with a prompt longer than "
                f"{max_tokens} tokens, {invalid} unreadable; first: {first})")
    return kept, {"invalid": invalid, "too_long": long}, note
