"""Tool calling in the OpenAI chat API (no I/O here; ``arbor.serve.server`` uses it, the formats are
the chat template's: ``arbor.models.tool_calls``).

For a backend that takes tools (``check_fields``/``chat_messages`` with ``tools=True``):
``tools`` (OpenAI function schemas) are rendered by the template; ``tool_choice`` is ``"auto"`` (the
default with tools), ``"none"`` (tools rendered, calls not parsed), ``"required"`` (the generation
prompt ends with the parser's ``call_prefix``) or ``{"type": "function", "function": {"name": N}}``
(it ends with ``call_start(N)``: the model writes N's arguments). ``tool_plan`` checks all this into a
``ToolPlan``. A completion is read as the forced text + the generated text: if it holds calls and no
malformed one, the message has ``tool_calls`` (ids ``call_…``, arguments as JSON strings), ``content``
the remaining text or null, and ``finish_reason: "tool_calls"``; otherwise (no call, or any malformed
call — a random or undertrained model's forced call included) ``content`` is that whole text, forced
part included, and the finish reason is the engine's (``stop`` or ``length``), so the client sees
exactly what the model wrote. Messages may be ``role: "tool"`` (``tool_call_id``) and assistant
messages with ``tool_calls`` (arguments a JSON string, decoded to an object for the template;
``content`` may be null).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from arbor.models.tool_calls import ToolCallParser, parser_for_template
from arbor.serve.openai_protocol import RequestError

_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_SHAPE = ('{"type": "function", "function": {"name": "<letters, digits, _ or -; at most 64>", '
               '"description": "...", "parameters": {<JSON Schema object>}}}')
_CHOICES = '"auto", "none", "required" or {"type": "function", "function": {"name": "<one of the tools>"}}'


@dataclass
class ToolPlan:
    """A chat request's tools (module docstring): ``tools`` the schemas the template renders (None: no
    tools), ``parser`` reads each completion (None: calls are not parsed), ``forced`` is appended to the
    generation prompt and read as the completion's beginning ("" unless tool_choice forces a call)."""
    tools: list[dict] | None = None
    parser: ToolCallParser | None = None
    forced: str = ""

    def message(self, text: str) -> tuple[dict, str | None]:
        """``assistant_message(text, self)``."""
        return assistant_message(text, self)


def tool_plan(body: dict, tokenizer) -> ToolPlan:
    """``tools`` and ``tool_choice`` checked against each other and the model's chat template → ToolPlan;
    RequestError naming the bad entry, a tool_choice not in ``tools``, or a template that takes no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise RequestError("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
        return ToolPlan()
    tools = _check_tools(tools)
    template = getattr(tokenizer, "chat_template", None)
    if not getattr(tokenizer, "supports_tools", False):
        raise RequestError("this model's chat template does not render tools (it never reads a `tools` variable); "
                           "send no 'tools', or serve a model whose template takes them (Qwen2.5/Qwen3, "
                           "Llama 3.1+, Arbor's built-in template)", "tools")
    names = [t["function"]["name"] for t in tools]
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolPlan(tools)
    if choice not in ("auto", "required"):
        f = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise RequestError(f"'tool_choice' must be {_CHOICES}", "tool_choice")
        if f["name"] not in names:
            raise RequestError(f"'tool_choice' names the function {f['name']!r}, which is not in 'tools' "
                               f"({', '.join(names)})", "tool_choice")
    try:
        parser = parser_for_template(template)
    except ValueError as e:
        raise RequestError(f"this model's tool calls cannot be read: {e}", "tools") from None
    forced = {"auto": "", "required": parser.call_prefix}.get(choice) if isinstance(choice, str) else \
        parser.call_start(choice["function"]["name"])
    return ToolPlan(tools, parser, forced)


def _check_tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise RequestError(f"'tools' must be a list of {_TOOL_SHAPE}", "tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        bad = None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            bad = f"must be {_TOOL_SHAPE}"
        elif not _TOOL_NAME.fullmatch(f["name"]):
            bad = f"has the name {f['name']!r}; a name is 1 to 64 letters, digits, _ or -"
        elif not isinstance(f.get("description", ""), str) or not isinstance(f.get("parameters", {}), dict):
            bad = f"needs a string 'description' and an object 'parameters' (a JSON Schema), as in {_TOOL_SHAPE}"
        elif f.get("strict"):
            bad = "asks for 'strict': true; this server does not constrain decoding to the schema (send no 'strict')"
        elif f["name"] in seen:
            bad = f"repeats the name {f['name']!r}; tool names must be unique"
        if bad:
            raise RequestError(f"tools[{i}] {bad}", "tools")
        seen.add(f["name"])
        f = {**f, "parameters": f.get("parameters") or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": f})
    return out


def assistant_message(text: str, plan: ToolPlan | None = None) -> tuple[dict, str | None]:
    """A chat completion's ``text`` → (message, finish reason to report instead of the engine's, or None),
    reading tool calls as the module docstring says."""
    if plan is None or plan.parser is None:
        return {"role": "assistant", "content": text}, None
    full = plan.forced + text
    turn = plan.parser.parse(full)
    if turn.calls and not turn.errors:
        return {"role": "assistant", "content": turn.content or None,
                "tool_calls": [c.openai() for c in turn.calls]}, "tool_calls"
    return {"role": "assistant", "content": full}, None


class ToolStream:
    """One streamed chat choice whose completion may hold tool calls (``plan.parser`` set). ``step(text)``
    → the content to send now: the text before any call markup (``content_end``), trailing whitespace held
    back, so nothing is sent once a call has begun (or when the call is forced). ``last(text)`` → the
    final deltas and finish reason: the rest of the content, then one ``tool_calls`` delta with every call
    (``finish_reason: "tool_calls"``), or, with no clean call, the rest of the whole text. The streamed
    deltas add up to the non-streamed message (a call turn's content may keep leading whitespace)."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.sent = plan, ""

    def step(self, text: str) -> str:
        full = self.plan.forced + text
        safe = full[:self.plan.parser.content_end(full)].rstrip()
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def last(self, text: str, finish_reason: str) -> tuple[list[dict], str]:
        message, reason = assistant_message(text, self.plan)
        content = message["content"] or ""
        start = len(self.sent) if content.startswith(self.sent) else len(self.sent.lstrip())
        deltas = [{"content": content[start:]}] if content[start:] else []
        if reason:
            deltas.append({"tool_calls": [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]})
        return deltas or [{"content": ""}], reason or finish_reason
