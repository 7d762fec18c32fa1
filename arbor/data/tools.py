"""Tools as plain Python functions: a schema from the signature and docstring, loading from files, and
running a model's call without ever raising.

A tool is a typed function with a Google-style docstring, the convention of transformers'
``get_json_schema`` (so a tool file works there too)::

    def get_weather(city: str, unit: Literal["C", "F"] = "C") -> str:
        '''The current weather in a city.

        Args:
            city: The city's name.
            unit: The temperature unit.
        '''

Its schema (OpenAI function format) is ``{"type": "function", "function": {"name", "description",
"parameters"}}``: the description is the docstring's first paragraph; ``parameters`` is a JSON Schema
object with one property per parameter (its type, and its ``Args:`` description), ``required`` listing
the parameters without a default. Types: ``str``, ``int``, ``float``, ``bool``, ``list``/``list[X]``,
``dict``/``dict[str, X]``, ``Any``, ``Literal[...]`` (an ``enum``), ``Optional[X]``/``X | None``
(``"nullable": true``) and unions of those; a trailing ``(choices: [...])`` in a description is an ``enum``,
as in transformers. The return hint is not part of the schema. Anything else (no docstring, an untyped or
undescribed parameter, a type with no JSON form, ``*args``/``**kwargs``) is a ValueError naming the
function, the problem and what is accepted.

``call_tool`` runs a ``ToolCall`` (``arbor.models.tool_calls``) and returns the observation the model
reads next: the result as a string, or one line ``error: ...``; it never raises.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Union

from arbor.data.objects import load_callable
from arbor.models.tool_calls import ToolCall

TYPES = ("str, int, float, bool, list[X], dict, dict[str, X], Any, Literal[...], Optional[X] / X | None "
         "and unions of these")
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
_ARGS_HEAD = re.compile(r"^\s*(Args|Arguments|Parameters):\s*$", re.MULTILINE)
_SECTION = re.compile(r"^\s*(Returns|Return|Raises|Yields|Examples?|Notes?):\s*$", re.MULTILINE)
_ARG = re.compile(r"^(\s*)(\w+)\s*(?:\([^()\n]*\))?\s*:\s*(.*)$")


@dataclass
class Tool:
    """A callable the model may call by ``name``; ``schema`` is its OpenAI function schema."""
    name: str
    fn: Callable
    schema: dict


def _type_schema(hint, where: str) -> dict:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return {}
    if origin is None:
        if hint in _SCALARS:
            return {"type": _SCALARS[hint]}
        if hint in (list, tuple):
            return {"type": "array"}
        if hint is dict:
            return {"type": "object"}
        raise ValueError(f"{where} has the type {getattr(hint, '__name__', hint)!r}, which has no JSON schema "
                         f"(accepted: {TYPES})")
    if origin is Literal:
        if not args or any(type(a) not in _SCALARS for a in args):
            raise ValueError(f"{where}: Literal values must be str, int, float, bool or None")
        kinds = list(dict.fromkeys(_SCALARS[type(a)] for a in args))
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin is Union or origin is types.UnionType:
        subs = [_type_schema(a, where) for a in args if a is not type(None)]
        if len(subs) == 1:
            out = subs[0]
        elif all(set(s) == {"type"} and isinstance(s["type"], str) for s in subs):
            names = sorted({s["type"] for s in subs})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subs}
        return {**out, "nullable": True} if type(None) in args else out
    if origin is list:
        return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
    if origin is dict:
        if args and args[0] is not str:
            raise ValueError(f"{where}: a dict's keys must be str (JSON object keys), got {args[0]!r}")
        return {"type": "object", **({"additionalProperties": _type_schema(args[1], where)} if args else {})}
    raise ValueError(f"{where} has the type {hint!r}, which has no JSON schema (accepted: {TYPES})")


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """A Google-style docstring → (description: the text before its first section, {parameter:
    description} from its ``Args:`` section, continuation lines joined with spaces)."""
    doc = inspect.cleandoc(doc)
    head = _ARGS_HEAD.search(doc)
    other = _SECTION.search(doc)
    stops = [m.start() for m in (head, other) if m is not None]
    description = doc[:min(stops)].strip() if stops else doc.strip()
    described: dict[str, str] = {}
    if head is None:
        return description, described
    block = doc[head.end():]
    end = _SECTION.search(block)
    lines = [line for line in (block[:end.start()] if end else block).split("\n") if line.strip()]
    indent = None
    for line in lines:
        m = _ARG.match(line)
        if m and (indent is None or len(m.group(1)) <= indent):
            indent = len(m.group(1))
            described[m.group(2)] = m.group(3).strip()
        elif described:
            last = next(reversed(described))
            described[last] = (described[last] + " " + line.strip()).strip()
    return description, described


def tool_from_function(fn: Callable) -> Tool:
    """The ``Tool`` of a typed, documented function (module docstring); ValueError naming what is missing."""
    name = getattr(fn, "__name__", None)
    if not callable(fn) or not isinstance(name, str):
        raise ValueError(f"a tool must be a named Python function, got {fn!r}")
    doc = inspect.getdoc(fn)
    if not doc or not doc.strip():
        raise ValueError(f"tool {name}: no docstring; write one whose first paragraph says what the tool does "
                         "and whose 'Args:' section describes each parameter ('name: description')")
    description, described = parse_docstring(doc)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:
        raise ValueError(f"tool {name}: its type hints do not resolve ({type(e).__name__}: {e})") from None
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            star = "*" if p.kind is p.VAR_POSITIONAL else "**"
            raise ValueError(f"tool {name}: {star}{p.name} cannot be described to a model; "
                             "accepted: named parameters, each with a type hint")
        if p.name not in hints:
            raise ValueError(f"tool {name}: parameter {p.name!r} has no type hint (accepted: {TYPES})")
        prop = _type_schema(hints[p.name], f"tool {name}: parameter {p.name!r}")
        if p.name not in described:
            raise ValueError(f"tool {name}: parameter {p.name!r} is not described in the docstring's 'Args:' "
                             f"section (write '{p.name}: what it is' under 'Args:')")
        text = described[p.name]
        choices = re.search(r"\(choices:\s*(.*?)\)\s*$", text, flags=re.IGNORECASE)
        if choices:
            try:
                prop["enum"] = json.loads(choices.group(1))
            except json.JSONDecodeError:
                raise ValueError(f"tool {name}: parameter {p.name!r}: '(choices: ...)' must hold a JSON list") from None
            text = text[:choices.start()].strip()
        properties[p.name] = {**prop, "description": text}
        if p.default is p.empty:
            required.append(p.name)
    parameters = {"type": "object", "properties": properties, **({"required": required} if required else {})}
    return Tool(name, fn, {"type": "function", "function": {"name": name, "description": description,
                                                            "parameters": parameters}})


def load_tools(specs: list[str], what: str = "tools") -> list[Tool]:
    """The tools named by ``specs`` (each ``"path/file.py:name"`` or ``"pkg.module:name"``); ValueError
    naming ``what`` (the config key) for a spec that does not load, a function that is not a valid tool,
    or two tools with one name."""
    if isinstance(specs, str) or not isinstance(specs, (list, tuple)):
        raise ValueError(f"{what}: expected a list of 'path/file.py:name' or 'package.module:name', got {specs!r}")
    tools, seen = [], {}
    for spec in specs:
        try:
            tool = tool_from_function(load_callable(spec, what))
        except ValueError as e:
            raise ValueError(str(e) if str(e).startswith(what) else f"{what}: {spec}: {e}") from None
        if tool.name in seen:
            raise ValueError(f"{what}: two tools are named {tool.name!r} ({seen[tool.name]} and {spec}); "
                             "tool names must be unique")
        seen[tool.name] = spec
        tools.append(tool)
    return tools


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "…"


def _as_text(result) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


async def call_tool(tools: dict[str, Tool], call: ToolCall, timeout_s: float = 10.0) -> str:
    """Run ``call`` with the tool of its name → the result as text (a ``str`` as is, else ``json.dumps``,
    else ``str``). Never raises: an unknown tool, arguments that do not fit the signature, an exception in
    the tool or a run past ``timeout_s`` give one line ``error: ...`` naming the problem. A sync tool runs
    on a worker thread (a timed-out one is abandoned, not killed: it runs on to its end)."""
    tool = tools.get(call.name)
    if tool is None:
        return f"error: unknown tool {call.name!r}; available: {', '.join(sorted(tools)) or '(none)'}"
    args = call.arguments
    if not isinstance(args, dict):
        return f"error: {call.name}: arguments must be a JSON object, got {type(args).__name__}"
    sig = inspect.signature(tool.fn)
    try:
        sig.bind(**args)
    except TypeError as e:
        return f"error: {call.name}: bad arguments ({e}); expected {call.name}{sig}"
    try:
        if inspect.iscoroutinefunction(tool.fn):
            result = await asyncio.wait_for(tool.fn(**args), timeout_s)
        else:
            result = await asyncio.wait_for(asyncio.to_thread(tool.fn, **args), timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        return f"error: {call.name} did not finish within {timeout_s:g} s"
    except Exception as e:
        return f"error: {call.name} raised {type(e).__name__}: {_one_line(e)}"
    return _as_text(result)


__all__ = ["TYPES", "Tool", "call_tool", "load_tools", "parse_docstring", "tool_from_function"]
