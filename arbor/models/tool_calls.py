"""Tool calls in a model's text, read and written in the format its chat template renders them.

The parser is chosen from the template text (``parser_for_template``), never from a model name:

- ``hermes`` (Qwen2.5, Qwen3, Hermes, Arbor's built-in template): each call is
  ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``, whitespace and newlines around the JSON
  allowed, several calls per turn; the text outside the tags is the content. Two renderings exist:
  Qwen's ``<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>`` and the built-in
  template's compact ``<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>``; ``parse`` reads both,
  ``format_call`` writes the one its template renders (``<tool_call>{`` in the template → compact).
- ``llama3_json`` (Llama 3.1-3.3): ``{"name": "f", "parameters": {...}}`` (``arguments`` is read too),
  optionally after ``<|python_tag|>``, several separated by ``;``. The calls start at ``<|python_tag|>``
  or, without it, at the first ``{"name":``; the text before them (and any text after) is the content.

Invariants:
- ``parse`` never raises. A call that is not JSON, not an object, has no string ``name`` or has
  non-object arguments is an ``errors`` entry (``"call N: ..."``, with the offending text clipped) and is
  not in ``calls``; missing arguments read as ``{}``. ``content`` is the text without call markup, stripped.
- ``parse(format_call(n, a))`` is one ``ToolCall(n, a)`` with content ``""``.
- ``format_call(n, a).startswith(call_start(n))`` and ``call_start(n).startswith(call_prefix)``: a
  generation prompt ending in ``call_start(n)`` forces a call of ``n`` (the model writes the arguments
  and the rest), one ending in ``call_prefix`` forces some call.
- ``content_end(text)``: how many leading characters of ``text`` are content whatever comes next (a
  stream sends those; call markup, or what may become its beginning, is held back).
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, field

from arbor.models.tokenizer import reads_tools


def new_call_id() -> str:
    """A fresh OpenAI-style call id: ``call_`` + 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One call: the tool's ``name``, its ``arguments`` (a JSON object as a dict), and an ``id`` that the
    tool's result refers to (``tool_call_id``)."""
    name: str
    arguments: dict
    id: str = field(default_factory=new_call_id)

    def openai(self) -> dict:
        """The OpenAI ``tool_calls`` entry: ``arguments`` as a JSON string."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass
class ParsedTurn:
    """A model turn read by a parser (module docstring): its content, its well-formed calls in order,
    and one message per malformed call."""
    content: str
    calls: list[ToolCall]
    errors: list[str]


def _clip(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")


def _call(obj, n: int, raw: str, keys: tuple[str, ...]) -> ToolCall | str:
    """The call a decoded JSON value describes, or the error saying what is wrong with it."""
    want = f'a JSON object {{"name": ..., "{keys[0]}": {{...}}}}'
    if not isinstance(obj, dict):
        return f"call {n}: expected {want}, got a JSON {type(obj).__name__}: {_clip(raw)}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f'call {n}: no "name" string (expected {want}): {_clip(raw)}'
    key = next((k for k in keys if k in obj), None)
    args = {} if key is None else obj[key]
    if not isinstance(args, dict):
        return f'call {n} ({name}): "{key}" must be a JSON object, got a JSON {type(args).__name__}: {_clip(raw)}'
    return ToolCall(name, args)


def _decode(text: str, n: int, keys: tuple[str, ...]) -> ToolCall | str:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return f"call {n}: malformed JSON ({e.msg} at character {e.pos}): {_clip(text)}"
    return _call(obj, n, text, keys)


def _partial(text: str, marker: str) -> int:
    """The length of the longest proper prefix of ``marker`` that ``text`` ends with."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _turn(content: str, found: list, errors: list[str]) -> ParsedTurn:
    return ParsedTurn(content.strip(), found, errors)


class HermesParser:
    """``<tool_call>JSON</tool_call>`` calls (module docstring); ``compact``: the built-in template's
    rendering (no spaces or newlines), else Qwen's."""
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, compact: bool = False):
        self.compact = compact
        self.call_prefix = '<tool_call>{"name":"' if compact else '<tool_call>\n{"name": "'

    def __repr__(self) -> str:
        return f"HermesParser(compact={self.compact})"

    def call_start(self, name: str) -> str:
        """The rendered call of ``name`` up to its arguments."""
        quoted = json.dumps(name, ensure_ascii=False)
        return (f'<tool_call>{{"name":{quoted},"arguments":' if self.compact
                else f'<tool_call>\n{{"name": {quoted}, "arguments": ')

    def format_call(self, name: str, arguments: dict) -> str:
        """One call exactly as the template renders an assistant message's tool call."""
        if self.compact:
            return self.call_start(name) + json.dumps(arguments, ensure_ascii=False, separators=(",", ":")) + \
                "}</tool_call>"
        return self.call_start(name) + json.dumps(arguments, ensure_ascii=False) + "}\n</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        content, found, errors, pos = [], [], [], 0
        while (i := text.find(self.OPEN, pos)) >= 0:
            content.append(text[pos:i])
            j = text.find(self.CLOSE, i)
            body = text[i + len(self.OPEN): j if j >= 0 else len(text)]
            call = _decode(body.strip(), len(found) + len(errors) + 1, ("arguments", "parameters"))
            if isinstance(call, str):
                errors.append(call + ("" if j >= 0 else f" (no closing {self.CLOSE})"))
            else:
                found.append(call)
            pos = len(text) if j < 0 else j + len(self.CLOSE)
        content.append(text[pos:])
        return _turn("".join(content), found, errors)

    def content_end(self, text: str) -> int:
        i = text.find(self.OPEN)
        return i if i >= 0 else len(text) - _partial(text, self.OPEN)


class Llama3JsonParser:
    """Llama 3.x JSON calls (module docstring)."""
    name = "llama3_json"
    TAG = "<|python_tag|>"
    call_prefix = '{"name": "'
    _START = re.compile(r'\{\s*"name"\s*:')
    _KEY = '{"name":'

    def __repr__(self) -> str:
        return "Llama3JsonParser()"

    def call_start(self, name: str) -> str:
        """The rendered call of ``name`` up to its arguments."""
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": '

    def format_call(self, name: str, arguments: dict) -> str:
        """One call exactly as the Llama 3.1 template renders an assistant message's tool call."""
        return self.call_start(name) + json.dumps(arguments, ensure_ascii=False) + "}"

    def _start(self, text: str) -> tuple[int, int] | None:
        """(where the calls begin, how many characters of tag to skip), or None."""
        tag, m = text.find(self.TAG), self._START.search(text)
        if tag >= 0 and (m is None or tag <= m.start()):
            return tag, len(self.TAG)
        return None if m is None else (m.start(), 0)

    def parse(self, text: str) -> ParsedTurn:
        start = self._start(text)
        if start is None:
            return _turn(text, [], [])
        content, body = text[:start[0]], text[start[0] + start[1]:]
        found, errors, pos, decoder = [], [], 0, json.JSONDecoder()
        while True:
            pos = len(body) - len(body[pos:].lstrip())
            if pos >= len(body):
                break
            n = len(found) + len(errors) + 1
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as e:
                errors.append(f"call {n}: malformed JSON ({e.msg} at character {e.pos - pos}): {_clip(body[pos:])}")
                break
            call = _call(obj, n, body[pos:end], ("parameters", "arguments"))
            (errors if isinstance(call, str) else found).append(call)
            pos = len(body) - len(body[end:].lstrip())
            if body.startswith(";", pos):
                pos += 1
            elif not body.startswith("{", pos):
                content += " " + body[pos:]         # text after the calls is content
                break
        return _turn(content, found, errors)

    def content_end(self, text: str) -> int:
        start = self._start(text)
        if start is not None:
            return start[0]
        hold = _partial(text, self.TAG)
        brace = text.rfind("{")
        if brace >= 0 and self._KEY.startswith(re.sub(r"\s", "", text[brace:])):
            hold = max(hold, len(text) - brace)
        return len(text) - hold


ToolCallParser = HermesParser | Llama3JsonParser
KNOWN_FORMATS = ("hermes (<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>: Qwen2.5, Qwen3, Hermes, "
                 "Arbor's built-in template)",
                 "llama3_json ({\"name\": ..., \"parameters\": {...}}, optionally after <|python_tag|>: Llama 3.1-3.3)")


def template_reads_tools(template: str) -> bool:
    """Whether the Jinja ``template`` reads a ``tools`` variable (renders tool schemas)."""
    return reads_tools(template)


@functools.lru_cache(maxsize=16)
def parser_for_template(template: str | None) -> ToolCallParser | None:
    """The parser for the calls ``template`` renders: ``<tool_call>`` in it → hermes (compact when it
    writes ``<tool_call>{``); ``<|python_tag|>`` or ``"parameters":`` (Llama 3.x) → llama3_json; None when
    the template does not read ``tools``. ValueError for a template that reads ``tools`` in no known format.
    Cached per template (parsers hold no state)."""
    if not template or not template_reads_tools(template):
        return None
    if HermesParser.OPEN in template:
        return HermesParser(compact="<tool_call>{" in template)
    if Llama3JsonParser.TAG in template or '"parameters":' in template:
        return Llama3JsonParser()
    raise ValueError("the chat template reads `tools` but renders tool calls in a format Arbor does not parse; "
                     "known formats: " + "; ".join(KNOWN_FORMATS))


def parser_for(tokenizer) -> ToolCallParser | None:
    """``parser_for_template(tokenizer.chat_template)``."""
    return parser_for_template(getattr(tokenizer, "chat_template", None))


__all__ = ["HermesParser", "KNOWN_FORMATS", "Llama3JsonParser", "ParsedTurn", "ToolCall", "ToolCallParser",
           "new_call_id", "parser_for", "parser_for_template", "template_reads_tools"]
